"""The bench driver: a small vLLM-0.4.2-style scheduler loop around one block-manager backend.

It runs any :class:`~pagedkv.bench.workload.Workload` (W1, W2). Issue 10 replaces this loop with
``pagedkv.Scheduler``; the workloads stay.

Each step mirrors what vLLM's scheduler and engine ask of the block manager:

1. **decode** — every running group in arrival (request) order, as vLLM's FCFS policy sorts them:
   ``can_append_slots(group)``; while it is False, preempt the latest-arriving running group
   (possibly the group itself):
   recompute for single-sequence groups (``free`` + WAITING + ``reset_state_for_recompute`` +
   front of the waiting queue), swap for forked groups (``can_swap_out``/``swap_out`` + SWAPPED).
   Then ``append_slots(seq)`` for each running sequence (CoW dicts go to ``blocks_to_copy``).
2. **swap in** — only if nobody was preempted this step: swapped groups in order while
   ``can_swap_in`` is OK and the sequence limit allows (``swap_in`` + RUNNING + append slots).
3. **admit** — only if nobody was preempted and nothing is left swapped: waiting groups in order
   while ``can_allocate`` is OK and both the prefill-token budget and the sequence limit allow
   (``allocate`` + RUNNING). ``AllocStatus.NEVER`` (or a prompt over the budget) ignores the
   request. Prompts are admitted whole; decodes and prefills share a step.
4. **prepare** — for every scheduled sequence ``get_block_table(seq)`` and
   ``access_all_blocks_in_seq(seq, now)`` (``now`` = the step number, so eviction order is
   deterministic); ``get_common_computed_block_ids(seqs)`` for each prefill group.
5. **after the model step** — ``mark_blocks_as_computed(group)`` for every scheduled group.
6. **outputs** — every scheduled sequence appends its predetermined token; an n=2 group forks
   right after its prefill (``seq.fork`` before either appends, as vLLM's output processor, then
   ``manager.fork(parent, child)``); a sequence that reached its output length is
   FINISHED_LENGTH_CAPPED and ``free``d.

**Chunked prefill** (``config.chunked_prefill``, vLLM 0.4.2's ``_schedule_chunked_prefill``):
``prefill_token_budget`` is the step's token budget. Running groups are visited in order and take
their tokens from it: one per sequence for a decode, the rest of the prompt for a group still in
prefill, cut to what is left of the budget unless the group has forked (a group that gets no
token is not scheduled this step, nor is any after it). Preemption is as above. Swapped groups
come back only if nobody was preempted and the budget allows; waiting groups are admitted
(``allocate`` reserves the whole prompt) with a first chunk, even after a preemption or with
groups still swapped out. A group produces its first output token (and forks) in the step that
computes the last chunk of its prompt. ``tests/test_bench_vllm.py`` checks this timeline
(admissions, forks, recomputes, swaps, frees per step) against vLLM's own chunked-prefill
Scheduler (0.4.2 and 0.5.0). One deliberate difference: vLLM swaps out a group that will fork
(n=2) even before its prompt is complete, and its chunked scheduler swaps groups back in without
chunking, so such a group whose prompt rest exceeds the step budget never comes back (the run
stalls); the driver recomputes any group that has not forked yet.

The ``native-batch`` backend replaces per-sequence ``append_slots``/``get_block_table`` with
``append_slots_batch`` into numpy buffers allocated once per run (and ``fill_block_tables`` for
the rows of prefill sequences, whose slots ``allocate`` already reserved). It produces exactly
the same schedule: when ``free >= running sequences`` no group can fail ``can_append_slots`` (a
decode step takes at most one block per sequence), so it makes one batched append (which checks
everything itself before changing anything) without per-group checks; otherwise it goes group by
group (one batched call per group) like the per-sequence path. ``access_all_blocks_in_seqs`` and
``compute_full_blocks_in_seqs`` replace the per-sequence access and per-group mark calls.

Timing: only block-manager work is timed, with one ``perf_counter`` pair per phase (per call only
in the rare phases: preemption, swap-in, admission); sequence objects, queues and token
generation stay outside the timed regions.

If a forked group cannot be swapped out (CPU swap space full), vLLM 0.4.2 aborts the engine; the
driver instead aborts that request (frees it, FINISHED_ABORTED) and counts it.
"""

from __future__ import annotations

import gc
import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from pagedkv.bench.backends import Backend
from pagedkv.bench.workload import Request, Workload

__all__ = ["RunResult", "run", "run_w1", "StallError"]


class StallError(RuntimeError):
    """The simulated scheduler made no progress (a backend bug)."""


@dataclass
class RunResult:
    backend: str
    enable_caching: bool
    steps: int
    step_times_us: np.ndarray
    phase_us: Dict[str, float]
    finished: int
    ignored: int
    aborted: int
    preempt_recompute: int
    preempt_swap: int
    swap_ins: int
    cow_copies: int
    forks: int
    prefix_lookups: Optional[int]
    prefix_hits: Optional[int]
    final_free_gpu: int
    final_free_cpu: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    mean_batch_seqs: float
    schedule_digest: str
    wall_s: float
    partial_prefills: int = 0  # prompt chunks that did not finish their prompt
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def all_blocks_free(self) -> bool:
        return self.final_free_gpu == self.num_gpu_blocks and (
            self.final_free_cpu == self.num_cpu_blocks
        )

    @property
    def hit_rate(self) -> Optional[float]:
        if self.prefix_lookups is None or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_lookups if self.prefix_lookups else 0.0

    def step_stats(self) -> Dict[str, float]:
        t = self.step_times_us
        if len(t) == 0:
            return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0, "total_ms": 0.0}
        return {
            "mean": float(t.mean()),
            "p50": float(np.percentile(t, 50)),
            "p99": float(np.percentile(t, 99)),
            "max": float(t.max()),
            "total_ms": float(t.sum() / 1e3),
        }

    def schedule_key(self) -> Dict[str, Any]:
        """What must be identical across backends for the same workload and caching setting."""
        key = {
            "steps": self.steps,
            "finished": self.finished,
            "ignored": self.ignored,
            "aborted": self.aborted,
            "preempt_recompute": self.preempt_recompute,
            "preempt_swap": self.preempt_swap,
            "swap_ins": self.swap_ins,
            "cow_copies": self.cow_copies,
            "forks": self.forks,
            "partial_prefills": self.partial_prefills,
            "final_free_gpu": self.final_free_gpu,
            "final_free_cpu": self.final_free_cpu,
            "schedule_digest": self.schedule_digest,
        }
        if self.prefix_hits is not None:
            key["prefix_lookups"] = self.prefix_lookups
            key["prefix_hits"] = self.prefix_hits
        return key

    def to_dict(self) -> Dict[str, Any]:
        d = {
            "backend": self.backend,
            "enable_caching": self.enable_caching,
            "step_us": self.step_stats(),
            "phase_total_ms": {k: v / 1e3 for k, v in self.phase_us.items()},
            "prefix_hit_rate": self.hit_rate,
            "mean_batch_seqs": self.mean_batch_seqs,
            "all_blocks_free": self.all_blocks_free,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "wall_s": self.wall_s,
        }
        d.update(self.schedule_key())
        d.update(self.extra)
        return d


class _Live:
    """Driver-side state of one request (plain Python: identical cost for every backend)."""

    __slots__ = (
        "req",
        "group",
        "seqs",
        "num_out",
        "done",
        "prompt_len",
        "in_prefill",
        "computed",
        "chunk",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.group: Any = None
        self.seqs: List[Any] = []  # unfinished sequences, parent first
        self.num_out = 0  # output tokens so far (the same for every sequence of the group)
        self.done = False
        self.prompt_len = len(req.prompt_token_ids)
        # chunked prefill only:
        self.in_prefill = True  # its (re)computed prompt is not complete yet
        self.computed = 0  # tokens of that prompt computed so far
        self.chunk = 0  # tokens scheduled this step

    def take(self, budget_left: int) -> int:
        """Tokens this group computes next (vLLM's ``_get_num_new_tokens`` with chunking): the
        rest of its prefill, or one per sequence when decoding; a single-sequence group's
        share is cut to ``budget_left`` (a decode too: with nothing left it waits), a forked
        group's is not."""
        want = self.prompt_len + self.num_out - self.computed if self.in_prefill else 1
        if len(self.seqs) > 1:
            return len(self.seqs)
        return max(0, min(want, budget_left))


def _alloc_name(status: Any) -> str:
    """AllocStatus member name; tolerant of either backend's enum."""
    return getattr(status, "name", str(status)).rsplit(".", 1)[-1]


def run(
    workload: Workload,
    backend: Backend,
    enable_caching: bool,
    progress: Optional[Callable[[int], None]] = None,
) -> RunResult:
    """Replay ``workload`` against a fresh manager of ``backend``; see the module docstring.

    ``progress(k)`` is called with the number of requests that completed since the last call.
    The cyclic garbage collector is paused during the run (as ``timeit`` does), so that its
    pauses do not land at random in the timed regions.
    """
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _run(workload, backend, enable_caching, progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _run(
    workload: Workload,
    backend: Backend,
    enable_caching: bool,
    progress: Optional[Callable[[int], None]],
) -> RunResult:
    cfg = workload.config
    wall0 = time.perf_counter()
    mgr = backend.make_manager(
        cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks, cfg.watermark, enable_caching
    )
    status = backend.status
    WAITING, RUNNING, SWAPPED = status.WAITING, status.RUNNING, status.SWAPPED
    FIN_LEN = status.FINISHED_LENGTH_CAPPED
    FIN_IGNORED = status.FINISHED_IGNORED
    FIN_ABORTED = getattr(status, "FINISHED_ABORTED", FIN_IGNORED)
    new_seq, new_group = backend.make_sequence, backend.make_group
    chunked = cfg.chunked_prefill
    lp0 = backend.logprob_cls(0.0)
    sp_single = backend.sampling_params_cls(n=1)
    sp_pair = backend.sampling_params_cls(n=2, best_of=2)
    block_size = cfg.block_size
    max_num_seqs = cfg.max_num_seqs
    token_budget = cfg.prefill_token_budget
    batch = backend.batch

    # Manager entry points, bound once.
    can_append_slots = mgr.can_append_slots
    append_slots = mgr.append_slots
    get_block_table = mgr.get_block_table
    access_all = mgr.access_all_blocks_in_seq
    common_computed = mgr.get_common_computed_block_ids
    mark_computed = mgr.mark_blocks_as_computed
    free_seq = mgr.free
    fork_seq = mgr.fork
    num_free_gpu = mgr.get_num_free_gpu_blocks
    if batch:
        append_batch = mgr.append_slots_batch
        access_all_batch = mgr.access_all_blocks_in_seqs
        mark_computed_batch = mgr.compute_full_blocks_in_seqs
        fill_tables = getattr(mgr, "fill_block_tables", None)
        block_tables = np.zeros((max_num_seqs, cfg.max_blocks_per_seq + 1), dtype=np.int32)
        context_lens = np.zeros(max_num_seqs, dtype=np.int32)
        slot_mapping = np.zeros(max_num_seqs, dtype=np.int32)
    pc = time.perf_counter

    waiting: Deque[_Live] = deque(_Live(r) for r in workload.requests)
    # FCFS by arrival (request order), as vLLM's policy sorts them: the last running group is
    # the preemption victim, the first swapped one comes back first
    running: List[_Live] = []
    swapped: Deque[_Live] = deque()
    next_child_id = len(workload.requests)

    counters = {
        "finished": 0,
        "ignored": 0,
        "aborted": 0,
        "recompute": 0,
        "swap": 0,
        "swap_in": 0,
        "cow": 0,
        "forks": 0,
        "partial": 0,
    }
    phase = {"decode": 0.0, "swap_admit": 0.0, "prepare": 0.0, "post": 0.0}
    step_times: List[float] = []
    trace: List[tuple] = []
    batch_seqs_total = 0

    def make_group(live: _Live) -> None:
        req = live.req
        seq = new_seq(req.index, req.prompt_token_ids, block_size)
        sp = sp_pair if req.n == 2 else sp_single
        live.group = new_group(req.request_id, [seq], sp, req.arrival_time)
        live.seqs = [seq]

    def count_cow(cow: Any) -> None:
        # {src: [dst, ...]} (vLLM 0.4, pagedkv) or [(src, dst), ...] (vLLM 0.5)
        counters["cow"] += sum(len(d) for d in cow.values()) if hasattr(cow, "values") else len(cow)

    # preemption: returns seconds spent outside manager calls (to subtract from the phase)
    recompute_preempted: List[_Live] = []

    def preempt(victim: _Live) -> float:
        group = victim.group
        if len(victim.seqs) > 1:
            if mgr.can_swap_out(group):
                mgr.swap_out(group)
                x0 = pc()
                for s in victim.seqs:
                    s.status = SWAPPED
                _insert_in_arrival_order(swapped, victim)
                counters["swap"] += 1
                return pc() - x0
            for s in victim.seqs:
                free_seq(s)
            x0 = pc()
            for s in victim.seqs:
                s.status = FIN_ABORTED
            victim.done = True
            counters["aborted"] += 1
            return pc() - x0
        seq = victim.seqs[0]
        free_seq(seq)
        x0 = pc()
        seq.status = WAITING
        seq.reset_state_for_recompute()
        victim.in_prefill, victim.computed = True, 0
        recompute_preempted.append(victim)
        counters["recompute"] += 1
        return pc() - x0

    done_before = 0
    step = 0
    while waiting or running or swapped:
        now = float(step)
        t_decode = t_admit = 0.0
        num_cow_before = counters["cow"]
        recompute_preempted.clear()
        num_preempted_before = counters["recompute"] + counters["swap"] + counters["aborted"]
        decode: List[_Live] = []
        row = 0  # next free row of the batch buffers
        budget_left = token_budget  # chunked prefill: the step's token budget
        num_running = len(running)  # the head of ``running`` that gets scheduled (chunked)
        if chunked and batch:
            num_running, budget_left = _plan_chunks(running, budget_left)

        # ---- 1. decode reservations for every running group
        if batch:
            running_seqs = [s for r in running[:num_running] for s in r.seqs]
            t0 = pc()
            if num_free_gpu() >= len(running_seqs):
                # every group would pass can_append_slots (one free block per running
                # sequence); append_slots_batch checks again and raises before changing anything
                if running_seqs:
                    cow = append_batch(running_seqs, block_tables, context_lens, slot_mapping)
                    if cow:
                        count_cow(cow)
                row = len(running_seqs)
                decode = running[:num_running]
                t_decode = pc() - t0
            else:
                budget_left = token_budget
                excluded = 0.0
                i = 0
                while i < len(running):
                    r = running[i]
                    if chunked:
                        r.chunk = r.take(budget_left)
                        if r.chunk == 0:
                            break
                    while not can_append_slots(r.group):
                        victim = running.pop()
                        excluded += preempt(victim)
                        if victim is r:
                            break
                    else:
                        seqs = r.seqs
                        cow = append_batch(
                            seqs, block_tables[row:], context_lens[row:], slot_mapping[row:]
                        )
                        if cow:
                            count_cow(cow)
                        row += len(seqs)
                        budget_left -= r.chunk
                        i += 1
                decode = running[:i]
                t_decode = pc() - t0 - excluded
        else:
            excluded = 0.0
            t0 = pc()
            i = 0
            while i < len(running):
                r = running[i]
                if chunked:
                    r.chunk = r.take(budget_left)
                    if r.chunk == 0:
                        break
                while not can_append_slots(r.group):
                    victim = running.pop()
                    excluded += preempt(victim)
                    if victim is r:
                        break
                else:
                    for s in r.seqs:
                        cow = append_slots(s)
                        if cow:
                            count_cow(cow)
                    budget_left -= r.chunk
                    i += 1
            t_decode = pc() - t0 - excluded
            decode = running[:i]
        preempted_now = (
            counters["recompute"] + counters["swap"] + counters["aborted"] > num_preempted_before
        )

        num_seqs = sum(len(r.seqs) for r in running)
        swapped_in = 0
        # ---- 2. swap in (before admitting anything new)
        if not preempted_now:
            while swapped:
                r = swapped[0]
                if num_seqs + len(r.seqs) > max_num_seqs:
                    break
                if chunked and len(r.seqs) > budget_left:
                    break
                t0 = pc()
                st = _alloc_name(mgr.can_swap_in(r.group))
                t_admit += pc() - t0
                if st == "LATER":
                    break
                swapped.popleft()
                if st == "NEVER":
                    t0 = pc()
                    for s in r.seqs:
                        free_seq(s)
                    t_admit += pc() - t0
                    for s in r.seqs:
                        s.status = FIN_ABORTED
                    r.done = True
                    counters["aborted"] += 1
                    continue
                t0 = pc()
                mgr.swap_in(r.group)
                t_admit += pc() - t0
                for s in r.seqs:
                    s.status = RUNNING
                t0 = pc()
                if batch:
                    seqs = r.seqs
                    cow = append_batch(
                        seqs, block_tables[row:], context_lens[row:], slot_mapping[row:]
                    )
                    row += len(seqs)
                    t_admit += pc() - t0
                    if cow:
                        count_cow(cow)
                else:
                    cows = [append_slots(s) for s in r.seqs]
                    t_admit += pc() - t0
                    for cow in cows:
                        if cow:
                            count_cow(cow)
                _insert_in_arrival_order(running, r)
                decode.append(r)
                num_seqs += len(r.seqs)
                r.chunk = len(r.seqs)
                budget_left -= r.chunk
                swapped_in += 1
                counters["swap_in"] += 1

        # ---- 3. admit waiting requests (whole prompts, or first chunks)
        prefill: List[_Live] = []
        prefill_tokens = 0
        if chunked or (not preempted_now and not swapped):
            while waiting:
                r = waiting[0]
                if r.group is None:
                    make_group(r)
                num_tokens = r.prompt_len + r.num_out
                if not chunked and num_tokens > token_budget:
                    waiting.popleft()
                    _ignore(r, FIN_IGNORED)
                    counters["ignored"] += 1
                    continue
                t0 = pc()
                st = _alloc_name(mgr.can_allocate(r.group))
                t_admit += pc() - t0
                if st == "LATER":
                    break
                if st == "NEVER":
                    waiting.popleft()
                    _ignore(r, FIN_IGNORED)
                    counters["ignored"] += 1
                    continue
                if chunked:
                    num_tokens = min(num_tokens, budget_left)
                    if num_tokens == 0:
                        break
                elif prefill_tokens + num_tokens > token_budget:
                    break
                if num_seqs + r.req.n > max_num_seqs:
                    break
                waiting.popleft()
                t0 = pc()
                mgr.allocate(r.group)
                t_admit += pc() - t0
                for s in r.seqs:
                    s.status = RUNNING
                _insert_in_arrival_order(running, r)
                prefill.append(r)
                prefill_tokens += num_tokens
                num_seqs += r.req.n
                r.in_prefill, r.computed, r.chunk = True, 0, num_tokens
                budget_left -= num_tokens
        if recompute_preempted:
            # vLLM: waiting.extendleft(preempted) after admission -> the oldest preempted group
            # ends up first, and none is readmitted in the step that preempted it
            waiting.extendleft(recompute_preempted)

        scheduled = decode + prefill
        if not scheduled and not preempted_now and (waiting or swapped):
            raise StallError(
                f"{backend.name}: step {step} scheduled nothing "
                f"(waiting={len(waiting)}, swapped={len(swapped)})"
            )

        # ---- 4. prepare the model inputs, 5. mark computed after the model step
        if batch:
            prefill_seqs = [s for r in prefill for s in r.seqs]
            all_seqs = [s for r in scheduled for s in r.seqs]
            t0 = pc()
            if prefill_seqs:
                # prompts were fully reserved by allocate: only their tables are needed
                if fill_tables is not None:
                    fill_tables(prefill_seqs, block_tables[row:], context_lens=context_lens[row:])
                else:
                    append_batch(
                        prefill_seqs, block_tables[row:], context_lens[row:], slot_mapping[row:]
                    )
            access_all_batch(all_seqs, now)
            for r in prefill:
                common_computed(r.seqs)
            t_prepare = pc() - t0
        else:
            t0 = pc()
            for r in scheduled:
                for s in r.seqs:
                    get_block_table(s)
                    access_all(s, now)
            for r in prefill:
                common_computed(r.seqs)
            t_prepare = pc() - t0
        if batch:
            marked = [s for r in scheduled for s in r.group.get_seqs()]
            t0 = pc()
            mark_computed_batch(marked)
        else:
            t0 = pc()
            for r in scheduled:
                mark_computed(r.group)
        t_post = pc() - t0

        # ---- 6. outputs: append tokens, fork n=2 groups after prefill, finish
        forks = []
        to_free = []
        any_done = False
        for r in scheduled:
            if chunked and r.in_prefill:
                r.computed += r.chunk
                if r.computed < r.prompt_len + r.num_out:
                    counters["partial"] += 1
                    continue  # a chunk of the prompt: no output token yet
                r.in_prefill = False
            seqs = r.seqs
            p = r.num_out
            rows = r.req.output_token_ids
            if r.req.n == 2 and len(seqs) == 1 and p == 0:
                parent = seqs[0]
                child = parent.fork(next_child_id)
                next_child_id += 1
                child.status = RUNNING
                tok = rows[1][p]
                child.append_token_id(tok, {tok: lp0})
                tok = rows[0][p]
                parent.append_token_id(tok, {tok: lp0})
                r.group.add(child)
                seqs.append(child)
                forks.append((parent, child))
            else:
                for j, s in enumerate(seqs):
                    tok = rows[j][p]
                    s.append_token_id(tok, {tok: lp0})
            p += 1
            r.num_out = p
            if p >= r.req.output_len:
                for s in seqs:
                    s.status = FIN_LEN
                    to_free.append(s)
                r.done = True
                any_done = True
                counters["finished"] += 1
        t0 = pc()
        for parent, child in forks:
            fork_seq(parent, child)
        for s in to_free:
            free_seq(s)
        t_post += pc() - t0
        counters["forks"] += len(forks)
        if any_done:
            running = [r for r in running if not r.done]

        step_total = t_decode + t_admit + t_prepare + t_post
        step_times.append(step_total)
        phase["decode"] += t_decode
        phase["swap_admit"] += t_admit
        phase["prepare"] += t_prepare
        phase["post"] += t_post
        n_sched = sum(len(r.seqs) for r in scheduled)
        batch_seqs_total += n_sched
        trace.append(
            (
                n_sched,
                len(prefill),
                prefill_tokens,
                swapped_in,
                counters["recompute"],
                counters["swap"],
                counters["cow"] - num_cow_before,
                num_free_gpu(),
            )
        )
        step += 1
        if progress is not None:
            done_now = counters["finished"] + counters["ignored"] + counters["aborted"]
            if done_now != done_before:
                progress(done_now - done_before)
                done_before = done_now

    stats = getattr(mgr, "prefix_cache_stats", None)
    lookups = hits = None
    if callable(stats):
        lookups, hits = (int(x) for x in stats())
    digest = hashlib.sha256(repr(trace).encode()).hexdigest()[:16]
    return RunResult(
        backend=backend.name,
        enable_caching=enable_caching,
        steps=step,
        step_times_us=np.asarray(step_times) * 1e6,
        phase_us={k: v * 1e6 for k, v in phase.items()},
        finished=counters["finished"],
        ignored=counters["ignored"],
        aborted=counters["aborted"],
        preempt_recompute=counters["recompute"],
        preempt_swap=counters["swap"],
        swap_ins=counters["swap_in"],
        cow_copies=counters["cow"],
        forks=counters["forks"],
        prefix_lookups=lookups,
        prefix_hits=hits,
        final_free_gpu=num_free_gpu(),
        final_free_cpu=mgr.get_num_free_cpu_blocks(),
        num_gpu_blocks=cfg.num_gpu_blocks,
        num_cpu_blocks=cfg.num_cpu_blocks,
        mean_batch_seqs=batch_seqs_total / step if step else 0.0,
        schedule_digest=digest,
        wall_s=time.perf_counter() - wall0,
        partial_prefills=counters["partial"],
    )


def _insert_in_arrival_order(queue: Any, live: _Live) -> None:
    """Put ``live`` into ``queue`` (kept in request order) after every earlier request: vLLM's
    FCFS policy sorts its running and swapped queues by arrival time each step, and a real
    engine stamps requests in the order they come in (a group readmitted after a recompute
    preemption goes back to its place, not to the end)."""
    i = len(queue)
    while i > 0 and queue[i - 1].req.index > live.req.index:
        i -= 1
    queue.insert(i, live)


def _plan_chunks(running: List[_Live], budget_left: int) -> Tuple[int, int]:
    """Chunk sizes of the running groups in order until the budget runs out (batch fast path:
    valid when nobody is preempted): the number of groups scheduled and the budget left."""
    for i, r in enumerate(running):
        r.chunk = r.take(budget_left)
        if r.chunk == 0:
            return i, budget_left
        budget_left -= r.chunk
    return len(running), budget_left


#: The name the driver was introduced under.
run_w1 = run


def _ignore(live: _Live, status: Any) -> None:
    for s in live.seqs:
        s.status = status
    live.done = True
