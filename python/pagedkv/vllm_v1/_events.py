"""vLLM's KV cache events from the native manager's event log.

The native pool logs what it does, in order: ``("stored", first, end)`` when blocks
``first..end`` of the request at hand were cached, ``("removed", hash, 0)`` when a hash left
the prefix cache, ``("cleared", 0, 0)`` after a prefix-cache reset. :class:`EventBuilder` turns
them into vLLM's own ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` objects with the
fields vLLM's ``BlockPool`` fills (vLLM's helpers for extra keys and hash conversion are called,
so the content is vLLM's by construction), right after each native call, while the request is
at hand; the order is the pool's. The native manager builds the frequent ones itself, with the
same contents (``rust/py/src/vllm_v1/events.rs``): ``BlockRemoved``, and ``BlockStored`` for a
request without extra hash keys; they arrive here as ``("event", object, 0)``. The hybrid
manager (``_hybrid.py``) binds the same native builder through :func:`bind_native`, one entry
per KV cache group.

Lookahead block hashes (vLLM 0.33's ``num_hash_lookahead_tokens``, L > 0): a block's hash also
covers the L tokens after it, so its event's extra keys are vLLM's over the block and those
tokens (``generate_lookahead_block_hash_extra_keys``), and ``lookahead_token_ids`` lists each
published block's L following tokens (:func:`stored_keys`); with L = 0 the field stays ``None``.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

#: ``BlockStored``'s fields in vLLM 0.32 and 0.33, in order (0.33 adds
#: ``lookahead_token_ids`` after them): the native builder passes them positionally.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)


def int_hashes_enabled() -> bool:
    """vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: vLLM reads it on every conversion;
    pagedkv reads it once per manager (here, at construction)."""
    from vllm import envs

    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


def published(block_hash: bytes, int_hashes: bool) -> Any:
    """The hash as events publish it: the bytes, or (vLLM's integer mode) its last 8 bytes
    read as a big-endian unsigned integer, as vLLM's converter gives."""
    return int.from_bytes(block_hash[-8:], "big") if int_hashes else block_hash


def stored_keys(
    request: Any, block_size: int, positions: Iterable[int], lookahead: int
) -> Tuple[Any, Optional[List[List[int]]]]:
    """A ``BlockStored``'s ``extra_keys`` and ``lookahead_token_ids`` for the request's blocks
    at ``positions`` (of ``block_size`` tokens), as vLLM's block pool writes them: the keys
    over each block (and, with ``lookahead`` L > 0, its next L tokens, the multimodal index
    rewound as vLLM's lookahead helper does), untagged; the next L token ids of each block
    (``None`` when L is 0)."""
    from vllm.v1.core import kv_cache_utils as u

    extra, mm_idx = [], 0
    ahead: Optional[List[List[int]]] = [] if lookahead else None
    tokens = request.all_token_ids
    for i in positions:
        start, end = i * block_size, (i + 1) * block_size
        if lookahead:
            keys, mm_idx = u.generate_lookahead_block_hash_extra_keys(
                request, start, end, end + lookahead, mm_idx
            )
            ahead.append(tokens[end : end + lookahead])  # type: ignore[union-attr]
        else:
            keys, mm_idx = u.generate_block_hash_extra_keys(request, start, end, mm_idx)
        extra.append(keys)
    return u.to_event_extra_keys(extra), ahead


def bind_native(
    native: Any,
    groups: Sequence[Tuple[Any, Any, int]],
    hash_block_size: int,
    int_hashes: bool,
    lookahead: int = 0,
) -> None:
    """Have ``native`` (a ``V1Manager`` or ``V1Hybrid``) build ``BlockRemoved`` (one per
    evicted block) and, for requests without extra hash keys, ``BlockStored`` itself, where
    the structs' fields start as this module writes them (``rust/py/src/vllm_v1/events.rs``;
    equal objects). ``groups``: ``(spec_kind, sliding_window, block_size)`` per KV cache
    group, in vLLM's order; each block size a multiple of ``hash_block_size``; ``lookahead``:
    vLLM's ``num_hash_lookahead_tokens`` (0.33; 0 on 0.32)."""
    from vllm.distributed import kv_events

    removed_fields = getattr(kv_events.BlockRemoved, "__struct_fields__", ())
    if removed_fields[:3] == ("block_hashes", "medium", "group_idx"):
        native.bind_removed_events(kv_events.BlockRemoved, kv_events.MEDIUM_GPU, int_hashes)
    stored_fields = getattr(kv_events.BlockStored, "__struct_fields__", ())
    fields = STORED_FIELDS + (("lookahead_token_ids",) if lookahead else ())
    if tuple(stored_fields[: len(fields)]) == fields:
        from vllm.v1.request import Request

        native.bind_stored_events(
            kv_events.BlockStored,
            kv_events.MEDIUM_GPU,
            int_hashes,
            list(groups),
            hash_block_size,
            Request,
            lookahead,
        )


class EventBuilder:
    """Builds vLLM event objects for one group-0 full-attention cache of ``block_size``."""

    def __init__(
        self, block_size: int, spec_kind: Any, sliding_window: Any, lookahead: int = 0
    ) -> None:
        from vllm.distributed import kv_events
        from vllm.v1.core import kv_cache_utils

        self._ev = kv_events
        self._removed_cls = kv_events.BlockRemoved
        removed_fields = getattr(kv_events.BlockRemoved, "__struct_fields__", ())
        # Positional construction (cheaper) where the fields start as in 0.32 and 0.33.
        self._removed_positional = removed_fields[:3] == ("block_hashes", "medium", "group_idx")
        self._cleared_cls = kv_events.AllBlocksCleared
        self._utils = kv_cache_utils
        self._block_size = block_size
        self._medium = kv_events.MEDIUM_GPU
        self._spec = (spec_kind, sliding_window)
        fields = getattr(kv_events.BlockStored, "__struct_fields__", ())
        self._has_lookahead = "lookahead_token_ids" in fields
        self._lookahead = lookahead
        self._int_hashes = int_hashes_enabled()

    def build(self, native_events: List[Tuple[str, Any, Any]], request: Any) -> List[Any]:
        out = []
        append, removed = out.append, self.removed
        for kind, a, b in native_events:
            if kind == "event":  # built natively (see bind_native)
                append(a)
            elif kind == "removed":
                append(removed(a))
            elif kind == "stored":
                append(self.stored(request, a, b))
            else:
                append(self._cleared_cls())
        return out

    def bind_native(self, native: Any) -> None:
        """Have ``native`` build ``BlockRemoved`` and, for plain requests, ``BlockStored``
        itself (see :func:`bind_native`)."""
        kind, window = self._spec
        bind_native(
            native,
            [(kind, window, self._block_size)],
            self._block_size,
            self._int_hashes,
            self._lookahead,
        )

    def removed(self, block_hash: bytes) -> Any:
        h = published(block_hash, self._int_hashes)
        if self._removed_positional:
            return self._removed_cls([h], self._medium, 0)
        return self._removed_cls(block_hashes=[h], medium=self._medium, group_idx=0)

    def _hashes(self, hashes: Any) -> List[Any]:
        """The hashes as events publish them (:func:`published`)."""
        if not self._int_hashes:
            return list(hashes)
        return [published(h, True) for h in hashes]

    def _keys(self, request: Any, first: int, end: int) -> Tuple[Any, Any]:
        """The event's extra keys and lookahead token ids (:func:`stored_keys`). Without
        lookahead tokens, a request with no multimodal input, LoRA, cache salt or prompt
        embeddings has no extra keys for any block (vLLM's helper returns ``None`` for each),
        so that list is written directly."""
        if not self._lookahead and not (
            request.mm_features
            or request.lora_request
            or request.cache_salt
            or request.prompt_embeds is not None
        ):
            return [None] * (end - first) or None, None
        return stored_keys(request, self._block_size, range(first, end), self._lookahead)

    def stored(self, request: Any, first: int, end: int) -> Any:
        """``BlockStored`` for the request's blocks ``first..end``."""
        hashes = request.block_hashes
        bs = self._block_size
        lora = request.lora_request
        extra_keys, ahead = self._keys(request, first, end)
        parent = self._hashes(hashes[first - 1 : first])[0] if first else None
        kwargs = dict(
            block_hashes=self._hashes(hashes[first:end]),
            parent_block_hash=parent,
            token_ids=request.all_token_ids[first * bs : end * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=self._medium,
            lora_name=lora.name if lora else None,
            extra_keys=extra_keys,
            group_idx=0,
            session_id=request.session_id,
        )
        if self._has_lookahead:
            kwargs["lookahead_token_ids"] = ahead
        event = self._ev.BlockStored(**kwargs)
        event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = self._spec
        return event
