"""A KV connector on a native step: the lines of vLLM's ``schedule()`` and
``update_from_output()`` around the scheduler's KV connector (P/D transfer over NIXL,
LMCache, offloading, ...), run where the native walk reaches them.

**What is the same.** The connector is called as vLLM's loop calls it, in the same order, with
the same arguments: ``get_num_new_matched_tokens`` at a waiting request's prefix lookup (the
hit presented block-aligned, a local sub-block tail dropped when the connector's hit is
longer), ``update_state_after_alloc`` after each allocation of the waiting pass,
``has_pending_block_frees`` before a preemption, ``build_connector_meta`` on the step's
``SchedulerOutput`` (with its ``KVConnectorBlockState``) before ``_update_after_schedule``,
and, in ``update_from_output``, ``request_finished`` (inside vLLM's own ``_free_request``),
``_update_from_kv_xfer_finished``, the connector's stats and events. An asynchronous load
takes the request to ``WAITING_FOR_REMOTE_KVS`` in ``kv_holding_waiting``; vLLM's own
``_handle_blocked_waiting_request`` promotes it once the load is done. Deferred block frees
(async scheduling or pipeline parallelism with a consumer) use vLLM's own fences.

Failed loads and invalid blocks go through vLLM's own ``_handle_failed_recving`` and
``_handle_invalid_blocks``; their rows take nothing, and under the "fail" policy the requests
are finished with an error, as vLLM's ``update_from_output`` does.

**Where vLLM's loop runs instead** (:func:`pagedkv.vllm_v1._scope.engine_out_of_scope`):
an aux-output or EC connector, prefix replay, HiSparse's deferred loads.

:class:`ConnectorSteps` is called by the native loop (``pagedkv._native.V1Loop``, from
Rust: ``rust/py/src/vllm_v1/connector.rs``) and by :mod:`._native_loop`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ._version import is_release_033


class ConnectorSteps:
    """Per scheduler with a KV connector: vLLM's lines around it for the native loop."""

    def __init__(self, sched: Any) -> None:
        from vllm.v1.core.sched import scheduler as vllm_scheduler
        from vllm.v1.core.sched.output import KVConnectorBlockState
        from vllm.v1.request import RequestStatus

        self.sched = sched
        self.connector = sched.connector
        #: Read by the binding's ``_holds_kv_blocks``.
        self.WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._waiting_to_start = vllm_scheduler.KV_FETCH_WAITING_TO_START
        self._in_progress = vllm_scheduler.KV_FETCH_IN_PROGRESS
        self._block_state = KVConnectorBlockState
        self._drains_loads = is_release_033()
        #: The step's ``SchedulerOutput``, built by :meth:`step_end` (taken by ``schedule``).
        self._built: Any = None

    # schedule(): the waiting pass.

    def lookup(self, request: Any) -> Optional[Tuple[Any, int, int, bool]]:
        """vLLM's prefix lookup of a waiting request with nothing computed, the connector's
        part included: ``(blocks, num_local, num_external, load_async)``, or ``None`` when
        the connector cannot tell yet (vLLM skips the request). Sets the request's
        ``shared_prefix_boundary``, its first admission's prefill stats and its KV fetch
        stage as vLLM does."""
        s = self.sched
        blocks, num_local, boundary, diverged = s._get_local_prefix_cache_hit(request)
        request.shared_prefix_boundary = boundary
        partial_tail = num_local % s.block_size
        aligned = num_local - partial_tail
        ext, load_async = self.connector.get_num_new_matched_tokens(request, aligned)
        if request.skip_reading_prefix_cache:
            ext, load_async = 0, False
        if ext is None:
            return None
        if partial_tail and ext > partial_tail:
            # A longer remote hit supersedes the local sub-block tail.
            blocks = s.kv_cache_manager.truncate_computed_blocks(blocks, aligned)
            num_local, num_external = aligned, ext
        elif partial_tail:
            num_external, load_async = 0, False
        else:
            num_external = ext
        if diverged and num_external == 0:
            blocks, num_local, request.shared_prefix_boundary = (
                s.kv_cache_manager.get_computed_blocks(request)
            )
        num_computed = num_local + num_external
        assert num_computed <= request.num_tokens
        stats = request.prefill_stats
        if stats and request.num_preemptions <= 0:
            assert num_computed <= request.num_prompt_tokens
            stats.set(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=num_local,
                num_external_cached_tokens=num_external,
            )
        s._set_kv_fetch_stage(request, self._waiting_to_start if load_async else None)
        return blocks, num_local, num_external, bool(load_async)

    def allocated(self, request: Any, num_external: int, queries: int, load_async: bool) -> None:
        """After the waiting pass allocated ``request``'s slots: the connector's
        ``update_state_after_alloc`` and its prefix-cache stats (``queries``: the tokens past
        the local hit, 0 without a lookup); a request admitted now leaves fetch tracking."""
        s = self.sched
        blocks = s.kv_cache_manager.get_blocks(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, num_external)
        stats = s.connector_prefix_cache_stats
        if stats is not None and queries != 0:
            preempted = request.num_preemptions > 0
            sources = None
            if num_external and not preempted:
                sources = self.connector.get_external_cache_hit_sources(request, num_external)
            stats.record(
                num_tokens=queries,
                num_hits=num_external,
                preempted=preempted,
                hits_by_source=sources,
            )
        if not load_async:
            s._set_kv_fetch_stage(request, None)

    def start_remote_load(self, request: Any, num_computed: int) -> None:
        """An asynchronous load: the request waits for remote KV with its blocks (the walk
        then puts it back in ``kv_holding_waiting``, deferred)."""
        s = self.sched
        request.status = self.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_computed
        s._inflight_prefills.add(request)
        s._set_kv_fetch_stage(request, self._in_progress)

    def reserved_blocks(self, request: Any) -> int:
        """Before an asynchronous load's ``allocate_slots``: the blocks it must leave free
        (what the in-flight prefills still need, and a speculative decoding step's), then the
        connector's ``get_loaded_kv_cache_group_ids(request)``, asked as vLLM asks it for
        ``skip_zeroing_group_ids`` (no group is zeroed where the native managers serve)."""
        s = self.sched
        reserved = s._inflight_prefill_reserved_blocks() + s._spec_decode_step_blocks
        self.connector.get_loaded_kv_cache_group_ids(request)
        return reserved

    # schedule(): the running pass.

    def pending_frees(self) -> bool:
        return bool(self.connector.has_pending_block_frees())

    def blocks_can_be_freed(self, request: Any) -> bool:
        return bool(self.sched._request_blocks_can_be_freed(request))

    # schedule(): the step's end.

    def step_end(self, parts: Any, sync_kv_loads: bool) -> None:
        """The step's ``SchedulerOutput`` from the native loop's parts, then what vLLM does
        before ``_update_after_schedule``: ``has_sync_kv_loads``, the connector's block state
        and ``build_connector_meta``, the deferred-free fence."""
        s = self.sched
        manager = s.kv_cache_manager
        offloads = manager.take_boundary_state_offloads()  # drained before the output, as vLLM
        out = s._pagedkv_output.scheduler_output(*parts[:4], *parts[5:])
        out.has_sync_kv_loads = sync_kv_loads
        req_ids = set(out.num_scheduled_tokens)
        req_ids.update(r for r in offloads if r in s.requests)
        out.kv_connector_block_state = self._block_state(
            req_ids=req_ids,
            resolve_block_ids=manager.get_block_ids,
            boundary_state_offloads=offloads,
        )
        out.kv_connector_metadata = s._build_kv_connector_meta(self.connector, out)
        out.kv_connector_block_state = None
        if s.defer_block_free:
            if out.total_num_scheduled_tokens > 0:
                s.sched_step_seq += 1
            # `_update_after_schedule`'s fence for each scheduled request.
            for req_id in out.num_scheduled_tokens:
                s.requests[req_id].last_sched_seq = s.sched_step_seq
        self._built = out

    def take_output(self) -> Any:
        out, self._built = self._built, None
        return out

    # update_from_output().

    def failed_loads(self, scheduler_output: Any, model_runner_output: Any) -> set:
        """vLLM's ``failed_kv_load_req_ids``: the connector's failed loads and invalid blocks,
        handled by vLLM's own methods (a request to recompute has its computed tokens taken
        back); the rows of these requests take nothing this step."""
        s = self.sched
        out = model_runner_output.kv_connector_output
        failed: set = set()
        if out and out.failed_recving:
            failed.update(s._handle_failed_recving(out.failed_recving))
        if out and out.invalid_block_ids:
            scheduled = scheduler_output.num_scheduled_tokens
            failed.update(s._handle_invalid_blocks(out.invalid_block_ids, scheduled))
        return failed

    def fail_loads(self, failed: set, outputs: List[Tuple[int, Any]]) -> None:
        """Under the "fail" policy, the requests whose load failed are finished with an
        error, each output added to its client's list (after the rows' outputs), as vLLM's
        ``update_from_output`` does before the finished transfers."""
        s = self.sched
        if not failed or s.recompute_kv_load_failures:
            return
        from vllm.v1.request import RequestStatus

        for request in s.finish_requests(failed, RequestStatus.FINISHED_ERROR):
            out = s._pagedkv_output.error_output(request)
            client = request.client_index
            found = next((outs for c, outs in outputs if c == client), None)
            if found is None:
                outputs.append((client, [out]))
            else:
                found.append(out)

    def before_update(self, scheduler_output: Any) -> None:
        """The deferred frees (and 0.33's deferred loads) whose fence the step completed."""
        s = self.sched
        if s.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            s.processed_step_seq += 1
            s._drain_deferred_frees()
            if self._drains_loads:
                s._drain_deferred_loads()

    def after_update(self, model_runner_output: Any) -> Any:
        """The finished transfers (``_update_from_kv_xfer_finished``), then the step's KV
        connector stats: the worker's aggregated with the scheduler side's."""
        s = self.sched
        out = model_runner_output.kv_connector_output
        if out:
            s._update_from_kv_xfer_finished(out)
        stats = out.kv_connector_stats if out else None
        own = self.connector.get_kv_connector_stats()
        if own is not None and not own.is_empty():
            stats = stats.aggregate(own) if stats is not None else own
        return stats

    def take_events(self, events: Any) -> Any:
        """The manager's events with the connector's after them."""
        extra = self.connector.take_events()
        if extra:
            events = list(extra) if events is None else [*events, *extra]
        return events
