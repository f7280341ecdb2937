#!/usr/bin/env bash
# Install the wheel from DIST (default dist/) into a fresh virtualenv on a PATH with no Rust
# toolchain (no ~/.cargo/bin, no rustup), from binaries only, and use it as a newcomer would:
# import it, ask for help, run the quick benchmark. Proves the wheel needs no Rust to install.
set -euo pipefail
cd "$(dirname "$0")/.."
dist=$(cd "${1:-dist}" && pwd)
wheels=("$dist"/pagedkv-*.whl)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
venv=$scratch/venv
python3 -m venv "$venv"
no_rust_path=$(printf %s "$PATH" | tr ':' '\n' | grep -v -e '/\.cargo' -e 'rustup' -e '^$' | paste -sd: -)
cd "$scratch"  # away from the source tree
env -u CARGO_HOME -u RUSTUP_HOME PATH="$venv/bin:$no_rust_path" bash -euo pipefail -c '
    for tool in cargo rustc rustup; do
        if command -v "$tool" >/dev/null; then echo "smoke: $tool is on PATH" >&2; exit 1; fi
    done
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet --only-binary=:all: "$1"
    python -c "import importlib.metadata as m, pagedkv
assert pagedkv.__version__ == m.version(\"pagedkv\"), pagedkv.__version__
print(\"smoke: pagedkv\", pagedkv.__version__, \"from\", pagedkv.__file__)"
    pagedkv bench --quick >/dev/null
    pagedkv --help >/dev/null
    echo "smoke: import, pagedkv bench --quick, pagedkv --help: OK (no Rust toolchain on PATH)"
' smoke "${wheels[0]}"
