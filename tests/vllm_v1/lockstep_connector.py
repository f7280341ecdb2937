"""A deterministic KV connector (scheduler side only) for the lockstep differential: each
scheduler builds its own from the same ``KVTransferConfig``, and both must see the same calls.

A request's ``kv_transfer_params`` (:func:`params`) say what the connector does for it:
``external``: tokens it loads past the local hit (at most what is left of the prompt: all of
it when asynchronous, all but the last token otherwise); ``async``: loaded while the request
waits (``WAITING_FOR_REMOTE_KVS``) until the harness reports it in ``finished_recving``
(loaded once: a later lookup, after a preemption, finds nothing, as NIXL's);
``unknown``: how many lookups answer ``None`` first (the connector cannot tell yet); ``hold``:
when it runs to its end (stopped or length-capped, not aborted) the connector keeps its blocks
(``delay_free_blocks``) until the harness reports it in ``finished_sending``.
``kv_connector_extra_config``: ``pending_frees`` (a running request that does not fit waits
for held blocks instead of preempting), ``requires_kv_delivery``.

Every scheduler-side call it gets goes into its metadata in order (:class:`LockstepMetadata`,
compared every step as part of the ``SchedulerOutput``): lookups with their answers, the
loaded groups asked, allocations with their block ids and external tokens, pending-free
queries, finished requests with their block ids; then the step's scheduled requests.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus


def params(external: int, load_async: bool, unknown: int = 0, hold: bool = False) -> dict:
    """A request's ``kv_transfer_params`` for this connector."""
    return {"external": external, "async": load_async, "unknown": unknown, "hold": hold}


@dataclasses.dataclass
class LockstepMetadata(KVConnectorMetadata):
    calls: list = dataclasses.field(default_factory=list)
    scheduled: list = dataclasses.field(default_factory=list)


class LockstepConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._pending_frees = bool(extra.get("pending_frees", False))
        self._delivery = bool(extra.get("requires_kv_delivery", False))
        self._asked: dict[str, int] = {}
        self._loaded: set[str] = set()
        self._meta = LockstepMetadata()
        #: Requests whose blocks it holds after their finish.
        self.held: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return self._delivery

    # Scheduler side.

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[Optional[int], bool]:
        answer = self._matched(request, num_computed_tokens)
        self._meta.calls.append(("lookup", request.request_id, num_computed_tokens, answer))
        return answer

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        p = request.kv_transfer_params or {}
        if request.request_id in self._loaded:
            return 0, False  # as NIXL: a request's KV is loaded once (a resume recomputes)
        asked = self._asked.get(request.request_id, 0)
        self._asked[request.request_id] = asked + 1
        if asked < p.get("unknown", 0):
            return None, False
        load_async = bool(p.get("async"))
        room = request.num_tokens - num_computed_tokens - (0 if load_async else 1)
        external = max(0, min(p.get("external", 0), room))
        return external, load_async and external > 0

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        self._meta.calls.append(("loaded_groups", request.request_id))
        return super().get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = [list(g) for g in blocks.get_block_ids()]
        self._meta.calls.append(("alloc", request.request_id, ids, num_external_tokens))
        if num_external_tokens:
            self._loaded.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, LockstepMetadata()
        meta.scheduled = sorted(scheduler_output.num_scheduled_tokens.items())
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        return self._finished(request, [list(block_ids)])

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict]]:
        return self._finished(request, [list(g) for g in block_ids])

    def _finished(self, request: Any, block_ids: list) -> tuple[bool, Optional[dict]]:
        self._asked.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        self._meta.calls.append(("finished", request.request_id, str(request.status), block_ids))
        p = request.kv_transfer_params or {}
        # As NIXL's: only a request that ran to its end hands its blocks on (not an abort).
        ended = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        hold = bool(p.get("hold")) and ended and any(block_ids)
        if hold:
            self.held.add(request.request_id)
        out = {"lockstep_blocks": block_ids, "do_remote_prefill": bool(p.get("external"))}
        return hold, out

    def has_pending_block_frees(self) -> bool:
        answer = self._pending_frees and bool(self.held)
        self._meta.calls.append(("pending_frees", answer))
        return answer

    def update_connector_output(self, connector_output: Any) -> None:
        self.held.difference_update(connector_output.finished_sending or ())

    # Worker side: never built (the harness has no model runner).

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError
