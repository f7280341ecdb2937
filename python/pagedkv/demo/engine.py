"""The engine and the check of ``pagedkv demo`` (the command: :mod:`pagedkv.demo`; needs torch).

:func:`run_demo` serves requests with :class:`~pagedkv.attention.TinyDecoder` (random weights,
fixed seed, GQA, RoPE) on :class:`pagedkv.Scheduler` (vLLM 0.4.2's policy, prefix caching on)
over a deliberately small GPU block pool plus a CPU swap pool. The scheduler is the package's
one scheduler, driven through the batch step (``path="batch"``, the default) or through the
vLLM-compatible ``schedule()`` (``"compat"``); see :mod:`pagedkv.vllm_042.demo_paths`. Either yields
a :class:`~pagedkv.vllm_042.demo_paths.StepPlan` per step, which the engine executes in vLLM's
order: swap out, swap in, copy-on-write (on the real cache tensors), then the paged forward.
Sampling is greedy: a row that samples ``k`` tokens takes its top ``k``; the runners-up go to new
child sequences, the best to the row's own sequence.

The workload shows, by vLLM's policy alone: **prefix-cache hits** (most prompts share a system
prefix and arrive staggered; a prompt row leaves out its cached prefix), **n=2 forks** (every
third request; its next decode copies the shared partial block: copy-on-write) and
**preemption** (the pool is too small: vLLM swaps out groups with several sequences, swapped
back in later, and recomputes single-sequence ones; ``preemption_mode`` can force one kind).
The pool is sized by model-free dry runs of the same engine (:func:`choose_num_gpu_blocks`).

The check: every logits row (prompt rows and every decode row, including the rows that
produced each generated token) is compared with ``model.dense_forward`` over the sequence's
tokens at the same position: ``|paged - dense| <= atol + rtol * max|dense row|`` for every
element (:data:`TOLERANCES`: fp32 1e-5 and 1e-5; bf16 2e-2 and 2e-2). At the end every request
must have finished, every GPU and CPU block must be free and every event of :data:`EVENTS`
must have happened.

The command line (``pagedkv demo``, ``python -m pagedkv.demo``) is :mod:`pagedkv.demo`, which
calls :func:`run_command`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from pagedkv import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from pagedkv.attention import TinyConfig, TinyDecoder, allocate_kv_cache, copy_blocks, swap_blocks
from pagedkv.demo import DEFAULT_REQUESTS, PATHS
from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_042.demo_paths import PATHS as STEP_PATHS
from pagedkv.vllm_042.demo_paths import StepPlan
from pagedkv.vllm_042.scheduler import CacheConfig, Scheduler, SchedulerConfig

__all__ = [
    "DemoConfig",
    "DemoEngine",
    "DemoReport",
    "StepPlan",
    "choose_num_gpu_blocks",
    "run_command",
    "run_demo",
]

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

#: events every demo run must show (report fields that must be > 0)
EVENTS = (
    "prefix_hits",
    "prefix_cached_tokens",
    "forks",
    "cow_copies",
    "swap_outs",
    "swap_ins",
    "recompute_preemptions",
)

#: fractions of the unconstrained peak GPU usage tried as pool sizes, in order
_POOL_FRACTIONS = (0.7, 0.6, 0.8, 0.5, 0.9, 0.4, 0.3)


@dataclass(frozen=True)
class DemoConfig:
    """Workload and engine sizes of the demo (the defaults exercise every event)."""

    num_requests: int = DEFAULT_REQUESTS
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
    #: GPU pool; ``None``: chosen by :func:`choose_num_gpu_blocks`
    num_gpu_blocks: Optional[int] = None
    #: CPU swap pool; ``None``: room for every request
    num_cpu_blocks: Optional[int] = None
    max_num_seqs: int = 16
    #: ``"batch"`` (BatchEngine.step) or ``"compat"`` (schedule() + metadata)
    path: str = "batch"
    #: ``None`` (vLLM's choice: swap groups with several sequences, recompute the others),
    #: ``"swap"`` or ``"recompute"``
    preemption_mode: Optional[str] = None
    max_steps: int = 10_000
    model: TinyConfig = field(default_factory=TinyConfig)


@dataclass
class DemoReport:
    """Counts of one demo run, the logits check and ``ok``."""

    device: str
    dtype: str
    path: str
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
            f"pagedkv demo: {self.device} {self.dtype}, pagedkv.Scheduler via the {self.path} "
            f"path, block_size {self.block_size}, {self.num_gpu_blocks} GPU / "
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


# --------------------------------------------------------------------------- #
# the engine
# --------------------------------------------------------------------------- #

Hook = Callable[["DemoEngine", StepPlan], None]


class DemoEngine:
    """The engine around :class:`pagedkv.Scheduler`: KV caches, model, sampler, the check.

    Built and driven by :func:`run_demo`; exposed for hooks and tests (``scheduler``,
    ``manager``, ``gpu_caches``, ``cpu_caches``, ``model``, ``plans``: a copy of every
    step's :class:`StepPlan`). ``model=None`` makes a *dry run*: the same scheduler and
    path, no caches and pseudo-random logits instead of the model (it sizes the GPU pool,
    see :func:`choose_num_gpu_blocks`). ``num_gpu_blocks`` overrides the config.
    """

    def __init__(
        self,
        config: DemoConfig,
        model: Optional[TinyDecoder],
        *,
        hook: Optional[Hook] = None,
        num_gpu_blocks: Optional[int] = None,
    ) -> None:
        if config.path not in PATHS:
            raise InvalidArgumentError(f"unknown path {config.path!r}; expected one of {PATHS}")
        self.config = cfg = config
        self.model = model
        self.dry_run = model is None
        self.device = torch.device("cpu") if model is None else model.device
        self.hook = hook
        self.requests = _make_requests(cfg)
        peak = _peak_blocks(self.requests, cfg.block_size)
        # default: room for everything (no preemption); run_demo passes a smaller pool
        self.num_gpu_blocks = num_gpu_blocks or cfg.num_gpu_blocks or sum(peak) + 2
        self.num_cpu_blocks = cfg.num_cpu_blocks or sum(peak) + 2
        self.scheduler = _make_scheduler(
            cfg, self.requests, self.num_gpu_blocks, self.num_cpu_blocks
        )
        self.manager = self.scheduler.block_manager
        self.gpu_caches, self.cpu_caches = self._allocate_caches()
        new_seq_id = itertools.count(len(self.requests)).__next__
        self.path = STEP_PATHS[cfg.path](self.scheduler, new_seq_id)
        self._pending = list(self.requests)  # not arrived yet, by arrival step
        self._fake_gen = torch.Generator().manual_seed(cfg.seed)
        self._status: Dict[str, SequenceStatus] = {}
        self.clock = 0
        self.max_used_gpu_blocks = 0
        self.plans: List[StepPlan] = []
        self.preemptions: List[Tuple[int, str, str, int]] = []
        #: seq_id -> list of (positions [k] long, logits [k, vocab] float32), on the CPU
        self.records: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self.report = DemoReport(
            device=str(self.device),
            dtype="none" if model is None else str(model.dtype).replace("torch.", ""),
            path=cfg.path,
            requests=len(self.requests),
            block_size=cfg.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            prompt_tokens=sum(len(r.group.prompt_token_ids) for r in self.requests),
        )

    def _allocate_caches(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        if self.model is None:
            return [], []
        mc, bs = self.model.config, self.config.block_size
        gpu = self.model.allocate_kv_caches(self.num_gpu_blocks, bs)
        cpu = [
            allocate_kv_cache(
                self.num_cpu_blocks,
                bs,
                mc.num_kv_heads,
                mc.head_dim,
                dtype=self.model.dtype,
                device="cpu",
                pin_memory=self.device.type == "cuda",
            )
            for _ in range(mc.num_layers)
        ]
        return gpu, cpu

    # ------------------------------------------------------------------ #
    # driver
    # ------------------------------------------------------------------ #

    def run(self) -> None:
        while self._pending or self.scheduler.has_unfinished_seqs():
            if self.clock >= self.config.max_steps:
                raise RuntimeError(f"demo did not finish within {self.config.max_steps} steps")
            self.step()

    def step(self) -> None:
        """One engine iteration: arrivals, schedule (and, on the batch path, apply the
        previous samples), execute, sample (and, on the compat path, process outputs)."""
        while self._pending and self._pending[0].arrival_step <= self.clock:
            self.scheduler.add_seq_group(self._pending.pop(0).group)
        plan = self.path.plan(self.clock, float(self.clock))
        used = self.num_gpu_blocks - self.manager.get_num_free_gpu_blocks()
        self.max_used_gpu_blocks = max(self.max_used_gpu_blocks, used)
        self._count_preemptions()
        if not plan.is_empty():
            self._count(plan)
            self.plans.append(plan.copy())
            if self.hook is not None:
                self.hook(self, plan)
            self.path.finish(plan, self._execute(plan))
        self.clock += 1

    def _count(self, plan: StepPlan) -> None:
        rep, p = self.report, plan.num_prompt_rows
        rep.steps += 1
        if plan.num_rows:
            rep.prefill_steps += p > 0
            rep.decode_steps += p == 0
        rep.prefill_tokens_computed += int(plan.query_start_loc[p] - plan.query_start_loc[0])
        rep.prefix_cached_tokens += int(plan.cached_tokens[:p].sum())
        rep.cow_copies += len(plan.copies)
        rep.blocks_swapped_out += len(plan.swap_out)
        rep.blocks_swapped_in += len(plan.swap_in)

    def _count_preemptions(self) -> None:
        """Group status changes the scheduler made this step (both paths write them onto
        the ``Sequence`` objects): RUNNING -> SWAPPED is a swap-out, SWAPPED -> RUNNING a
        swap-in, RUNNING -> WAITING a recompute preemption. Each is logged in
        ``self.preemptions`` as ``(step, event, request id, unfinished sequences)``."""
        events = {
            (SequenceStatus.RUNNING, SequenceStatus.SWAPPED): "swap_outs",
            (SequenceStatus.SWAPPED, SequenceStatus.RUNNING): "swap_ins",
            (SequenceStatus.RUNNING, SequenceStatus.WAITING): "recompute_preemptions",
        }
        for req in self.requests:
            rid, live = req.group.request_id, req.group.get_unfinished_seqs()
            now = live[0].status if live else SequenceStatus.FINISHED_STOPPED
            event = events.get((self._status.get(rid, SequenceStatus.WAITING), now))
            self._status[rid] = now
            if event is not None:
                setattr(self.report, event, getattr(self.report, event) + 1)
                self.preemptions.append((self.clock, event, rid, len(live)))

    # ------------------------------------------------------------------ #
    # execution
    # ------------------------------------------------------------------ #

    def _execute(self, plan: StepPlan) -> np.ndarray:
        """Cache operations in vLLM's order (blocks a swap-out frees may be this step's
        swap-in or copy targets; a swapped-in block may be a copy source), the forward,
        the logits records; returns the sampled tokens in row order."""
        if not self.dry_run:
            if len(plan.swap_out):
                swap_blocks(self.gpu_caches, self.cpu_caches, plan.swap_out)
            if len(plan.swap_in):
                swap_blocks(self.cpu_caches, self.gpu_caches, plan.swap_in)
            if len(plan.copies):
                copy_blocks(self.gpu_caches, plan.copies)
        if plan.num_rows == 0:
            return np.zeros(0, np.int32)
        logits = self._forward(plan).float().cpu()
        q = plan.query_start_loc.tolist()
        positions = torch.from_numpy(plan.positions.astype(np.int64))
        for i, sid in enumerate(plan.seq_ids.tolist()):
            rec = (positions[q[i] : q[i + 1]], logits[q[i] : q[i + 1]])
            self.records.setdefault(sid, []).append(rec)
        return _sample(plan, logits)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        n = len(plan.input_tokens)
        if self.model is None:
            return torch.rand(n, self.config.model.vocab_size, generator=self._fake_gen)

        def dev(a: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)

        return self.model.paged_forward(
            dev(plan.input_tokens, torch.long),
            dev(plan.positions, torch.long),
            dev(plan.slot_mapping, torch.long),
            self.gpu_caches,
            dev(plan.block_tables),
            dev(plan.context_lens),
            dev(plan.query_start_loc),
        )

    # ------------------------------------------------------------------ #
    # the check
    # ------------------------------------------------------------------ #

    def all_seqs(self) -> Dict[int, Sequence]:
        return {s.seq_id: s for r in self.requests for s in r.group.get_seqs()}

    def count_events(self) -> None:
        """Fill the report's counts that are read at the end of a run."""
        rep, seqs = self.report, self.all_seqs()
        rep.sequences = len(seqs)
        rep.forks = len(seqs) - len(self.requests)
        rep.generated_tokens = sum(s.get_output_len() for s in seqs.values())
        rep.prefix_lookups, rep.prefix_hits = self.manager.prefix_cache_stats()

    def check(self, atol: float, rtol: float) -> None:
        """Compare every recorded logits row with ``dense_forward``; fill the report."""
        rep = self.report
        rep.atol, rep.rtol = atol, rtol
        self.count_events()
        examples: List[str] = []
        for seq_id, seq in sorted(self.all_seqs().items()):
            if seq_id in self.records:
                examples += self._check_seq(seq, self.records[seq_id], atol, rtol)
        if rep.mismatches:
            rep.failures.append(
                f"{rep.mismatches} of {rep.checked_rows} logits rows differ from dense_forward "
                f"(e.g. {'; '.join(examples[:3])})"
            )
        rep.failures += self._state_failures()
        for name in EVENTS:
            if getattr(rep, name) <= 0:
                rep.failures.append(f"event did not happen: {name} == 0")
        rep.ok = not rep.failures

    def _check_seq(self, seq: Sequence, recs: list, atol: float, rtol: float) -> List[str]:
        rep = self.report
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
        return [
            f"seq {seq.seq_id} position {int(positions[i])}: |diff| {float(diff[i].max()):.3g}"
            for i in bad.nonzero().flatten().tolist()[:2]
        ]

    def _state_failures(self) -> List[str]:
        """Every request finished by its length limit, every block free."""
        out = []
        ignored = [g.request_id for g in self.path.ignored]
        if ignored:
            out.append(f"requests ignored by the scheduler: {ignored}")
        for req in self.requests:
            if not req.group.is_finished():
                out.append(f"{req.group.request_id} did not finish")
        mgr = self.manager
        for kind, total, free in (
            ("GPU", self.num_gpu_blocks, mgr.get_num_free_gpu_blocks()),
            ("CPU", self.num_cpu_blocks, mgr.get_num_free_cpu_blocks()),
        ):
            if free != total:
                out.append(f"{total - free} {kind} blocks still in use")
        return out


def _sample(plan: StepPlan, logits: torch.Tensor) -> np.ndarray:
    """Greedy: a row with ``k`` samples takes its top ``k`` tokens, the runners-up first
    (they go to new children) and the best last (the row's own sequence)."""
    out: List[int] = []
    last = plan.query_start_loc[1:] - 1
    for row, k in zip(last.tolist(), plan.num_samples.tolist()):
        if k:
            out += reversed(torch.topk(logits[row], k).indices.tolist())
    return np.array(out, np.int32)


def _make_scheduler(
    cfg: DemoConfig, requests: List[_Request], num_gpu_blocks: int, num_cpu_blocks: int
) -> Scheduler:
    max_len = max(len(r.group.prompt_token_ids) + r.max_tokens for r in requests)
    sched_cfg = SchedulerConfig(
        None, cfg.max_num_seqs, max_len, preemption_mode=cfg.preemption_mode
    )
    cache_cfg = CacheConfig(
        cfg.block_size,
        enable_prefix_caching=True,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
    )
    return Scheduler(sched_cfg, cache_cfg)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _peak_blocks(requests: List[_Request], block_size: int) -> List[int]:
    """Upper bound of the GPU blocks each request holds at its longest."""
    return [
        r.n * _ceil_div(len(r.group.prompt_token_ids) + r.max_tokens, block_size) for r in requests
    ]


def choose_num_gpu_blocks(config: DemoConfig) -> int:
    """A GPU pool size under which the workload of ``config`` shows every event.

    The decisions depend only on lengths and arrival times, not on token values (no stop
    tokens; prompts are distinct, so no two sequences' blocks share a hash unless they
    share a prefix by construction), so model-free dry runs of the same engine predict
    them. A first dry run with room for everything measures the peak usage; pools of
    several fractions of it (:data:`_POOL_FRACTIONS`, never below what the largest request
    needs alone) are then tried and the first that shows every event of :data:`EVENTS` is
    returned (if none does, the first candidate: the run then reports the missing events).
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
        engine.count_events()
        if all(getattr(engine.report, name) > 0 for name in EVENTS):
            return size
    return candidates[0]


def _make_requests(cfg: DemoConfig) -> List[_Request]:
    """Deterministic requests from ``cfg.seed`` (see :class:`DemoConfig`); prompts are
    distinct."""
    if cfg.num_requests < 1:
        raise InvalidArgumentError("num_requests must be >= 1")
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab, bs = cfg.model.vocab_size, cfg.block_size

    def randint(lo: int, hi: int, size: int = 1) -> List[int]:
        return torch.randint(lo, hi + 1, (size,), generator=gen).tolist()

    prefix = randint(0, vocab - 1, cfg.shared_prefix_len)
    requests: List[_Request] = []
    prompts: set = set()
    for i in range(cfg.num_requests):
        n = 2 if i % cfg.fork_every == 1 else 1
        shared = i % cfg.fork_every != 2
        suffix_len = randint(*cfg.suffix_len)[0]
        head = prefix if shared else randint(0, vocab - 1, cfg.shared_prefix_len)
        if n > 1 and (len(head) + suffix_len) % bs == 0:
            suffix_len += 1  # a forked prompt ends in a partial block: its first decode is CoW
        prompt = head + randint(0, vocab - 1, suffix_len)
        while tuple(prompt) in prompts:
            prompt = head + randint(0, vocab - 1, suffix_len)
        prompts.add(tuple(prompt))
        max_tokens = randint(*cfg.max_tokens)[0]
        seq = Sequence(i, f"request-{i}", prompt, bs)
        params = SamplingParams(n=n, max_tokens=max_tokens)
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

    ``hook(engine, plan)`` is called every step after scheduling and before the cache
    operations (tests use it to inject faults). ``atol``/``rtol`` default to
    :data:`TOLERANCES` for ``dtype``. Never raises on a failed check: see ``report.ok``
    and ``report.failures``.
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


def run_command(args: argparse.Namespace) -> int:
    """``pagedkv demo`` with parsed arguments (:func:`pagedkv.demo.run` checked the request
    count); 0 if every check passed."""
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        print(f"pagedkv demo: bad --device: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("pagedkv demo: CUDA is not available", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        num_requests=args.requests,
        seed=args.seed,
        path=args.path,
        model=TinyConfig(seed=args.seed),
    )
    report = run_demo(cfg, device=args.device, dtype=_DTYPES[args.dtype], verbose=not args.quiet)
    if not report.ok:
        msg = "; ".join(report.failures)
        print(f"pagedkv demo FAILED: {msg}", file=sys.stderr)
        return 1
    return 0
