"""The native scheduling loop: vLLM v1's ``schedule()`` and ``update_from_output()`` in Rust
(``pagedkv._native.V1Loop``) for the requests and engines in scope, vLLM's own Python loop
for everything else, chosen per step.

**No second copy of state.** The native loop reads and writes vLLM's own objects: the
scheduler's ``running`` list and ``waiting`` queue, each ``Request``'s fields and token lists,
the scheduler's id sets and counters, and pagedkv's native KV manager (which vLLM's loop uses
too). After a native step the scheduler is in the state vLLM's loop would have left, so the
next step can be either loop's; a switch needs no hand-over.

**The switch.** ``Scheduler.schedule`` runs natively when

* the engine is eligible (checked once at construction,
  :func:`pagedkv.vllm_v1._scope.engine_out_of_scope`: the
  synchronous or the async scheduler over pagedkv's native manager, no KV/EC connector,
  ...; pipeline parallelism, speculative decoding, prefill deferral (a data-parallel rank's
  throttled steps, 0.33's prefill cadence), per-step performance metrics, iteration-detail
  logging and sampling masks are served natively, read from the scheduler every step), and
* every request the scheduler holds is in scope
  (:func:`pagedkv.vllm_v1._scope.request_out_of_scope`: plain
  sampling, structured output, LoRA, multimodal inputs, prompt embeddings, repetition
  detection, streaming sessions, pooling requests in a pooling model, KV transfer parameters
  without a connector), and
  the scheduler is not paused.

A request out of scope puts the engine on vLLM's loop from the next step until it has left
(finished or aborted): its decisions couple every request of the step (budgets, queue order,
preemption), so a step is wholly one loop's. ``update_from_output`` follows the same rule.
Each step is counted by loop, a fallback with its reason (:mod:`pagedkv.vllm_v1._report`:
the scheduler's ``pagedkv_steps`` and a periodic log line); docs/vllm_v1.md, "The native loop",
has the contract.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from ._connector import ConnectorSteps
from ._grammar import grammar_output, manager_kind
from ._hashing import NativeHashers, hash_name_of
from ._manager import KVCacheManager, log_once
from ._report import NATIVE, StepCounter, interval_from_env
from ._scope import (
    engine_out_of_scope,
    hashes_natively,
    is_pooling_model,
    request_out_of_scope,
    update_out_of_scope,
)
from ._version import is_release_033

#: Out-of-scope requests the engine holds, per scheduler: request id -> why it is out of scope
#: (pruned as requests leave).
_HELD = "_pagedkv_python_requests"


class NativeLoop:
    """Mixin for pagedkv's ``Scheduler``: the per-step switch between the native loop and
    vLLM's (the class it is mixed into)."""

    _pagedkv_loop: Any = None
    _pagedkv_connector: Optional[ConnectorSteps] = None
    _pagedkv_hashers: Optional[NativeHashers] = None
    _pagedkv_counter: Optional[StepCounter] = None
    #: The last native step's output and its grammar rows' request ids (``None``: the last
    #: step had no structured-output row past its prefill, or was vLLM's).
    _pagedkv_grammar_rows: Optional[Tuple[Any, List[str]]] = None
    #: Steps scheduled by the native loop and by vLLM's, since construction.
    pagedkv_native_steps = 0
    pagedkv_vllm_steps = 0

    def _pagedkv_start_loop(self) -> Optional[str]:
        """Build the native loop if the engine is in scope; else why it is not."""
        why = engine_out_of_scope(self)
        if why is not None:
            return why
        from vllm.v1.core.sched.interface import PauseState

        from pagedkv import _native

        setattr(self, _HELD, {})
        #: Tokens sampled per step the native loop serves: 1, or 0 for a pooling model (a
        #: diffusion model's 0 stays vLLM's; vLLM's own tests set it after construction).
        self._pagedkv_sampled_per_step = 0 if is_pooling_model(self) else 1
        self._pagedkv_counter = StepCounter(interval_from_env())
        self._pagedkv_unpaused = PauseState.UNPAUSED  # compared every step
        from vllm.v1.request import RequestStatus

        self._pagedkv_remote_kvs = RequestStatus.WAITING_FOR_REMOTE_KVS
        native = self.kv_cache_manager._native
        #: Tokens the KV cache holds for one request: no request may outgrow it.
        self._pagedkv_pool_tokens = pool_tokens(self.kv_cache_manager)
        self._pagedkv_rejected: List[Any] = []
        self._pagedkv_output = _OutputBuilder(self)
        #: The connector the loop serves (``None``: none) and vLLM's lines around it.
        self._pagedkv_connector_of = self.connector
        self._pagedkv_connector = ConnectorSteps(self) if self.connector is not None else None
        config = _loop_config(self)
        config["pool_tokens"] = self._pagedkv_pool_tokens
        config["connector_steps"] = self._pagedkv_connector
        #: The manager's own ``allocate_slots`` (the native loop allocates in Rust: a
        #: replaced one, a test's spy or a plugin's patch, puts the step on vLLM's loop).
        self._pagedkv_allocate = _allocate_slots_of(self.kv_cache_manager)
        #: vLLM 0.32 counts only the adapters its running pass scheduled: with pipeline
        #: parallelism a request awaiting its output holds a LoRA slot uncounted, a request
        #: with another adapter is admitted, and vLLM's next step asserts (0.33 counts every
        #: running request). Those steps stay vLLM's (``use_pp`` is read every step).
        self._pagedkv_pp_lora_guard = not config["release_033"] and self.lora_config is not None
        self._pagedkv_loop = _native.V1Loop(native, config)
        cap = self._pagedkv_loop.length_cap(self.max_model_len)
        if cap < self.max_model_len:
            # A cache smaller than max_model_len: the cache's size stands in for it, on both
            # loops (vLLM's reads ``max_model_len`` for the running room and ``check_stop``).
            log_once(
                "pagedkv: the KV cache holds %d tokens, fewer than max_model_len %d: requests "
                "are capped at the cache's size",
                cap,
                self.max_model_len,
            )
            self.max_model_len = cap
            # The manager caps slot counts (lookahead slots included) at the same length.
            self.kv_cache_manager.cap_max_model_len(cap)
        return None

    @property
    def pagedkv_steps(self) -> Dict[str, int]:
        """Steps since construction by loop: ``"native"``, and per reason vLLM's loop ran
        (empty when the native loop is not built: the start line said why)."""
        counter = self._pagedkv_counter
        return dict(counter.total) if counter is not None else {}

    def _pagedkv_native_step(self) -> bool:
        return self._pagedkv_fallback() is None

    def _pagedkv_fallback(self) -> Optional[str]:
        """Why this step runs on vLLM's loop (``None``: it runs natively). Twice per step
        (``schedule`` and ``update_from_output``): one expression decides the common case."""
        if self._pagedkv_loop is None:
            return "engine out of scope"
        d = self.__dict__
        served = d["_pagedkv_connector"] is not None
        if (
            not d[_HELD]
            and self._pause_state is self._pagedkv_unpaused
            and self.connector is d["_pagedkv_connector_of"]
            and (served or not self.kv_holding_waiting or not self._pagedkv_awaits_remote_kv())
            and not self.grammar_compile_error_reqs
            and d.get("aux_output_connector") is None
            and d.get("ec_connector") is None
            and not d.get("encoder_cache_mismatch_reqs")
            and d.get("num_sampled_tokens_per_step", 1) == d["_pagedkv_sampled_per_step"]
            and (served or not d.get("defer_block_free"))
            and not d.get("defer_async_loads")
            and _allocate_slots_of(self.kv_cache_manager) == d["_pagedkv_allocate"]
            and not (d["_pagedkv_pp_lora_guard"] and d.get("use_pp"))
        ):
            return None
        return self._pagedkv_fallback_reason()

    def _pagedkv_fallback_reason(self) -> Optional[str]:
        """The reason :meth:`_pagedkv_fallback` gives when its fast check fails."""
        held = getattr(self, _HELD)
        if held:
            for rid in [r for r in held if r not in self.requests]:
                del held[rid]
            if held:
                return ", ".join(sorted(set(held.values())))
        served = self._pagedkv_connector is not None
        checks = (
            (self._pause_state != self._pagedkv_unpaused, "engine paused"),
            (self.connector is not self._pagedkv_connector_of, "a KV connector"),
            (getattr(self, "aux_output_connector", None) is not None, "an aux output connector"),
            (getattr(self, "ec_connector", None) is not None, "an EC connector"),
            (
                not served and bool(self.kv_holding_waiting) and self._pagedkv_awaits_remote_kv(),
                "a request waiting for remote KV",
            ),
            (bool(self.grammar_compile_error_reqs), "grammar compile errors"),
            (bool(getattr(self, "encoder_cache_mismatch_reqs", None)), "encoder cache mismatch"),
            # Settings vLLM's own tests change after construction.
            (
                getattr(self, "num_sampled_tokens_per_step", 1) != self._pagedkv_sampled_per_step,
                "a diffusion model",
            ),
            (
                not served and bool(getattr(self, "defer_block_free", False)),
                "deferred block frees",
            ),
            (bool(getattr(self, "defer_async_loads", False)), "deferred KV loads"),
            (
                _allocate_slots_of(self.kv_cache_manager) != self._pagedkv_allocate,
                "a replaced allocate_slots",
            ),
            (
                self._pagedkv_pp_lora_guard and bool(getattr(self, "use_pp", False)),
                "pipeline parallelism with LoRA on vLLM 0.32",
            ),
        )
        return next((why for out, why in checks if out), None)

    def _pagedkv_awaits_remote_kv(self) -> bool:
        """A request in ``kv_holding_waiting`` the native walk does not serve: one waiting for
        remote KV (``WAITING_FOR_REMOTE_KVS``, a connector's; the walk serves streaming
        sessions there, paused or resumed)."""
        remote = self._pagedkv_remote_kvs
        return any(r.status == remote for r in self.kv_holding_waiting)

    def _pagedkv_start_hashing(self) -> None:
        """Native block hashing for in-scope requests (:mod:`pagedkv.vllm_v1._hashing`) when
        pagedkv's manager (one group or hybrid: every group's hashes are the requests' at the
        hash block size) caches prefixes."""
        from ._hybrid import HybridKVCacheManager

        manager = self.kv_cache_manager
        native = isinstance(manager, (KVCacheManager, HybridKVCacheManager))
        if native and manager.enable_caching:
            lookahead = getattr(self, "num_hash_lookahead_tokens", 0)
            self._pagedkv_hashers = NativeHashers(self.hash_block_size, lookahead)

    def add_request(self, request: Any) -> None:
        update = request.request_id in self.requests
        super().add_request(request)  # type: ignore[misc]
        if update:
            # A streaming update of a live session (vLLM applied or queued it): the session
            # is held if the update brings what the native loop does not serve.
            why = update_out_of_scope(request)
            if why is not None and self._pagedkv_loop is not None:
                getattr(self, _HELD)[request.request_id] = why
            return
        if self._pagedkv_loop is None and self._pagedkv_hashers is None:
            return
        why = request_out_of_scope(request)
        if self._pagedkv_hashers is not None and hashes_natively(request, why):
            self._pagedkv_hashers.hash_natively(request)
        if self._pagedkv_loop is None:
            return
        if why is not None:
            getattr(self, _HELD)[request.request_id] = why
        elif self._pagedkv_loop.refuses_prompt(
            request.num_prompt_tokens, self.max_model_len, self._pagedkv_sampled_per_step
        ):
            self._pagedkv_reject(request)

    def _pagedkv_reject(self, request: Any) -> None:
        """A prompt at or past the length cap (``min(max_model_len, cache tokens)``; a request
        stops at the cap, so such a prompt leaves no room for an output token; a pooling
        model's, which samples none, past it) never runs:
        vLLM's loop would keep it at the head of the queue forever, or, prefilled in chunks,
        RUNNING without its last prompt token (the room rule leaves ``cap - 1`` tokens),
        blocking every request behind it. Finished with an error now, reported by the next
        ``update_from_output`` as vLLM reports its own request errors. vLLM's input processor
        refuses a prompt of ``max_model_len`` tokens or more for the same reason; here the
        cache stands in for ``max_model_len`` where it is smaller."""
        from vllm.v1.request import RequestStatus

        log_once(
            "pagedkv: a prompt of the KV cache's size (%d tokens) or longer is finished "
            "with an error",
            self._pagedkv_pool_tokens,
        )
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self._pagedkv_rejected.append(request)

    def schedule(self, throttle_prefills: bool = False) -> Any:
        why = self._pagedkv_fallback()
        counter = self._pagedkv_counter
        if counter is not None:
            counter.count(NATIVE if why is None else why)
        self._pagedkv_grammar_rows = None
        if why is not None:
            self.pagedkv_vllm_steps += 1
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        self.pagedkv_native_steps += 1
        parts = self._pagedkv_loop.schedule(self, throttle_prefills)
        connector = self._pagedkv_connector
        if connector is not None:
            out = connector.take_output()  # built before `_update_after_schedule`
        else:
            out = self._pagedkv_output.scheduler_output(*parts[:4], *parts[5:])
        structured = parts[4]
        if structured is not None:
            has_requests, pending_tokens, grammar_ids = structured
            out.has_structured_output_requests = has_requests
            out.pending_structured_output_tokens = pending_tokens
            self._pagedkv_grammar_rows = (out, grammar_ids)
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return out

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        """vLLM's method; for the output of the last native step from the grammar rows it
        found (:func:`pagedkv.vllm_v1._grammar.grammar_output`)."""
        rows = self._pagedkv_grammar_rows
        if rows is None or rows[0] is not scheduler_output:
            return super().get_grammar_bitmask(scheduler_output)  # type: ignore[misc]
        return grammar_output(self, scheduler_output, rows[1])

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """vLLM's method, natively where the native loop is built (the same writes: each
        request's ``spec_token_ids``, a prefill chunk's emptied, a structured-output request's
        validated by vLLM's ``validate_tokens``)."""
        if self._pagedkv_loop is None:
            return super().update_draft_token_ids(draft_token_ids)  # type: ignore[misc]
        self._pagedkv_loop.update_draft_token_ids(
            self, draft_token_ids.req_ids, draft_token_ids.draft_token_ids
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        connector = self._pagedkv_connector
        if not self._pagedkv_native_step() or not _plain_step(model_runner_output, connector):
            result = super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output
            )
        else:
            failed = None
            if connector is not None:
                connector.before_update(scheduler_output)
            perf_stats = self._pagedkv_output.perf_stats(scheduler_output)
            if connector is not None:
                failed = connector.failed_loads(scheduler_output, model_runner_output)
            outputs, spec_stats = self._pagedkv_loop.update(
                self, scheduler_output, model_runner_output, failed
            )
            if failed and connector is not None:
                connector.fail_loads(failed, outputs)
            result = self._pagedkv_output.engine_core_outputs(
                outputs, model_runner_output, spec_stats, perf_stats, connector
            )
        if self._pagedkv_loop is not None and self._pagedkv_rejected:
            rejected, self._pagedkv_rejected = self._pagedkv_rejected, []
            self._pagedkv_output.report_errors(result, rejected)
        return result


def _allocate_slots_of(manager: Any) -> Tuple[Any, Any]:
    """The manager's ``allocate_slots``: the instance's own attribute (pagedkv's one-group
    manager binds the native method there) and the class's."""
    return (manager.__dict__.get("allocate_slots"), type(manager).allocate_slots)


def pool_tokens(manager: Any) -> int:
    """The most tokens one request can hold in the KV cache (the null block excluded): the
    length cap. One group: every block. Hybrid groups: the blocks the full-attention groups
    alone need (one per block of each); a longer request can never fit, however little its
    window, chunk and Mamba groups hold (their blocks are not counted, so a request under the
    cap may still not fit, as in vLLM). Full-attention groups sit at the hash block size with
    caching on; without it (Mamba hybrids: the hash block is the scheduler's) at their own,
    the largest counted (a cap never below what fits). Without a full-attention group (a
    lone sliding-window or Mamba group) a request's blocks do not grow with its length: no
    cap (``2**63 - 1``)."""
    from ._hybrid import HybridKVCacheManager, group_kinds

    native = manager._native
    if not isinstance(manager, HybridKVCacheManager):
        return (native.num_blocks - 1) * native.block_size
    sizes = [bs for kind, bs, *_ in group_kinds(manager.kv_cache_config) if kind == "full"]
    if not sizes:
        return 2**63 - 1
    return (native.num_blocks - 1) // len(sizes) * max(sizes)


def _plain_step(model_runner_output: Any, connector: Optional[ConnectorSteps]) -> bool:
    """The native loop can take this step's output: no EC connector output, and KV connector
    output only for the connector it serves (drafts, encoder inputs and pooler outputs are the
    native loop's: it rolls rejected drafts back, frees encoder inputs and stops a pooling
    request at its pooler output as vLLM does)."""
    if getattr(model_runner_output, "ec_connector_output", None) is not None:
        return False
    if getattr(model_runner_output, "kv_connector_output", None) is None:
        return True
    return connector is not None


def _loop_config(sched: Any) -> Dict[str, Any]:
    """What ``V1Loop`` needs of the scheduler and of vLLM's classes."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.request_queue import SchedulingPolicy
    from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus

    fields = list(EngineCoreOutput.__struct_fields__)
    defaults = list(EngineCoreOutput.__struct_defaults__)
    defaults = [None] * (len(fields) - len(defaults)) + defaults
    if any(d is not None and not isinstance(d, (int, float, str)) for d in defaults):
        raise TypeError("EngineCoreOutput has a default pagedkv cannot share between outputs")
    return {
        "release_033": is_release_033(),
        "hash_block_size": sched.hash_block_size,
        "num_hash_lookahead_tokens": getattr(sched, "num_hash_lookahead_tokens", 0),
        "async_scheduling": isinstance(sched, AsyncScheduler),
        "decode_stagger": getattr(sched, "decode_stagger", 1),
        "PRIORITY": SchedulingPolicy.PRIORITY,
        "event_scheduled": EngineCoreEventType.SCHEDULED if sched.log_stats else None,
        "WAITING": RequestStatus.WAITING,
        "RUNNING": RequestStatus.RUNNING,
        "PREEMPTED": RequestStatus.PREEMPTED,
        "FINISHED_STOPPED": RequestStatus.FINISHED_STOPPED,
        "FINISHED_LENGTH_CAPPED": RequestStatus.FINISHED_LENGTH_CAPPED,
        "FINISHED_ERROR": RequestStatus.FINISHED_ERROR,
        "FINISHED_REPETITION": RequestStatus.FINISHED_REPETITION,
        "reason_stop": FinishReason.STOP,
        "reason_length": FinishReason.LENGTH,
        "reason_error": FinishReason.ERROR,
        "reason_repetition": FinishReason.REPETITION,
        "make_new": _new_request_data_factory(sched),
        "monotonic": time.monotonic,
        "hash_name_of": hash_name_of(
            sched.hash_block_size, getattr(sched, "num_hash_lookahead_tokens", 0)
        ),
        "output_cls": EngineCoreOutput,
        "output_fields": fields,
        "output_defaults": defaults,
        "draft_slots": _draft_slots(sched),
        "observe_spec_metrics": _observe_spec_metrics,
        "spec_decoding_stats": _spec_decoding_stats,
        "vllm_mamba_split_code": _vllm_mamba_split_code(),
        "grammar_manager_kind": manager_kind,
    }


def _vllm_mamba_split_code() -> Any:
    """The code of vLLM's own ``Scheduler._mamba_block_aligned_split`` (under any
    ``functools.wraps`` wrapper a platform plugin put on the class), or ``None`` when the class
    holds a function from elsewhere. A scheduler whose split runs other code (a plugin's
    patch, a subclass's override, a test's stand-in) gets that split called every time
    vLLM would call it; vLLM's own runs natively (``pagedkv_core::vllm_v1::mamba_split``)."""
    import inspect

    from vllm.v1.core.sched import scheduler

    name = "_mamba_block_aligned_split"
    owner = next(c for c in scheduler.Scheduler.__mro__ if name in c.__dict__)
    code = getattr(inspect.unwrap(owner.__dict__[name]), "__code__", None)
    return code if code is not None and code.co_filename == scheduler.__file__ else None


def _draft_slots(sched: Any) -> int:
    """The input budget each scheduled request also takes for drafting."""
    spec = sched.vllm_config.speculative_config
    return spec.max_num_new_slots_for_drafting if spec is not None else 0


def _observe_spec_metrics(sched: Any, metrics: Any, proposed: int, accepted: int) -> None:
    """A request's own ``spec_decode_metrics``, observed as vLLM's ``update_from_output``
    observes them (the grammar-invalidated drafts already taken off ``proposed``)."""
    detailed = sched.spec_decode_metrics_level == "detailed"
    metrics.observe(num_draft_tokens=proposed, num_accepted=accepted, detailed=detailed)


def _spec_decoding_stats(
    num_spec_tokens: int,
    num_drafts: int,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    accepted_per_pos: List[int],
    draft_per_pos: List[int],
) -> Any:
    """vLLM's ``SpecDecodingStats`` of a step, from the native tally of
    ``make_spec_decoding_stats``' observations (``pagedkv_core::vllm_v1::spec_stats``)."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    return SpecDecodingStats(
        num_spec_tokens=num_spec_tokens,
        num_drafts=num_drafts,
        num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens,
        num_accepted_tokens_per_pos=accepted_per_pos,
        num_draft_tokens_per_pos=draft_per_pos,
    )


def _new_request_data_factory(sched: Any) -> Any:
    """``NewRequestData.from_request`` as vLLM's ``schedule()`` calls it, for the v1 or the
    v2 model runner (``v2``: the scheduler's ``use_v2_model_runner``, read each step)."""
    from vllm.v1.core.sched.output import NewRequestData

    mrope = sched.model_uses_mrope

    def make_new(req: Any, ids: Any, v2: bool) -> Any:
        if v2:
            return NewRequestData.from_request(req, ids, req._all_token_ids, uses_mrope=mrope)
        return NewRequestData.from_request(req, ids, uses_mrope=mrope)

    return make_new


class _OutputBuilder:
    """vLLM's ``SchedulerOutput`` and ``EngineCoreOutputs`` around the native loop's parts,
    with each release's fields (built as vLLM's ``schedule()`` / ``update_from_output()``
    build them, from the same calls)."""

    def __init__(self, sched: Any) -> None:
        import dataclasses

        from vllm.distributed.kv_events import KVEventBatch
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
        from vllm.v1.engine import EngineCoreOutputs

        self.sched = sched
        self._Cached = CachedRequestData
        self._Output = SchedulerOutput
        self._Outputs = EngineCoreOutputs
        self._Batch = KVEventBatch
        self._fields = {f.name for f in dataclasses.fields(SchedulerOutput)}

    def scheduler_output(
        self,
        new_reqs: List[Any],
        cached: tuple,
        num_scheduled: Dict[str, int],
        total: int,
        drafts: Dict[str, List[int]],
        skip_drafts: bool,
        encoder_inputs: Dict[str, List[int]],
        encoder_updates: Optional[Dict[str, Any]],
        num_spec_tokens_to_schedule: int,
    ) -> Any:
        """``encoder_updates``: ``_get_encoder_input_updates``' result, computed by the loop
        before ``_update_after_schedule`` as vLLM computes it (``None``: no multimodal row,
        vLLM's would be empty); ``num_spec_tokens_to_schedule``: the step's draft count (a
        dynamic schedule's for its batch size, else ``num_spec_tokens``)."""
        s = self.sched
        req_ids, resumed, new_tokens, all_tokens, new_blocks, computed, outputs = cached
        cached_data = self._Cached(
            req_ids=req_ids,
            resumed_req_ids=resumed,
            new_token_ids=new_tokens,
            all_token_ids=all_tokens,
            new_block_ids=new_blocks,
            num_computed_tokens=computed,
            num_output_tokens=outputs,
        )
        encoders = s.encoder_cache_manager
        kwargs: Dict[str, Any] = dict(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=drafts,
            scheduled_encoder_inputs=encoder_inputs,
            scheduled_encoder_input_stats=self._encoder_input_stats(encoder_inputs),
            preempted_req_ids=s.reset_preempted_req_ids,
            finished_req_ids=s.finished_req_ids,
            free_encoder_mm_hashes=encoders.get_freed_mm_hashes(),
            new_block_ids_to_zero=s._get_new_block_ids_to_zero(),
            has_sync_kv_loads=False,
            kv_cache_block_copies=None,
            kv_connector_block_state=None,
            num_spec_tokens_to_schedule=num_spec_tokens_to_schedule,
            ec_manager_metadata=encoders.get_manager_metadata(),
        )
        if "encoder_input_updates" in self._fields:
            kwargs["encoder_input_updates"] = encoder_updates or {}
        if "skip_drafts" in self._fields:
            kwargs["skip_drafts"] = skip_drafts
        return self._Output(**kwargs)

    def _encoder_input_stats(self, encoder_inputs: Dict[str, List[int]]) -> Any:
        """With iteration-detail logging on (and ``log_stats``), vLLM's ``schedule()`` counts
        the step's encoder inputs (``_make_scheduled_encoder_input_stats``)."""
        s = self.sched
        if s.log_stats and s.observability_config.enable_logging_iteration_details:
            return s._make_scheduled_encoder_input_stats(encoder_inputs)
        return None

    def perf_stats(self, scheduler_output: Any) -> Any:
        """The step's per-GPU performance stats when the scheduler's ``perf_metrics`` is on,
        computed as vLLM's ``update_from_output()`` does before it reads the outputs."""
        metrics = self.sched.perf_metrics
        if metrics and metrics.is_enabled():
            return metrics.get_step_perf_stats_per_gpu(scheduler_output)
        return None

    @staticmethod
    def error_output(request: Any) -> Any:
        """A finished request's final output as vLLM reports its request errors: no tokens,
        the finish reason from its status, its events."""
        from vllm.v1.engine import EngineCoreOutput

        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            events=request.take_events(),
            trace_headers=request.trace_headers,
        )

    def report_errors(self, result: Dict[int, Any], requests: List[Any]) -> None:
        """Each request's :meth:`error_output`, added to its client's ``EngineCoreOutputs``
        as vLLM adds its own request errors."""
        for request in requests:
            out = self.error_output(request)
            eco = result.get(request.client_index)
            if eco is None:
                result[request.client_index] = eco = self._Outputs(outputs=[])
            eco.outputs.append(out)

    def engine_core_outputs(
        self,
        outputs: List[Any],
        model_runner_output: Any,
        spec_stats: Any = None,
        perf_stats: Any = None,
        connector: Optional[ConnectorSteps] = None,
    ) -> Any:
        """vLLM's ``update_from_output`` after its per-request loop: a connector's finished
        transfers and stats, the KV events published, the outputs per client with the
        finished ids, the scheduler stats."""
        s = self.sched
        kv_stats = None
        if connector is not None:
            kv_stats = connector.after_update(model_runner_output)
        events = s.kv_cache_manager.take_events()
        if connector is not None:
            events = connector.take_events(events)
        if events:
            s.kv_event_publisher.publish(self._Batch(ts=time.time(), events=events))
        result = {client: self._Outputs(outputs=outs) for client, outs in outputs}
        finished = s.finished_req_ids_dict
        if finished:
            for client, ids in finished.items():
                eco = result.get(client)
                if eco is not None:
                    eco.finished_requests = ids
                else:
                    result[client] = self._Outputs(finished_requests=ids)
            finished.clear()
        stats = s.make_stats(spec_stats, kv_stats, model_runner_output.cudagraph_stats, perf_stats)
        if stats is not None:
            eco = next(iter(result.values()), None)
            if eco is None:
                result[0] = eco = self._Outputs()
            eco.scheduler_stats = stats
        return result
