"""Micro benchmarks: the native hasher and block pool against their pure-Python equivalents.

* Chained hashing of one 4,096-token prompt (block size 16): ``pagedkv.hash_blocks`` fed a list
  and an ``np.int32`` array, ``pagedkv.vllm_042.reference.hashing.hash_blocks`` fed a list (Mtok/s).
* Pool operations on a 100,000-block pool with caching on (ns per operation, measured as a
  Python loop of calls, so the call overhead a Python engine pays is included):
  allocate / free over the whole pool, one call per block and batched
  (``allocate_many`` / ``free_many``), and the prefix-cache cycle register -> free (evictable)
  -> lookup (hit) -> incref (revive) -> free on a set of blocks.

Every measurement is the best of a few repetitions with the garbage collector paused; setup
(pool construction, token lists) is not timed. The reference pool is
``pagedkv.vllm_042.reference.pool.BlockPool``; if it is not importable its rows are left empty
with a note.
"""

from __future__ import annotations

import gc
import importlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["MicroConfig", "MICRO_FULL", "MICRO_QUICK", "run_micro"]


@dataclass(frozen=True)
class MicroConfig:
    prompt_tokens: int = 4096
    block_size: int = 16
    pool_blocks: int = 100_000
    cache_cycle_blocks: int = 20_000
    min_time_s: float = 0.05  # per hashing measurement
    repeats: int = 5
    ref_repeats: int = 3

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


MICRO_FULL = MicroConfig()
MICRO_QUICK = MicroConfig(cache_cycle_blocks=5_000, min_time_s=0.02, repeats=3, ref_repeats=1)


def _import_attr(module: str, name: str) -> Optional[Any]:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _best_per_call(fn: Callable[[], Any], min_time: float, repeats: int) -> float:
    """Best seconds per call of ``fn`` over ``repeats`` runs of at least ``min_time`` each."""
    fn()  # warm up
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-9)
    loops = max(1, int(min_time / once))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best


def _hashing(cfg: MicroConfig, rng: np.random.Generator) -> Dict[str, Any]:
    import pagedkv

    tokens = rng.integers(0, 32000, size=cfg.prompt_tokens)
    as_list = tokens.tolist()
    as_array = tokens.astype(np.int32)
    bs = cfg.block_size
    n = cfg.prompt_tokens
    results: Dict[str, Any] = {"prompt_tokens": n, "block_size": bs}
    cases: List[Tuple[str, Callable[[], Any]]] = [
        ("native_list", lambda: pagedkv.hash_blocks(as_list, bs)),
        ("native_array", lambda: pagedkv.hash_blocks(as_array, bs)),
    ]
    ref_hash = _import_attr("pagedkv.vllm_042.reference.hashing", "hash_blocks")
    if ref_hash is not None:
        cases.append(("reference_list", lambda: ref_hash(as_list, bs)))
    else:
        results["note"] = "pagedkv.vllm_042.reference.hashing is not importable"
    for name, fn in cases:
        reps = cfg.ref_repeats if name.startswith("reference") else cfg.repeats
        sec = _best_per_call(fn, cfg.min_time_s, reps)
        results[name] = {"us_per_prompt": sec * 1e6, "mtok_per_s": n / sec / 1e6}
    ref = results.get("reference_list")
    if ref:
        for name in ("native_list", "native_array"):
            results[name]["speedup_vs_reference"] = (
                ref["us_per_prompt"] / results[name]["us_per_prompt"]
            )
    return results


# ---------------------------------------------------------------------------------------- pool


def _alloc_free(pool_cls: Any, cfg: MicroConfig, repeats: int) -> Dict[str, float]:
    """ns per op: allocate / free one call at a time, and batched when the pool offers it."""
    n = cfg.pool_blocks
    best = {"allocate": float("inf"), "free": float("inf")}
    batched = hasattr(pool_cls, "allocate_many") and hasattr(pool_cls, "free_many")
    if batched:
        best["allocate_many"] = float("inf")
        best["free_many"] = float("inf")
    rng = range(n)
    pc = time.perf_counter
    for _ in range(repeats):
        pool = pool_cls(n, cfg.block_size, enable_caching=True)
        alloc, free = pool.allocate, pool.free
        t0 = pc()
        blocks = [alloc() for _ in rng]
        t1 = pc()
        for b in blocks:
            free(b)
        t2 = pc()
        best["allocate"] = min(best["allocate"], (t1 - t0) / n)
        best["free"] = min(best["free"], (t2 - t1) / n)
        if batched:
            t0 = pc()
            blocks = pool.allocate_many(n)
            t1 = pc()
            pool.free_many(blocks)
            t2 = pc()
            best["allocate_many"] = min(best["allocate_many"], (t1 - t0) / n)
            best["free_many"] = min(best["free_many"], (t2 - t1) / n)
        if pool.num_free != n:
            raise AssertionError(f"{pool_cls.__module__}: pool not free after the cycle")
    return {k: v * 1e9 for k, v in best.items()}


def _cache_cycle(
    pool_cls: Any, cfg: MicroConfig, repeats: int, hashes: List[int], token_lists: List[List[int]]
) -> Dict[str, float]:
    """ns per op of register / lookup (hit) / incref (revive) / free (to evictable)."""
    k = len(hashes)
    best = {
        "register": float("inf"),
        "lookup_hit": float("inf"),
        "incref_revive": float("inf"),
        "free_to_evictable": float("inf"),
    }
    pc = time.perf_counter
    pairs = list(zip(hashes, token_lists))
    for _ in range(repeats):
        pool = pool_cls(cfg.pool_blocks, cfg.block_size, enable_caching=True)
        blocks = [pool.allocate() for _ in range(k)]
        triples = list(zip(blocks, hashes, token_lists))
        register, lookup, incref, free = pool.register, pool.lookup, pool.incref, pool.free
        t0 = pc()
        for b, h, t in triples:
            register(b, h, t)
        t1 = pc()
        for b in blocks:
            free(b)  # -> evictable (untimed: measured below)
        t2 = pc()
        hits = [lookup(h, t) for h, t in pairs]
        t3 = pc()
        for b in hits:
            incref(b)
        t4 = pc()
        for b in hits:
            free(b)
        t5 = pc()
        if hits != blocks:
            raise AssertionError(
                f"{pool_cls.__module__}: lookups did not hit the registered blocks"
            )
        best["register"] = min(best["register"], (t1 - t0) / k)
        best["lookup_hit"] = min(best["lookup_hit"], (t3 - t2) / k)
        best["incref_revive"] = min(best["incref_revive"], (t4 - t3) / k)
        best["free_to_evictable"] = min(best["free_to_evictable"], (t5 - t4) / k)
    out = {key: v * 1e9 for key, v in best.items()}
    out["cycle"] = sum(out.values())
    return out


def _pool(cfg: MicroConfig, rng: np.random.Generator) -> Dict[str, Any]:
    import pagedkv

    k = cfg.cache_cycle_blocks
    flat = rng.integers(0, 32000, size=k * cfg.block_size).astype(np.int32)
    hashes = pagedkv.hash_blocks(flat, cfg.block_size)
    token_lists = flat.reshape(k, cfg.block_size).tolist()
    results: Dict[str, Any] = {
        "pool_blocks": cfg.pool_blocks,
        "cache_cycle_blocks": k,
        "enable_caching": True,
        "unit": "ns per operation (Python loop of calls)",
    }
    impls = {"native": pagedkv.BlockPool}
    ref_pool = _import_attr("pagedkv.vllm_042.reference.pool", "BlockPool")
    if ref_pool is not None:
        impls["reference"] = ref_pool
    else:
        results["note"] = (
            "pagedkv.vllm_042.reference.pool.BlockPool is not importable: reference skipped"
        )
    for name, cls in impls.items():
        reps = cfg.ref_repeats if name == "reference" else cfg.repeats
        try:
            row = _alloc_free(cls, cfg, reps)
            row.update(_cache_cycle(cls, cfg, reps, hashes, token_lists))
        except Exception as exc:  # a reference still being written must not stop the bench
            results.setdefault("errors", {})[name] = repr(exc)
            continue
        results[name] = row
    if "native" in results and "reference" in results:
        nat, ref = results["native"], results["reference"]
        speedup = {}
        for key, v in nat.items():
            # batched native ops compare against the reference's batched op if it has one,
            # otherwise against its per-call loop
            ref_key = (
                key if key in ref else {"allocate_many": "allocate", "free_many": "free"}.get(key)
            )
            if ref_key in ref and v > 0:
                speedup[key] = ref[ref_key] / v
        results["speedup_vs_reference"] = speedup
    return results


def run_micro(cfg: MicroConfig = MICRO_FULL, seed: int = 0) -> Dict[str, Any]:
    """Run every micro benchmark (garbage collector paused, as ``timeit`` does)."""
    rng = np.random.default_rng(seed)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return {"config": cfg.to_dict(), "hashing": _hashing(cfg, rng), "pool": _pool(cfg, rng)}
    finally:
        if gc_was_enabled:
            gc.enable()
