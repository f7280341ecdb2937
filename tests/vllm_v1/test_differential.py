"""Randomized lockstep differential: vLLM's v1 scheduler over vLLM's KVCacheManager and over
the manager under test ($PAGEDKV_V1_MANAGER_UNDER_TEST, see v1_harness), same seeded workload,
compared after every call (SchedulerOutput, EngineCoreOutputs with the scheduler stats and the
requests' events, published KV events, and ``v1_harness.scheduler_state``: queues in pop order,
the scheduler's sets and counters, every request's fields and tokens, usage, free blocks, block
tables)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import v1_harness as h
import vllm
from manager_driver import (
    HYBRID_LAYOUTS,
    LONE_GROUP_LAYOUTS,
    MAMBA_ALIGN_LAYOUTS,
    MAMBA_LAYOUTS,
    RETENTIONS,
    retention_interval,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager

# Not imported as `Scheduler`: this module (where the planted managers live) would be taken for
# a package with its own scheduler classes (h.scheduler_module).
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType
from vllm.v1.request import RequestStatus

from pagedkv.vllm_v1 import KVCacheManager as PagedKVCacheManager
from pagedkv.vllm_v1 import Scheduler as PagedScheduler
from pagedkv.vllm_v1._version import release_of

#: The installed vLLM's release ("0.32.0" or "0.33.0").
RELEASE = release_of(vllm.__version__)

FAST_SEEDS = range(100)
SLOW_SEEDS = range(100, 1100)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_lockstep(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    stats = h.run_seed(seed, tiny_model_dir, manager_cls)
    assert stats["steps"] > 0


@pytest.mark.parametrize("seed", range(12))
def test_lockstep_under_vllms_scheduler_class(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """The manager alone, built by vLLM's own Scheduler/AsyncScheduler from vLLM's
    constructor arguments (where its package brings its own scheduler classes too)."""
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, own_scheduler=False)
    assert stats["steps"] > 0


@pytest.mark.parametrize("seed", range(40))
def test_lockstep_cache_smaller_than_max_model_len(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """A KV cache smaller than max_model_len, prompts of exactly its size (refused) and one
    token short (they fill it): vLLM's loop would stall, pagedkv's refuses the first and caps
    every request's length at the cache's size. The reference is vLLM at max_model_len = the
    cache's size (v1_harness.length_cap; the prompts its processor would refuse are finished
    with an error and reported as pagedkv reports them), matched at every step.
    Only pagedkv's native loop applies the cap: vLLM's loop (the harness checking itself with
    vLLM's manager) stalls here."""
    if manager_cls.__module__.startswith("vllm."):
        return  # vLLM's own scheduler stalls on a cache smaller than max_model_len
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, small_cache=True)
    assert stats["capped_at_max_model_len"] + stats["refused_at_the_cap"] > 0, stats


@pytest.mark.parametrize("seed", range(16))
def test_lockstep_prefill_deferral(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """Prefills held back: data-parallel throttled steps (``schedule(throttle_prefills=True)``
    on a third to two thirds of the steps) and, on 0.33, the local prefill cadence
    (``prefill_schedule_interval`` 2 to 4), alone and together, with the capacity-bound
    release; the rest of the seed as :func:`test_lockstep` draws it (preemption, chunked
    prefill, drafts, async, aborts). Every step compared (``prefill_capacity_bound``,
    ``num_executed_steps`` and ``last_prefill_step`` among the state) and native."""
    from vllm.config import SchedulerConfig

    rng = random.Random(seed)
    cfg = h.random_config(rng)
    cadence = "prefill_schedule_interval" in {f.name for f in dataclasses.fields(SchedulerConfig)}
    throttle = (0.0, 0.35, 0.65)[seed % 3] if cadence else (0.35, 0.65)[seed % 2]
    interval = (1, 2, 4)[seed // 3 % 3] if cadence else 1
    if throttle == 0 and interval == 1:
        interval = 3
    cfg = dataclasses.replace(cfg, throttle_rate=throttle, prefill_schedule_interval=interval)
    capped = dataclasses.replace(cfg, max_model_len=h.length_cap(cfg))
    specs = h.random_workload(rng, capped)
    stats = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls).run()
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls)


@pytest.mark.parametrize("seed", range(24))
def test_lockstep_pipeline_parallel(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """Pipeline parallelism (2 to 4 stages, synchronous scheduling): as many steps in
    flight as stages, as EngineCore's batch queue keeps them (vLLM's
    ``max_concurrent_batches``), so prefill chunks overlap and decodes wait for their
    tokens; each step's ``CachedRequestData.new_token_ids`` carries the rows' tokens back
    to the first stage. The rest of the seed as :func:`test_lockstep` draws it. Every step
    compared and native. Every other seed also draws the request kinds (structured output,
    LoRA, prompt embeddings, repetition detection) and a hybrid layout. (Async scheduling
    with pipeline parallelism: vLLM's V1 model runner refuses it and vLLM's config here
    turns it off under the V2 runner; vLLM's own async PP tests, which set ``use_pp`` on an
    async scheduler, run against pagedkv's scheduler in test_vllm_own_tests.py.)"""
    import request_kinds as kinds

    rng = random.Random(seed)
    stages = 2 + seed % 3
    cfg = h.random_config(rng)
    if seed % 2:  # a pool with room for every group, as h.run_seed lays hybrid seeds out
        cfg = h.with_layout(cfg, sorted(HYBRID_LAYOUTS)[seed // 2 % len(HYBRID_LAYOUTS)])
    cfg = dataclasses.replace(cfg, async_scheduling=False, pipeline=stages)
    specs = h.random_workload(rng, dataclasses.replace(cfg, max_model_len=h.length_cap(cfg)))
    if seed % 2:
        cfg, specs = kinds.with_request_kinds(random.Random(f"kinds{seed}"), cfg, specs)
        if RELEASE == "0.32.0":  # vLLM 0.32 asserts with LoRA here (see below)
            cfg = dataclasses.replace(cfg, max_loras=None)
            specs = [dataclasses.replace(spec, lora=0) for spec in specs]
    stats = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls).run()
    assert stats["steps"] > 0 and stats["tokens_sent_back"] > 0, stats
    if manager_cls.__module__.startswith("pagedkv"):
        # vLLM's own method reports a grammar compile error: that step is vLLM's loop.
        assert set(stats["loops"]) <= {"native", "grammar compile errors"}, stats["loops"]
        assert stats["loops"]["native"] > stats["steps"] // 2, stats["loops"]


@pytest.mark.parametrize("seed", range(12))
def test_lockstep_async_pipeline_parallel(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Async scheduling with pipeline parallelism (2 to 4 stages), as vLLM's V2 model runner
    serves it on a GPU: the async scheduler, one step more in flight than stages
    (``max_concurrent_batches``), no tokens sent back (the stages share the sampled tokens).
    The config is built synchronous and switched (vLLM's config here turns async off: no
    Triton for the V2 runner). The rest of the seed as :func:`test_lockstep_pipeline_parallel`
    draws it, every other seed with the request kinds and a hybrid layout. Every step
    compared and native."""
    import request_kinds as kinds

    rng = random.Random(f"async-pp{seed}")
    cfg = h.random_config(rng)
    if seed % 2:
        cfg = h.with_layout(cfg, sorted(HYBRID_LAYOUTS)[seed // 2 % len(HYBRID_LAYOUTS)])
    cfg = dataclasses.replace(cfg, async_scheduling=True, pipeline=2 + seed % 3)
    specs = h.random_workload(rng, dataclasses.replace(cfg, max_model_len=h.length_cap(cfg)))
    if seed % 2:
        cfg, specs = kinds.with_request_kinds(random.Random(f"kinds{seed}"), cfg, specs)
        if RELEASE == "0.32.0":  # vLLM 0.32's LoRA count under PP (see below)
            cfg = dataclasses.replace(cfg, max_loras=None)
            specs = [dataclasses.replace(spec, lora=0) for spec in specs]
    stats = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls).run()
    assert stats["steps"] > 0 and stats["tokens_sent_back"] == 0, stats
    if manager_cls.__module__.startswith("pagedkv"):
        assert set(stats["loops"]) <= {"native", "grammar compile errors"}, stats["loops"]
        assert stats["loops"]["native"] > stats["steps"] // 2, stats["loops"]


def test_pipeline_parallel_lora_on_032_stays_vllms(tiny_model_dir: Path) -> None:
    """vLLM 0.32 with pipeline parallelism and LoRA: its running pass counts only the
    adapters it scheduled, so a request awaiting its output holds a slot uncounted, a
    request with another adapter is admitted, and vLLM's next step asserts (vLLM 0.33 counts
    every running request; its ``test_max_loras_counts_running_request_awaiting_output``
    runs natively against pagedkv). pagedkv's native loop would schedule both adapters
    where ``max_loras`` is 1, so on 0.32 those steps are vLLM's, which fails as vLLM fails;
    on 0.33 they are native and wait for the slot."""
    cfg = h.SchedConfig(max_loras=1, pipeline=2)
    sched = h.make_scheduler(cfg, tiny_model_dir, PagedKVCacheManager)
    hasher = h.request_block_hasher(cfg)
    scheduled = []
    for rid, lora in (("a", 1), ("b", 2)):
        spec = h.RequestSpec(rid, (5, 6, 7, 8, 9, 10, 11, 12), 4, True, 0, lora=lora)
        sched.add_request(h.build_request(spec, hasher))
        scheduled.append(list(sched.schedule().num_scheduled_tokens))  # a is in flight
    if RELEASE == "0.33.0":
        assert scheduled == [["a"], []]  # b waits: a holds the only slot
        assert sched.pagedkv_steps == {"native": 2}
    else:
        assert scheduled == [["a"], ["b"]]  # vLLM 0.32's rule, by vLLM's loop
        assert sched.pagedkv_steps == {"pipeline parallelism with LoRA on vLLM 0.32": 2}


def assert_native_loop(stats: dict, manager_cls: type, held: bool = False) -> None:
    """pagedkv's scheduler ran every step natively (``pagedkv_steps``); ``held``: the seed holds
    out-of-scope requests (``v1_harness.with_switch_requests``), so vLLM's loop ran while one
    was held, for no other reason, and the native loop ran the others."""
    if manager_cls.__module__.startswith("vllm."):
        return  # vLLM's own scheduler: no native loop
    loops = stats["loops"]
    assert loops.get("native", 0) > 0, loops
    if held:
        assert set(loops) <= {"native", "priority"}, loops
    else:
        assert set(loops) == {"native"}, loops


@pytest.mark.parametrize("seed", range(24))
def test_lockstep_hybrid(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """Hybrid KV cache groups (GPT-OSS-, Gemma-3-, Llama-4-like layouts and two windows, as
    vLLM groups the layers): pagedkv's native loop over its hybrid manager, matched with
    vLLM's scheduler over vLLM's manager at every step (preemption, prefix caching on and off,
    chunked prefill, aborts, drafts, KV events, sync and async), under each
    ``prefix_cache_retention_interval`` (every layout meets each mode twice; the scheduler
    sets each request's junction), every step native (vLLM's loop only while an
    out-of-scope request is held, one seed in four)."""
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, **hybrid_seed(seed))
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=seed % 4 == 3)


def hybrid_seed(seed: int) -> dict:
    """The layout and retention of hybrid lockstep seed ``seed`` (the block size is the
    seed's draw, so a periodic interval is set in scheduler blocks by the run)."""
    layouts = sorted(HYBRID_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    mode = RETENTIONS[seed // len(layouts) % len(RETENTIONS)]
    block_size = h.random_config(random.Random(seed)).block_size
    return dict(layout=layout, retention=retention_interval(mode, layout, block_size))


def test_hybrid_seeds_cover_preemption_hits_events_and_aborts(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """The hybrid seeds reach the paths they are there for, prefix hits under every
    retention mode (drafts: with async scheduling)."""
    totals: Counter = Counter()
    for seed in range(12):
        kw = hybrid_seed(seed)
        stats = h.run_seed(seed, tiny_model_dir, manager_cls, **kw)
        totals.update({k: v for k, v in stats.items() if isinstance(v, int)})
        totals["aborts"] += sum(stats["aborts"].values())
        totals[("hits", kw["retention"] and "periodic")] += stats["hits"]
    for key in ("preemptions", "hits", "events", "aborts", "drafts"):
        assert totals[key] > 0, (key, totals)
    for mode in (None, 0, "periodic"):
        assert totals[("hits", mode)] > 0, (mode, totals)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_lockstep_slow(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    stats = h.run_seed(seed, tiny_model_dir, manager_cls)
    assert stats["steps"] > 0


def test_fast_seeds_cover_every_configuration_axis() -> None:
    """The fast seeds draw every hash algorithm, each switch both ways, and each optional
    SchedulerConfig field is one this vLLM has (so that it is really set)."""
    cfgs = [h.random_config(random.Random(seed)) for seed in FAST_SEEDS]
    assert {c.hash_algo for c in cfgs} == set(h.HASH_ALGOS)
    switches = ("enable_caching", "async_scheduling", "kv_events", "reserve_full_isl")
    engine_options = ("perf_metrics", "iteration_details", "sampling_mask")
    for axis in (*switches, "adaptive_threshold", "include_finished_set", *engine_options):
        assert Counter(getattr(c, axis) for c in cfgs).keys() == {True, False}, axis
    assert {c.block_size for c in cfgs} == {4, 8, 16}
    assert {c.num_spec_tokens for c in cfgs} == {0, 2, 4}
    assert {(c.async_scheduling, c.num_spec_tokens > 0) for c in cfgs} == {
        (a, s) for a in (False, True) for s in (False, True)
    }
    assert {c.policy for c in cfgs} == {"fcfs", "priority"}
    assert {c.num_clients for c in cfgs} == {1, 2}
    assert {c.abort_rate > 0 for c in cfgs} == {True, False}
    for axis in ("max_num_scheduled_tokens", "max_num_active_seqs"):
        assert {getattr(c, axis) is None for c in cfgs} == {True, False}, axis
    assert set(h.optional_fields(h.SchedConfig())) == set(h.OPTIONAL_SCHEDULER_FIELDS.values())


def test_fast_seeds_cover_every_workload_axis() -> None:
    """Stop ids, min_tokens, ignore_eos both ways, max_tokens past max_model_len, n-like
    siblings, priority ties, arrival times out of order, clients, aborts at a set step."""
    specs, orders = [], []
    for seed in FAST_SEEDS:
        rng = random.Random(seed)
        cfg = h.random_config(rng)
        workload = h.random_workload(rng, cfg)
        specs += [(cfg, s) for s in workload]
        orders.append([s.arrival_time for s in workload])
    assert any(s.stop_token_ids for _, s in specs)
    assert {len(s.stop_token_ids) for _, s in specs} == {0, 1, 2, 3}
    assert any(s.min_tokens for _, s in specs)
    assert {s.ignore_eos for _, s in specs} == {True, False}
    assert any(len(s.prompt) + s.max_tokens > c.max_model_len for c, s in specs)
    assert any(s.req_id.startswith("1_") for _, s in specs)  # an n-like sibling
    assert {s.priority for _, s in specs} == {-1, 0, 1, 2}
    assert any(times != sorted(times) for times in orders)
    assert {s.client_index for _, s in specs} == {0, 1}
    assert any(s.abort_step is not None for _, s in specs)


PRESSURE = h.SchedConfig(
    block_size=4, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
)


def pressure_workload() -> list[h.RequestSpec]:
    """Eight requests sharing a 3-block prefix, more than the pool holds at once."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, h.VOCAB_SIZE) for _ in range(12)]
    return [
        h.RequestSpec(f"p{i}", tuple(prefix + [100 + i] * (3 + i)), 20, True, i // 2)
        for i in range(8)
    ]


@pytest.mark.parametrize(
    ("async_scheduling", "num_spec_tokens"), [(False, 0), (True, 0), (False, 3), (True, 3)]
)
def test_pressure_workload_preempts_hits_and_evicts(
    async_scheduling: bool, num_spec_tokens: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """The paths that matter are really taken: preemption, prefix hits, KV events (and draft
    tokens in lookahead slots: proposed between steps, or with async scheduling the
    placeholders of vLLM's "ngram_gpu" drafter)."""
    changes = {"async_scheduling": async_scheduling, "num_spec_tokens": num_spec_tokens}
    cfg = dataclasses.replace(PRESSURE, **changes)
    run = h.Lockstep(cfg, pressure_workload(), 1, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["preemptions"] > 0, stats
    assert stats["hits"] > 0, stats
    assert stats["events"] > 0, stats
    assert (stats["drafts"] > 0) == (num_spec_tokens > 0), stats
    if not manager_cls.__module__.startswith("vllm."):
        assert set(run.test.pagedkv_steps) == {"native"}, run.test.pagedkv_steps


def hybrid_pressure(
    cfg: h.SchedConfig, layout: str, retention: Optional[int] = None
) -> h.SchedConfig:
    """``cfg`` (the pressure configuration) over the layout's groups: the full group's 24
    blocks and 6 more per window or chunked group, which hold a few blocks each."""
    cfg = h.with_layout(cfg, layout, retention)
    groups = cfg.num_blocks // PRESSURE.num_blocks
    return dataclasses.replace(cfg, num_blocks=PRESSURE.num_blocks + 6 * (groups - 1))


#: Layouts whose requests' blocks grow with their length (a lone window or Mamba group's do
#: not: the pressure workload never preempts there).
def pressured(layouts: dict) -> list:
    return sorted(set(layouts) - LONE_GROUP_LAYOUTS)


@pytest.mark.parametrize("layout", sorted(HYBRID_LAYOUTS))
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("retention", [None, 0])
def test_hybrid_pressure_workload_preempts_hits_and_evicts(
    layout: str,
    async_scheduling: bool,
    retention: Optional[int],
    tiny_model_dir: Path,
    manager_cls: type,
) -> None:
    """The pressure workload over hybrid KV cache groups (the full group's 24 blocks and 6
    more per window or chunked group, which hold a few blocks each): preemption, prefix hits
    across groups (window blocks as null), KV events with groups; dense retention and vLLM's
    engine default (0)."""
    cfg = dataclasses.replace(PRESSURE, async_scheduling=async_scheduling)
    cfg = hybrid_pressure(cfg, layout, retention)
    stats = h.Lockstep(cfg, pressure_workload(), 1, tiny_model_dir, manager_cls).run()
    assert stats["preemptions"] > 0, stats
    assert stats["hits"] > 0, stats
    assert stats["events"] > 0, stats
    assert_native_loop(stats, manager_cls)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_local_layout_runs_natively_under_vllms_default_retention(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Llama-4-like groups (chunked local + full) with vLLM's engines' default
    ``prefix_cache_retention_interval=0`` (retention concerns sliding windows only): the
    pressure workload on the native loop, every step, matched with vLLM's."""
    cfg = dataclasses.replace(PRESSURE, async_scheduling=async_scheduling)
    cfg = hybrid_pressure(cfg, "llama4", 0)
    stats = h.Lockstep(cfg, pressure_workload(), 1, tiny_model_dir, manager_cls).run()
    assert stats["preemptions"] > 0 and stats["hits"] > 0 and stats["events"] > 0, stats
    assert_native_loop(stats, manager_cls)


@pytest.mark.parametrize("seed", range(12))
def test_lockstep_mamba_hybrid(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """Mamba layers beside full attention (Granite-4- / Nemotron-H-like layouts as vLLM
    groups the layers) in ``mamba_cache_mode`` "none" (prefix caching off; the state block
    spanning max_model_len, the scheduler block size their lcm as vLLM's engine resolves it;
    or state blocks at the attention block size): pagedkv's native loop over its hybrid
    manager matched with vLLM's scheduler over vLLM's ``MambaManager`` at every step
    (preemption, chunked prefill, aborts, drafts, the blocks to zero in every
    ``SchedulerOutput``, sync and async), every step native (vLLM's loop only while an
    out-of-scope request is held, one seed in four)."""
    layouts = sorted(MAMBA_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    stats = h.run_seed(
        seed, tiny_model_dir, manager_cls, layout=layout, retention=(None, 0)[seed % 2]
    )
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=seed % 4 == 3)


@pytest.mark.parametrize("seed", range(12))
def test_lockstep_lone_group(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """One KV cache group that is not full attention (vLLM's unitary coordinator): a
    sliding window on every layer, a pure Mamba model without prefix
    caching and with it ("align"): pagedkv's hybrid manager over that one group and its
    native loop matched with vLLM's scheduler over vLLM's manager at every step (prefix hits
    under dense, sparse and periodic retention, preemption, chunked prefill, aborts,
    events), every step native (vLLM's loop only while an out-of-scope request is held, one
    seed in four)."""
    layouts = sorted(LONE_GROUP_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    mode = RETENTIONS[seed // len(layouts) % len(RETENTIONS)]
    block_size = h.random_config(random.Random(seed)).block_size
    retention = retention_interval(mode, layout, block_size)
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, layout=layout, retention=retention)
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=seed % 4 == 3)


@pytest.mark.parametrize("seed", range(12))
def test_lockstep_mamba_align_hybrid(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """Mamba hybrids with prefix caching (``mamba_cache_mode`` "align": Granite-4-,
    Nemotron-H- and Qwen3-Next-like layouts, with and without prefill checkpoints and
    speculative state blocks): pagedkv's scheduler over its hybrid manager matched with
    vLLM's scheduler over vLLM's ``MambaManager`` at every step (prefix hits, preemption,
    chunked prefill, aborts, KV events, the blocks to zero, sync and async; no drafts:
    :func:`v1_harness.with_layout`), under
    dense and sparse retention, every step on pagedkv's native loop, which splits the
    prefills as vLLM's scheduler does (vLLM's loop only while an out-of-scope request is
    held, one seed in four)."""
    layouts = sorted(MAMBA_ALIGN_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    stats = h.run_seed(
        seed, tiny_model_dir, manager_cls, layout=layout, retention=(None, 0)[seed // 3 % 2]
    )
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=seed % 4 == 3)


def shared_prefix_workload(prefix_len: int, n: int) -> list[h.RequestSpec]:
    """``n`` requests sharing a ``prefix_len``-token prefix, tails of 5, 12, 19... tokens,
    two arriving per step."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, h.VOCAB_SIZE) for _ in range(prefix_len)]
    return [
        h.RequestSpec(f"w{i}", tuple(prefix + [100 + i] * (5 + 7 * i)), 12, True, i // 2)
        for i in range(n)
    ]


def _wide_block_config(
    layout: str, batched: int = 64, threshold: int = 8, async_scheduling: bool = False
) -> h.SchedConfig:
    """A Mamba "align" layout over 16-token blocks, a budget of ``batched`` tokens and a
    long-prefill threshold of ``threshold``."""
    cfg = h.SchedConfig(
        block_size=16,
        num_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=batched,
        max_model_len=128,
        long_prefill_token_threshold=threshold,
        async_scheduling=async_scheduling,
    )
    return h.with_layout(cfg, layout)


@pytest.mark.parametrize("layout", sorted(MAMBA_ALIGN_LAYOUTS))
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("batched", "threshold"), [(64, 8), (12, 0), (64, 0)])
def test_mamba_align_chunks_around_wide_blocks(
    layout: str,
    async_scheduling: bool,
    batched: int,
    threshold: int,
    tiny_model_dir: Path,
    manager_cls: type,
) -> None:
    """Mamba "align" with 16-token blocks: wider than the longest chunk the scheduler may
    schedule (a long-prefill threshold of 8, or a budget of 12), where chunks advance
    sub-block and re-align at the next boundary, and as wide as a third of the budget;
    prefix hits on a shared 40-token prefix (a hit ending mid-prompt, chunks resuming from
    it): pagedkv's native loop matched with vLLM's scheduler step by step."""
    cfg = _wide_block_config(layout, batched, threshold, async_scheduling)
    stats = h.Lockstep(cfg, shared_prefix_workload(40, 6), 1, tiny_model_dir, manager_cls).run()
    assert stats["hits"] > 0, stats
    assert_native_loop(stats, manager_cls)


def test_an_overridden_mamba_split_runs_in_the_native_loop(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """A scheduler class that overrides ``_mamba_block_aligned_split`` (as platform plugins
    do) gets its own split called by the native loop wherever vLLM's loop calls it, with
    vLLM's arguments: here one that logs and delegates, so the steps still match vLLM's."""
    from pagedkv.vllm_v1 import Scheduler

    calls: list[tuple] = []

    class LoggingSplit(Scheduler):
        def _mamba_block_aligned_split(self, request, num_new_tokens, *args):  # type: ignore[no-untyped-def]
            calls.append((request.request_id, num_new_tokens, *args))
            return super()._mamba_block_aligned_split(request, num_new_tokens, *args)

    pagedkv = not manager_cls.__module__.startswith("vllm.")
    cfg = _wide_block_config("granite4-align")
    work = shared_prefix_workload(40, 6)
    cls = LoggingSplit if pagedkv else None
    stats = h.Lockstep(cfg, work, 1, tiny_model_dir, manager_cls, scheduler_cls=cls).run()
    assert_native_loop(stats, manager_cls)
    if pagedkv:
        # Both passes: the waiting pass passes the prefix hit and no external tokens.
        assert {len(c) for c in calls} == {2, 4}, calls[:8]
        assert all(c[3] == 0 for c in calls if len(c) == 4)


def test_a_plugins_patch_of_vllms_mamba_split_is_called(
    tiny_model_dir: Path, manager_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A platform plugin's ``functools.wraps`` patch on vLLM's own ``Scheduler`` class: the
    native loop (built after the patch) calls the patched split, as vLLM's loop would."""
    import functools

    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    original = VllmScheduler._mamba_block_aligned_split
    callers: set[str] = set()

    @functools.wraps(original)
    def patched(self, request, num_new_tokens, *args):  # type: ignore[no-untyped-def]
        callers.add(type(self.kv_cache_manager).__module__.partition(".")[0])
        return original(self, request, num_new_tokens, *args)

    monkeypatch.setattr(VllmScheduler, "_mamba_block_aligned_split", patched)
    cfg = _wide_block_config("nemotron-h-align")
    stats = h.Lockstep(cfg, shared_prefix_workload(40, 6), 1, tiny_model_dir, manager_cls).run()
    assert_native_loop(stats, manager_cls)
    # The reference (vLLM's loop) and the scheduler under test both called it.
    assert callers == {"vllm", manager_cls.__module__.partition(".")[0]}, callers


@pytest.mark.parametrize("layout", pressured(MAMBA_LAYOUTS))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mamba_pressure_workload_preempts_natively(
    layout: str, async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """The pressure workload over Mamba hybrid groups (prefix caching off): preemption with
    the state blocks and the attention blocks to zero matched step by step, on the native
    loop every step."""
    cfg = dataclasses.replace(PRESSURE, async_scheduling=async_scheduling)
    cfg = hybrid_pressure(cfg, layout)
    stats = h.Lockstep(cfg, pressure_workload(), 1, tiny_model_dir, manager_cls).run()
    assert stats["preemptions"] > 0, stats
    assert_native_loop(stats, manager_cls)


def priority_workload() -> list[h.RequestSpec]:
    """Eight requests, each more urgent (smaller priority) than the one before, two arriving
    per step with one arrival time: the pool fills and the victims are the oldest (least
    urgent) running requests, not the tail of ``running``."""
    return [
        dataclasses.replace(spec, priority=8 - i, arrival_time=float(i // 2))
        for i, spec in enumerate(pressure_workload())
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_policy_preempts_by_priority(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    cfg = dataclasses.replace(PRESSURE, policy="priority", async_scheduling=async_scheduling)
    stats = h.Lockstep(cfg, priority_workload(), 1, tiny_model_dir, manager_cls).run()
    assert stats["preemptions"] > 0, stats
    assert stats["priority_preemptions"] > 0, stats


def stop_workload() -> list[h.RequestSpec]:
    """Requests that only stop ids can end early (EOS ignored), half with min_tokens (and
    every stop id)."""
    rng = random.Random(7)
    return [
        h.RequestSpec(
            f"s{i}",
            prompt(rng, 5 + i),
            max_tokens=40,
            ignore_eos=True,
            arrival_step=i // 4,
            stop_token_ids=h.STOP_TOKEN_IDS if i % 2 else h.STOP_TOKEN_IDS[: 1 + i % 3],
            min_tokens=30 if i % 2 else 0,
        )
        for i in range(24)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_ids_and_min_tokens(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Requests stopped by a stop id (``stop_reason`` set), and some by one that slipped past
    the sampler's min_tokens mask: vLLM's check_stop stops on it all the same."""
    cfg = dataclasses.replace(PRESSURE, num_blocks=64, async_scheduling=async_scheduling)
    stats = h.Lockstep(cfg, stop_workload(), 1, tiny_model_dir, manager_cls).run()
    assert stats["stopped_by_stop_id"] > 0, stats
    assert stats["stopped_under_min_tokens"] > 0, stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_max_model_len_caps_the_length(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """max_tokens past max_model_len, EOS ignored: every request ends at max_model_len tokens
    with finish reason "length"."""
    cfg = dataclasses.replace(PRESSURE, num_blocks=40, async_scheduling=async_scheduling)
    rng = random.Random(3)
    specs = [h.RequestSpec(f"c{i}", prompt(rng, 8 + 5 * i), 64, True, i) for i in range(6)]
    stats = h.Lockstep(cfg, specs, 1, tiny_model_dir, manager_cls).run()
    assert stats["capped_at_max_model_len"] == len(specs), stats


def test_aborts_everywhere(tiny_model_dir: Path, manager_cls: type) -> None:
    """Aborts of waiting, preempted and running requests, of requests with a step in flight,
    and of finished and unknown ids (which abort nothing)."""
    cfg = dataclasses.replace(PRESSURE, async_scheduling=True, abort_rate=0.3)
    rng = random.Random(11)
    specs = [
        h.RequestSpec(f"a{i}", prompt(rng, 10 + i % 7 * 3), 30, True, i // 3) for i in range(40)
    ]
    stats = h.Lockstep(cfg, specs, 1, tiny_model_dir, manager_cls).run()
    assert set(stats["aborts"]) == set(h.ABORT_KINDS), stats


def prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, h.VOCAB_SIZE) for _ in range(n))


# --------------------------------------------------------------------------- planted bugs


class ReversedFreeOrder(KVCacheManager):
    """Hands out free blocks in the opposite order (a different but 'valid' allocator)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pool = self.block_pool
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        pool.free_blocks(reversed(blocks))


class DropsLastEvent(KVCacheManager):
    """Loses the last KV event of each batch."""

    def take_events(self):
        return super().take_events()[:-1]


class UnderReportsHits(KVCacheManager):
    """Counts one hit token fewer in the prefix-cache stats of each hit."""

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        super().record_prefix_cache_stats(request, max(num_hits - 1, 0))


@pytest.mark.parametrize(
    ("planted", "what"),
    [
        (ReversedFreeOrder, "SchedulerOutput"),
        (DropsLastEvent, "KV events"),
        (UnderReportsHits, "EngineCoreOutputs"),
    ],
)
def test_the_differential_catches_a_planted_difference(
    planted: type, what: str, tiny_model_dir: Path
) -> None:
    with pytest.raises(h.Divergence, match=what):
        h.Lockstep(PRESSURE, pressure_workload(), 1, tiny_model_dir, planted).run()


class SendsOneGroup(PagedScheduler):
    """The native loop's output with every request's block ids cut to the first KV cache
    group (what a loop serving one group would send the model runner)."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            new.block_ids = new.block_ids[:1]
        cached = out.scheduled_cached_reqs
        cached.new_block_ids = [b if b is None else b[:1] for b in cached.new_block_ids]
        return out


class LosesLaterGroupsEvents(PagedScheduler):
    """The hybrid manager's KV events of groups past the first are lost as the native loop
    hands them on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        manager = self.kv_cache_manager
        drain = manager._drain_events

        def lossy(request=None) -> None:
            before = len(manager._events)
            drain(request)
            kept = [e for e in manager._events[before:] if getattr(e, "group_idx", 0) == 0]
            manager._events[before:] = kept

        manager._drain_events = lossy


@pytest.mark.parametrize(
    ("planted", "what"), [(SendsOneGroup, "SchedulerOutput"), (LosesLaterGroupsEvents, "KV events")]
)
def test_the_differential_catches_a_planted_hybrid_loop_difference(
    planted: type, what: str, tiny_model_dir: Path
) -> None:
    """Over hybrid groups, pagedkv's scheduler on its native loop (every step native) with a
    planted difference in what the loop hands on: caught where it first shows."""
    cfg = hybrid_pressure(PRESSURE, "gpt-oss")
    run = h.Lockstep(
        cfg, pressure_workload(), 1, tiny_model_dir, PagedKVCacheManager, scheduler_cls=planted
    )
    with pytest.raises(h.Divergence, match=what):
        run.run()
    assert run.test._pagedkv_loop is not None
    assert set(run.test.pagedkv_steps) == {"native"}, run.test.pagedkv_steps


class DoesNotCountSteps(VllmScheduler):
    """Forgets to advance ``current_step`` (nothing the engine gets back shows it)."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        self.current_step -= 1
        return out


class QueuesAtTheFront(VllmScheduler):
    """FCFS with a new request put at the front of ``waiting``."""

    def add_request(self, request) -> None:
        super().add_request(request)
        self.waiting.remove_request(request)
        self.waiting.prepend_request(request)


class LosesTheQueuedEvent(VllmScheduler):
    """Records no QUEUED event."""

    def add_request(self, request) -> None:
        super().add_request(request)
        request.events.clear()


class ForgetsPreemptions(VllmScheduler):
    """Does not count a preemption in ``num_preemptions``."""

    def _preempt_request(self, request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        request.num_preemptions -= 1


class AbortsAsStopped(VllmScheduler):
    """Finishes aborted requests as stopped (no output carries it: only their final state)."""

    def finish_requests(self, request_ids, finished_status):
        return super().finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)


@pytest.mark.parametrize(
    ("planted", "when"),
    [
        (DoesNotCountSteps, "after schedule"),
        (QueuesAtTheFront, "after arrivals and aborts"),
        (LosesTheQueuedEvent, "after arrivals and aborts"),
        (ForgetsPreemptions, "after schedule"),
        (AbortsAsStopped, "after arrivals and aborts"),
    ],
)
def test_the_scheduler_state_catches_a_planted_scheduler_difference(
    planted: type, when: str, tiny_model_dir: Path
) -> None:
    """What only the state shows, caught where it happens (vLLM's manager on both sides)."""
    specs = [dataclasses.replace(s, abort_step=4) for s in pressure_workload()[:2]]
    specs += pressure_workload()[2:]
    lockstep = h.Lockstep(PRESSURE, specs, 1, tiny_model_dir, KVCacheManager, scheduler_cls=planted)
    with pytest.raises(h.Divergence, match=f"{when}: scheduler state"):
        lockstep.run()


def test_vllms_manager_against_itself_agrees(tiny_model_dir: Path) -> None:
    """The harness's own baseline (nothing in it differs by construction: ids, timestamps)."""
    stats = h.Lockstep(PRESSURE, pressure_workload(), 1, tiny_model_dir, KVCacheManager).run()
    assert stats["preemptions"] > 0


# --------------------------------------------------------------------------- the injection


def test_the_scheduler_under_test_runs_the_manager_under_test(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    for async_scheduling in (False, True):
        cfg = h.SchedConfig(async_scheduling=async_scheduling)
        sched = h.make_scheduler(cfg, tiny_model_dir, manager_cls)
        assert type(sched.kv_cache_manager) is manager_cls
        reference = h.make_scheduler(cfg, tiny_model_dir)
        assert type(reference.kv_cache_manager) is KVCacheManager
        if hasattr(sched, "manager_kwargs"):  # injected: vLLM's own constructor arguments
            assert sched.manager_kwargs["kv_cache_config"] is sched.kv_cache_config
            assert sched.manager_kwargs["enable_caching"] is True
        else:  # the module's own Scheduler classes (pagedkv.vllm_v1)
            name = "AsyncScheduler" if async_scheduling else "Scheduler"
            assert isinstance(sched, getattr(h.scheduler_module(manager_cls), name))


@dataclasses.dataclass
class Stamped:
    value: int
    timestamp: float


def test_normalize_keeps_order_and_drops_timestamps() -> None:
    a = h.normalize({"x": [1, 2], "y": {3, 1}})
    assert a == h.normalize({"x": [1, 2], "y": {1, 3}})
    assert a != h.normalize({"y": {1, 3}, "x": [1, 2]})
    assert h.normalize(Stamped(1, 2.0)) == h.normalize(Stamped(1, 3.0))
    assert h.normalize(Stamped(1, 2.0)) != h.normalize(Stamped(2, 2.0))
    diff = h.first_difference(h.normalize([Stamped(1, 0.0)]), h.normalize([Stamped(2, 0.0)]))
    assert diff == "[0].value: 1 != 2"


def test_normalize_compares_event_types_and_enum_names() -> None:
    queued = h.normalize(EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0))
    assert queued == h.normalize(EngineCoreEvent(EngineCoreEventType.QUEUED, 2.0))
    assert queued != h.normalize(EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.0))
    assert h.normalize(RequestStatus.RUNNING) == "RequestStatus.RUNNING"
    assert h.normalize(RequestStatus.RUNNING) != h.normalize(int(RequestStatus.RUNNING))


def test_scheduler_state_reads_the_priority_queue_in_pop_order(tiny_model_dir: Path) -> None:
    """Pop order is (priority, arrival_time, request id), not the heap's list order; reading it
    pops nothing."""
    cfg = h.SchedConfig(policy="priority")
    sched = h.make_scheduler(cfg, tiny_model_dir)
    hasher = h.request_block_hasher(cfg)
    arrivals = [("a", 2, 0.0), ("b", 0, 5.0), ("c", 0, 1.0), ("d", 1, 0.0), ("b2", 0, 1.0)]
    for rid, priority, arrival in arrivals:
        spec = h.RequestSpec(rid, (5, 6, 7), 4, True, 0, priority=priority, arrival_time=arrival)
        sched.add_request(h.build_request(spec, hasher))
    state = h.scheduler_state(sched)
    assert state["waiting"] == ["b2", "c", "b", "d", "a"]
    assert [r.request_id for r in sched.waiting._heap] != state["waiting"]
    assert h.scheduler_state(sched) == state


def switch_workload() -> list[h.RequestSpec]:
    """Plain requests throughout; one held request (outside the native loop) arrives at step
    6 and runs for a while."""
    rng = random.Random(11)
    specs = [
        h.RequestSpec(f"p{i}", tuple(h._tokens(rng, 20 + 7 * i)), 30, True, 2 * i) for i in range(8)
    ]
    specs.append(h.RequestSpec("rep", tuple(h._tokens(rng, 24)), 12, True, 6, held=True))
    return specs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_switch_to_vllms_loop_and_back(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """While the out-of-scope request is held, pagedkv's Scheduler runs vLLM's loop; before
    it arrives and after it leaves, its native loop; the differential holds throughout."""
    cfg = dataclasses.replace(
        PRESSURE, async_scheduling=async_scheduling, max_model_len=128, num_blocks=64
    )
    run = h.Lockstep(cfg, switch_workload(), 3, tiny_model_dir, manager_cls)
    loops: list[str] = []
    schedule = run.test.schedule

    def recording_schedule(*args: object, **kwargs: object) -> object:
        before = getattr(run.test, "pagedkv_native_steps", None)
        out = schedule(*args, **kwargs)
        if before is not None:
            loops.append("native" if run.test.pagedkv_native_steps > before else "vllm")
        return out

    run.test.schedule = recording_schedule  # type: ignore[method-assign]
    run.run()
    if manager_cls.__module__.startswith("vllm."):
        return  # the harness checking itself: no native loop
    first_vllm, last_vllm = loops.index("vllm"), len(loops) - 1 - loops[::-1].index("vllm")
    assert "native" in loops[:first_vllm] and "native" in loops[last_vllm + 1 :], loops


#: SchedConfig's engine options, each served by pagedkv's native loop.
ENGINE_OPTIONS = ("perf_metrics", "iteration_details", "sampling_mask")


def option_in_effect(sched: VllmScheduler, option: str) -> bool:
    """Whether the scheduler really has ``option`` on, as vLLM's loop reads it."""
    if option == "perf_metrics":
        return bool(sched.perf_metrics and sched.perf_metrics.is_enabled())
    if option == "iteration_details":
        return sched.log_stats and sched.observability_config.enable_logging_iteration_details
    return sched.return_sampling_mask


def option_output_seen(result: dict, option: str) -> bool:
    """Whether one step's ``EngineCoreOutputs`` carry what ``option`` adds (iteration details
    add nothing here: vLLM's count of no encoder inputs is ``None``)."""
    if option == "perf_metrics":
        return any(
            eco.scheduler_stats.perf_stats is not None
            for eco in result.values()
            if eco.scheduler_stats
        )
    if option == "sampling_mask":
        return any(o.new_sampling_mask is not None for eco in result.values() for o in eco.outputs)
    return False


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("option", ENGINE_OPTIONS)
def test_engine_option_runs_natively(
    option: str, async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """With an engine option on, a plain workload (stops, truncations, preemption, two
    clients): every call matches vLLM's (decisions, outputs with their perf stats and
    sampling masks, state), and pagedkv's Scheduler runs every step natively."""
    cfg = dataclasses.replace(
        PRESSURE,
        async_scheduling=async_scheduling,
        max_model_len=128,
        num_blocks=40,
        num_clients=2,
        **{option: True},
    )
    rng = random.Random(11)
    specs = [s for s in h.random_workload(rng, cfg) if not s.repetition]
    run = h.Lockstep(cfg, specs, 11, tiny_model_dir, manager_cls)
    assert option_in_effect(run.ref, option) and option_in_effect(run.test, option)
    seen: list[bool] = []
    update = run.test.update_from_output

    def recording_update(*args: object) -> object:
        result = update(*args)
        seen.append(option_output_seen(result, option))
        return result

    run.test.update_from_output = recording_update  # type: ignore[method-assign]
    stats = run.run()
    assert stats["steps"] > 0 and stats["stopped_by_stop_id"] + stats["preemptions"] > 0
    if option != "iteration_details":
        assert any(seen)
    if manager_cls.__module__.startswith("vllm."):
        return  # the harness checking itself: no native loop
    assert set(run.test.pagedkv_steps) == {"native"}, run.test.pagedkv_steps
