"""A model-free engine loop around a vLLM-0.4.2-style scheduler, for differential tests.

One ``World`` is one scheduler with its own Sequence family: ``"ours"`` is
``pagedkv.Scheduler`` over pagedkv's classes; ``"vllm"`` is vLLM 0.4.2's real ``Scheduler``
with vLLM's own classes (``pagedkv.vllm_release``); ``"dropin"`` is vLLM's scheduler with
pagedkv's classes dropped in. Each step does what ``LLMEngine.step()`` and its single-step
output processor do (update computed tokens, sample only where ``do_sample``, fork for
``best_of > 1``, stop checks, free finished sequences, ``free_finished_seq_groups``), with
tokens and stops that depend only on (request, sequence, position), so every world sees the
same inputs as long as the schedulers agree. ``step()`` returns a record of the decisions with
block numbers renumbered by first appearance (vLLM's free order depends on object addresses).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pagedkv.bench.vllm_042 import driver


class FakeClock:
    """A clock that moves only when told (both worlds read the same time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@dataclass
class Workload:
    seed: int
    block_size: int = 4
    gpu_blocks: int = 48
    cpu_blocks: int = 32
    max_num_seqs: int = 8
    max_model_len: int = 64
    max_num_batched_tokens: int = 64
    chunked: bool = False
    caching: bool = False
    lookahead: int = 0
    delay_factor: float = 0.0
    max_loras: Optional[int] = None
    preemption_mode: Optional[str] = None
    #: Every request with best_of > 1 uses beam search (vLLM's single-step beam processing).
    beam: bool = False
    #: CacheConfig.sliding_window in tokens (vLLM's v1 manager: without prefix caching).
    sliding_window: Optional[int] = None
    steps: int = 120
    #: Per step, the chance of aborting one group drawn from a non-empty queue (waiting,
    #: running or swapped; ``queue_aborts``), on top of the requests' own ``abort_at``.
    queue_abort_rate: float = 0.0
    eos: int = 3
    vocab: int = 40
    requests: List[dict] = field(default_factory=list)

    @classmethod
    def random(cls, seed: int, **force: Any) -> Workload:
        r = random.Random(seed)
        chunked = force.get("chunked", r.random() < 0.4)
        w = cls(
            seed=seed,
            block_size=r.choice([4, 8]),
            gpu_blocks=r.randint(12, 60),
            cpu_blocks=r.choice([4, 16, 64]),
            max_num_seqs=r.randint(2, 10),
            max_model_len=r.choice([48, 64, 96]),
            chunked=chunked,
            caching=force.get("caching", r.random() < 0.4),
            lookahead=0,  # vLLM 0.4.2's v1 manager refuses lookahead slots
            delay_factor=r.choice([0.0, 0.0, 0.5]),
            max_loras=force.get("max_loras", r.choice([None, None, 1, 2])),
        )
        w.max_num_batched_tokens = (
            r.randint(max(w.max_num_seqs, 8), 48)
            if chunked
            else r.randint(w.max_model_len, w.max_model_len * 2)
        )
        for k, v in force.items():
            setattr(w, k, v)
        w.requests = w._make_requests(r)
        return w

    @classmethod
    def starved(cls, seed: int, **force: Any) -> Workload:
        """The starved-pool corner (issue 18): a GPU pool of 1-3 max-length sequences, a CPU
        pool 4-8x the GPU pool or (30% of seeds) only 1/2-1x of it, n 1-3 with best_of n or
        n+1 (so swap and recompute preemption together), many aborts, block size 8 or 16,
        chunked prefill and prefix caching drawn unless forced."""
        r = random.Random(f"starved/{seed}")
        bs = r.choice([8, 16])
        max_len = bs * r.randint(3, 6)
        gpu = max_len // bs * r.randint(1, 3)
        scale = r.uniform(0.5, 1.0) if r.random() < 0.3 else r.uniform(4.0, 8.0)
        chunked = force.get("chunked", r.random() < 0.5)
        w = cls(
            seed=seed,
            block_size=bs,
            gpu_blocks=gpu,
            cpu_blocks=max(1, round(gpu * scale)),
            max_num_seqs=r.randint(2, 8),
            max_model_len=max_len,
            chunked=chunked,
            caching=force.get("caching", r.random() < 0.5),
            delay_factor=r.choice([0.0, 0.0, 0.5]),
            steps=160,
            queue_abort_rate=0.08,
        )
        w.max_num_batched_tokens = (
            r.randint(max(w.max_num_seqs, 8), max_len)
            if chunked
            else r.randint(max_len, max_len * 2)
        )
        for k, v in force.items():
            setattr(w, k, v)
        w.requests = w._make_requests(r, starved=True)
        return w

    def _make_requests(self, r: random.Random, starved: bool = False) -> List[dict]:
        bs = self.block_size
        prefixes = [[r.randrange(self.vocab) for _ in range(bs * 3)] for _ in range(3)]
        reqs = []
        for i in range(r.randint(6, 16) if starved else r.randint(8, 30)):
            n = r.randint(1, self.max_model_len + 16)
            if self.caching:
                # Whole-block prompts: vLLM 0.4.2 shares a partially filled prompt block
                # through the cache and then writes into it (a bug we do not copy).
                n = max(bs, n // bs * bs)
                pre = r.choice(prefixes)[: r.choice([0, bs, 2 * bs, 3 * bs])]
                prompt = (pre + [r.randrange(self.vocab) for _ in range(n)])[:n]
            else:
                prompt = [r.randrange(self.vocab) for _ in range(n)]
            if starved:
                samples = r.choice([1, 1, 2, 3])
                best_of = samples + int(r.random() < 0.5)
            else:
                samples, best_of = 1, r.choice([1, 1, 1, 2, 3])
            reqs.append(
                dict(
                    rid=f"r{i}",
                    seq_id=i,
                    prompt=prompt,
                    n=samples,
                    best_of=best_of,
                    max_tokens=r.randint(1, 24),
                    lora=r.choice([0, 1, 2, 3]) if self.max_loras else 0,
                    at_step=r.randint(0, self.steps // 2),
                    abort_at=r.randint(0, self.steps) if r.random() < 0.1 else None,
                )
            )
        return reqs


def queue_aborts(w: Workload, step: int, sched: Any) -> List[str]:
    """The request ids to abort before ``step``, aimed at the queues of ``sched`` (the worlds
    agree on them while they agree on decisions): with ``w.queue_abort_rate``, one group of a
    non-empty queue drawn at random."""
    r = random.Random(f"abort/{w.seed}/{step}")
    if r.random() >= w.queue_abort_rate:
        return []
    queues = [q for q in (sched.waiting, sched.running, sched.swapped) if q]
    return [r.choice(list(r.choice(queues))).request_id] if queues else []


def token_for(rid: str, seq_id: int, pos: int, vocab: int) -> int:
    return random.Random(f"{rid}/{seq_id}/{pos}").randrange(vocab)


class VllmFailure(Exception):
    """vLLM's own scheduler hit one of its known failures (docs/scheduler.md)."""


class World:
    def __init__(self, kind: str, w: Workload, clock: FakeClock) -> None:
        self.kind, self.w, self.clock = kind, w, clock
        if kind == "ours":
            import pagedkv
            import pagedkv.vllm_042.scheduler as sched_mod
            from pagedkv.vllm_042 import sequence as seq_mod
            from pagedkv.vllm_042 import types

            self.seq_mod, self.types = seq_mod, types
            cfg_mod = sched_mod
            self.Logprob, self.SamplingParams = types.Logprob, types.SamplingParams
            self.LoRARequest = types.LoRARequest
            self.Sequence, self.SequenceGroup = pagedkv.Sequence, pagedkv.SequenceGroup
        else:
            from pagedkv import vllm_release

            v = vllm_release.load("0.4.2", "vllm" if kind == "vllm" else "pagedkv")
            sched_mod, cfg_mod, seq_mod = v.scheduler, v.config, v.sequence
            self.seq_mod = seq_mod
            self.Logprob = seq_mod.Logprob
            self.SamplingParams = v.sampling_params.SamplingParams
            self.LoRARequest = v.lora_request.LoRARequest
            self.Sequence, self.SequenceGroup = seq_mod.Sequence, seq_mod.SequenceGroup
        self.sched_mod = sched_mod
        self._real_time = sched_mod.time
        sched_mod.time = clock  # the module's `time.time()` reads the fake clock (close())
        self.Status = seq_mod.SequenceStatus
        scfg, ccfg = driver.scheduler_configs(
            cfg_mod,
            w.max_num_batched_tokens,
            w.max_num_seqs,
            w.max_model_len,
            w.block_size,
            w.gpu_blocks,
            w.cpu_blocks,
            chunked_prefill=w.chunked,
            caching=w.caching,
            scheduler_fields={"num_lookahead_slots": w.lookahead, "delay_factor": w.delay_factor},
            cache_fields={"sliding_window": w.sliding_window},
        )
        lcfg = None
        if w.max_loras:
            if kind == "ours":
                lcfg = sched_mod.LoRAConfig(max_lora_rank=8, max_loras=w.max_loras)
            else:
                lcfg = _LoraCfg(w.max_loras)
        if w.preemption_mode and kind == "ours":
            scfg.preemption_mode = w.preemption_mode
        self.sched = sched_mod.Scheduler(scfg, ccfg, lcfg)
        if w.preemption_mode and kind != "ours":
            # vLLM 0.4.2 has no config field for it; its `_preempt` takes the mode.
            forced = sched_mod.PreemptionMode[w.preemption_mode.upper()]
            preempt = self.sched._preempt
            self.sched._preempt = lambda group, swap_out, mode=None: preempt(
                group, swap_out, forced
            )
        self.next_child = 100_000
        self.groups: Dict[str, Any] = {}

    def close(self) -> None:
        """Give the scheduler module its real clock back."""
        self.sched_mod.time = self._real_time

    # -- requests ------------------------------------------------------------------------------

    def add(self, req: dict) -> None:
        lora = None
        if req["lora"]:
            lora = self.LoRARequest(f"l{req['lora']}", req["lora"], "/nowhere")
        seq = self.Sequence(
            req["seq_id"], "", list(req["prompt"]), self.w.block_size, self.w.eos, lora
        )
        beam = self.w.beam and req["best_of"] > 1
        params = self.SamplingParams(
            n=1 if beam else req.get("n", 1),
            best_of=req["best_of"],
            max_tokens=req["max_tokens"],
            temperature=0.0 if beam else 1.0,
            use_beam_search=beam,
        )
        group = self.SequenceGroup(req["rid"], [seq], params, self.clock.now, lora)
        self.groups[req["rid"]] = group
        self.sched.add_seq_group(group)

    # -- one engine step -----------------------------------------------------------------------

    def schedule(self) -> tuple:
        metas, out = self.sched.schedule()
        return metas, out

    def record(self, metas, out) -> dict:
        names: Dict[tuple, int] = {}

        def canon(dev: str, b: int) -> int:
            return names.setdefault((dev, b), len(names))

        mgr = self.sched.block_manager
        meta = []
        for m in metas:
            tables = [
                (sid, [canon("g", b) for b in t]) for sid, t in sorted(m.block_tables.items())
            ]
            computed = [canon("g", b) for b in (m.computed_block_nums or [])]
            meta.append(
                (m.request_id, m.is_prompt, m.do_sample, m.token_chunk_size, tables, computed)
            )
        copies = sorted(
            (canon("g", s), sorted(canon("g", d) for d in ds))
            for s, ds in out.blocks_to_copy.items()
        )
        swap_out = sorted((canon("g", a), canon("c", b)) for a, b in out.blocks_to_swap_out.items())
        swap_in = sorted((canon("c", a), canon("g", b)) for a, b in out.blocks_to_swap_in.items())
        return {
            "scheduled": [
                (g.seq_group.request_id, g.token_chunk_size) for g in out.scheduled_seq_groups
            ],
            "num_prefill_groups": out.num_prefill_groups,
            "num_batched_tokens": out.num_batched_tokens,
            "ignored": [g.request_id for g in out.ignored_seq_groups],
            "lookahead": out.num_lookahead_slots,
            "running_queue_size": out.running_queue_size,
            "meta": meta,
            "copy": copies,
            "swap_in": swap_in,
            "swap_out": swap_out,
            "free": (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()),
            "first_scheduled": {
                rid: g.metrics.first_scheduled_time for rid, g in self.groups.items()
            },
            "queues": [
                [g.request_id for g in q]
                for q in (self.sched.waiting, self.sched.running, self.sched.swapped)
            ],
            "statuses": {
                rid: sorted(
                    (s.seq_id, s.status.name, s.data.get_num_computed_tokens(), s.is_prefill())
                    for s in g.get_seqs()
                )
                for rid, g in self.groups.items()
            },
        }

    def process(self, metas, out) -> None:
        """vLLM 0.4.2's `_process_model_outputs` with the single-step output processor
        (pagedkv.bench.vllm_042.driver), sampling where the metadata says ``do_sample``."""
        by_id = {m.request_id: m for m in metas}
        driver.process_outputs(
            self.sched, out, lambda sg: by_id[sg.seq_group.request_id].do_sample, self._sample
        )

    def _sample(self, group) -> None:
        if group.sampling_params.use_beam_search:
            return self._sample_beam(group)
        params = group.sampling_params
        fork = params.best_of if len(group.get_seqs()) == 1 else 1

        def samples(parent) -> List[int]:
            pos, rid = parent.get_len(), group.request_id
            children = [
                token_for(rid, self.next_child + k, pos, self.w.vocab) for k in range(fork - 1)
            ]
            return children + [token_for(rid, parent.seq_id, pos, self.w.vocab)]

        driver.process_group_samples(
            self.sched,
            group,
            samples,
            self._new_seq_id,
            lambda seq: self._stop(seq, params),
            self.Status.RUNNING,
            self.Logprob,
        )

    def _new_seq_id(self) -> int:
        self.next_child += 1
        return self.next_child - 1

    def _stop(self, seq, params) -> None:
        """After a sequence's new token: finished at its length cap or the EOS token."""
        self._stop_check(seq, seq.get_last_token_id(), params)

    def _stop_check(self, seq, tok: int, params) -> None:
        Status = self.Status
        if seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.w.max_model_len:
            seq.status = Status.FINISHED_LENGTH_CAPPED
        elif tok == self.w.eos:
            seq.status = Status.FINISHED_STOPPED

    def _beam_samples(self, group, parents) -> Dict[int, List[tuple]]:
        """A model-free beam sampler: every parent proposes 2 * beam_width (token, logprob)
        candidates that depend only on (request, parent, position); the best 2 * beam_width by
        cumulative logprob across parents are kept, grouped by parent (vLLM's sampler keeps the
        top 2 * beam_width the same way)."""
        width = group.sampling_params.best_of
        cands = []
        for p_idx, parent in enumerate(parents):
            pos = parent.get_len()
            for j in range(2 * width):
                r = random.Random(f"{group.request_id}/{parent.seq_id}/{pos}/{j}")
                tok, lp = r.randrange(self.w.vocab), -3.0 * r.random()
                score = parent.get_cumulative_logprob() + lp
                cands.append((-score, p_idx, j, tok, lp))
        cands.sort()
        by_parent: Dict[int, List[tuple]] = {p.seq_id: [] for p in parents}
        for _, p_idx, _, tok, lp in cands[: 2 * width]:
            by_parent[parents[p_idx].seq_id].append((tok, lp))
        return by_parent

    def _sample_beam(self, group) -> None:
        """vLLM 0.4.2's single-step output processing with beam search (early_stopping
        False): children forked per sample, the best finished and running candidates kept,
        the others removed from the group and freed."""
        Status, sched = self.Status, self.sched
        params = group.sampling_params
        width = params.best_of
        parents = group.get_seqs(status=Status.RUNNING)
        done_before = group.get_finished_seqs()
        pairs = []  # (sequence, the parent it continues)
        for parent, samples in zip(parents, self._beam_samples(group, parents).values()):
            if not samples:
                parent.status = Status.FINISHED_ABORTED
                group.remove(parent.seq_id)
                sched.free_seq(parent)
                continue
            for tok, lp in samples[:-1]:
                child = parent.fork(self.next_child)
                self.next_child += 1
                child.append_token_id(tok, {tok: self.Logprob(lp)})
                pairs.append((child, parent))
            tok, lp = samples[-1]
            parent.append_token_id(tok, {tok: self.Logprob(lp)})
            pairs.append((parent, parent))
        for seq, _ in pairs:
            self._stop_check(seq, seq.get_last_token_id(), params)

        def score(seq) -> float:
            return seq.get_beam_search_score(
                length_penalty=params.length_penalty, eos_token_id=seq.eos_token_id
            )

        finished = [(s, None, False) for s in done_before]
        finished += [(s, p, True) for s, p in pairs if s.is_finished()]
        finished.sort(key=lambda x: score(x[0]), reverse=True)
        keep = [(s, p) for s, p, new in finished[:width] if new]
        drop = [(s, p) for s, p, new in finished[width:] if new]
        for s, _, new in finished[width:]:
            if not new:
                group.remove(s.seq_id)
        running = [(s, p) for s, p in pairs if not s.is_finished()]
        running.sort(key=lambda x: score(x[0]), reverse=True)
        stop = not running or (
            len(finished) >= width and score(finished[width - 1][0]) >= score(running[0][0])
        )
        if stop:
            drop += running
        else:
            keep += running[:width]
            drop += running[width:]
        for s, p in keep:
            if s is not p:
                group.add(s)
                if not s.is_finished():
                    sched.fork_seq(p, s)
        for s, p in keep:
            if s is p and s.is_finished():
                sched.free_seq(s)
        for s, p in drop:
            if s is p:
                group.remove(s.seq_id)
                sched.free_seq(s)


class _LoraCfg:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = 8


def vllm_hazard(world: World) -> Optional[str]:
    """Before a step: is vLLM's scheduler in a state where one of its known failures
    (docs/scheduler.md) decides this step?"""
    for g in world.sched.waiting:
        if len(g.get_seqs()) > 1:
            return "recompute of a best_of>1 group with finished sequences (fix 2)"
    if world.w.chunked:
        for g in world.sched.swapped:
            if g.is_prefill():
                return "a group swapped out mid-prefill in chunked mode (fix 3)"
        if _running_group_over_budget(world):
            return "a running group with several sequences over the token budget (fix 1)"
    return None


def _running_group_over_budget(world: World) -> bool:
    """Chunked mode: does the running pass reach a group with several running sequences whose
    tokens exceed what is left of the budget? vLLM takes it anyway (and may preempt for it);
    we stop taking running groups there (fix 1). The pass is replayed in arrival order: the
    groups before it are each scheduled (victims are taken from the back), so this is exact
    unless the group is itself taken as a victim first (then it stops a run needlessly)."""
    left = world.w.max_num_batched_tokens
    for g in sorted(world.sched.running, key=lambda g: g.metrics.arrival_time):
        seqs = g.get_seqs(status=world.Status.RUNNING)
        n = sum(s.get_num_new_tokens() for s in seqs)
        if len(seqs) > 1 and n > left:
            return True
        left -= min(n, left)
    return False


def vllm_output_failure(world: World, before_swapped: List[str], out) -> Optional[str]:
    w = world.w
    if any(g.token_chunk_size <= 0 for g in out.scheduled_seq_groups):
        return "a non-positive chunk (fix 1)"
    if out.num_batched_tokens > w.max_num_batched_tokens:
        return "over the token budget (fix 1)"
    sched = world.sched
    if any(
        rid not in {g.request_id for q in (sched.waiting, sched.running, sched.swapped) for g in q}
        for rid in before_swapped
    ):
        return "a swapped group that can never swap in keeps its CPU blocks"
    return None
