"""The bench workloads (W1, W2, the scaling sweep), the driver's schedule (chunked prefill,
preemption) and the cross-backend schedule check."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv.bench.backends import BACKEND_NAMES, Backend, resolve_backends
from pagedkv.bench.driver import run_w1
from pagedkv.bench.report import cross_check
from pagedkv.bench.scaling import FACTORS, base_config, sweep_configs
from pagedkv.bench.workload import (
    W1_FULL,
    W1_QUICK,
    W2_FULL,
    W2_QUICK,
    W1Config,
    WorkloadConfig,
    generate,
    generate_w1,
)

BACKENDS, SKIP_NOTES = resolve_backends(list(BACKEND_NAMES))
BY_NAME = {b.name: b for b in BACKENDS}

needs_backends = pytest.mark.skipif(not BACKENDS, reason=f"no backend: {SKIP_NOTES}")

# A small, tight W1: few GPU blocks, no watermark and many n=2 requests, so that recompute and
# swap preemption (and copy-on-write after forks) all happen within a few hundred steps.
TIGHT = W1Config(
    num_requests=32,
    prompt_len_min=512,
    prompt_len_max=2048,
    num_prefixes=4,
    prefix_len_min=128,
    prefix_len_max=448,
    output_len_min=64,
    output_len_max=384,
    n2_share=0.3,
    num_gpu_blocks=600,
    num_cpu_blocks=200,
    watermark=0.0,
    max_num_seqs=16,
    prefill_token_budget=4096,
)

# One request and no prefixes: the step count of a chunked prefill is known by hand.
ONE = WorkloadConfig(
    name="T",
    num_requests=1,
    prompt_len_min=100,
    prompt_len_max=100,
    num_prefixes=0,
    prefix_share=0.0,
    output_len_min=5,
    output_len_max=5,
    n2_share=0.0,
    num_gpu_blocks=64,
    num_cpu_blocks=8,
    max_num_seqs=4,
    prefill_token_budget=32,
    chunked_prefill=True,
)


# -------------------------------------------------------------------------- chunked prefill


@needs_backends
@pytest.mark.parametrize("backend", [b.name for b in BACKENDS])
def test_chunked_prefill_schedule_by_hand(backend):
    b = BY_NAME[backend]
    # 100 prompt tokens in chunks of 32, 32, 32, 4 (the 4th also samples the first token),
    # then 4 decode steps
    r = run_w1(generate(ONE), b, False)
    assert (r.steps, r.partial_prefills, r.finished) == (8, 3, 1)
    # three 40-token prompts sharing a 32-token budget with the decodes (vLLM's chunked
    # scheduling: running groups first, then new prefills with what is left):
    # step 0: A 32 | 1: A 8, B 24 | 2: A 1, B 16, C 15 | 3: A, B 1 each, C 25 | 4: B, C | 5: C
    three = dataclasses.replace(
        ONE,
        num_requests=3,
        prompt_len_min=40,
        prompt_len_max=40,
        output_len_min=3,
        output_len_max=3,
    )
    r = run_w1(generate(three), b, False)
    assert (r.steps, r.partial_prefills, r.finished) == (6, 3, 3)
    assert r.all_blocks_free
    # without chunking each prompt is admitted whole: the budget must hold one
    whole = dataclasses.replace(three, chunked_prefill=False, prefill_token_budget=80)
    r = run_w1(generate(whole), b, False)
    assert r.partial_prefills == 0 and r.steps == 4  # A+B | A,B,C | A,B,C | C


def test_chunked_budget_must_hold_a_decode_per_sequence():
    with pytest.raises(ValueError, match="max_num_seqs"):
        dataclasses.replace(ONE, prefill_token_budget=3)
    with pytest.raises(ValueError, match="longest prompt"):
        dataclasses.replace(ONE, chunked_prefill=False)


# ------------------------------------------------------------------------------ W2 and W1


@needs_backends
def test_w2_preempts_both_ways_with_chunked_prefill_and_backends_agree():
    w = generate(W2_QUICK, seed=0)
    results = [run_w1(w, b, True) for b in BACKENDS]
    for r in results:
        assert r.finished == W2_QUICK.num_requests and r.all_blocks_free
        assert r.preempt_recompute > 0 and r.preempt_swap > 0
        assert r.swap_ins == r.preempt_swap
        assert r.partial_prefills > 0
        assert r.cow_copies > 0 and r.forks == sum(q.n == 2 for q in w.requests)
    assert cross_check(results)["ok"]


@pytest.mark.skipif("native-batch" not in BY_NAME, reason="native-batch backend not available")
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_w1_never_preempts(caching):
    """What the README says: W1 (full size) never preempts, W2 (full size) does."""
    r = run_w1(generate(W1_FULL), BY_NAME["native-batch"], caching)
    assert r.finished == W1_FULL.num_requests
    assert r.preempt_recompute == r.preempt_swap == r.partial_prefills == 0


@pytest.mark.slow
@pytest.mark.skipif("native-batch" not in BY_NAME, reason="native-batch backend not available")
def test_w2_full_preempts():
    r = run_w1(generate(W2_FULL), BY_NAME["native-batch"], True)
    assert r.finished == W2_FULL.num_requests and r.all_blocks_free
    assert r.preempt_recompute > 10 and r.preempt_swap > 10 and r.partial_prefills > 100


def test_w2_request_ids_and_shape():
    w = generate(W2_QUICK, seed=0)
    assert w.requests[0].request_id == "w2-0"
    assert sum(r.n == 2 for r in w.requests) == round(W2_QUICK.n2_share * W2_QUICK.num_requests)
    assert W2_FULL.chunked_prefill and not W1_FULL.chunked_prefill
    # the pool holds well under the running batch's demand (that is what makes W2 preempt)
    mean_len = (W2_FULL.prompt_len_min + W2_FULL.prompt_len_max) / 2 + W2_FULL.output_len_max / 4
    demand = W2_FULL.max_num_seqs * mean_len / W2_FULL.block_size
    assert W2_FULL.num_gpu_blocks < demand / 2


# ------------------------------------------------------------------------------ scaling sweep


def test_scaling_sweep_configs():
    for quick in (True, False):
        sweeps = sweep_configs(quick)
        base = base_config(quick)
        assert [c.max_num_seqs for c in sweeps["batch"]] == [base.max_num_seqs * k for k in FACTORS]
        assert [c.num_gpu_blocks for c in sweeps["batch"]] == [
            base.num_gpu_blocks * k for k in FACTORS
        ]
        assert [c.num_gpu_blocks for c in sweeps["pool"]] == [
            base.num_gpu_blocks * k for k in FACTORS
        ]
        assert {c.max_num_seqs for c in sweeps["pool"]} == {base.max_num_seqs}
    assert base_config(True).num_requests < base_config(False).num_requests


# ------------------------------------------------------------------------------- W1 generator


def test_w1_deterministic():
    a = generate_w1(W1_QUICK, seed=3)
    b = generate_w1(W1_QUICK, seed=3)
    c = generate_w1(W1_QUICK, seed=4)
    assert a.digest() == b.digest()
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.output_token_ids for r in a.requests] == [r.output_token_ids for r in b.requests]
    assert a.digest() != c.digest()


def test_w1_matches_spec():
    cfg = W1_FULL
    w = generate_w1(cfg, seed=0)
    reqs = w.requests
    assert len(reqs) == 1024
    assert len(w.prefixes) == 16
    assert all(256 <= len(p) <= 1536 for p in w.prefixes)
    assert min(len(p) for p in w.prefixes) == 256 and max(len(p) for p in w.prefixes) == 1536
    plens = np.array([len(r.prompt_token_ids) for r in reqs])
    assert plens.min() >= 512 and plens.max() <= 4096
    assert plens.min() < 700 and plens.max() > 3900  # spans the range
    olens = np.array([r.output_len for r in reqs])
    assert olens.min() >= 32 and olens.max() <= 256
    prefixed = [r for r in reqs if r.prefix_id is not None]
    assert len(prefixed) == round(0.8 * 1024)
    for r in prefixed:
        p = w.prefixes[r.prefix_id]
        assert r.prompt_token_ids[: len(p)] == p
        assert len(r.prompt_token_ids) >= len(p) + cfg.min_own_tokens
    assert len({r.prefix_id for r in prefixed}) == 16
    n2 = [r for r in reqs if r.n == 2]
    assert len(n2) == round(0.05 * 1024)
    assert all(r.n in (1, 2) for r in reqs)
    for r in reqs:
        assert len(r.output_token_ids) == r.n
        assert all(len(row) == r.output_len for row in r.output_token_ids)
        assert all(0 <= t < cfg.vocab_size for t in r.output_token_ids[0])
        assert r.arrival_time == 0.0
    # no two unprefixed prompts share their first block
    heads = [tuple(r.prompt_token_ids[:16]) for r in reqs if r.prefix_id is None]
    assert len(set(heads)) == len(heads)


def test_quick_config_is_scaled_w1():
    q = W1_QUICK
    assert q.num_requests < W1_FULL.num_requests
    assert q.num_gpu_blocks / q.num_requests == pytest.approx(
        W1_FULL.num_gpu_blocks / W1_FULL.num_requests
    )
    assert (q.prompt_len_min, q.prompt_len_max) == (W1_FULL.prompt_len_min, W1_FULL.prompt_len_max)


# -------------------------------------------------------------------------------- cross-check


@needs_backends
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_backends_agree_under_preemption(caching):
    w = generate_w1(TIGHT, seed=1)
    results = [run_w1(w, b, caching) for b in BACKENDS]
    for r in results:
        assert r.finished == TIGHT.num_requests
        assert r.all_blocks_free, r.backend
        assert r.preempt_recompute > 0 and r.preempt_swap > 0
        assert r.swap_ins == r.preempt_swap
        assert r.forks == sum(q.n == 2 for q in w.requests)
        assert r.cow_copies > 0
    check = cross_check(results)
    assert check["ok"], check


@needs_backends
def test_backends_agree_on_ignored_and_aborted():
    # a GPU pool too small for the longest prompts (NEVER -> ignored) and a CPU pool too small
    # to swap a forked group out (aborted)
    cfg = W1Config(
        **{**TIGHT.to_dict(), "num_gpu_blocks": 120, "num_cpu_blocks": 30, "num_requests": 24}
    )
    w = generate_w1(cfg, seed=1)
    results = [run_w1(w, b, True) for b in BACKENDS]
    for r in results:
        assert r.ignored > 0 and r.aborted > 0
        assert r.finished + r.ignored + r.aborted == cfg.num_requests
        assert r.all_blocks_free
    assert cross_check(results)["ok"]


@pytest.mark.skipif("native-batch" not in BY_NAME, reason="native-batch backend not available")
def test_batch_buffers_match_block_tables():
    """Every row append_slots_batch writes equals get_block_table / get_len / the newest slot."""
    nb = BY_NAME["native-batch"]
    bs = TIGHT.block_size
    checked = {"rows": 0}

    def make_manager(*args):
        mgr = nb.make_manager(*args)
        real = mgr.append_slots_batch

        def append_slots_batch(seqs, block_tables, context_lens, slot_mapping, **kw):
            cow = real(seqs, block_tables, context_lens, slot_mapping, **kw)
            for i, s in enumerate(seqs):
                table = mgr.get_block_table(s)
                n = s.get_len()
                assert context_lens[i] == n
                assert list(block_tables[i, : len(table)]) == table
                assert not block_tables[i, len(table) :].any()
                assert slot_mapping[i] == table[(n - 1) // bs] * bs + (n - 1) % bs
                checked["rows"] += 1
            return cow

        methods = {name: getattr(mgr, name) for name in dir(mgr) if not name.startswith("_")}
        methods["append_slots_batch"] = append_slots_batch
        return SimpleNamespace(**methods)

    backend = Backend(**{**nb.__dict__, "make_manager": make_manager})
    w = generate_w1(TIGHT, seed=2)
    r = run_w1(w, backend, True)
    assert r.all_blocks_free and checked["rows"] > 1000
    if "native" in BY_NAME:
        assert cross_check([run_w1(w, BY_NAME["native"], True), r])["ok"]


def test_chunk_sizes_follow_vllms_get_num_new_tokens():
    """Chunking cuts a single-sequence group's tokens to the budget (a decode too: with no
    budget left it waits), never a forked group's."""
    from pagedkv.bench.driver import _Live

    live = _Live(generate(ONE).requests[0])
    live.seqs = [object()]
    assert live.take(32) == 32 and live.take(500) == 100 and live.take(0) == 0
    live.computed = 96
    assert live.take(32) == 4
    live.in_prefill = False
    assert live.take(32) == 1 and live.take(0) == 0
    live.seqs = [object(), object()]
    assert live.take(0) == 2 and live.take(1) == 2
