"""How pagedkv is switched on inside vLLM: the scheduler classes, the fallback, the version
gate and the ``vllm.general_plugins`` entry point."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import tempfile
from typing import Any, Dict

import pytest
import vllm
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VLLMAsync
from vllm.v1.core.sched.scheduler import Scheduler as VLLMScheduler
from vllm.v1.kv_cache_interface import SlidingWindowSpec

import pagedkv.vllm_v1 as pv
from pagedkv.bench import vllm_v1 as bench
from pagedkv.bench.harness import EngineConfig
from pagedkv.bench.workload import W1_QUICK
from pagedkv.errors import UnsupportedVLLMError
from pagedkv.vllm_v1 import _manager, plugin

SMALL = dataclasses.replace(W1_QUICK, num_requests=4, num_gpu_blocks=64, max_num_seqs=4)


def scheduler(native: bool, **spec) -> object:
    engine_spec = bench.EngineSpec(**spec)
    config = EngineConfig.from_workload(SMALL, engine_spec.caching)
    with tempfile.TemporaryDirectory() as d:
        model = bench.write_model_dir(d, config.max_model_len)
        return bench.build_scheduler(engine_spec, config, model, native)


def test_scheduler_gets_the_native_manager() -> None:
    s = scheduler(True)
    assert type(s) is pv.Scheduler and isinstance(s, VLLMScheduler)
    assert type(s.kv_cache_manager) is pv.KVCacheManager
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == SMALL.num_gpu_blocks - 1


def test_naming_scheduler_gives_the_async_variant_under_async_scheduling() -> None:
    base = scheduler(False)
    base.vllm_config.scheduler_config.async_scheduling = True
    s = pv.Scheduler(
        vllm_config=base.vllm_config,
        kv_cache_config=base.kv_cache_config,
        block_size=SMALL.block_size,
        structured_output_manager=base.structured_output_manager,
    )
    assert type(s) is pv.AsyncScheduler and isinstance(s, VLLMAsync)
    assert type(s.kv_cache_manager) is pv.KVCacheManager


def test_out_of_scope_configs_get_vllms_manager(caplog: pytest.LogCaptureFixture) -> None:
    s = scheduler(False)
    cfg = s.kv_cache_config
    two_groups = dataclasses.replace(cfg, kv_cache_groups=cfg.kv_cache_groups * 2)
    args = dict(max_model_len=256, scheduler_block_size=16, hash_block_size=16)
    _manager._LOGGED.clear()
    with caplog.at_level("DEBUG", logger="pagedkv.vllm_v1"):
        # Two full-attention groups: the native hybrid manager (pagedkv.vllm_v1._hybrid).
        m = pv.KVCacheManager(two_groups, **args)
        assert type(m).__name__ == "HybridKVCacheManager"
        windows = dataclasses.replace(
            cfg,
            kv_cache_groups=[
                dataclasses.replace(
                    g,
                    kv_cache_spec=SlidingWindowSpec(
                        sliding_window=32, **_attention_fields(g.kv_cache_spec)
                    ),
                )
                for g in cfg.kv_cache_groups * 2
            ],
        )
        assert type(pv.KVCacheManager(windows, **args)) is VLLMManager
        # EAGLE/MTP is native; decode context parallelism is not.
        assert type(pv.KVCacheManager(cfg, use_eagle=True, **args)) is pv.KVCacheManager
        dcp = dict(args, scheduler_block_size=32, hash_block_size=32, dcp_world_size=2)
        assert type(pv.KVCacheManager(cfg, **dcp)) is VLLMManager  # its blocks 16 x 2 ranks
        assert type(pv.KVCacheManager(cfg, **args)) is pv.KVCacheManager
    text = caplog.text
    assert "without a full-attention group" in text and "context parallelism" in text
    assert "native KV cache manager" in text


def _attention_fields(spec: Any) -> Dict[str, Any]:
    names = ("block_size", "num_kv_heads", "head_size", "dtype")
    return {n: getattr(spec, n) for n in names}


def test_other_vllm_releases_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    cfg = scheduler(False).kv_cache_config
    with pytest.raises(UnsupportedVLLMError, match="0.31.0"):
        pv.KVCacheManager(cfg, max_model_len=256, scheduler_block_size=16, hash_block_size=16)


def test_entry_point_is_registered() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "pagedkv.vllm_v1.plugin:register" for ep in eps)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plugin_makes_pagedkv_the_default_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    config = scheduler(False).scheduler_config
    config.async_scheduling = async_scheduling  # vLLM's CPU platform turns it off; set it back
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    assert SchedulerConfig.get_scheduler_cls is original
    monkeypatch.setattr(SchedulerConfig, "get_scheduler_cls", original)
    monkeypatch.setenv(plugin.ENV, "1")
    plugin.register()
    want = pv.AsyncScheduler if async_scheduling else pv.Scheduler
    assert config.get_scheduler_cls() is want
    config.scheduler_cls = "vllm.v1.core.sched.scheduler.Scheduler"
    assert config.get_scheduler_cls() is VLLMScheduler  # a named class wins
