"""The bench workloads (W1, W2, the scaling sweep), the schedule recorded from
pagedkv.Scheduler (chunked prefill, preemption), its replay onto every block-manager backend
and the replay's cross-check against the scheduler."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv.bench.report import cross_check
from pagedkv.bench.scaling import FACTORS, base_config, sweep_configs
from pagedkv.bench.vllm_042.backends import BACKEND_NAMES, Backend, resolve_backends
from pagedkv.bench.vllm_042.replay import replay
from pagedkv.bench.vllm_042.trace import record
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

# A small, tight W1: few GPU blocks and many n=2 requests, so that recompute and swap
# preemption (and copy-on-write after forks) all happen within a few hundred steps.
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
    num_cpu_blocks=400,
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


def run(workload, backend, caching):
    """The bench's block-manager run: pagedkv.Scheduler's schedule, replayed on ``backend``."""
    return replay(record(workload, caching), backend)


def scheduled(cfg):
    """``(request id, tokens)`` scheduled per step, from pagedkv.Scheduler."""
    return [list(s.scheduled) for s in record(generate(cfg), False).steps]


# ------------------------------------------------------------------ the schedule, by hand


def test_chunked_prefill_schedule_by_hand():
    # 100 prompt tokens in chunks of 32, 32, 32, 4 (the 4th also samples the first token),
    # then 4 decode steps
    assert scheduled(ONE) == [[("t-0", n)] for n in (32, 32, 32, 4, 1, 1, 1, 1)]
    # three 40-token prompts sharing a 32-token budget with the decodes (vLLM's chunked
    # scheduling: running groups first, then new prefills with what is left; the outputs list
    # new prefills, then running prefills, then decodes)
    three = dataclasses.replace(
        ONE,
        num_requests=3,
        prompt_len_min=40,
        prompt_len_max=40,
        output_len_min=3,
        output_len_max=3,
    )
    assert scheduled(three) == [
        [("t-0", 32)],
        [("t-1", 24), ("t-0", 8)],
        [("t-2", 15), ("t-1", 16), ("t-0", 1)],
        [("t-2", 25), ("t-0", 1), ("t-1", 1)],
        [("t-1", 1), ("t-2", 1)],
        [("t-2", 1)],
    ]
    # without chunking vLLM's default policy admits whole prompts and never mixes prompts
    # with decodes: A+B fill the 80-token budget, C waits a step, then all three decode
    whole = dataclasses.replace(three, chunked_prefill=False, prefill_token_budget=80)
    assert scheduled(whole) == [
        [("t-0", 40), ("t-1", 40)],
        [("t-2", 40)],
        [("t-0", 1), ("t-1", 1), ("t-2", 1)],
        [("t-0", 1), ("t-1", 1), ("t-2", 1)],
    ]


@needs_backends
@pytest.mark.parametrize("backend", [b.name for b in BACKENDS])
def test_replay_counts_chunks_and_finishes(backend):
    r = run(generate(ONE), BY_NAME[backend], False)
    assert (r.steps, r.partial_prefills, r.finished, r.mismatch) == (8, 3, 1, None)
    assert r.all_blocks_free


def test_chunked_budget_must_hold_a_decode_per_sequence():
    with pytest.raises(ValueError, match="max_num_seqs"):
        dataclasses.replace(ONE, prefill_token_budget=3)
    with pytest.raises(ValueError, match="longest prompt"):
        dataclasses.replace(ONE, chunked_prefill=False)


def test_the_scheduler_watermark_is_vllms():
    with pytest.raises(ValueError, match="watermark must be 0.01"):
        record(generate(dataclasses.replace(ONE, watermark=0.0)), False)


# ------------------------------------------------------------------------------ W2 and W1


@needs_backends
def test_w2_preempts_both_ways_with_chunked_prefill_and_backends_agree():
    w = generate(W2_QUICK, seed=0)
    results = [run(w, b, True) for b in BACKENDS]
    for r in results:
        assert r.finished == W2_QUICK.num_requests and r.all_blocks_free
        assert r.preempt_recompute > 0 and r.preempt_swap > 0
        assert r.swap_ins == r.preempt_swap
        assert r.partial_prefills > 0
        assert r.cow_copies > 0 and r.forks == sum(q.n == 2 for q in w.requests)
    assert cross_check(results)["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_w1_preempts_once(caching):
    """What the README says: under vLLM's default policy (whole prompts admitted while the
    pool's watermark allows, decodes then grow the tables) W1 preempts exactly one group, by
    recompute, with or without caching; it never swaps and never chunks."""
    steps = record(generate(W1_FULL), caching).steps
    victims = [v for s in steps for v in s.victims]
    assert [mode for _, mode in victims] == ["recompute"]
    assert all(not s.swapped_in for s in steps)
    assert all(s.outputs or not s.scheduled for s in steps)  # every scheduled group sampled


@pytest.mark.slow
@pytest.mark.skipif("native-batch" not in BY_NAME, reason="native-batch backend not available")
def test_w2_full_preempts():
    r = run(generate(W2_FULL), BY_NAME["native-batch"], True)
    assert r.finished == W2_FULL.num_requests and r.all_blocks_free and r.mismatch is None
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
    # the x4: 4,096 requests, 1,024 running, 262,144 GPU blocks
    x4 = sweep_configs(False)["batch"][1]
    assert (x4.num_requests, x4.max_num_seqs, x4.num_gpu_blocks) == (4096, 1024, 262144)


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


# ------------------------------------------------------------------- replay cross-check


@needs_backends
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_backends_agree_under_preemption(caching):
    w = generate_w1(TIGHT, seed=1)
    trace = record(w, caching)
    results = [replay(trace, b) for b in BACKENDS]
    for r in results:
        assert r.mismatch is None, r.mismatch
        assert r.finished == TIGHT.num_requests
        assert r.all_blocks_free, r.backend
        assert r.preempt_recompute > 0 and r.preempt_swap > 0
        assert r.swap_ins == r.preempt_swap
        assert r.forks == sum(q.n == 2 for q in w.requests)
        assert r.cow_copies > 0
    check = cross_check(results)
    assert check["ok"], check


@needs_backends
def test_backends_agree_on_ignored():
    # a GPU pool too small for the longest prompts: can_allocate says NEVER -> ignored
    cfg = W1Config(**{**TIGHT.to_dict(), "num_gpu_blocks": 120, "num_requests": 24})
    trace = record(generate_w1(cfg, seed=1), True)
    results = [replay(trace, b) for b in BACKENDS]
    for r in results:
        assert r.mismatch is None and r.ignored > 0
        assert r.finished + r.ignored == cfg.num_requests
        assert r.all_blocks_free
    assert cross_check(results)["ok"]


def _faulty(backend, **overrides):
    """``backend`` whose managers have some methods replaced (``name=lambda mgr, real: fn``)."""

    def make_manager(*args):
        mgr = backend.make_manager(*args)
        methods = {name: getattr(mgr, name) for name in dir(mgr) if not name.startswith("_")}
        for name, wrap in overrides.items():
            methods[name] = wrap(mgr, methods[name])
        return SimpleNamespace(**methods)

    return Backend(**{**backend.__dict__, "name": backend.name, "make_manager": make_manager})


@pytest.mark.skipif("native" not in BY_NAME, reason="native backend not available")
def test_a_manager_that_leaks_a_block_fails_the_cross_check():
    """A manager whose free() forgets one sequence's blocks diverges in its free count at
    that step: the replay stops there and the cross-check fails."""
    nat = BY_NAME["native"]
    state = {"frees": 0}

    def leaky(mgr, real):
        def free(seq):
            state["frees"] += 1
            if state["frees"] != 3:
                real(seq)

        return free

    trace = record(generate_w1(TIGHT, seed=1), False)
    good, bad = replay(trace, nat), replay(trace, _faulty(nat, free=leaky))
    assert good.mismatch is None
    assert bad.mismatch is not None and "free GPU/CPU blocks" in bad.mismatch
    assert bad.steps < good.steps
    check = cross_check([good, bad])
    assert not check["ok"]
    assert check["groups"]["caching_off"]["mismatches"][0]["backend"] == "native"


@pytest.mark.skipif("native" not in BY_NAME, reason="native backend not available")
def test_a_manager_that_refuses_an_append_diverges():
    """can_append_slots saying no where the scheduler appended (and had no victim left) is a
    divergence, not a silent preemption."""
    nat = BY_NAME["native"]
    calls = {"n": 0}

    def refuse_once(mgr, real):
        def can_append_slots(group, *a):
            calls["n"] += 1
            return False if calls["n"] == 50 else real(group, *a)

        return can_append_slots

    trace = record(generate_w1(TIGHT, seed=1), False)
    bad = replay(trace, _faulty(nat, can_append_slots=refuse_once))
    assert bad.mismatch is not None and "cannot append" in bad.mismatch


@pytest.mark.skipif("native" not in BY_NAME, reason="native backend not available")
def test_preemptions_follow_the_managers_answers():
    """Victims are preempted while the replayed manager says the head group cannot append:
    a manager that always says yes leaves the recorded victims unpreempted -> divergence."""
    nat = BY_NAME["native"]
    trace = record(generate_w1(TIGHT, seed=1), False)
    assert any(s.victims for s in trace.steps)
    always = replay(trace, _faulty(nat, can_append_slots=lambda mgr, real: lambda g, *a: True))
    assert always.mismatch is not None
    assert "the manager can append, the scheduler preempted" in always.mismatch


@pytest.mark.skipif("native-batch" not in BY_NAME, reason="native-batch backend not available")
def test_batch_buffers_match_block_tables():
    """Every row append_slots_batch writes equals get_block_table / get_len / the newest slot."""
    nb = BY_NAME["native-batch"]
    bs = TIGHT.block_size
    checked = {"rows": 0}

    def checking(mgr, real):
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

        return append_slots_batch

    trace = record(generate_w1(TIGHT, seed=2), True)
    r = replay(trace, _faulty(nb, append_slots_batch=checking))
    assert r.mismatch is None and r.all_blocks_free and checked["rows"] > 1000
