"""The block-manager backends the bench driver can drive.

A :class:`Backend` is everything the driver needs to know about one implementation: how to build
a manager, which Sequence / SequenceGroup classes go with it, and whether to use the batch step
API. The driver never imports a backend itself, so new ones (or test stand-ins) plug in here.

``vllm-<version>`` backends (``pagedkv bench --compare vllm==0.4.2``) run a vLLM release's own
``BlockSpaceManagerV1`` and ``Sequence`` family, loaded by :mod:`pagedkv.vllm_release` from that
release's sdist (downloaded once and cached) with small stand-ins for its torch/config imports;
:func:`vllm_provenance` says which of the loaded files are vLLM's and which are stand-ins.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = [
    "Backend",
    "BackendError",
    "BACKEND_NAMES",
    "CROSS_CHECKED",
    "parse_compare",
    "resolve_backends",
    "vllm_backend",
    "vllm_provenance",
]

#: Backends in report order; ``reference`` first because ratios are relative to it.
BACKEND_NAMES = ("reference", "native", "native-batch")

#: Backends whose schedules must be identical (they implement docs/block_manager.md). vLLM
#: differs on purpose with prefix caching (it shares partial blocks, among other things), so it
#: is timed but not cross-checked; ``benches/vllm_compare.py`` compares it where it agrees.
CROSS_CHECKED = ("reference", "native", "native-batch")


class BackendError(RuntimeError):
    """A requested backend cannot run here (the message says why and what to do)."""


@dataclass
class Backend:
    """How to drive one block-manager implementation.

    ``make_manager(block_size, num_gpu_blocks, num_cpu_blocks, watermark, enable_caching)``
    returns a fresh manager. ``status`` is the SequenceStatus enum the sequences use.
    ``batch``: use ``manager.append_slots_batch`` instead of per-sequence ``append_slots`` /
    ``get_block_table``. ``make_sequence(seq_id, prompt_token_ids, block_size)`` and
    ``make_group(request_id, seqs, sampling_params, arrival_time)`` default to the 0.4.2
    constructor signatures of ``sequence_cls`` and ``group_cls``.
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
    make_sequence: Optional[Callable[[int, List[int], int], Any]] = None
    make_group: Optional[Callable[[str, List[Any], Any, float], Any]] = None

    def __post_init__(self) -> None:
        seq_cls, group_cls = self.sequence_cls, self.group_cls
        if self.make_sequence is None:
            self.make_sequence = lambda i, tokens, bs: seq_cls(i, "", tokens, bs)
        if self.make_group is None:
            self.make_group = lambda rid, seqs, sp, t: group_cls(rid, seqs, sp, t)


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
    mods = (pkg, _import("pagedkv.vllm_042.sequence"), _import("pagedkv.vllm_042.types"))
    desc = "pagedkv.BlockSpaceManager + pagedkv.Sequence"
    if batch:
        desc += " (append_slots_batch into numpy buffers)"
    return _backend(
        "native-batch" if batch else "native",
        desc,
        _first_attr("BlockSpaceManager", pkg, _import("pagedkv.vllm_042.block_manager")),
        _first_attr("Sequence", *mods),
        mods,
        batch,
    )


def _reference() -> Tuple[Optional[Backend], str]:
    ref = _import("pagedkv.vllm_042.reference")
    ref_seq = _import("pagedkv.vllm_042.reference.sequence")
    # The reference reuses the package's group, status and value types.
    mods = (ref, ref_seq, _import("pagedkv.vllm_042.sequence"), _import("pagedkv.vllm_042.types"))
    return _backend(
        "reference",
        "pagedkv.reference.BlockSpaceManager + pagedkv.reference.Sequence (pure Python)",
        _first_attr("BlockSpaceManager", ref, _import("pagedkv.vllm_042.reference.block_manager")),
        _first_attr("Sequence", ref, ref_seq),
        mods,
    )


_RESOLVERS: Dict[str, Callable[[], Tuple[Optional[Backend], str]]] = {
    "reference": _reference,
    "native": lambda: _native(False),
    "native-batch": lambda: _native(True),
}


def resolve_backends(names: List[str]) -> Tuple[List[Backend], List[str]]:
    """The importable backends among ``names`` (in ``BACKEND_NAMES`` order) and skip notes.

    Used for the default set, where a missing one is only noted; ``pagedkv bench`` turns a
    note about a backend the user named into an error.
    """
    unknown = [n for n in names if n not in _RESOLVERS]
    if unknown:
        hint = ""
        if any(n.startswith("vllm") for n in unknown):
            hint = " (vLLM runs through --compare vllm==VERSION)"
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(BACKEND_NAMES)}{hint}")
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


# ------------------------------------------------------------------------ vLLM releases


def parse_compare(spec: str) -> str:
    """The vLLM version named by a ``--compare`` item (``vllm==0.4.2``)."""
    name, sep, version = spec.strip().partition("==")
    if name.strip().lower() != "vllm" or not sep or not version.strip():
        raise ValueError(f"bad --compare {spec!r}: expected vllm==VERSION, e.g. vllm==0.4.2")
    return version.strip()


def vllm_backend(version: str) -> Backend:
    """vLLM ``version``'s own BlockSpaceManagerV1 and Sequence family (fetched, not installed).

    Raises :class:`BackendError` if the release is not supported or cannot be fetched.
    """
    try:
        from pagedkv import vllm_release
    except ImportError as exc:  # pragma: no cover - an install without the module
        raise BackendError(f"vllm=={version}: pagedkv.vllm_release is missing ({exc})") from None
    if version not in vllm_release.SUPPORTED:
        raise BackendError(
            f"vllm=={version} is not supported; choose from {', '.join(vllm_release.SUPPORTED)}"
        )
    try:
        v = vllm_release.load(version, "vllm")
    except vllm_release.FetchError as exc:
        raise BackendError(f"vllm=={version}: cannot fetch the release: {exc}") from None
    seq_mod = v.sequence
    new_inputs = _sequence_factory(seq_mod.Sequence)
    group_cls = seq_mod.SequenceGroup
    backend = Backend(
        f"vllm-{version}",
        _manager_factory(v.block_manager_v1.BlockSpaceManagerV1),
        seq_mod.Sequence,
        group_cls,
        seq_mod.SequenceStatus,
        v.sampling_params.SamplingParams,
        seq_mod.Logprob,
        False,
        f"vLLM {version}'s BlockSpaceManagerV1 + Sequence (its own files; not cross-checked)",
        make_sequence=new_inputs,
        make_group=lambda rid, seqs, sp, t: group_cls(
            request_id=rid, seqs=seqs, sampling_params=sp, arrival_time=t
        ),
    )
    backend.provenance = vllm_provenance(v, vllm_release.fetch(version))  # type: ignore[attr-defined]
    return backend


def _sequence_factory(seq_cls: Any) -> Callable[[int, List[int], int], Any]:
    """vLLM 0.4 takes ``(seq_id, prompt, prompt_token_ids, block_size)``; 0.5 takes
    ``(seq_id, inputs, block_size)`` with an ``LLMInputs`` dict."""
    params = inspect.signature(seq_cls).parameters
    if "inputs" in params:
        return lambda i, tokens, bs: seq_cls(
            i, {"prompt": "", "prompt_token_ids": tokens, "multi_modal_data": None}, bs
        )
    return lambda i, tokens, bs: seq_cls(i, "", tokens, bs)


def vllm_provenance(loaded: Any, root: Any) -> Dict[str, List[str]]:
    """Which files of a loaded release are vLLM's, checked against its sdist at ``root``.

    Every ``.py`` file of the laid-out package ``loaded.package`` is compared, ignoring import
    lines (pagedkv.vllm_release renames them) and blank lines, with the release's file of the
    same path: ``"vllm"`` lists the equal ones; ``"extracted"`` those that differ but whose
    lines are at least three quarters the release's (vLLM's definitions under a module header
    of ours); ``"stand-in"`` the rest (pagedkv's own, whether or not the release has a file there).
    Paths are relative to the package (``vllm/...``).
    """
    pkg_dir = Path(sys.modules[loaded.package].__file__).parent
    release = Path(root) / "vllm"
    out: Dict[str, List[str]] = {"vllm": [], "extracted": [], "stand-in": []}
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg_dir).as_posix()
        theirs = release / rel
        ours = _code_lines(path)
        kind = "stand-in"
        if theirs.is_file():
            reference = _code_lines(theirs)
            if ours == reference:
                kind = "vllm"
            elif ours and sum(ln in set(reference) for ln in ours) >= 0.75 * len(ours):
                kind = "extracted"
        out[kind].append(f"vllm/{rel}")
    return out


def _code_lines(path: Path) -> List[str]:
    lines = (ln.strip() for ln in path.read_text(encoding="utf-8").splitlines())
    return [ln for ln in lines if ln and not ln.startswith(("import ", "from "))]
