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
  synchronous or the async scheduler over pagedkv's native manager, no speculative decoding,
  no KV/EC connector, no pipeline parallelism, no prefill cadence, ...), and
* every request the scheduler holds is in scope
  (:func:`pagedkv.vllm_v1._scope.request_out_of_scope`: plain
  sampling; no structured output, LoRA, multimodal inputs, prompt embeddings, KV transfer,
  streaming sessions or repetition detection), and the scheduler is not paused.

A request out of scope puts the engine on vLLM's loop from the next step until it has left
(finished or aborted): its decisions couple every request of the step (budgets, queue order,
preemption), so a step is wholly one loop's. ``update_from_output`` follows the same rule.
Each step is counted by loop, a fallback with its reason (:mod:`pagedkv.vllm_v1._report`:
the scheduler's ``pagedkv_steps`` and a periodic log line); docs/vllm_v1.md, "The native loop",
has the contract.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from ._hashing import NativeHashers, hash_name_of
from ._manager import KVCacheManager, log_once
from ._report import NATIVE, StepCounter, interval_from_env
from ._scope import engine_out_of_scope, hashes_natively, request_out_of_scope

#: Out-of-scope requests the engine holds, per scheduler: request id -> why it is out of scope
#: (pruned as requests leave).
_HELD = "_pagedkv_python_requests"


class NativeLoop:
    """Mixin for pagedkv's ``Scheduler``: the per-step switch between the native loop and
    vLLM's (the class it is mixed into)."""

    _pagedkv_loop: Any = None
    _pagedkv_hashers: Optional[NativeHashers] = None
    _pagedkv_counter: Optional[StepCounter] = None
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
        self._pagedkv_counter = StepCounter(interval_from_env())
        self._pagedkv_unpaused = PauseState.UNPAUSED  # compared every step
        native = self.kv_cache_manager._native
        #: Tokens the KV cache holds (the null block excluded): no request may outgrow it.
        self._pagedkv_pool_tokens = (native.num_blocks - 1) * native.block_size
        self._pagedkv_rejected: List[Any] = []
        self._pagedkv_output = _OutputBuilder(self)
        config = _loop_config(self)
        config["pool_tokens"] = self._pagedkv_pool_tokens
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
        """Why this step runs on vLLM's loop (``None``: it runs natively)."""
        if self._pagedkv_loop is None:
            return "engine out of scope"
        held = getattr(self, _HELD)
        if held:
            for rid in [r for r in held if r not in self.requests]:
                del held[rid]
            if held:
                return ", ".join(sorted(set(held.values())))
        checks = (
            (self._pause_state != self._pagedkv_unpaused, "engine paused"),
            (self.connector is not None, "a KV connector"),
            (getattr(self, "aux_output_connector", None) is not None, "an aux output connector"),
            (getattr(self, "ec_connector", None) is not None, "an EC connector"),
            (bool(getattr(self, "return_sampling_mask", False)), "sampling masks"),
            (bool(self.kv_holding_waiting), "requests holding KV while waiting"),
            (bool(self.num_waiting_for_streaming_input), "streaming input awaited"),
            (bool(self.grammar_compile_error_reqs), "grammar compile errors"),
            (bool(getattr(self, "encoder_cache_mismatch_reqs", None)), "encoder cache mismatch"),
        )
        return next((why for out, why in checks if out), None)

    def _pagedkv_start_hashing(self) -> None:
        """Native block hashing for in-scope requests (:mod:`pagedkv.vllm_v1._hashing`) when
        pagedkv's manager caches prefixes."""
        manager = self.kv_cache_manager
        if isinstance(manager, KVCacheManager) and manager.enable_caching:
            self._pagedkv_hashers = NativeHashers(self.hash_block_size)

    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        if self._pagedkv_loop is None and self._pagedkv_hashers is None:
            return
        why = request_out_of_scope(request)
        if self._pagedkv_hashers is not None and hashes_natively(request, why):
            self._pagedkv_hashers.hash_natively(request)
        if self._pagedkv_loop is None:
            return
        if why is not None:
            getattr(self, _HELD)[request.request_id] = why
        elif self._pagedkv_loop.refuses_prompt(request.num_prompt_tokens, self.max_model_len):
            self._pagedkv_reject(request)

    def _pagedkv_reject(self, request: Any) -> None:
        """A prompt at or past the length cap (``min(max_model_len, cache tokens)``; a request
        stops at the cap, so such a prompt leaves no room for an output token) never runs:
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
        why = "prefill throttling" if throttle_prefills else self._pagedkv_fallback()
        counter = self._pagedkv_counter
        if counter is not None:
            counter.count(NATIVE if why is None else why)
        if why is not None:
            self.pagedkv_vllm_steps += 1
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        self.pagedkv_native_steps += 1
        new_reqs, cached, num_scheduled, total, structured = self._pagedkv_loop.schedule(self)
        out = self._pagedkv_output.scheduler_output(new_reqs, cached, num_scheduled, total)
        out.has_structured_output_requests = structured
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not self._pagedkv_native_step() or not _plain_step(
            scheduler_output, model_runner_output
        ):
            result = super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output
            )
        else:
            outputs = self._pagedkv_loop.update(self, scheduler_output, model_runner_output)
            result = self._pagedkv_output.engine_core_outputs(outputs, model_runner_output)
        if self._pagedkv_loop is not None and self._pagedkv_rejected:
            rejected, self._pagedkv_rejected = self._pagedkv_rejected, []
            self._pagedkv_output.report_errors(result, rejected)
        return result


def _plain_step(scheduler_output: Any, model_runner_output: Any) -> bool:
    """No draft tokens, connector outputs or pooler outputs in this step."""
    return (
        not scheduler_output.scheduled_spec_decode_tokens
        and not scheduler_output.scheduled_encoder_inputs
        and getattr(model_runner_output, "kv_connector_output", None) is None
        and getattr(model_runner_output, "ec_connector_output", None) is None
        and not model_runner_output.pooler_output
    )


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
        "release_033": hasattr(sched, "num_executed_steps"),
        "hash_block_size": sched.hash_block_size,
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
        "hash_name_of": hash_name_of(sched.hash_block_size),
        "output_cls": EngineCoreOutput,
        "output_fields": fields,
        "output_defaults": defaults,
    }


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
        self, new_reqs: List[Any], cached: tuple, num_scheduled: Dict[str, int], total: int
    ) -> Any:
        s = self.sched
        req_ids, resumed, all_tokens, new_blocks, computed, outputs = cached
        cached_data = self._Cached(
            req_ids=req_ids,
            resumed_req_ids=resumed,
            new_token_ids=[],
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
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            scheduled_encoder_input_stats=None,
            preempted_req_ids=s.reset_preempted_req_ids,
            finished_req_ids=s.finished_req_ids,
            free_encoder_mm_hashes=encoders.get_freed_mm_hashes(),
            new_block_ids_to_zero=s._get_new_block_ids_to_zero(),
            has_sync_kv_loads=False,
            kv_cache_block_copies=None,
            kv_connector_block_state=None,
            num_spec_tokens_to_schedule=s.num_spec_tokens,
            ec_manager_metadata=encoders.get_manager_metadata(),
        )
        if "encoder_input_updates" in self._fields:
            kwargs["encoder_input_updates"] = s._get_encoder_input_updates(
                num_scheduled, new_reqs, {}
            )
        if "skip_drafts" in self._fields:
            kwargs["skip_drafts"] = False
        return self._Output(**kwargs)

    def report_errors(self, result: Dict[int, Any], requests: List[Any]) -> None:
        """Each request's final output (no tokens, finish reason from its status), added to
        its client's ``EngineCoreOutputs`` as vLLM adds its own request errors."""
        from vllm.v1.engine import EngineCoreOutput

        for request in requests:
            out = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            eco = result.get(request.client_index)
            if eco is None:
                result[request.client_index] = eco = self._Outputs(outputs=[])
            eco.outputs.append(out)

    def engine_core_outputs(self, outputs: List[Any], model_runner_output: Any) -> Any:
        s = self.sched
        events = s.kv_cache_manager.take_events()
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
        stats = s.make_stats(None, None, model_runner_output.cudagraph_stats, None)
        if stats is not None:
            eco = next(iter(result.values()), None)
            if eco is None:
                result[0] = eco = self._Outputs()
            eco.scheduler_stats = stats
        return result
