"""vLLM's block hashes, computed natively where the result is vLLM's byte for byte.

vLLM hashes a request's blocks as they fill: ``Request.update_block_hashes`` (after every
appended token) calls the request's hasher, the closure ``get_request_block_hasher`` returns,
which hashes each new full block as ``hash_fn((parent, tuple(tokens), extra_keys))``. KV
events, connectors and routers key on these bytes, so pagedkv only takes the work over where it
provably computes the same bytes (``pagedkv._native.vllm_block_hash``, tested against vLLM's
functions):

* the request's hasher is vLLM's own closure, at the scheduler's hash block size and lookahead
  tokens (vLLM 0.33's ``num_hash_lookahead_tokens``: a block is hashed once that many tokens
  follow it, its extra keys ``(None, *those tokens)``), over one of ``sha256``,
  ``sha256_cbor``, ``xxhash``, ``xxhash_cbor`` (:func:`hash_name_of`);
* the request is in the native loop's scope, its extra keys past its first block are none
  or a LoRA adapter's ``(("lora", name, path),)`` with short, distinct ``str`` name and
  path (multimodal inputs and prompt embeddings, which the loop serves, keep vLLM's hasher),
  the block has a parent hash (the first block, which may carry a cache salt, stays
  vLLM's), and every token is an ``int`` the encoding covers.

Two places use it: the native loop hashes the blocks it fills itself, and
:func:`hash_natively` gives an in-scope request a native stand-in for its hasher
(``_native.VllmBlockHasher``) so the steps vLLM's own loop runs hash natively too. The
stand-in hands anything else to the closure it replaced.
"""

from __future__ import annotations

from typing import Any, List, Optional

from pagedkv import _native

#: vLLM's block hash functions pagedkv reproduces (``vllm.utils.hashing``).
HASH_FUNCTIONS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def hash_name_of(hash_block_size: int, lookahead: int = 0) -> Any:
    """``name_of(block_hasher)``: the name of vLLM's hash function when ``block_hasher`` is
    vLLM's own closure (or pagedkv's stand-in for one) hashing at ``hash_block_size`` with
    ``lookahead`` tokens past each block (the scheduler's), else ``None``. The answer for the
    last hasher is kept (an engine has one)."""
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils

    code = kv_cache_utils.get_request_block_hasher(hash_block_size, hashing.sha256).__code__
    names = {getattr(hashing, n): n for n in HASH_FUNCTIONS if hasattr(hashing, n)}
    last: List[Any] = [None, None]

    def name_of(hasher: Any) -> Optional[str]:
        if hasher is last[0]:
            return last[1]
        name = None
        if isinstance(hasher, _native.VllmBlockHasher):
            shape = (hasher.block_size, hasher.lookahead)
            name = hasher.name if shape == (hash_block_size, lookahead) else None
        elif getattr(hasher, "__code__", None) is code and hasher.__closure__ is not None:
            bound = dict(zip(code.co_freevars, (c.cell_contents for c in hasher.__closure__)))
            shape = (bound.get("hash_block_size"), bound.get("num_hash_lookahead_tokens", 0))
            if shape == (hash_block_size, lookahead):
                name = names.get(bound.get("caching_hash_fn"))
        last[:] = [hasher, name]
        return name

    return name_of


class NativeHashers:
    """Per scheduler: the native stand-in for each vLLM hasher seen (an engine has one)."""

    def __init__(self, hash_block_size: int, lookahead: int = 0) -> None:
        from vllm.v1.request import Request

        self._request_cls = Request
        self._block_size = hash_block_size
        self._lookahead = lookahead
        self._name_of = hash_name_of(hash_block_size, lookahead)
        self._last: List[Any] = [None, None]

    def hash_natively(self, request: Any) -> bool:
        """Give ``request`` (in scope, vLLM's ``Request`` class) the native stand-in for its
        hasher when that hasher is vLLM's own; whether it did."""
        hasher = request._block_hasher
        if hasher is None or type(request) is not self._request_cls:
            return False
        if hasher is not self._last[0]:
            name = self._name_of(hasher)
            if isinstance(hasher, _native.VllmBlockHasher) or name is None:
                stand_in = None
            else:
                stand_in = _native.VllmBlockHasher(name, self._block_size, hasher, self._lookahead)
            self._last[:] = [hasher, stand_in]
        stand_in = self._last[1]
        if stand_in is None:
            return False
        request._block_hasher = stand_in
        return True
