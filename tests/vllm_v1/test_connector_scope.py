"""Which KV cache manager ``pagedkv.vllm_v1.Scheduler`` installs beside a KV connector, and
that the connector is bound to it: the native manager (one group, or the hybrid manager over
attention groups) for a connector that only schedules; vLLM's own, with the reason in the
start line, beside Mamba layers or for a connector that binds vLLM's block pool. Then a few
steps with external tokens, synchronous and asynchronous, against vLLM's scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import pytest
from v1_harness import first_difference, normalize
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager
from vllm.v1.core.sched.scheduler import Scheduler as VLLMScheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pagedkv.bench.vllm_v1 import driver
from pagedkv.vllm_v1 import KVCacheManager, Scheduler
from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

BLOCK = 16


class OfferingConnector(KVConnectorBase_V1, SupportsHMA):
    """A scheduler-side connector that offers half of each new request's uncomputed prompt
    as external tokens, loaded asynchronously for ids ending in an odd digit (said with an
    int, which vLLM's manager reads by truth value); a load is reported done by the next
    step's model output (``finished``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.loading: List[str] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        if num_computed_tokens or request.request_id in self.loading:
            return 0, False
        # "Asynchronously" as an int, as vLLM's scheduler passes it on to the manager as is.
        return (request.num_tokens - num_computed_tokens) // 2, int(request.request_id[-1]) % 2

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        if num_external and int(request.request_id[-1]) % 2:
            self.loading.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple:
        return False, None

    def finished(self) -> Optional[set]:
        done, self.loading = set(self.loading), []
        return done or None

    # The worker side is not used by a scheduler.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...


class PoolReadingConnector(OfferingConnector):
    """A connector that binds vLLM's block pool (as SimpleCPUOffload does)."""

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.pool = gpu_block_pool


def scheduler(tmp_path: Path, cls: type, connector: str, layers: Any = None) -> Any:
    model = driver.model_config(driver.write_model_dir(tmp_path / "m", 4096), 4096)
    vllm_config, kv_cache_config = driver.vllm_configs(
        model,
        BLOCK,
        300,
        layers=layers,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        async_scheduling=False,
    )
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=connector, kv_connector_module_path=__name__, kv_role="kv_both"
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = not layers
    return driver.new_scheduler(cls, vllm_config, kv_cache_config)


def test_a_scheduling_connector_gets_the_native_manager(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, Scheduler, "OfferingConnector")
    assert type(sched.kv_cache_manager) is KVCacheManager
    assert sched.connector._kv_cache_manager is sched.kv_cache_manager


def test_a_hybrid_attention_cache_gets_the_native_hybrid_manager(tmp_path: Path) -> None:
    sched = scheduler(tmp_path, Scheduler, "OfferingConnector", ["full", ("swa", 64)])
    assert type(sched.kv_cache_manager) is HybridKVCacheManager
    assert sched.connector._kv_cache_manager is sched.kv_cache_manager


@pytest.mark.parametrize(
    "connector,layers,why",
    [
        ("PoolReadingConnector", None, "binds vLLM's block pool (PoolReadingConnector)"),
        ("OfferingConnector", ["full", ("mamba", "align", 0)], "beside Mamba layers"),
    ],
)
def test_vllms_manager_stays_where_the_connector_needs_it(
    tmp_path: Path, connector: str, layers: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    sched = scheduler(tmp_path, Scheduler, connector, layers)
    assert isinstance(sched.kv_cache_manager, VLLMManager)
    from pagedkv.vllm_v1 import _scope

    assert why in (_scope.connector_out_of_scope(sched.connector, sched.kv_cache_config) or "")


def test_a_connector_of_unknown_kind_keeps_vllms_manager() -> None:
    """An object that is no ``KVConnectorBase_V1`` (its binding unknown) is read as binding
    vLLM's pool."""
    from types import SimpleNamespace

    from pagedkv.vllm_v1 import _scope

    config = SimpleNamespace(kv_cache_groups=[])
    assert "(object)" in (_scope.connector_out_of_scope(object(), config) or "")


def _requests(n: int) -> List[Request]:
    hasher = driver.request_block_hasher(BLOCK)
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[i % 3] * 40 + list(range(100 + i, 100 + i + 20 + 7 * i)),
            sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("layers", [None, ["full", ("swa", 64)]], ids=["one-group", "gpt-oss"])
def test_external_tokens_step_as_vllms(tmp_path: Path, layers: Any) -> None:
    """The same requests through vLLM's scheduler and pagedkv's, each over its own connector:
    every step's whole ``SchedulerOutput`` (block ids included) and outputs are equal."""
    ours = scheduler(tmp_path, Scheduler, "OfferingConnector", layers)
    theirs = scheduler(tmp_path, VLLMScheduler, "OfferingConnector", layers)
    assert type(ours.kv_cache_manager).__module__.startswith("pagedkv")
    sides = []
    for sched in (ours, theirs):
        reqs = {r.request_id: r for r in _requests(6)}
        for r in reqs.values():
            sched.add_request(r)
        sides.append((sched, reqs))
    for _ in range(40):
        seen = []
        for sched, reqs in sides:
            so = sched.schedule()
            mro = driver.model_runner_output(*driver.sampled_tokens(so, reqs, lambda r: 7))
            mro.kv_connector_output = KVConnectorOutput(finished_recving=sched.connector.finished())
            out = sched.update_from_output(so, mro)
            seen.append(normalize((so, out)))
        assert seen[0] == seen[1], first_difference(seen[0], seen[1])
    assert not ours.has_requests() and not theirs.has_requests()
