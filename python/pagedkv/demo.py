"""End-to-end proof: a tiny paged-attention engine whose every logit matches a dense forward.

:func:`run_demo` serves a batch of requests with :class:`~pagedkv.attention.TinyDecoder`
(random weights, fixed seed, GQA, RoPE) through :class:`pagedkv.BlockSpaceManager`
(``enable_caching=True``) on a deliberately small GPU block pool plus a CPU swap pool.
The schedule is deterministic and provably exercises:

* **prefix caching** — most prompts share a system prefix and requests arrive staggered;
  at admission ``get_common_computed_block_ids`` tells how many leading tokens are
  already in the cache and only the uncached suffix is fed (at least the last token);
* **parallel sampling / fork** — every third request has ``n=2``: after its prefill the
  sequence forks (``seq.fork``, ``group.add``, ``manager.fork``); the parent takes the
  best token and the child the 2nd best, so the next decode step copies the shared
  partial block (copy-on-write, executed with :func:`~pagedkv.attention.copy_blocks`);
* **preemption** — FCFS; when a running group cannot get its next slots the latest
  arrival is preempted: a forked group is swapped out (later swapped back in, both
  executed with :func:`~pagedkv.attention.swap_blocks`), a single-sequence one is
  recomputed (freed, ``WAITING``, ``reset_state_for_recompute``, re-prefilled).

Each step runs, in order: swap out, swap in, copy-on-write, forward.  Prefill steps
pack per-sequence chunks with :func:`~pagedkv.attention.build_paged_batch`; decode
steps get their metadata from the manager's batch API through persistent
:class:`~pagedkv.attention.StepBuffers` (one host-to-device copy per step).

The sampler is deterministic (greedy; a forked child takes the 2nd-best token once).

The check: every logits row the engine computes (the prefill rows and each decode
row, including the rows that produced every generated token) is compared with
``model.dense_forward(tokens of that sequence)`` at the same position (causal, so the
row at position ``p`` only depends on tokens ``0..p``): every element must satisfy
``|paged - dense| <= atol + rtol * max|dense row|`` (:data:`TOLERANCES`: fp32 1e-5 and
1e-5; bf16 2e-2 and 2e-2, i.e. a few units in the last place of the largest logit).
At the end every GPU and CPU block must be free again and every event above must have
happened (the default workload needs at least :data:`MIN_REQUESTS` requests for that).
The GPU pool is sized by model-free dry runs of the same schedule
(:func:`choose_num_gpu_blocks`).

CLI: ``pagedkv demo [--device D] [--dtype T] [--requests N] [--seed S] [--quiet]``
(also ``python -m pagedkv.demo``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from pagedkv import (
    AllocStatus,
    BlockSpaceManager,
    Logprob,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.attention import (
    DeviceView,
    SeqChunk,
    StepBuffers,
    TinyConfig,
    TinyDecoder,
    allocate_kv_cache,
    build_paged_batch,
    copy_blocks,
    swap_blocks,
)
from pagedkv.cli import DEMO_DEFAULT_REQUESTS, DEMO_MIN_REQUESTS, add_demo_arguments

__all__ = [
    "DemoConfig",
    "DemoEngine",
    "DemoReport",
    "StepPlan",
    "add_arguments",
    "main",
    "run",
    "run_demo",
]

HELP = "serve requests through the paged engine and check every logit against a dense forward"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
#: (atol, rtol) of the logits check per dtype
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


@dataclass(frozen=True)
class DemoConfig:
    """Workload and engine sizes of the demo (the defaults exercise every event)."""

    num_requests: int = DEMO_DEFAULT_REQUESTS
    seed: int = 0
    block_size: int = 4
    #: tokens of the system prompt shared by most requests
    shared_prefix_len: int = 8
    #: (min, max) length of each prompt's own suffix, inclusive
    suffix_len: Tuple[int, int] = (2, 7)
    #: (min, max) tokens generated per sequence, inclusive
    max_tokens: Tuple[int, int] = (8, 14)
    #: request ``i`` has ``n=2`` when ``i % fork_every == 1``; it has no shared prefix
    #: when ``i % fork_every == 2``
    fork_every: int = 3
    #: request ``i`` arrives at step ``i * arrival_gap``
    arrival_gap: int = 2
    #: GPU pool; ``None``: chosen by :func:`choose_num_gpu_blocks` (a fraction of the
    #: unconstrained peak usage, small enough to force both kinds of preemption)
    num_gpu_blocks: Optional[int] = None
    #: CPU swap pool; ``None``: room for every request
    num_cpu_blocks: Optional[int] = None
    max_num_seqs: int = 16
    #: ``"step_buffers"`` (batch API + StepBuffers) or ``"append_slots"`` (per sequence)
    decode_path: str = "step_buffers"
    max_steps: int = 10_000
    model: TinyConfig = field(default_factory=TinyConfig)


@dataclass
class StepPlan:
    """What one step runs; a ``hook`` passed to :func:`run_demo` sees (and may alter) it
    before the cache operations are executed."""

    step: int
    kind: str  # "prefill" or "decode"
    #: prefill: (sequence, number of leading tokens already in the cache)
    prefill: List[Tuple[Sequence, int]] = field(default_factory=list)
    #: decode: sequences in row order
    decode: List[Sequence] = field(default_factory=list)
    groups: List[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_out: Dict[int, int] = field(default_factory=dict)
    blocks_to_swap_in: Dict[int, int] = field(default_factory=dict)
    blocks_to_copy: Dict[int, List[int]] = field(default_factory=dict)
    device_view: Optional[DeviceView] = None


@dataclass
class DemoReport:
    """Counts of one demo run, the logits check and ``ok``."""

    device: str
    dtype: str
    decode_path: str
    requests: int = 0
    sequences: int = 0
    block_size: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_cached_tokens: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    generated_tokens: int = 0
    forks: int = 0
    cow_copies: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    recompute_preemptions: int = 0
    checked_rows: int = 0
    max_abs_diff: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    mismatches: int = 0
    seconds: float = 0.0
    failures: List[str] = field(default_factory=list)
    ok: bool = False

    def format(self) -> str:
        hit_rate = self.prefix_hits / self.prefix_lookups if self.prefix_lookups else 0.0
        lines = [
            f"pagedkv demo: {self.device} {self.dtype}, decode path {self.decode_path}, "
            f"block_size {self.block_size}, {self.num_gpu_blocks} GPU / "
            f"{self.num_cpu_blocks} CPU blocks",
            f"  requests {self.requests} ({self.sequences} sequences), steps {self.steps} "
            f"({self.prefill_steps} prefill, {self.decode_steps} decode), "
            f"{self.seconds:.2f} s",
            f"  tokens: {self.prompt_tokens} prompt, {self.prefill_tokens_computed} prefilled, "
            f"{self.prefix_cached_tokens} skipped (prefix cache), "
            f"{self.generated_tokens} generated",
            f"  prefix cache: {self.prefix_hits}/{self.prefix_lookups} block hits ({hit_rate:.0%})",
            f"  forks {self.forks}, copy-on-write copies {self.cow_copies}",
            f"  swaps: {self.swap_outs} out ({self.blocks_swapped_out} blocks), "
            f"{self.swap_ins} in ({self.blocks_swapped_in} blocks); "
            f"recompute preemptions {self.recompute_preemptions}",
            f"  logits check: {self.checked_rows} rows vs dense_forward, "
            f"max |diff| {self.max_abs_diff:.3g} (atol {self.atol:g}, rtol {self.rtol:g}), "
            f"{self.mismatches} mismatches",
        ]
        lines += [f"  FAIL: {msg}" for msg in self.failures]
        lines.append(f"  result: {'OK' if self.ok else 'FAILED'}")
        return "\n".join(lines)


@dataclass
class _Request:
    index: int
    arrival_step: int
    group: SequenceGroup
    max_tokens: int
    n: int


Hook = Callable[["DemoEngine", StepPlan], None]


class DemoEngine:
    """A minimal vLLM-style engine: FCFS scheduler, block manager, paged KV cache, model.

    Built and driven by :func:`run_demo`; exposed for hooks and tests (``manager``,
    ``gpu_caches``, ``cpu_caches``, ``model``, ``step_buffers``).

    ``model=None`` makes a *dry run*: same scheduler and block manager, no caches and
    pseudo-random logits instead of the model (used to size the GPU pool, see
    :func:`choose_num_gpu_blocks`).  ``num_gpu_blocks`` overrides the config.
    """

    def __init__(
        self,
        config: DemoConfig,
        model: Optional[TinyDecoder],
        *,
        hook: Optional[Hook] = None,
        num_gpu_blocks: Optional[int] = None,
    ) -> None:
        if config.decode_path not in ("step_buffers", "append_slots"):
            raise ValueError(f"unknown decode_path {config.decode_path!r}")
        self.config = cfg = config
        self.model = model
        self.dry_run = model is None
        self.device = torch.device("cpu") if model is None else model.device
        self.hook = hook
        bs = cfg.block_size
        self.requests = _make_requests(cfg)
        self._order = {r.group.request_id: r.index for r in self.requests}
        self._max_tokens = {r.group.request_id: r.max_tokens for r in self.requests}

        peak = _peak_blocks(self.requests, bs)
        max_len = max(len(r.group.prompt_token_ids) + r.max_tokens for r in self.requests)
        # default: room for everything (no preemption); run_demo passes a smaller pool
        self.num_gpu_blocks = num_gpu_blocks or cfg.num_gpu_blocks or sum(peak) + 2
        self.num_cpu_blocks = cfg.num_cpu_blocks or sum(peak) + 2
        self.manager = BlockSpaceManager(
            bs, self.num_gpu_blocks, self.num_cpu_blocks, enable_caching=True
        )
        self.gpu_caches: List[torch.Tensor] = []
        self.cpu_caches: List[torch.Tensor] = []
        if model is not None:
            mc = model.config
            self.gpu_caches = model.allocate_kv_caches(self.num_gpu_blocks, bs)
            self.cpu_caches = [
                allocate_kv_cache(
                    self.num_cpu_blocks,
                    bs,
                    mc.num_kv_heads,
                    mc.head_dim,
                    dtype=model.dtype,
                    device="cpu",
                    pin_memory=self.device.type == "cuda",
                )
                for _ in range(mc.num_layers)
            ]
        self._fake_gen = torch.Generator().manual_seed(cfg.seed)
        self.step_buffers = StepBuffers(
            cfg.max_num_seqs, _ceil_div(max_len, bs), device=self.device
        )

        self._pending = list(self.requests)  # not arrived yet, by arrival step
        self.waiting: List[SequenceGroup] = []
        self.running: List[SequenceGroup] = []
        self.swapped: List[SequenceGroup] = []
        self.finished: List[SequenceGroup] = []
        self._forked: set = set()
        self._next_seq_id = 1 + max(s.seq_id for r in self.requests for s in r.group.get_seqs())
        self.clock = 0
        self.max_used_gpu_blocks = 0
        self.all_seqs: Dict[int, Sequence] = {
            s.seq_id: s for r in self.requests for s in r.group.get_seqs()
        }
        #: seq_id -> list of (positions [k] long, logits [k, vocab] float32), on the CPU
        self.records: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self.report = DemoReport(
            device=str(self.device),
            dtype="none" if model is None else str(model.dtype).replace("torch.", ""),
            decode_path=cfg.decode_path,
            requests=len(self.requests),
            block_size=bs,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            prompt_tokens=sum(len(r.group.prompt_token_ids) for r in self.requests),
        )

    # ------------------------------------------------------------------ #
    # driver
    # ------------------------------------------------------------------ #

    def has_work(self) -> bool:
        return bool(self._pending or self.waiting or self.running or self.swapped)

    def run(self) -> None:
        while self.has_work():
            if self.clock >= self.config.max_steps:
                raise RuntimeError(f"demo did not finish within {self.config.max_steps} steps")
            self.step()
        self.report.prefix_lookups, self.report.prefix_hits = self.manager.prefix_cache_stats()

    def step(self) -> None:
        """One engine iteration: admit arrivals, schedule, execute, process outputs."""
        while self._pending and self._pending[0].arrival_step <= self.clock:
            self.waiting.append(self._pending.pop(0).group)
        plan = self._schedule()
        used = self.num_gpu_blocks - self.manager.get_num_free_gpu_blocks()
        self.max_used_gpu_blocks = max(self.max_used_gpu_blocks, used)
        if plan is not None:
            if self.hook is not None:
                self.hook(self, plan)
            self._execute(plan)
        elif self.waiting and not self.running and not self.swapped:
            raise RuntimeError("a waiting request can never be scheduled: GPU pool too small")
        self.clock += 1

    # ------------------------------------------------------------------ #
    # scheduling
    # ------------------------------------------------------------------ #

    def _arrival(self, group: SequenceGroup) -> int:
        return self._order[group.request_id]

    def _schedule(self) -> Optional[StepPlan]:
        self.waiting.sort(key=self._arrival)
        self.running.sort(key=self._arrival)
        self.swapped.sort(key=self._arrival)
        plan = StepPlan(step=self.clock, kind="prefill")
        if not self.swapped and self._schedule_prefills(plan):
            return plan
        plan.kind = "decode"
        if self._schedule_decodes(plan):
            return plan
        return None

    def _schedule_prefills(self, plan: StepPlan) -> bool:
        """Admit waiting groups FCFS while they fit (vLLM: prefills first, no swapped ones)."""
        mgr = self.manager
        num_seqs = sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)
        while self.waiting:
            group = self.waiting[0]
            status = mgr.can_allocate(group)
            if status == AllocStatus.NEVER:
                raise RuntimeError(f"request {group.request_id} can never fit in the GPU pool")
            if status == AllocStatus.LATER:
                break
            if num_seqs + group.get_max_num_running_seqs() > self.config.max_num_seqs:
                break
            self.waiting.pop(0)
            mgr.allocate(group)
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
                computed = mgr.get_common_computed_block_ids([seq])
                num_cached = min(len(computed) * self.config.block_size, seq.get_len() - 1)
                plan.prefill.append((seq, num_cached))
                mgr.access_all_blocks_in_seq(seq, float(self.clock))
            num_seqs += group.get_max_num_running_seqs()
            plan.groups.append(group)
            self.running.append(group)
        return bool(plan.prefill)

    def _schedule_decodes(self, plan: StepPlan) -> bool:
        """Give every running group its next slots, preempting the latest arrivals if needed;
        then swap groups back in when nothing was preempted."""
        mgr = self.manager
        use_buffers = self.config.decode_path == "step_buffers"
        if use_buffers:
            self.step_buffers.begin_step()
        queue = list(self.running)
        kept: List[SequenceGroup] = []
        preempted = False
        while queue:
            group = queue.pop(0)
            while not mgr.can_append_slots(group):
                preempted = True
                if queue:
                    self._preempt(queue.pop(), plan)
                else:
                    self._preempt(group, plan)
                    group = None
                    break
            if group is not None:
                self._append(group, plan, use_buffers)
                kept.append(group)
        self.running = kept
        if not preempted:
            num_seqs = len(plan.decode)
            while self.swapped:
                group = self.swapped[0]
                if mgr.can_swap_in(group) != AllocStatus.OK:
                    break
                if num_seqs + group.num_seqs(SequenceStatus.SWAPPED) > self.config.max_num_seqs:
                    break
                num_seqs += group.num_seqs(SequenceStatus.SWAPPED)
                self.swapped.pop(0)
                mapping = mgr.swap_in(group)
                plan.blocks_to_swap_in.update(mapping)
                self.report.swap_ins += 1
                self.report.blocks_swapped_in += len(mapping)
                for seq in group.get_seqs(SequenceStatus.SWAPPED):
                    seq.status = SequenceStatus.RUNNING
                self._append(group, plan, use_buffers)
                self.running.append(group)
        if use_buffers and plan.decode:
            plan.device_view = self.step_buffers.to_device()
        return bool(plan.decode)

    def _append(self, group: SequenceGroup, plan: StepPlan, use_buffers: bool) -> None:
        mgr = self.manager
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if use_buffers:
            cows = [self.step_buffers.append(mgr, seqs)]
        else:
            cows = [mgr.append_slots(seq) for seq in seqs]
        for cow in cows:
            for src, dsts in cow.items():
                plan.blocks_to_copy.setdefault(src, []).extend(dsts)
        for seq in seqs:
            mgr.access_all_blocks_in_seq(seq, float(self.clock))
        plan.decode.extend(seqs)
        plan.groups.append(group)

    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        """Forked groups are swapped out, single-sequence groups recomputed."""
        mgr = self.manager
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if len(seqs) > 1:
            if not mgr.can_swap_out(group):
                raise RuntimeError(f"no CPU swap space for request {group.request_id}")
            mapping = mgr.swap_out(group)
            plan.blocks_to_swap_out.update(mapping)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.report.swap_outs += 1
            self.report.blocks_swapped_out += len(mapping)
        else:
            for seq in seqs:
                mgr.free(seq)
                seq.status = SequenceStatus.WAITING
                seq.reset_state_for_recompute()
            self.waiting.append(group)
            self.report.recompute_preemptions += 1

    # ------------------------------------------------------------------ #
    # execution
    # ------------------------------------------------------------------ #

    def _execute(self, plan: StepPlan) -> None:
        if self.dry_run:
            self._execute_dry(plan)
            return
        # order matters: blocks freed by a swap-out may be the targets of this step's
        # swap-ins / copies, and a swapped-in block may be the source of a copy
        if plan.blocks_to_swap_out:
            swap_blocks(self.gpu_caches, self.cpu_caches, plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            swap_blocks(self.cpu_caches, self.gpu_caches, plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            copy_blocks(self.gpu_caches, plan.blocks_to_copy)
            self.report.cow_copies += sum(len(d) for d in plan.blocks_to_copy.values())
        if plan.kind == "prefill":
            logits, rows = self._forward_prefill(plan)
            self.report.prefill_steps += 1
        else:
            logits, rows = self._forward_decode(plan)
            self.report.decode_steps += 1
        self.report.steps += 1
        logits = logits.float().cpu()
        for seq_id, start, positions in rows:
            chunk = logits[start : start + positions.shape[0]]
            self.records.setdefault(seq_id, []).append((positions, chunk))
        self._process_outputs(plan, logits, rows)

    def _execute_dry(self, plan: StepPlan) -> None:
        """Bookkeeping of :meth:`_execute` with pseudo-random logits and no cache."""
        rep = self.report
        rep.cow_copies += sum(len(d) for d in plan.blocks_to_copy.values())
        rows, start = [], 0
        items = (
            plan.prefill if plan.kind == "prefill" else [(s, s.get_len() - 1) for s in plan.decode]
        )
        for seq, num_cached in items:
            positions = torch.arange(num_cached, seq.get_len())
            rows.append((seq.seq_id, start, positions))
            start += positions.shape[0]
            if plan.kind == "prefill":
                rep.prefix_cached_tokens += num_cached
                rep.prefill_tokens_computed += positions.shape[0]
        if plan.kind == "prefill":
            rep.prefill_steps += 1
        else:
            rep.decode_steps += 1
        rep.steps += 1
        logits = torch.rand(start, self.config.model.vocab_size, generator=self._fake_gen)
        self._process_outputs(plan, logits, rows)

    def _forward_prefill(self, plan: StepPlan):
        mgr, bs = self.manager, self.config.block_size
        chunks = []
        rows = []
        start = 0
        for seq, num_cached in plan.prefill:
            tokens = seq.get_token_ids()[num_cached:]
            chunks.append(SeqChunk(tokens, num_cached, mgr.get_block_table(seq)))
            positions = torch.arange(num_cached, seq.get_len())
            rows.append((seq.seq_id, start, positions))
            start += len(tokens)
            self.report.prefix_cached_tokens += num_cached
            self.report.prefill_tokens_computed += len(tokens)
        # Two prompts admitted together may share a cached prefix block that neither has
        # computed yet: both write identical K/V into the same slots (write_kv allows it).
        batch = build_paged_batch(chunks, bs)
        batch = dataclasses.replace(
            batch,
            **{f.name: getattr(batch, f.name).to(self.device) for f in dataclasses.fields(batch)},
        )
        return self.model.paged_forward_batch(batch, self.gpu_caches), rows

    def _forward_decode(self, plan: StepPlan):
        rows = [
            (seq.seq_id, i, torch.tensor([seq.get_len() - 1])) for i, seq in enumerate(plan.decode)
        ]
        if plan.device_view is not None:
            v = plan.device_view
            logits = self.model.paged_forward(
                v.input_ids,
                v.positions,
                v.slot_mapping,
                self.gpu_caches,
                v.block_tables,
                v.context_lens,
                None,
            )
            return logits, rows
        mgr = self.manager
        chunks = [
            SeqChunk([seq.get_last_token_id()], seq.get_len() - 1, mgr.get_block_table(seq))
            for seq in plan.decode
        ]
        batch = build_paged_batch(chunks, self.config.block_size, device=self.device)
        logits = self.model.paged_forward(
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            self.gpu_caches,
            batch.block_tables,
            batch.context_lens,
            None,
        )
        return logits, rows

    def _process_outputs(self, plan: StepPlan, logits: torch.Tensor, rows) -> None:
        mgr = self.manager
        last_row = {seq_id: start + pos.shape[0] - 1 for seq_id, start, pos in rows}
        for group in plan.groups:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                if seq.seq_id not in last_row:
                    continue  # forked in this very loop
                row = logits[last_row[seq.seq_id]]
                logprobs = torch.log_softmax(row, -1)
                best = torch.topk(row, 2).indices.tolist()
                seq.data.update_num_computed_tokens(seq.data.get_num_uncomputed_tokens())
                n = group.sampling_params.n
                if n > 1 and group.request_id not in self._forked:
                    # parallel sampling: the parent keeps the best token, a child the 2nd best
                    self._forked.add(group.request_id)
                    child = seq.fork(self._next_seq_id)
                    self._next_seq_id += 1
                    group.add(child)
                    mgr.fork(seq, child)
                    self.all_seqs[child.seq_id] = child
                    token = best[1]
                    child.append_token_id(token, {token: Logprob(float(logprobs[token]))})
                    self.report.forks += 1
                    self.report.generated_tokens += 1
                token = best[0]
                seq.append_token_id(token, {token: Logprob(float(logprobs[token]))})
                self.report.generated_tokens += 1
            mgr.mark_blocks_as_computed(group)
            max_tokens = self._max_tokens[group.request_id]
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                if seq.get_output_len() >= max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    mgr.free(seq)
            if group.is_finished():
                self.running.remove(group)
                self.finished.append(group)

    # ------------------------------------------------------------------ #
    # the check
    # ------------------------------------------------------------------ #

    def check(self, atol: float, rtol: float) -> None:
        """Compare every recorded logits row with ``dense_forward``; fill the report."""
        rep = self.report
        rep.atol, rep.rtol = atol, rtol
        rep.sequences = len(self.all_seqs)
        examples = []
        for seq_id, seq in sorted(self.all_seqs.items()):
            recs = self.records.get(seq_id)
            if not recs:
                continue
            dense = self.model.dense_forward(seq.get_token_ids()).float().cpu()
            positions = torch.cat([p for p, _ in recs])
            paged = torch.cat([lg for _, lg in recs])
            ref = dense[positions]
            diff = (paged - ref).abs()
            bound = atol + rtol * ref.abs().amax(-1, keepdim=True)
            bad = (diff > bound).any(-1) | ~torch.isfinite(paged).all(-1)
            rep.checked_rows += positions.shape[0]
            rep.max_abs_diff = max(rep.max_abs_diff, float(diff.max()))
            rep.mismatches += int(bad.sum())
            for i in bad.nonzero().flatten().tolist()[:2]:
                worst = float(diff[i].max())
                examples.append(f"seq {seq_id} position {int(positions[i])}: |diff| {worst:.3g}")
        if rep.mismatches:
            rep.failures.append(
                f"{rep.mismatches} of {rep.checked_rows} logits rows differ from dense_forward "
                f"(e.g. {'; '.join(examples[:3])})"
            )
        mgr = self.manager
        if mgr.get_num_free_gpu_blocks() != self.num_gpu_blocks:
            rep.failures.append(
                f"{self.num_gpu_blocks - mgr.get_num_free_gpu_blocks()} GPU blocks still in use"
            )
        if mgr.get_num_free_cpu_blocks() != self.num_cpu_blocks:
            rep.failures.append(
                f"{self.num_cpu_blocks - mgr.get_num_free_cpu_blocks()} CPU blocks still in use"
            )
        rep.prefix_lookups, rep.prefix_hits = mgr.prefix_cache_stats()
        for name in EVENTS:
            if getattr(rep, name) <= 0:
                rep.failures.append(f"event did not happen: {name} == 0")
        rep.ok = not rep.failures


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _peak_blocks(requests: List[_Request], block_size: int) -> List[int]:
    """Upper bound of the GPU blocks each request holds at its longest."""
    return [
        r.n * _ceil_div(len(r.group.prompt_token_ids) + r.max_tokens, block_size) for r in requests
    ]


#: events every demo run must show (report fields that must be > 0)
EVENTS = (
    "prefix_hits",
    "prefix_cached_tokens",
    "cow_copies",
    "swap_outs",
    "swap_ins",
    "recompute_preemptions",
)

#: the default workload needs this many requests to show every event
MIN_REQUESTS = DEMO_MIN_REQUESTS

#: fractions of the unconstrained peak GPU usage tried as pool sizes, in order
_POOL_FRACTIONS = (0.7, 0.6, 0.8, 0.5, 0.9, 0.4, 0.3)


def choose_num_gpu_blocks(config: DemoConfig) -> int:
    """A GPU pool size under which the workload of ``config`` shows every event.

    The schedule depends only on lengths and arrival times, not on token values (the
    requests have no stop tokens), so model-free dry runs of the engine predict it.
    A first dry run with room for everything measures the peak usage; pools of
    several fractions of it (:data:`_POOL_FRACTIONS`, never below what the largest
    request needs alone) are then tried and the first that shows every event of
    :data:`EVENTS` is returned (if none does, the first candidate: the run will then
    report the missing events).
    """
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    requests = _make_requests(config)
    peak = _peak_blocks(requests, config.block_size)
    roomy = DemoEngine(config, None, num_gpu_blocks=sum(peak) + 2)
    roomy.run()
    floor = max(peak) + 2
    candidates: List[int] = []
    for fraction in _POOL_FRACTIONS:
        size = max(floor, math.ceil(fraction * roomy.max_used_gpu_blocks))
        if size not in candidates:
            candidates.append(size)
    for size in candidates:
        engine = DemoEngine(config, None, num_gpu_blocks=size)
        try:
            engine.run()
        except RuntimeError:
            continue
        if all(getattr(engine.report, name) > 0 for name in EVENTS):
            return size
    return candidates[0]


def _make_requests(cfg: DemoConfig) -> List[_Request]:
    """Deterministic requests from ``cfg.seed`` (see :class:`DemoConfig`)."""
    if cfg.num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab, bs = cfg.model.vocab_size, cfg.block_size

    def randint(lo: int, hi: int, size: int = 1) -> List[int]:
        return torch.randint(lo, hi + 1, (size,), generator=gen).tolist()

    prefix = randint(0, vocab - 1, cfg.shared_prefix_len)
    requests = []
    seq_id = 0
    for i in range(cfg.num_requests):
        n = 2 if i % cfg.fork_every == 1 else 1
        shared = i % cfg.fork_every != 2
        suffix_len = randint(*cfg.suffix_len)[0]
        head = prefix if shared else randint(0, vocab - 1, cfg.shared_prefix_len)
        if n > 1 and (len(head) + suffix_len) % bs == 0:
            suffix_len += 1  # a forked prompt ends in a partial block: its first decode is CoW
        prompt = head + randint(0, vocab - 1, suffix_len)
        max_tokens = randint(*cfg.max_tokens)[0]
        params = SamplingParams(n=n, max_tokens=max_tokens)
        seq = Sequence(seq_id, f"request-{i}", prompt, bs)
        seq_id += 1
        group = SequenceGroup(f"request-{i}", [seq], params, arrival_time=float(i))
        requests.append(_Request(i, i * cfg.arrival_gap, group, max_tokens, n))
    return requests


def run_demo(
    config: Optional[DemoConfig] = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    verbose: bool = True,
    hook: Optional[Hook] = None,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
) -> DemoReport:
    """Run the demo engine and the logits check; returns the :class:`DemoReport`.

    ``hook(engine, plan)`` is called every step after scheduling and before the
    cache operations (tests use it to inject faults).  ``atol``/``rtol`` default to
    :data:`TOLERANCES` for ``dtype``.  Never raises on a failed check: see
    ``report.ok`` and ``report.failures``.
    """
    cfg = config or DemoConfig()
    if isinstance(dtype, str):
        dtype = _DTYPES[dtype]
    default_atol, default_rtol = TOLERANCES.get(dtype, (2e-2, 2e-2))
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    t0 = time.perf_counter()
    num_gpu_blocks = choose_num_gpu_blocks(cfg)
    model = TinyDecoder(cfg.model, dtype=dtype, device=device)
    engine = DemoEngine(cfg, model, hook=hook, num_gpu_blocks=num_gpu_blocks)
    # The model's matrices are tiny: on the CPU, intra-op threads only add overhead
    # (and stall badly on a busy machine), so run single-threaded, then restore.
    threads = torch.get_num_threads()
    if model.device.type == "cpu":
        torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            try:
                engine.run()
            except RuntimeError as exc:
                engine.report.failures.append(f"engine error: {exc}")
            engine.check(atol, rtol)
    finally:
        torch.set_num_threads(threads)
    engine.report.seconds = time.perf_counter() - t0
    if verbose:
        print(engine.report.format())
    return engine.report


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedkv demo`` (defined torch-free in :mod:`pagedkv.cli`)."""
    add_demo_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; 0 if every check passed."""
    if args.requests < MIN_REQUESTS:
        print(
            f"pagedkv demo: --requests must be >= {MIN_REQUESTS} "
            "(fewer cannot show a swap and a recompute preemption)",
            file=sys.stderr,
        )
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        print(f"pagedkv demo: bad --device: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("pagedkv demo: CUDA is not available", file=sys.stderr)
        return 2
    cfg = DemoConfig(num_requests=args.requests, seed=args.seed, model=TinyConfig(seed=args.seed))
    report = run_demo(cfg, device=args.device, dtype=_DTYPES[args.dtype], verbose=not args.quiet)
    if not report.ok:
        msg = "; ".join(report.failures)
        print(f"pagedkv demo FAILED: {msg}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv demo", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
