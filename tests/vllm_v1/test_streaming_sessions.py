"""The lockstep differential over vLLM's streaming sessions (resumable requests): a session's
turn stops (``max_tokens``, EOS, a stop id) without finishing the request; its next input
(``add_request`` for the same id, :class:`v1_harness.SessionUpdate`) is queued while the
session runs or applied at once while it waits for input (``WAITING_FOR_STREAMING_REQ``,
in ``kv_holding_waiting`` with its KV blocks); a final update ends it (at its next stop, or
aborted while it waits); an abort may hit it while it waits. Beside plain requests, with
preemption, prefix caching, async scheduling, drafts and both policies.

Every step is compared (SchedulerOutput, EngineCoreOutputs with stats, KV events, the
scheduler's and each request's state, block hashes included) against vLLM's own loop over
vLLM's manager, on the release of the environment; and pagedkv's scheduler must run every step
of these workloads natively.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path
from typing import Any

import mm_harness as mm
import pytest
import request_kinds as kinds
import v1_harness as h
import vllm
from vllm.v1.core.kv_cache_manager import KVCacheManager

# Not imported as `Scheduler`: this module would be taken for a package with its own scheduler
# classes (v1_harness.scheduler_module).
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import RequestStatus

SEEDS = range(48)

#: Drafts beside sessions on 0.33 only: vLLM 0.32 resumes a session from
#: ``num_computed_tokens``, which a stop among accepted drafts leaves past the kept tokens,
#: so its next turn can schedule no token and vLLM's own waiting pass asserts
#: (``num_new_tokens > 0``); 0.33 trims the computed tokens at a stop.
DRAFTS_WITH_SESSIONS = vllm.__version__.startswith("0.33")

ROOMY = h.SchedConfig(
    block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128
)


def prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, h.VOCAB_SIZE) for _ in range(n))


def session(i: int, rng: random.Random, prefix: tuple[int, ...]) -> h.RequestSpec:
    """A session of one to three updates after its first prompt, each arriving soon (queued
    while the session runs) or late (the session waits for input), then a final update (soon
    or late) or an abort (late: while it waits for input)."""
    arrival = rng.randint(0, 8)
    step = arrival
    updates = []
    for _ in range(rng.randint(1, 3)):
        step += rng.choice((0, 1, 2, 8, 14, 20))
        chunk = prompt(rng, rng.randint(1, 9))
        updates.append(h.SessionUpdate(step, chunk, rng.randint(1, 6)))
    step += rng.choice((1, 3, 16))
    abort_step = None
    if rng.random() < 0.3:
        abort_step = step
    else:
        updates.append(h.SessionUpdate(step))
    stops = rng.sample(h.STOP_TOKEN_IDS, 1) if rng.random() < 0.3 else []
    first = (prefix if rng.random() < 0.5 else ()) + prompt(rng, rng.randint(2, 12))
    return h.RequestSpec(
        f"s{i}",
        first,
        rng.randint(1, 6),
        ignore_eos=rng.random() < 0.5,
        arrival_step=arrival,
        abort_step=abort_step,
        priority=rng.choice((0, 1, -1)),
        stop_token_ids=tuple(stops),
        updates=tuple(updates),
    )


def session_workload(rng: random.Random) -> list[h.RequestSpec]:
    """Four to eight sessions beside four to eight plain requests, over a shared prefix."""
    prefix = prompt(rng, 8)
    specs = [session(i, rng, prefix) for i in range(rng.randint(4, 8))]
    for i in range(rng.randint(4, 8)):
        body = (prefix if rng.random() < 0.5 else ()) + prompt(rng, rng.randint(2, 20))
        specs.append(
            h.RequestSpec(f"p{i}", body, rng.randint(1, 16), rng.random() < 0.5, rng.randint(0, 20))
        )
    return specs


def session_config(rng: random.Random) -> h.SchedConfig:
    """Sync or async, either policy, caching on or off, a roomy or a starved pool (preemption),
    drafts now and then (synchronous only), random aborts now and then."""
    asynchronous = rng.random() < 0.5
    num_spec_tokens = 0 if asynchronous else rng.choice((0, 0, 2))
    if not DRAFTS_WITH_SESSIONS:
        num_spec_tokens = 0
    return dataclasses.replace(
        ROOMY,
        async_scheduling=asynchronous,
        policy=rng.choice(("fcfs", "priority")),
        enable_caching=rng.random() < 0.7,
        num_blocks=rng.choice((96, 40, 24)),
        max_num_batched_tokens=rng.choice((64, 16)),
        num_spec_tokens=num_spec_tokens,
        abort_rate=rng.choice((0.0, 0.0, 0.05)),
        # Sampling masks: the V2 model runner where the release has it (0.33).
        sampling_mask=not num_spec_tokens and rng.random() < 0.25,
        iteration_details=rng.random() < 0.2,
    )


_STATS: dict[tuple[int, str], dict] = {}


def session_run(seed: int, model_dir: Path, manager_cls: type) -> h.Lockstep:
    rng = random.Random(f"sessions{seed}")
    cfg = session_config(rng)
    run = h.Lockstep(cfg, session_workload(rng), seed, model_dir, manager_cls)
    if random.Random(f"v2{seed}").random() < 0.3:
        v2_runner(run)
    run.run()
    _STATS[(seed, manager_cls.__qualname__)] = run.stats
    return run


def v2_runner(run: h.Lockstep) -> None:
    """Both schedulers serve vLLM's V2 model runner (``use_v2_model_runner``, set after
    construction as vLLM's own tests set it: a resumed session is sent as new, with its
    token ids; async decodes wait for ``next_decode_eligible_step``)."""
    run.ref.use_v2_model_runner = run.test.use_v2_model_runner = True


def native_only(manager_cls: type) -> bool:
    """pagedkv's scheduler (not the harness checking itself with vLLM's manager)."""
    return not manager_cls.__module__.startswith("vllm.")


@pytest.mark.parametrize("seed", SEEDS)
def test_sessions_in_lockstep_every_step_native(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    run = session_run(seed, tiny_model_dir, manager_cls)
    assert run.stats["session_updates"] > 0
    if native_only(manager_cls):
        steps = run.test.pagedkv_steps
        assert set(steps) == {"native"}, steps


KIND_SEEDS = range(16)


@pytest.mark.parametrize("seed", KIND_SEEDS)
def test_sessions_with_request_kinds_every_step_native(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Sessions and plain requests with structured output, LoRA and repetition detection
    drawn over them (request_kinds; prompt embeddings only on plain requests: a streaming
    update carries token ids)."""
    rng = random.Random(f"sessions-kinds{seed}")
    cfg, specs = kinds.with_request_kinds(rng, session_config(rng), session_workload(rng))
    specs = [dataclasses.replace(s, embeds=False) if s.updates else s for s in specs]
    run = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls)
    if seed % 3 == 0:
        v2_runner(run)
    stats = run.run()
    assert stats["session_updates"] > 0
    if native_only(manager_cls):
        steps = run.test.pagedkv_steps
        assert set(steps) == {"native"}, steps


def mm_session_workload(rng: random.Random) -> tuple[list[h.RequestSpec], dict[Any, tuple]]:
    """Sessions whose first prompt and updates carry images now and then (identifiers from a
    small pool, each of one length: encoder cache hits across sessions), beside plain
    requests with images."""
    lengths: dict[str, int] = {}

    def images_in(size: int) -> tuple:
        if rng.random() < 0.4:
            return ()
        ident = f"img{rng.randrange(5)}"
        length = lengths.setdefault(ident, rng.randint(2, 12))
        if length > size:
            return ()
        return (mm.Image(rng.randrange(size - length + 1), length, ident),)

    specs, images = [], {}
    for i in range(rng.randint(3, 6)):
        arrival = step = rng.randint(0, 6)
        updates = []
        for _ in range(rng.randint(1, 3)):
            step += rng.choice((0, 1, 10, 18))
            chunk = prompt(rng, rng.randint(4, 14))
            updates.append(h.SessionUpdate(step, chunk, rng.randint(1, 5)))
            images[(f"s{i}", step)] = images_in(len(chunk))
        updates.append(h.SessionUpdate(step + rng.choice((1, 16))))
        first = prompt(rng, rng.randint(6, 18))
        images[f"s{i}"] = images_in(len(first))
        specs.append(
            h.RequestSpec(f"s{i}", first, rng.randint(1, 5), True, arrival, updates=tuple(updates))
        )
    for i in range(rng.randint(2, 5)):
        body = prompt(rng, rng.randint(6, 24))
        images[f"p{i}"] = images_in(len(body))
        specs.append(h.RequestSpec(f"p{i}", body, rng.randint(1, 12), True, rng.randint(0, 12)))
    return specs, images


@pytest.mark.parametrize("seed", range(12))
def test_multimodal_sessions_every_step_native(
    seed: int, tiny_model_dir: Path, manager_cls: type
) -> None:
    """Updates bringing images (vLLM shifts them past the session's tokens): the encoder
    budget and cache, ``encoder_input_updates`` with the V2 runner (0.33), every step native;
    the encoder cache manager's state compared too (mm_harness)."""
    rng = random.Random(f"mm-sessions{seed}")
    cfg = dataclasses.replace(
        ROOMY,
        async_scheduling=seed % 2 == 1,
        policy="priority" if seed % 4 >= 2 else "fcfs",
        num_blocks=rng.choice((96, 32)),
        enable_caching=rng.random() < 0.7,
    )
    encoder = mm.Encoder(budget=32, cache_size=48, v2_runner=seed % 3 == 0)
    specs, images = mm_session_workload(rng)
    run = mm.MmLockstep(cfg, specs, images, encoder, seed, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["session_updates"] > 0 and stats["encoder_inputs"] > 0, stats
    if native_only(manager_cls):
        assert set(run.test.pagedkv_steps) == {"native"}, run.test.pagedkv_steps


def test_session_seeds_reach_every_path(tiny_model_dir: Path, manager_cls: type) -> None:
    """Updates queued and applied while waiting, turns, aborts while waiting, final updates,
    preemption, prefix hits, async scheduling, drafts."""
    total: Counter = Counter()
    for seed in SEEDS:
        stats = _STATS.get((seed, manager_cls.__qualname__))
        if stats is None:
            stats = session_run(seed, tiny_model_dir, manager_cls).stats
        total.update({k: v for k, v in stats.items() if isinstance(v, int)})
    for key in (
        "updates_while_waiting",
        "updates_queued",
        "session_turns",
        "aborts_while_waiting_for_input",
        "preemptions",
        "hits",
        *(("drafts",) if DRAFTS_WITH_SESSIONS else ()),
    ):
        assert total[key] > 0, (key, total)
    configs = [session_config(random.Random(f"sessions{s}")) for s in SEEDS]
    assert {c.async_scheduling for c in configs} == {True, False}
    assert {c.policy for c in configs} == {"fcfs", "priority"}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_session_waits_for_input_then_resumes_then_ends(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """One session beside a plain request: its first turn stops, it waits for input (holding
    its blocks, counted against the active limit), resumes from its kept tokens with a prefix
    of its own, takes a queued update, and ends with a final update while it waits."""
    rng = random.Random(5)
    updates = (
        h.SessionUpdate(12, prompt(rng, 5), 3),  # waits for input until then
        h.SessionUpdate(13, prompt(rng, 2), 2),  # queued: the session runs
        h.SessionUpdate(40),  # the session waits again: aborted
    )
    specs = [
        h.RequestSpec("s", prompt(rng, 9), 3, True, 0, updates=updates),
        h.RequestSpec("p", prompt(rng, 7), 30, True, 1),
    ]
    cfg = dataclasses.replace(ROOMY, async_scheduling=async_scheduling, max_num_active_seqs=2)
    run = h.Lockstep(cfg, specs, 5, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["updates_while_waiting"] == 2 and stats["updates_queued"] == 1, stats
    assert stats["session_turns"] == 3, stats
    if native_only(manager_cls):
        assert set(run.test.pagedkv_steps) == {"native"}, run.test.pagedkv_steps


def test_a_session_across_switches_to_vllms_loop_and_back(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """A held request (out of scope) puts the engine on vLLM's loop in the middle of a
    session's turns, updates and pause, and back: the session's state carries across."""
    if not native_only(manager_cls):
        return
    rng = random.Random(8)
    updates = tuple(h.SessionUpdate(step, prompt(rng, 3), 3) for step in (2, 9, 10, 18, 26, 27)) + (
        h.SessionUpdate(40),
    )
    specs = [
        h.RequestSpec("s", prompt(rng, 9), 3, True, 0, updates=updates),
        h.RequestSpec("held", prompt(rng, 5), 8, True, 6, held=True),
        h.RequestSpec("held2", prompt(rng, 5), 4, True, 24, held=True),
        h.RequestSpec("p", prompt(rng, 7), 20, True, 1),
    ]
    for asynchronous in (False, True):
        cfg = dataclasses.replace(ROOMY, async_scheduling=asynchronous)
        run = h.Lockstep(cfg, specs, 8, tiny_model_dir, manager_cls)
        stats = run.run()
        steps = run.test.pagedkv_steps
        assert steps.get("native", 0) > 0 and steps.get("priority", 0) > 0, steps
        assert stats["updates_while_waiting"] > 0 and stats["updates_queued"] > 0, stats


def test_a_request_waiting_for_remote_kv_in_kv_holding_waiting_falls_back(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """The walk serves streaming sessions in ``kv_holding_waiting``, not a request waiting
    for remote KV there (a connector's): that step is vLLM's, with its reason."""
    if not native_only(manager_cls):
        return
    sched = h.make_scheduler(ROOMY, tiny_model_dir, manager_cls)
    spec = h.RequestSpec("s", (5, 6, 7), 2, True, 0, updates=(h.SessionUpdate(1),))
    request = h.build_request(spec, h.request_block_hasher(ROOMY))
    request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    request.num_computed_tokens = 3
    sched.requests[request.request_id] = request
    sched.kv_holding_waiting.add_request(request)
    assert sched._pagedkv_fallback() is None
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched._pagedkv_fallback() == "a request waiting for remote KV"


def test_an_update_out_of_scope_holds_its_session(tiny_model_dir: Path, manager_cls: type) -> None:
    """An update whose sampling parameters the native loop does not hold (a stop id beyond
    64 bits) puts the engine on vLLM's loop until the session leaves; a plain update does not."""
    if not native_only(manager_cls):
        return
    sched = h.make_scheduler(ROOMY, tiny_model_dir, manager_cls)
    hasher = h.request_block_hasher(ROOMY)
    spec = h.RequestSpec("s", (5, 6, 7), 2, True, 0, updates=(h.SessionUpdate(1, (8, 9), 2),))
    sched.add_request(h.build_request(spec, hasher))
    sched.add_request(h.build_request(spec, hasher, spec.updates[0]))
    assert sched._pagedkv_fallback() is None
    wide = dataclasses.replace(spec, stop_token_ids=(2**70,))
    sched.add_request(h.build_request(wide, hasher, spec.updates[0]))
    assert sched._pagedkv_fallback() == "stop token ids beyond 64 bits"
    sched.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    assert sched._pagedkv_fallback() is None


# --------------------------------------------------------------------------- planted differences


class FinishesStoppedSessions(VllmScheduler):
    """Treats a stopped session as finished: no next turn."""

    def _handle_stopped_request(self, request: Any) -> bool:
        request.resumable = False
        return super()._handle_stopped_request(request)


class ForgetsPausedSessions(VllmScheduler):
    """Does not count paused sessions against the active limit."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        paused, self.num_waiting_for_streaming_input = self.num_waiting_for_streaming_input, 0
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.num_waiting_for_streaming_input = paused


@pytest.mark.parametrize(
    ("planted", "what"),
    [(FinishesStoppedSessions, "EngineCoreOutputs"), (ForgetsPausedSessions, "SchedulerOutput")],
)
def test_the_differential_catches_a_planted_session_difference(
    planted: type, what: str, tiny_model_dir: Path
) -> None:
    """vLLM's scheduler against a planted variant (vLLM's manager on both sides)."""
    rng = random.Random(3)
    specs = [
        h.RequestSpec(
            "s",
            prompt(rng, 6),
            2,
            True,
            0,
            updates=(h.SessionUpdate(9, (5, 6), 2), h.SessionUpdate(20)),
        ),
        h.RequestSpec("p", prompt(rng, 6), 12, True, 4),
    ]
    cfg = dataclasses.replace(ROOMY, max_num_active_seqs=1)
    run = h.Lockstep(cfg, specs, 3, tiny_model_dir, KVCacheManager, scheduler_cls=planted)
    with pytest.raises(h.Divergence, match=what):
        run.run()
