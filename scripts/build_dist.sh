#!/usr/bin/env bash
# Build the release artifacts into OUT (default dist/):
#   * a manylinux2014 (glibc 2.17) abi3 wheel for CPython >= 3.10, linked through zig against
#     glibc 2.17 symbols, so the tag is honest on any build host (a plain `maturin build` here
#     gives a linux_x86_64 wheel PyPI refuses, and manylinux_2_28 fails on newer symbols);
#   * an sdist (builds anywhere with a Rust toolchain).
# The tools come from the `release` dependency group of pyproject.toml (pip >= 25.1).
# Then scripts/check_dist.py checks both archives (contents, metadata, honest platform tag).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
python -m pip install --quiet --group release
rm -f "$out"/pagedkv-*.whl "$out"/pagedkv-*.tar.gz  # check_dist wants exactly one of each
# maturin finds zig through `python -m ziglang`, i.e. the python on PATH (this environment's).
maturin build --release --zig --compatibility manylinux2014 --out "$out" --quiet
maturin sdist --out "$out"
python scripts/check_dist.py "$out"
