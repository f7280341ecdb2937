"""The lockstep differential over request kinds outside pagedkv's plain scope: structured
output (a fake grammar, request_kinds.FakeGrammar: late compilation, rejected tokens, compile
errors), LoRA adapters under ``max_loras``, prompt embeddings, repetition detection, mixed with
aborts, preemption, prefix caching, async scheduling and both policies.

Today pagedkv's Scheduler runs vLLM's own loop while such a request is held (the per-step
switch, counted in ``pagedkv_steps``): these tests hold that loop over pagedkv's manager to
vLLM's, step by step, and will hold the native loop to it once it serves these kinds
(:func:`test_every_step_of_a_kinds_workload_is_native`, expected to fail until then).
vLLM 0.32 and 0.33 build every kind alike (request_kinds' docstring); where they differ
(0.33's grammar-compile error carries a ``RequestError``), both sides run the same release.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import request_kinds as kinds
import v1_harness as h
from vllm.v1.core.kv_cache_manager import KVCacheManager

# Not imported as `Scheduler`: this module would be taken for a package with its own scheduler
# classes (v1_harness.scheduler_module).
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import RequestStatus

KIND_SEEDS = range(64)
SMALL_CACHE_KIND_SEEDS = range(12)

ROOMY = h.SchedConfig(
    block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
)
STARVED = dataclasses.replace(ROOMY, num_blocks=20)


def prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, h.VOCAB_SIZE) for _ in range(n))


def plain(i: int, rng: random.Random, arrival: int = 0, **fields: Any) -> h.RequestSpec:
    fields.setdefault("max_tokens", 12)
    fields.setdefault("ignore_eos", True)
    return h.RequestSpec(f"r{i}", prompt(rng, 6 + 3 * i), arrival_step=arrival, **fields)


def scheduled_per_step(run: h.Lockstep) -> list[list[str]]:
    """Records the ids the reference schedules, per ``schedule()`` call."""
    steps: list[list[str]] = []
    schedule = run.ref.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        steps.append(list(out.num_scheduled_tokens))
        return out

    run.ref.schedule = recording  # type: ignore[method-assign]
    return steps


def cached_tokens(run: h.Lockstep, req_id: str) -> int:
    """The prefix-cache hit of a request's prefill, from its first output's prefill stats."""
    return run.outputs[req_id][0].prefill_stats.num_local_cached_tokens


def native_only(manager_cls: type) -> bool:
    """pagedkv's scheduler (not the harness checking itself with vLLM's manager)."""
    return not manager_cls.__module__.startswith("vllm.")


# --------------------------------------------------------------------------- randomized


_KIND_STATS: dict[tuple[int, str], dict] = {}


def kind_run(seed: int, model_dir: Path, manager_cls: type) -> dict:
    """``run_seed`` with the kinds, once per seed and manager in a session."""
    key = (seed, manager_cls.__qualname__)
    if key not in _KIND_STATS:
        _KIND_STATS[key] = h.run_seed(seed, model_dir, manager_cls, request_kinds=True)
    return _KIND_STATS[key]


@pytest.mark.parametrize("seed", KIND_SEEDS)
def test_lockstep_with_request_kinds(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    stats = kind_run(seed, tiny_model_dir, manager_cls)
    assert stats["steps"] > 0


@pytest.mark.parametrize("seed", SMALL_CACHE_KIND_SEEDS)
def test_lockstep_with_request_kinds_in_a_small_cache(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """The kinds in a cache smaller than max_model_len (heavy preemption; only pagedkv's
    scheduler caps lengths at the cache, so vLLM's manager against itself is not run)."""
    if not native_only(manager_cls):
        return
    stats = h.run_seed(seed, tiny_model_dir, manager_cls, small_cache=True, request_kinds=True)
    assert stats["steps"] > 0


def kind_workloads(seeds: range) -> list[tuple[h.SchedConfig, list[h.RequestSpec]]]:
    out = []
    for seed in seeds:
        rng = random.Random(seed)
        cfg = h.random_config(rng)
        specs = h.random_workload(rng, cfg)
        out.append(kinds.with_request_kinds(random.Random(f"kinds{seed}"), cfg, specs))
    return out


def test_kind_seeds_draw_every_kind_and_mix_them() -> None:
    """Every kind, grammars late, rejecting, terminating and failing, one to three LoRA
    slots over two to four adapters, and seeds holding all four kinds at once (with async
    scheduling, the priority policy, caching and aborts among them)."""
    workloads = kind_workloads(KIND_SEEDS)
    specs = [s for _, ws in workloads for s in ws]
    grammars = [s.grammar for s in specs if s.grammar]
    assert any(g.ready_after > 0 for g in grammars)
    assert any(g.reject_mod for g in grammars)
    assert any(g.length for g in grammars)
    assert any(g.compile_error for g in grammars)
    assert {c.max_loras for c, _ in workloads} == {None, 1, 2, 3}
    assert {s.lora for s in specs} >= {0, 1, 2, 3}
    assert any(s.embeds for s in specs) and any(s.repetition for s in specs)
    mixed = [c for c, ws in workloads if all_kinds(ws)]
    assert len(mixed) >= 5
    assert {c.async_scheduling for c in mixed} == {True, False}
    assert {c.policy for c in mixed} == {"fcfs", "priority"}
    assert {c.enable_caching for c in mixed} == {True, False}
    assert any(c.abort_rate for c in mixed)


def all_kinds(specs: list[h.RequestSpec]) -> bool:
    fields = ("grammar", "lora", "embeds", "repetition")
    return all(any(getattr(s, name) for s in specs) for name in fields)


def test_kind_seeds_reach_every_outcome(tiny_model_dir: Path, manager_cls: type) -> None:
    """Over the first kind seeds (run once, shared with the randomized test): grammar
    rejections (error), repetition stops, compared grammar bitmasks, preemptions."""
    totals: Counter = Counter()
    for seed in KIND_SEEDS[:10]:
        stats = kind_run(seed, tiny_model_dir, manager_cls)
        totals.update(stats["finished"])
        totals.update(bitmasks=stats["bitmasks"], preemptions=stats["preemptions"])
    assert totals["FINISHED_ERROR"] > 0, totals
    assert totals["FINISHED_REPETITION"] > 0, totals
    assert totals["bitmasks"] > 0 and totals["preemptions"] > 0, totals


# --------------------------------------------------------------------------- structured output


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_ready_after_steps_while_others_run(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """A structured-output request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (skipped by
    the waiting pass, the plain requests behind it scheduled) until its grammar compiles four
    steps after arrival; from then on its bitmask is compared every step."""
    rng = random.Random(1)
    grammar = kinds.GrammarSpec(ready_after=4)
    specs = [plain(0, rng, grammar=grammar, max_tokens=8)]
    specs += [plain(i, rng) for i in range(1, 4)]
    cfg = dataclasses.replace(ROOMY, async_scheduling=async_scheduling)
    run = h.Lockstep(cfg, specs, 1, tiny_model_dir, manager_cls)
    steps = scheduled_per_step(run)
    stats = run.run()
    first = next(i for i, ids in enumerate(steps) if "r0" in ids)
    assert first == 4, steps
    assert all({"r1", "r2", "r3"} <= set(ids) for ids in steps[:first]), steps
    assert stats["bitmasks"] > 0
    assert stats["finish_reasons"] == Counter(LENGTH=4), stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_rejected_token_finishes_with_error(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Grammars that reject odd tokens: the first odd sampled token ends the request with
    FINISHED_ERROR, the rejected token still delivered in the last output (finish reason
    "error"); requests whose grammar terminates early run on (tokens after termination are
    ignored)."""
    rng = random.Random(2)
    rejecting = kinds.GrammarSpec(reject_mod=2, reject_residue=1)
    terminating = kinds.GrammarSpec(length=2)
    specs = [plain(i, rng, grammar=rejecting, max_tokens=30) for i in range(4)]
    specs += [plain(i, rng, grammar=terminating, max_tokens=6) for i in range(4, 6)]
    cfg = dataclasses.replace(ROOMY, async_scheduling=async_scheduling)
    run = h.Lockstep(cfg, specs, 2, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["finished"]["FINISHED_ERROR"] == 4, stats
    assert stats["finish_reasons"] == Counter(ERROR=4, LENGTH=2), stats
    for rid in ("r0", "r1", "r2", "r3"):
        last = run.outputs[rid][-1]
        assert last.finish_reason.name == "ERROR" and last.new_token_ids[-1] % 2 == 1, last


def test_a_grammar_rejecting_eos_overrides_the_stop(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """vLLM checks the stop rules first, then feeds the tokens to the grammar: a request
    stopped by EOS whose grammar rejects EOS ends FINISHED_ERROR, not FINISHED_STOPPED."""
    rng = random.Random(3)
    eos_only = kinds.GrammarSpec(reject_mod=h.VOCAB_SIZE, reject_residue=h.EOS_TOKEN_ID)
    specs = [plain(i, rng, grammar=eos_only, max_tokens=60, ignore_eos=False) for i in range(6)]
    run = h.Lockstep(ROOMY, specs, 3, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["finished"]["FINISHED_ERROR"] > 0, stats
    assert stats["finished"]["FINISHED_STOPPED"] == 0, stats
    errors = [outs[-1] for outs in run.outputs.values() if outs[-1].finish_reason.name == "ERROR"]
    assert all(out.new_token_ids[-1] == h.EOS_TOKEN_ID for out in errors), errors


def test_a_grammar_rejecting_a_stop_id_keeps_the_stop_reason(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """A stop id the grammar rejects: check_stop has set ``stop_reason`` to the id before the
    grammar refuses it, and the request ends FINISHED_ERROR with that stop reason kept."""
    rng = random.Random(13)
    stop = h.STOP_TOKEN_IDS[0]
    rejects_stop = kinds.GrammarSpec(reject_mod=h.VOCAB_SIZE, reject_residue=stop)
    specs = [
        plain(i, rng, grammar=rejects_stop, max_tokens=60, stop_token_ids=(stop,)) for i in range(6)
    ]
    run = h.Lockstep(ROOMY, specs, 13, tiny_model_dir, manager_cls)
    stats = run.run()
    errors = [outs[-1] for outs in run.outputs.values() if outs[-1].finish_reason.name == "ERROR"]
    assert errors and stats["finished"]["FINISHED_STOPPED"] == 0, stats
    assert all(out.stop_reason == stop == out.new_token_ids[-1] for out in errors), errors


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_compile_error(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """A grammar that fails to compile two steps after arrival: the request is finished with
    FINISHED_ERROR and reported with an output carrying no tokens, the others run on."""
    rng = random.Random(4)
    failing = kinds.GrammarSpec(ready_after=2, compile_error=True)
    specs = [plain(0, rng, grammar=failing)] + [plain(i, rng) for i in range(1, 3)]
    cfg = dataclasses.replace(ROOMY, async_scheduling=async_scheduling)
    run = h.Lockstep(cfg, specs, 4, tiny_model_dir, manager_cls)
    stats = run.run()
    (out,) = run.outputs["r0"]
    assert out.finish_reason.name == "ERROR" and not out.new_token_ids, out
    assert stats["finish_reasons"] == Counter(ERROR=1, LENGTH=2), stats


# --------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_max_loras_one_with_three_adapters(
    policy: str, tiny_model_dir: Path, manager_cls: type
) -> None:
    """max_loras=1: a step schedules requests of one adapter (and requests without one); the
    waiting pass skips a request of another adapter and schedules those behind it, and the
    skipped requests keep their order (the queues are compared after every call)."""
    rng = random.Random(5)
    specs = [plain(i, rng, lora=1 + i % 3, max_tokens=6) for i in range(6)]
    specs.append(plain(6, rng))  # no adapter, behind all of them
    cfg = dataclasses.replace(ROOMY, max_loras=1, policy=policy)
    run = h.Lockstep(cfg, specs, 5, tiny_model_dir, manager_cls)
    steps = scheduled_per_step(run)
    run.run()
    adapter = {s.req_id: s.lora for s in specs}
    per_step = [{adapter[r] for r in ids} - {0} for ids in steps]
    assert all(len(a) <= 1 for a in per_step), per_step
    assert set().union(*per_step) == {1, 2, 3}, per_step
    assert "r6" in steps[0] and "r1" not in steps[0], steps


def test_adapters_do_not_share_cache_blocks(tiny_model_dir: Path, manager_cls: type) -> None:
    """One prompt under adapters 1, 1, 2 and none, one after the other: the second request of
    adapter 1 hits the first's blocks; adapter 2's and the plain one hit nothing (the adapter's
    name is in the block hash)."""
    rng = random.Random(6)
    shared = prompt(rng, 24)
    specs = [
        h.RequestSpec(f"l{i}", shared, 2, True, 4 * i, lora=lora)
        for i, lora in enumerate((1, 1, 2, 0))
    ]
    cfg = dataclasses.replace(ROOMY, max_loras=2)
    run = h.Lockstep(cfg, specs, 6, tiny_model_dir, manager_cls)
    run.run()
    cached = [cached_tokens(run, s.req_id) for s in specs]
    assert cached == [0, 20, 0, 0], cached


# --------------------------------------------------------------------------- prompt embeddings


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_embeds_with_prefix_caching(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Requests with prompt embeddings in place of ids: one with the same embeddings as an
    earlier one hits its blocks; a token-id request with the same ids hits none of them."""
    rng = random.Random(7)
    shared = prompt(rng, 21)
    specs = [
        h.RequestSpec("e0", shared, 3, True, 0, embeds=True),
        h.RequestSpec("e1", shared, 3, True, 5, embeds=True),
        h.RequestSpec("t2", shared, 3, True, 10),
        h.RequestSpec("e3", shared[:9] + prompt(rng, 8), 3, True, 15, embeds=True),
    ]
    cfg = dataclasses.replace(ROOMY, async_scheduling=async_scheduling)
    run = h.Lockstep(cfg, specs, 7, tiny_model_dir, manager_cls)
    run.run()
    cached = [cached_tokens(run, s.req_id) for s in specs]
    assert cached == [0, 20, 0, 8], cached


# --------------------------------------------------------------------------- repetition


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_repetition_stops_a_request(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Outputs that start to loop end with FINISHED_REPETITION, stop reason
    "repetition_detected" (checked after EOS, stop ids, the length and min_tokens)."""
    rng = random.Random(8)
    specs = [plain(i, rng, repetition=True, max_tokens=60) for i in range(6)]
    cfg = dataclasses.replace(ROOMY, async_scheduling=async_scheduling, num_blocks=200)
    run = h.Lockstep(cfg, specs, 8, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["finished"]["FINISHED_REPETITION"] > 0, stats
    for outs in run.outputs.values():
        last = outs[-1]
        if last.finish_reason.name == "STOP":
            assert last.stop_reason == "repetition_detected", last


# --------------------------------------------------------------------------- all at once


def all_kinds_workload(rng: random.Random) -> list[h.RequestSpec]:
    """Twenty requests cycling through the kinds (and plain ones), over a shared prefix."""
    prefix = prompt(rng, 8)
    grammars = (
        kinds.GrammarSpec(ready_after=3, reject_mod=13, reject_residue=5),
        kinds.GrammarSpec(reject_mod=7, reject_residue=0),
        kinds.GrammarSpec(ready_after=1, compile_error=True),
    )
    specs = []
    for i in range(20):
        kind = [
            {"grammar": grammars[i // 5 % 3]},
            {"lora": 1 + i % 3},
            {"embeds": True},
            {"repetition": True},
            {},
        ][i % 5]
        body = prefix + prompt(rng, 4 + 3 * (i % 7))
        specs.append(h.RequestSpec(f"k{i}", body, 24, i % 2 == 0, i // 3, **kind))
    return specs


@pytest.mark.parametrize(
    ("async_scheduling", "policy"), [(False, "fcfs"), (True, "fcfs"), (True, "priority")]
)
def test_all_kinds_in_a_starved_pool_with_aborts(
    async_scheduling: bool, policy: str, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Every kind in one batch, a pool that forces preemptions, aborts at random."""
    cfg = dataclasses.replace(
        STARVED, max_loras=2, async_scheduling=async_scheduling, policy=policy, abort_rate=0.15
    )
    run = h.Lockstep(cfg, all_kinds_workload(random.Random(9)), 9, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["preemptions"] > 0, stats
    assert sum(stats["aborts"].values()) > 0, stats
    assert stats["finished"]["FINISHED_ERROR"] > 0, stats
    assert stats["bitmasks"] > 0, stats


# --------------------------------------------------------------------------- the native loop


def test_every_step_of_a_kinds_workload_is_native(tiny_model_dir: Path, manager_cls: type) -> None:
    """The native loop serves these kinds: no step of this workload falls back to vLLM's
    loop (``pagedkv_steps`` counts each fallback with its reason)."""
    if not native_only(manager_cls):
        return
    cfg = dataclasses.replace(STARVED, max_loras=2, num_blocks=40)
    specs = [dataclasses.replace(s, abort_step=None) for s in all_kinds_workload(random.Random(10))]
    run = h.Lockstep(cfg, specs, 10, tiny_model_dir, manager_cls)
    run.run()
    steps = run.test.pagedkv_steps
    assert set(steps) == {"native"}, steps


# --------------------------------------------------------------------------- planted differences


class AcceptsEveryToken(VllmScheduler):
    """Never asks the grammar: no request ends with a rejected token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.structured_output_manager.accept_tokens = lambda request, tokens: True


class IgnoresMaxLoras(VllmScheduler):
    """Schedules any number of adapters in a step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lora_config = None


class NoGrammarBitmask(VllmScheduler):
    """Gives the engine no grammar bitmask."""

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        return None


class PromotesGrammarsEarly(VllmScheduler):
    """Treats a pending grammar as compiled: the request is scheduled at once."""

    def add_request(self, request: Any) -> None:
        if request.structured_output_request is not None:
            request.status = RequestStatus.WAITING
        super().add_request(request)


@pytest.mark.parametrize("seed", range(6))
def test_kv_transfer_params_without_a_connector_run_natively(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """A third of the requests carry P/D ``kv_transfer_params`` (as a proxy sends them), on an
    engine without a KV connector: inert in vLLM's scheduler (``_connector_finished`` returns
    none, no remote KV is awaited), so the native loop serves them, every step compared
    (outputs carry no ``kv_transfer_params``) and native."""
    from test_differential import assert_native_loop

    from pagedkv.vllm_v1._scope import request_out_of_scope

    rng = random.Random(seed)
    cfg = h.random_config(rng)
    capped = dataclasses.replace(cfg, max_model_len=h.length_cap(cfg))
    specs = [
        dataclasses.replace(s, kv_transfer=i % 3 == 0)
        for i, s in enumerate(h.random_workload(rng, capped))
    ]
    request = h.build_request(specs[0], lambda r: [])
    assert request.kv_transfer_params == h.KV_TRANSFER_PARAMS
    assert request_out_of_scope(request) is None
    stats = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls).run()
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls)


@pytest.mark.parametrize(
    ("planted", "what", "workload"),
    [
        (AcceptsEveryToken, "EngineCoreOutputs", "rejecting"),
        (IgnoresMaxLoras, "SchedulerOutput", "loras"),
        (NoGrammarBitmask, "grammar bitmask", "rejecting"),
        (PromotesGrammarsEarly, "scheduler state", "late"),
    ],
)
def test_the_differential_catches_a_planted_kind_difference(
    planted: type, what: str, workload: str, tiny_model_dir: Path
) -> None:
    """vLLM's scheduler against a planted variant (vLLM's manager on both sides)."""
    rng = random.Random(12)
    grammars = {
        "rejecting": kinds.GrammarSpec(reject_mod=3),
        "late": kinds.GrammarSpec(ready_after=2),
    }
    if workload == "loras":
        specs = [plain(i, rng, lora=1 + i % 3) for i in range(6)]
    else:
        specs = [plain(i, rng, grammar=grammars[workload], max_tokens=20) for i in range(4)]
    cfg = dataclasses.replace(ROOMY, max_loras=1)
    run = h.Lockstep(cfg, specs, 12, tiny_model_dir, KVCacheManager, scheduler_cls=planted)
    with pytest.raises(h.Divergence, match=what):
        run.run()
