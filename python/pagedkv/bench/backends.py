"""The block-manager backends the W1 driver can drive.

A :class:`Backend` is everything the driver needs to know about one implementation: how to build
a manager, which Sequence / SequenceGroup classes go with it, and whether to use the batch step
API. The driver never imports a backend itself, so new ones (or test stand-ins) plug in here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Backend", "BACKEND_NAMES", "CROSS_CHECKED", "resolve_backends"]

#: Backends in report order; ``reference`` first because ratios are relative to it. ``vllm``
#: (vLLM's own BlockSpaceManagerV1 and Sequence) runs only where vLLM is installed.
BACKEND_NAMES = ("reference", "native", "native-batch", "vllm")

#: Backends whose schedules must be identical (they implement docs/block_manager.md). vLLM
#: differs on purpose with prefix caching (it shares partial blocks, among other things), so it
#: is timed but not cross-checked; ``benches/vllm_compare.py`` compares it where it agrees.
CROSS_CHECKED = ("reference", "native", "native-batch")


@dataclass
class Backend:
    """How to drive one block-manager implementation.

    ``make_manager(block_size, num_gpu_blocks, num_cpu_blocks, watermark, enable_caching)``
    returns a fresh manager. ``status`` is the SequenceStatus enum the sequences use.
    ``batch``: use ``manager.append_slots_batch`` instead of per-sequence ``append_slots`` /
    ``get_block_table``.
    """

    name: str
    make_manager: Callable[..., Any]
    sequence_cls: Any
    group_cls: Any
    status: Any
    sampling_params_cls: Any
    logprob_cls: Any
    batch: bool = False
    description: str = ""


def _import(module: str) -> Optional[Any]:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _first_attr(name: str, *modules: Optional[Any]) -> Optional[Any]:
    for m in modules:
        if m is not None and hasattr(m, name):
            return getattr(m, name)
    return None


def _manager_factory(cls: Any) -> Callable[..., Any]:
    def make(
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float,
        enable_caching: bool,
    ) -> Any:
        return cls(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            watermark=watermark,
            enable_caching=enable_caching,
        )

    return make


_VALUE_TYPES = ("SequenceGroup", "SequenceStatus", "SamplingParams", "Logprob")


def _backend(
    name: str, desc: str, manager: Any, seq: Any, modules: Tuple[Any, ...], batch: bool = False
) -> Tuple[Optional[Backend], str]:
    """A Backend from a manager class, a sequence class and the modules to take the group and
    value types from; a skip note naming what is missing if anything is."""
    found = {n: _first_attr(n, *modules) for n in _VALUE_TYPES}
    named = [("BlockSpaceManager", manager), ("Sequence", seq), *found.items()]
    missing = [n for n, v in named if v is None]
    if missing:
        return None, f"{name}: skipped, missing {', '.join(missing)}"
    if batch and not hasattr(manager, "append_slots_batch"):
        return None, f"{name}: skipped, BlockSpaceManager has no append_slots_batch"
    return Backend(
        name,
        _manager_factory(manager),
        seq,
        found["SequenceGroup"],
        found["SequenceStatus"],
        found["SamplingParams"],
        found["Logprob"],
        batch,
        desc,
    ), ""


def _native(batch: bool) -> Tuple[Optional[Backend], str]:
    pkg = _import("pagedkv")
    mods = (pkg, _import("pagedkv.sequence"), _import("pagedkv.types"))
    desc = "pagedkv.BlockSpaceManager + pagedkv.Sequence"
    if batch:
        desc += " (append_slots_batch into numpy buffers)"
    return _backend(
        "native-batch" if batch else "native",
        desc,
        _first_attr("BlockSpaceManager", pkg, _import("pagedkv.block_manager")),
        _first_attr("Sequence", *mods),
        mods,
        batch,
    )


def _reference() -> Tuple[Optional[Backend], str]:
    ref = _import("pagedkv.reference")
    ref_seq = _import("pagedkv.reference.sequence")
    # The reference reuses the package's group, status and value types.
    mods = (ref, ref_seq, _import("pagedkv.sequence"), _import("pagedkv.types"))
    return _backend(
        "reference",
        "pagedkv.reference.BlockSpaceManager + pagedkv.reference.Sequence (pure Python)",
        _first_attr("BlockSpaceManager", ref, _import("pagedkv.reference.block_manager")),
        _first_attr("Sequence", ref, ref_seq),
        mods,
    )


def _vllm() -> Tuple[Optional[Backend], str]:
    try:
        from vllm.core.block_manager_v1 import BlockSpaceManagerV1
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
    except Exception as exc:  # not installed, or a vLLM without the v1 block manager
        return None, f"vllm: skipped, vLLM's BlockSpaceManagerV1 is not importable ({exc!r})"
    desc = "vLLM's BlockSpaceManagerV1 + vllm.sequence.Sequence (not cross-checked)"
    return Backend(
        "vllm",
        _manager_factory(BlockSpaceManagerV1),
        Sequence,
        SequenceGroup,
        SequenceStatus,
        SamplingParams,
        Logprob,
        False,
        desc,
    ), ""


_RESOLVERS: Dict[str, Callable[[], Tuple[Optional[Backend], str]]] = {
    "reference": _reference,
    "native": lambda: _native(False),
    "native-batch": lambda: _native(True),
    "vllm": _vllm,
}


def resolve_backends(names: List[str]) -> Tuple[List[Backend], List[str]]:
    """The importable backends among ``names`` (in ``BACKEND_NAMES`` order) and skip notes."""
    unknown = [n for n in names if n not in _RESOLVERS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(BACKEND_NAMES)}")
    found: List[Backend] = []
    notes: List[str] = []
    for name in BACKEND_NAMES:
        if name not in names:
            continue
        try:
            backend, note = _RESOLVERS[name]()
        except Exception as exc:  # a half-landed module must not take the bench down
            backend, note = None, f"{name}: skipped, import failed: {exc!r}"
        if backend is None:
            notes.append(note)
        else:
            found.append(backend)
    return found, notes
