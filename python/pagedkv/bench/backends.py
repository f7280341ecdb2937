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


def _native(batch: bool) -> Tuple[Optional[Backend], str]:
    name = "native-batch" if batch else "native"
    pkg = _import("pagedkv")
    seq_mod = _import("pagedkv.sequence")
    bm_mod = _import("pagedkv.block_manager")
    types_mod = _import("pagedkv.types")
    manager = _first_attr("BlockSpaceManager", pkg, bm_mod)
    seq = _first_attr("Sequence", pkg, seq_mod)
    group = _first_attr("SequenceGroup", pkg, seq_mod)
    status = _first_attr("SequenceStatus", pkg, seq_mod)
    sp = _first_attr("SamplingParams", pkg, seq_mod, types_mod)
    lp = _first_attr("Logprob", pkg, seq_mod, types_mod)
    missing = [
        n
        for n, v in [
            ("BlockSpaceManager", manager),
            ("Sequence", seq),
            ("SequenceGroup", group),
            ("SequenceStatus", status),
            ("SamplingParams", sp),
            ("Logprob", lp),
        ]
        if v is None
    ]
    if missing:
        return None, f"{name}: skipped, pagedkv lacks {', '.join(missing)} (not landed yet)"
    if batch and not hasattr(manager, "append_slots_batch"):
        return None, f"{name}: skipped, BlockSpaceManager has no append_slots_batch yet"
    desc = "pagedkv.BlockSpaceManager + pagedkv.Sequence"
    if batch:
        desc += " (append_slots_batch into numpy buffers)"
    return Backend(name, _manager_factory(manager), seq, group, status, sp, lp, batch, desc), ""


def _reference() -> Tuple[Optional[Backend], str]:
    ref = _import("pagedkv.reference")
    ref_seq = _import("pagedkv.reference.sequence")
    ref_bm = _import("pagedkv.reference.block_manager")
    seq_mod = _import("pagedkv.sequence")
    types_mod = _import("pagedkv.types")
    manager = _first_attr("BlockSpaceManager", ref, ref_bm)
    seq = _first_attr("Sequence", ref, ref_seq)
    # The reference may reuse the package's group / status / value types.
    group = _first_attr("SequenceGroup", ref, ref_seq, seq_mod)
    status = _first_attr("SequenceStatus", ref, ref_seq, seq_mod)
    sp = _first_attr("SamplingParams", ref, ref_seq, types_mod, seq_mod)
    lp = _first_attr("Logprob", ref, ref_seq, types_mod, seq_mod)
    missing = [
        n
        for n, v in [
            ("BlockSpaceManager", manager),
            ("Sequence", seq),
            ("SequenceGroup", group),
            ("SequenceStatus", status),
            ("SamplingParams", sp),
            ("Logprob", lp),
        ]
        if v is None
    ]
    if missing:
        return None, f"reference: skipped, pagedkv.reference lacks {', '.join(missing)}"
    desc = "pagedkv.reference.BlockSpaceManager + pagedkv.reference.Sequence (pure Python)"
    return Backend(
        "reference", _manager_factory(manager), seq, group, status, sp, lp, False, desc
    ), ""


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
