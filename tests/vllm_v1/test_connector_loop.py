"""The native loop with a KV connector, matched with vLLM's scheduler at every step
(v1_harness.Lockstep): both build the deterministic :mod:`lockstep_connector` from the same
config, the harness reports the loads done (some failed) and the held blocks sent, and every
``SchedulerOutput`` (with the connector's metadata: what it was told, in order),
``EngineCoreOutputs`` (with the ``kv_transfer_params`` of finished requests), KV event and
the scheduler's state (the connector's id sets, fences, fetch stage counts included) is
compared. Seeds mix synchronous and asynchronous loads, connectors that cannot tell yet,
held blocks, ``has_pending_block_frees``, ``requires_kv_delivery``, both load-failure
policies, preemption, prefix caching, aborts, drafts, async scheduling, request kinds and
hybrid layouts."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import v1_harness as h
from manager_driver import HYBRID_LAYOUTS, RETENTIONS, retention_interval

from pagedkv.vllm_v1 import KVCacheManager as PagedKVCacheManager


def connector_seed(seed: int) -> dict:
    """A seed's arguments: a connector always; request kinds every third seed; a hybrid
    attention layout (window or chunked local beside full attention) every fifth."""
    kw: dict = {"connector": True, "request_kinds": seed % 3 == 1}
    if seed % 5 == 2:
        layout = sorted(HYBRID_LAYOUTS)[seed // 5 % len(HYBRID_LAYOUTS)]
        block_size = h.random_config(random.Random(seed)).block_size
        mode = RETENTIONS[seed // 5 % len(RETENTIONS)]
        kw.update(layout=layout, retention=retention_interval(mode, layout, block_size))
    return kw


def assert_native(stats: dict, manager_cls: type) -> None:
    """Every step on the native loop, but while a request out of its scope is held or a
    grammar compile error is to be reported (vLLM's own method reports it)."""
    if not issubclass(manager_cls, PagedKVCacheManager):
        return
    loops = stats["loops"]
    assert loops.get("native", 0) > 0, loops
    assert set(loops) <= {"native", "priority", "grammar compile errors"}, loops


@pytest.mark.parametrize("seed", range(40))
def test_lockstep_with_a_connector(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, **connector_seed(seed))
    assert stats["steps"] > 0
    assert_native(stats, manager_cls)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 400))
def test_lockstep_with_a_connector_slow(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, **connector_seed(seed))
    assert_native(stats, manager_cls)


def test_connector_seeds_reach_every_path(tiny_model_dir: Path, manager_cls: type) -> None:
    """The seeds load synchronously and asynchronously, fail loads, hold and send blocks,
    preempt, and draw every connector option and both failure policies."""
    totals: Counter = Counter()
    options: Counter = Counter()
    for seed in range(24):
        kw = connector_seed(seed)
        rng = random.Random(seed)
        cfg = h.random_config(rng)
        cfg, _ = h.with_connector(random.Random(f"connector{seed}"), cfg, [])
        options.update(cfg.connector or ("none",))
        stats = h.run_seed(seed, tiny_model_dir, manager_cls, **kw)
        totals.update({k: v for k, v in stats.items() if isinstance(v, int)})
    for key in ("remote_loads", "sync_loads", "failed_loads", "held_sends", "preemptions"):
        assert totals[key] > 0, (key, totals)
    for option in ("pending_frees", "requires_kv_delivery", "fail"):
        assert options[option] > 0, options


def test_the_differential_catches_a_connector_told_wrong(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, manager_cls: type
) -> None:
    """A planted difference: the native loop tells the connector one external token fewer
    after an allocation; the lockstep stops at that step's connector metadata."""
    if not issubclass(manager_cls, PagedKVCacheManager):
        pytest.skip("plants a difference in pagedkv's native loop")
    from pagedkv.vllm_v1 import _connector

    told = _connector.ConnectorSteps.allocated

    def planted(self, request, num_external, queries, load_async):  # type: ignore[no-untyped-def]
        if num_external:
            blocks = self.sched.kv_cache_manager.get_blocks(request.request_id)
            self.connector.update_state_after_alloc(request, blocks, num_external - 1)
            return
        told(self, request, num_external, queries, load_async)

    monkeypatch.setattr(_connector.ConnectorSteps, "allocated", planted)
    with pytest.raises(h.Divergence, match="SchedulerOutput"):
        h.run_seed(0, tiny_model_dir, manager_cls, **connector_seed(0))


def test_a_failed_load_below_the_tokens_in_flight(tiny_model_dir: Path, manager_cls: type) -> None:
    """Seed 1871 (0.33): an invalid block takes a request's computed tokens below its tokens
    in flight, and a step on vLLM's loop (a held request) then calls the manager's
    ``cache_blocks`` with a negative count, which vLLM's manager reads as nothing to cache
    (pagedkv's refused it once)."""
    stats = h.run_seed(1871, tiny_model_dir, manager_cls, **connector_seed(1871))
    assert stats["steps"] > 0
