"""The batch step (pagedkv.engine_step.BatchEngine) against the compat path, step by step.

Two pagedkv.Scheduler instances run the same randomized workload (tests/scheduler_engine.py:
preemption by swap and recompute, chunked prefill on/off, prefix caching on/off, best_of>1
forks with copy-on-write, aborts, LoRA limits, over-long prompts), with EOS, stop_token_ids,
ignore_eos and min_tokens drawn per request:

* ``compat``: ``schedule()`` + the engine's Python output processing (vLLM 0.4.2's
  single-step output processor and its ``StopChecker``, written out in ``_CompatWorld``);
* ``batch``: ``BatchEngine.step(sampled)``, one native call, fed the same sampled tokens
  (a token depends only on request, sequence id and position).

The compat path is the oracle: it is pagedkv.Scheduler's ``schedule()``, which
tests/test_scheduler_differential.py holds equal to vLLM 0.4.2's own scheduler, driven by
Python output processing that does not share the batch step's native code. At every step the
batch step's written buffers must equal what the compat path's metadata implies (token ids,
positions, slots, block tables, context lengths, query offsets, samples, cached-prefix
lengths, copy and swap pairs; a prompt row leaves out the prefix that ``computed_block_nums``
covers, as vLLM 0.4.2's model runner ``_prepare_prompt`` does), and after ``sync_views()``
the two worlds' Python objects must agree (statuses, computed tokens, stages, output tokens,
queues, free blocks, finished groups).

With stable rows (``BatchEngine(..., stable_rows=True)``) the same holds modulo the rows'
order: every row (its sequence, context, samples, cached prefix, block table and token span)
is compared by sequence id, the block tables rebuilt from the increments alone must equal the
compat path's, and a step may move (``ROW_MOVED``) at most as many rows as left the batch.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv.engine_step import (
    ROW_APPENDED,
    ROW_MOVED,
    ROW_REWRITTEN,
    ROW_SAME,
    BatchBuffers,
    BatchEngine,
)
from scheduler_engine import FakeClock, Workload, World, queue_aborts, token_for


def _stop_params(rid: str, vocab: int, eos: int) -> dict:
    r = random.Random(f"stop/{rid}")
    return dict(
        ignore_eos=r.random() < 0.25,
        min_tokens=r.choice([0, 0, 0, 2, 5]),
        stop_token_ids=r.sample(range(vocab), r.choice([0, 0, 1, 2])),
    )


class _CompatWorld(World):
    """The compat path with vLLM 0.4.2's StopChecker (order of checks and all)."""

    def add(self, req: dict) -> None:
        super().add(req)
        params = self.groups[req["rid"]].sampling_params
        for k, v in _stop_params(req["rid"], self.w.vocab, self.w.eos).items():
            setattr(params, k, v)

    def _stop(self, seq, params) -> None:
        Status = self.Status
        if seq.get_output_len() < params.min_tokens:
            return
        last = seq.get_last_token_id()
        if (not params.ignore_eos and last == seq.eos_token_id) or last in params.stop_token_ids:
            seq.status = Status.FINISHED_STOPPED
        elif seq.get_len() > self.w.max_model_len or seq.get_output_len() == params.max_tokens:
            seq.status = Status.FINISHED_LENGTH_CAPPED


def cached_prefix(world: World, meta, start: int, chunk: int) -> int:
    """Leading tokens of a prompt chunk the model runner leaves out: vLLM 0.4.2's
    ``_prepare_prompt`` starts a prompt at ``len(computed_block_nums) * block_size`` and
    refuses prefix caching with chunked prefill (the batch step then leaves nothing out)."""
    if not meta.is_prompt or world.w.chunked or not meta.computed_block_nums:
        return 0
    assert start == 0, "whole prompts start at 0"
    cached = len(meta.computed_block_nums) * world.w.block_size
    assert cached < chunk, "the computed blocks exclude the prompt's last block"
    return cached


def expected_inputs(world: World, metas, out) -> dict:
    """The model inputs the compat path's metadata implies (before output processing)."""
    bs = world.w.block_size
    rows, toks, pos, slots, qsl = [], [], [], [], [0]
    by_id = {m.request_id: m for m in metas}
    for sg in out.scheduled_seq_groups:
        group, meta = sg.seq_group, by_id[sg.seq_group.request_id]
        n_seqs = len(group.get_seqs())
        for seq in group.get_seqs(status=world.Status.RUNNING):
            start = seq.data.get_num_computed_tokens()
            chunk = sg.token_chunk_size
            table = list(meta.block_tables[seq.seq_id])
            skip = cached_prefix(world, meta, start, chunk)
            ids = seq.data.get_token_ids()[start + skip : start + chunk]
            for j, t in enumerate(ids):
                p = start + skip + j
                toks.append(t)
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + chunk - skip)
            samples = 0
            if meta.do_sample:
                samples = group.sampling_params.best_of if n_seqs == 1 else 1
            rows.append((seq.seq_id, start + chunk, samples, skip, table))

    def pairs(d: dict) -> list:
        return [(a, b) for a, v in d.items() for b in ([v] if isinstance(v, int) else v)]

    return dict(
        rows=rows,
        tokens=toks,
        positions=pos,
        slots=slots,
        query_start_loc=qsl,
        copies=pairs(out.blocks_to_copy),
        swap_in=pairs(out.blocks_to_swap_in),
        swap_out=pairs(out.blocks_to_swap_out),
        scheduled=[g.seq_group.request_id for g in out.scheduled_seq_groups],
        num_prefill_groups=out.num_prefill_groups,
        ignored=[g.request_id for g in out.ignored_seq_groups],
    )


def by_sequence(d: dict) -> dict:
    """Every row of ``expected_inputs`` / ``written_inputs`` with its token span, by
    sequence id (the rows' order aside)."""
    q, out = d["query_start_loc"], {}
    for i, row in enumerate(d["rows"]):
        span = slice(q[i], q[i + 1])
        assert row[0] not in out, "a sequence has one row"
        out[row[0]] = row[1:] + (d["tokens"][span], d["positions"][span], d["slots"][span])
    return out


PER_ROW = ("rows", "tokens", "positions", "slots", "query_start_loc")


def written_inputs(res) -> dict:
    b, n, t = res.buffers, res.num_rows, res.num_tokens
    rows = [
        (
            int(b.seq_ids[i]),
            int(b.context_lens[i]),
            int(b.num_samples[i]),
            int(b.cached_tokens[i]),
            b.block_tables[i].tolist(),
        )
        for i in range(n)
    ]
    return dict(
        rows=rows,
        tokens=b.input_tokens[:t].tolist(),
        positions=b.positions[:t].tolist(),
        slots=b.slot_mapping[:t].tolist(),
        query_start_loc=b.query_start_loc[: n + 1].tolist(),
        copies=[tuple(p) for p in res.pairs("copies").tolist()],
        swap_in=[tuple(p) for p in res.pairs("swap_in").tolist()],
        swap_out=[tuple(p) for p in res.pairs("swap_out").tolist()],
        scheduled=[g.request_id for g in res.scheduled],
        num_prefill_groups=res.num_prefill_groups,
        ignored=[g.request_id for g in res.ignored],
    )


def views(world: World) -> dict:
    mgr = world.sched.block_manager
    return {
        "free": (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()),
        "queues": [
            [g.request_id for g in q]
            for q in (world.sched.waiting, world.sched.running, world.sched.swapped)
        ],
        "seqs": {
            rid: sorted(
                (
                    s.seq_id,
                    s.status.name,
                    s.data.get_num_computed_tokens(),
                    s.is_prefill(),
                    list(s.data.output_token_ids),
                    s.get_len(),
                )
                for s in g.get_seqs()
            )
            for rid, g in world.groups.items()
        },
        "first_scheduled": {rid: g.metrics.first_scheduled_time for rid, g in world.groups.items()},
    }


class Pair:
    def __init__(self, w: Workload, stable: bool = False) -> None:
        self.w, self.clock = w, FakeClock()
        self.compat = _CompatWorld("ours", w, self.clock)
        self.batch = _CompatWorld("ours", w, self.clock)  # its add() sets the same params
        self.next_child = 100_000
        # Narrow rows: sequences outgrow max_model_len here (min_tokens; long prompts in
        # chunked mode, as in vLLM), so the engine must widen them itself.
        bufs = BatchBuffers.for_scheduler(self.batch.sched, incremental=True)
        self.persistent: list = []  # block tables kept up to date from the increments only
        self.rows_same = 0
        self.rows_moved = 0
        self.rows_freed = 0  # rows of a batch whose sequence left it (or that were new)
        self.cached_rows = 0  # prompt rows that left a cached prefix out
        self.stable = stable
        self.reordered = 0  # steps whose rows are not in schedule order
        self.owner: list = []  # per row of the increments' buffer: the sequence it holds
        self.engine = BatchEngine(
            self.batch.sched, bufs, seq_counter=self._new_id, stable_rows=stable
        )
        self.steps = 0
        self.samples_applied = 0
        self.aborted = 0  # running groups aborted for lack of CPU swap space (fix 7)

    def _new_id(self) -> int:
        self.next_child += 1
        return self.next_child - 1

    def apply_increments(self, res) -> None:
        """Keep a block-table buffer from the increments alone, as a caller would: a row
        holds what it was last sent (rows past the batch included) and moves read the
        buffer as it was before the step."""
        b, n = res.buffers, res.num_rows
        before, moved = list(self.persistent), 0
        ids = b.seq_ids[:n].tolist()
        in_batch = set(ids)
        # rows of the batch whose sequence is gone from it: the only rows a move may fill
        freed = sum(1 for i in range(n) if i >= len(self.owner) or self.owner[i] not in in_batch)
        self.persistent += [[] for _ in range(n - len(before))]
        self.owner += [None] * (n - len(self.owner))
        for i in range(n):
            new = b.new_blocks[b.new_block_loc[i] : b.new_block_loc[i + 1]].tolist()
            state = int(b.row_state[i])
            if state in (ROW_SAME, ROW_APPENDED):
                assert b.moved_from[i] == i and self.owner[i] == ids[i]
                assert state == ROW_APPENDED or not new, "a row the same has no new ids"
                self.rows_same += state == ROW_SAME
                self.persistent[i] = before[i] + new
            elif state == ROW_MOVED:
                j = int(b.moved_from[i])
                assert j != i and self.owner[j] == ids[i], "moved from the row that holds it"
                moved += 1
                self.persistent[i] = before[j] + new
            else:
                assert state == ROW_REWRITTEN and b.moved_from[i] == -1
                self.persistent[i] = new
        for i in range(n):
            self.owner[i] = ids[i]
        if self.stable:
            assert moved <= freed, f"{moved} rows moved, {freed} rows were left free"
        self.rows_moved += moved
        self.rows_freed += freed

    def sampled_for(self, res) -> np.ndarray:
        """The tokens for `res`'s rows (in row order), as the compat world samples them.
        Children's ids are drawn in schedule order (a group forks from at most one row)."""
        rid_of = {s.seq_id: rid for rid, g in self.batch.groups.items() for s in g.get_seqs()}
        b, n = res.buffers, res.num_rows
        pos = {g.request_id: i for i, g in enumerate(res.scheduled)}
        forking = [i for i in range(n) if b.num_samples[i] > 1]
        forking.sort(key=lambda i: pos[rid_of[int(b.seq_ids[i])]])
        child_ids, child = {}, self.next_child
        for i in forking:
            child_ids[i] = range(child, child + int(b.num_samples[i]) - 1)
            child += len(child_ids[i])
        out = []
        for i in range(n):
            sid, length = int(b.seq_ids[i]), int(b.context_lens[i])
            for c in child_ids.get(i, ()):
                out.append(token_for(rid_of[sid], c, length, self.w.vocab))
            if b.num_samples[i]:
                out.append(token_for(rid_of[sid], sid, length, self.w.vocab))
        return np.array(out, dtype=np.int32)

    def compare(self, step: int, got: dict, expect: dict) -> None:
        """The written inputs against the compat metadata's: equal, or with stable rows
        equal row by row by sequence id."""
        where = f"seed {self.w.seed} step {step}"
        for k in expect:
            if k != "rows" and not (self.stable and k in PER_ROW):
                assert got[k] == expect[k], f"{where} {k}"
        assert len(got["rows"]) == len(expect["rows"]), where
        trim = {e[0]: len(e[4]) for e in expect["rows"]}  # buffer rows are padded
        assert set(trim) == {r[0] for r in got["rows"]}, f"{where} row sequences"
        for r in got["rows"]:
            assert not any(r[4][trim[r[0]] :]), "rows are padded with 0"
        got_rows = [r[:4] + (r[4][: trim[r[0]]],) for r in got["rows"]]
        mine = by_sequence(dict(got, rows=got_rows))
        assert mine == by_sequence(expect), f"{where} rows"
        if not self.stable:
            assert got_rows == expect["rows"], f"{where} row order"
        self.reordered += got_rows != expect["rows"]
        self.cached_rows += sum(e[3] > 0 for e in expect["rows"])

    def run(self) -> Pair:
        aborts: dict = {}
        for req in self.w.requests:
            if req["abort_at"] is not None:
                aborts.setdefault(req["abort_at"], []).append(req["rid"])
        prev, sampled, finished_c, finished_b = None, None, set(), set()
        try:
            for step in range(self.w.steps):
                for world in (self.compat, self.batch):
                    for req in self.w.requests:
                        if req["at_step"] == step:
                            world.add(req)
                cancel = aborts.get(step, []) + queue_aborts(self.w, step, self.compat.sched)
                if cancel:
                    self.compat.sched.abort_seq_group(cancel + ["no-such-request"])
                    self.engine.abort_seq_group(cancel + ["no-such-request"])
                if prev is not None:
                    before = {g.request_id for g in self.compat.sched.running}
                    self.compat.process(*prev)
                    after = {g.request_id for g in self.compat.sched.running}
                    finished_c |= {r for r in before - after if self.compat.groups[r].is_finished()}
                running = {g.request_id for g in self.compat.sched.running}
                metas, out = self.compat.schedule()
                self.compat.sched.block_manager.check_invariants()
                self.aborted += sum(
                    g.request_id in running
                    and any(q.status == self.compat.Status.FINISHED_ABORTED for q in g.get_seqs())
                    for g in out.ignored_seq_groups
                )
                expect = expected_inputs(self.compat, metas, out)
                res = self.engine.step(sampled, now=self.clock.now)
                if sampled is not None:
                    self.samples_applied += len(sampled)
                finished_b |= {g.request_id for g in res.finished}
                got = written_inputs(res)
                self.compare(step, got, expect)
                self.apply_increments(res)
                tables = {r[0]: t for r, t in zip(got["rows"], self.persistent[: res.num_rows])}
                assert tables == {e[0]: e[4] for e in expect["rows"]}, f"step {step}"
                self.engine.sync_views()
                assert views(self.batch) == views(self.compat), f"seed {self.w.seed} step {step}"
                assert finished_b == finished_c
                sampled, prev = self.sampled_for(res), (metas, out)
                self.steps += 1
                self.clock.now += 0.05
                if not self.compat.sched.has_unfinished_seqs() and step > self.w.steps // 2:
                    break
        finally:
            self.batch.close()
            self.compat.close()
        if not self.compat.sched.has_unfinished_seqs():
            for world in (self.compat, self.batch):
                mgr = world.sched.block_manager
                free = (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks())
                assert free == (self.w.gpu_blocks, self.w.cpu_blocks), f"seed {self.w.seed}"
        return self


FORCES = [
    dict(chunked=False, caching=False),
    dict(chunked=True, caching=False),
    dict(chunked=False, caching=True),
    dict(chunked=True, caching=True),
]


@pytest.mark.parametrize("stable", [False, True], ids=["schedule-rows", "stable-rows"])
@pytest.mark.parametrize("force", FORCES, ids=["default", "chunked", "caching", "chunked+caching"])
def test_batch_step_makes_the_compat_decisions(force, stable):
    pairs = [Pair(Workload.random(seed, **force), stable).run() for seed in range(10)]
    assert sum(p.steps for p in pairs) >= 300
    assert sum(p.samples_applied for p in pairs) >= 300
    assert sum(p.rows_same for p in pairs) >= 300  # the increments are mostly empty
    moved, freed = sum(p.rows_moved for p in pairs), sum(p.rows_freed for p in pairs)
    assert moved >= 30  # rows move when earlier ones leave (stable: into their holes)
    if stable:
        assert moved <= freed  # (also checked per step)
        assert sum(p.reordered for p in pairs) >= 30  # the rows are not schedule()'s
    cached_rows = sum(p.cached_rows for p in pairs)
    if force["caching"] and not force["chunked"]:
        assert cached_rows >= 20, cached_rows
    else:
        assert cached_rows == 0


@pytest.mark.parametrize("stable", [False, True], ids=["schedule-rows", "stable-rows"])
def test_batch_step_with_lora_and_forced_preemption(stable):
    runs = [Pair(Workload.random(s, max_loras=1 + s % 2), stable).run() for s in range(100, 106)]
    for mode in ("swap", "recompute"):
        runs += [
            Pair(Workload.random(s, preemption_mode=mode), stable).run() for s in range(120, 124)
        ]
    assert sum(p.steps for p in runs) >= 300


@pytest.mark.parametrize("stable", [False, True], ids=["schedule-rows", "stable-rows"])
def test_blocks_shared_by_forks_are_swapped_once(stable):
    """Seed 225 swaps a forked group back in: its sequences share CPU blocks, and the swap
    pairs must name each block once (vLLM's dict), not once per sequence."""
    p = Pair(Workload.random(225, preemption_mode="swap"), stable).run()
    assert p.steps > 97


def check_starved(seeds, force: dict, stable: bool) -> list:
    """Starved pools (Workload.starved, issue 18): the batch step makes the compat decisions
    at every step and neither raises; some groups are aborted for lack of swap space."""
    pairs = [Pair(Workload.starved(seed, **force), stable).run() for seed in seeds]
    n = len(pairs)
    assert sum(p.steps for p in pairs) >= 40 * n
    assert sum(p.samples_applied for p in pairs) >= 40 * n
    assert sum(p.aborted for p in pairs) >= n // 20
    return pairs


@pytest.mark.parametrize("stable", [False, True], ids=["schedule-rows", "stable-rows"])
@pytest.mark.parametrize("force", FORCES, ids=["default", "chunked", "caching", "chunked+caching"])
def test_batch_step_on_starved_pools(force, stable):
    check_starved(range(40), force, stable)


@pytest.mark.slow
@pytest.mark.parametrize("stable", [False, True], ids=["schedule-rows", "stable-rows"])
@pytest.mark.parametrize("force", FORCES, ids=["default", "chunked", "caching", "chunked+caching"])
def test_batch_step_on_starved_pools_many_seeds(force, stable):
    check_starved(range(1000, 1400), force, stable)


@pytest.mark.parametrize("seed,chunked,caching", [(3, False, False), (12, True, True)])
def test_batch_step_starved_regressions(seed, chunked, caching):
    """Seeds whose compat step raised OutOfBlocksError before fix 7 (the batch step the same)."""
    for stable in (False, True):
        p = Pair(Workload.starved(seed, chunked=chunked, caching=caching), stable).run()
        assert p.aborted >= 1


@pytest.mark.parametrize("seed,chunked,caching", [(36, False, False), (0, False, False)])
def test_batch_step_starved_regressions_of_the_batch_step(seed, chunked, caching):
    """Seed 36: a group whose fork stopped at its first token is ignored when it can never
    swap back in (fix 6); the finished fork keeps its finish in both paths (the compat
    engine never forks a finished child into the scheduler). Seed 0: a group whose prompt row
    forks is aborted between steps (no child id is drawn for it)."""
    for stable in (False, True):
        Pair(Workload.starved(seed, chunked=chunked, caching=caching), stable).run()
