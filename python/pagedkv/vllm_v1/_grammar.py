"""Structured output on a native step: vLLM's ``Scheduler.get_grammar_bitmask`` and the two
calls of vLLM's ``StructuredOutputManager`` the step makes per structured-output row
(``grammar_bitmask``, ``accept_tokens``), without their per-row generality where it cannot
apply.

**What is the same.** The grammar objects are vLLM's (the backend's: xgrammar, guidance,
outlines, ...), called as vLLM calls them, in the same order, with the same arguments:
per row ``structured_output_request.grammar`` (the property's value: its ``_grammar`` slot
read directly where the property would only return it), ``is_terminated()``, then
``fill_bitmask(bitmask, row)`` or the row filled with the manager's full mask; at
``update_from_output`` ``reasoning_ended`` set and ``accept_tokens(request_id, tokens)`` on a
copy of the kept tokens. The bitmask is the manager's own tensor, sliced and returned as
vLLM returns it; ``GrammarOutput`` holds the same ids, in the same order, and the same draft
counts.

**When.** The bitmask and a structured row's advance only under :func:`plain_manager`: the
manager is vLLM's own ``StructuredOutputManager`` (not a subclass, no method replaced by a
plugin on the class or on the instance) and has no reasoning parser (or constrains reasoning
too, ``enable_in_reasoning``), so every row is constrained from its first token; the bitmask
also needs no diffusion model, the bitmask allocated, and, without drafts, no more rows
than vLLM fills on one thread (``fill_bitmask_parallel_threshold``; with drafts vLLM fills
on one thread always). Otherwise vLLM's manager is called
(:func:`manager_kind`: with a reasoning parser for structured rows only, as vLLM's own manager
accepts any other row at once; a manager that is not vLLM's own code for every row with
tokens, as vLLM's loop asks it).

**What it saves.** vLLM's ``get_grammar_bitmask`` looks every scheduled request up to find
the structured-output rows; the native step already knows them (the grammar rows of
``pagedkv_core``'s ``update_after_schedule``). vLLM's manager derives each row's constraint
bounds, draft rows and reasoning masks through several calls per row, and ``accept_tokens``
does the same per row: in the plain case each is the constant above, the bitmask's rows
filled in one native call per step. The grammar's own work, the bulk of it with a real
backend, is unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from pagedkv import _native

from ._version import is_release_033

#: vLLM's ``StructuredOutputManager`` methods whose plain-case result this module computes,
#: or which a native step skips for rows without structured output (``validate_tokens``):
#: a manager whose copies of these are not vLLM's own (a subclass, a plugin's patch) is
#: foreign.
_MIRRORED = (
    "grammar_bitmask",
    "accept_tokens",
    "validate_tokens",
    "_fill_bitmasks",
    "_get_constraint_bounds",
)

#: Per class and its functions of :data:`_MIRRORED`: whether they are vLLM's own.
_plain_classes: Dict[Tuple[Any, ...], bool] = {}


def _vllm_class_of(cls: type) -> bool:
    """``cls`` is vLLM's ``StructuredOutputManager`` with vLLM's own code for
    :data:`_MIRRORED` (cached per class and functions: a later patch is seen)."""
    functions = tuple(getattr(cls, name, None) for name in _MIRRORED)
    key = (cls, *functions)
    known = _plain_classes.get(key)
    if known is None:
        from vllm.v1 import structured_output

        source = structured_output.__file__
        # A wrapper (a plugin's, even under functools.wraps) is not vLLM's code.
        codes = [getattr(f, "__code__", None) for f in functions]
        known = cls is structured_output.StructuredOutputManager and all(
            code is not None and code.co_filename == source for code in codes
        )
        _plain_classes[key] = known
    return known


def _vllms_own(manager: Any) -> bool:
    """``manager`` runs vLLM's own code for :data:`_MIRRORED` (class and instance)."""
    own = vars(manager)
    return _vllm_class_of(type(manager)) and not any(name in own for name in _MIRRORED)


#: :func:`manager_kind`'s answers.
PLAIN, VLLMS_OWN, FOREIGN = 0, 1, 2


def manager_kind(manager: Any) -> int:
    """How ``update_from_output`` advances grammars with ``manager``: :data:`PLAIN`
    (:func:`plain_manager`: natively, rows without structured output answered at once),
    :data:`VLLMS_OWN` (vLLM's code with a reasoning parser: the manager's ``accept_tokens``
    for structured-output rows; it accepts any other row at once) or :data:`FOREIGN` (a
    subclass or a patch: the manager's ``accept_tokens`` for every row with tokens and its
    ``validate_tokens`` for every row given drafts, as vLLM's loop calls them)."""
    if not _vllms_own(manager):
        return FOREIGN
    if manager.enable_in_reasoning or manager.reasoner_cls is None:
        return PLAIN
    return VLLMS_OWN


def plain_manager(manager: Any) -> bool:
    """Every structured-output row of ``manager`` is constrained from its first token by
    vLLM's own code: ``accept_tokens(request, tokens)`` is then ``reasoning_ended = True``
    and the grammar's ``accept_tokens(request.request_id, list(tokens))``."""
    return manager_kind(manager) == PLAIN


def _plain_bitmask(manager: Any, num_rows: int) -> bool:
    """:func:`plain_manager`, and vLLM's ``grammar_bitmask`` would fill the rows on this
    thread (with drafts always; without them up to ``fill_bitmask_parallel_threshold``
    rows) into a bitmask it already allocated, one bonus row per request (no diffusion)."""
    config = manager.vllm_config
    return (
        manager._grammar_bitmask is not None
        and (config.num_speculative_tokens or num_rows <= manager.fill_bitmask_parallel_threshold)
        and not config.model_config.is_diffusion
        and plain_manager(manager)
    )


def fill_plain_bitmask(
    manager: Any, requests: Dict[str, Any], req_ids: Sequence[str], drafts: Dict[str, List[int]]
) -> Any:
    """vLLM's ``grammar_bitmask(requests, req_ids, drafts)`` under :func:`_plain_bitmask`:
    per request one row per scheduled draft and a bonus row, from row
    ``k * (num_speculative_tokens + 1)`` on for request ``k`` on vLLM 0.33 (a fixed stride;
    rows a request leaves unused keep what they held), packed on vLLM 0.32. The rows are
    filled natively with the requests' grammars, call for call as vLLM's serial fill makes
    them (``pagedkv._native.fill_plain_grammar_rows``): each draft's row is the mask before
    that draft, the draft then advanced through (the full mask from a ``-1`` padding draft
    on); after a draft the grammar rejects (or once it terminated), vLLM's error is logged
    and every later row repeats the failed row; then the bonus row; the advances are rolled
    back."""
    stride = manager.vllm_config.num_speculative_tokens + 1
    fixed_stride = is_release_033()  # 0.33 gives each request a fixed block of rows
    bitmask = manager._grammar_bitmask
    row = _native.fill_plain_grammar_rows(
        bitmask,
        manager._full_mask,
        requests,
        list(req_ids),
        drafts,
        stride if fixed_stride else None,
    )
    num_rows = len(req_ids) * stride if fixed_stride else row
    if num_rows < bitmask.shape[0]:
        bitmask = bitmask[:num_rows]
    return bitmask.numpy()


def grammar_output(sched: Any, scheduler_output: Any, grammar_ids: List[str]) -> Optional[Any]:
    """vLLM's ``Scheduler.get_grammar_bitmask(scheduler_output)`` for the output of a native
    step whose grammar rows were ``grammar_ids``: those still in the scheduler (vLLM's
    ``requests.get``; an abort or an earlier step's update may come between ``schedule()``
    and this call when ``EngineCore`` defers the sampling)."""
    if not scheduler_output.has_structured_output_requests:
        return None
    requests = sched.requests
    req_ids = [req_id for req_id in grammar_ids if req_id in requests]
    if not req_ids:
        return None
    from vllm.v1.core.sched.output import GrammarOutput

    manager = sched.structured_output_manager
    drafts = scheduler_output.scheduled_spec_decode_tokens
    if _plain_bitmask(manager, len(req_ids)):
        bitmask = fill_plain_bitmask(manager, requests, req_ids, drafts)
    else:
        bitmask = manager.grammar_bitmask(requests, req_ids, drafts)
    return GrammarOutput(req_ids, bitmask, _acceptable_drafts(drafts, req_ids))


def _acceptable_drafts(drafts: Dict[str, List[int]], req_ids: List[str]) -> List[int]:
    """Each row's drafts without the padding (vLLM's ``num_acceptable_drafts``)."""
    if not drafts:
        return [0] * len(req_ids)
    from vllm.v1.core.sched.scheduler import strip_speculative_padding

    return [len(strip_speculative_padding(drafts.get(req_id, []))) for req_id in req_ids]
