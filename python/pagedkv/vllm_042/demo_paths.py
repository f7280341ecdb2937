"""How the demo engine (:mod:`pagedkv.demo`) drives :class:`pagedkv.Scheduler`: two paths
that yield the same :class:`StepPlan` per step (torch-free).

* :class:`BatchPath`: :meth:`pagedkv.vllm_042.engine_step.BatchEngine.step`, one native call per
  step that applies the previous step's samples and writes the next batch's model inputs;
* :class:`CompatPath`: :meth:`pagedkv.Scheduler.schedule` and its vLLM-shaped metadata,
  turned into model inputs by vLLM 0.4.2's model-runner rules (``_prepare_prompt``:
  a prompt starts after its ``computed_block_nums``; ``_prepare_decode``: one token per
  sequence), then vLLM 0.4.2's output processing (forks, stop checks, frees) in Python.

The compat path builds its inputs from the metadata independently of the batch step's native
writer, so ``tests/test_demo.py`` comparing the two plans step by step checks one against
the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np

from pagedkv.bench.vllm_042 import driver
from pagedkv.vllm_042.engine_step import BatchEngine
from pagedkv.vllm_042.scheduler import Scheduler, SchedulerConfig
from pagedkv.vllm_042.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedkv.vllm_042.types import Logprob, SamplingParams

__all__ = ["PATHS", "BatchPath", "CompatPath", "StepPlan"]


@dataclass
class StepPlan:
    """One step's work, from either path: cache operations and model inputs (numpy).

    Pairs are ``[n, 2]`` ``(src, dst)``. Rows (one per running sequence of a scheduled group,
    prompt rows first): ``seq_ids``, ``num_samples``, ``cached_tokens``, ``context_lens``,
    ``block_tables`` and ``query_start_loc`` (row ``i``'s tokens are ``[q[i], q[i+1])`` of
    ``input_tokens``, ``positions``, ``slot_mapping``). A ``hook`` passed to
    :func:`run_demo` sees (and may alter) the plan before it is executed.
    """

    step: int
    swap_out: np.ndarray
    swap_in: np.ndarray
    copies: np.ndarray
    num_prompt_rows: int
    seq_ids: np.ndarray
    num_samples: np.ndarray
    cached_tokens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    input_tokens: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def is_empty(self) -> bool:
        return self.num_rows == 0 and not (len(self.swap_out) or len(self.swap_in))

    def copy(self) -> StepPlan:
        """A copy that owns its arrays (the batch path's are views of reused buffers)."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).copy()
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)
            },
        )


class BatchPath:
    """:class:`BatchEngine`: one native call per step; samples go in with the next call."""

    def __init__(self, scheduler: Scheduler, new_seq_id: Callable[[], int]) -> None:
        self.engine = BatchEngine(scheduler, seq_counter=new_seq_id)
        self.block_size = scheduler.cache_config.block_size
        self._sampled: Optional[np.ndarray] = None
        self.ignored: List[SequenceGroup] = []

    def plan(self, step: int, now: float) -> StepPlan:
        res = self.engine.step(self._sampled, now=now)
        self._sampled = None
        self.ignored += res.ignored
        b, n, t = res.buffers, res.num_rows, res.num_tokens
        cols = -(-int(b.context_lens[:n].max(initial=0)) // self.block_size)
        return StepPlan(
            step,
            res.pairs("swap_out"),
            res.pairs("swap_in"),
            res.pairs("copies"),
            res.num_prefill_groups,  # a prompt group has one row
            b.seq_ids[:n],
            b.num_samples[:n],
            b.cached_tokens[:n],
            b.context_lens[:n],
            b.block_tables[:n, :cols],  # the widest table of the batch
            b.query_start_loc[: n + 1],
            b.input_tokens[:t],
            b.positions[:t],
            b.slot_mapping[:t],
        )

    def finish(self, plan: StepPlan, sampled: np.ndarray) -> None:
        self._sampled = sampled


class CompatPath:
    """``schedule()`` + metadata -> model inputs (vLLM 0.4.2's model runner), then vLLM
    0.4.2's output processing (single-step processor, no beam search) in Python."""

    def __init__(self, scheduler: Scheduler, new_seq_id: Callable[[], int]) -> None:
        self.scheduler = scheduler
        self.new_seq_id = new_seq_id
        self.ignored: List[SequenceGroup] = []
        self._last: Any = None
        self._out: Any = None

    def plan(self, step: int, now: float) -> StepPlan:
        metas, out = self.scheduler.schedule()
        by_id = {m.request_id: m for m in metas}
        pairs = [(sg, by_id[sg.seq_group.request_id]) for sg in out.scheduled_seq_groups]
        self._last, self._out = pairs, out
        self.ignored += out.ignored_seq_groups
        bs = self.scheduler.cache_config.block_size
        rows = [row for sg, meta in pairs for row in _rows_from_metadata(sg, meta, bs)]
        return _plan_from_rows(step, out, rows, sum(m.is_prompt for _, m in pairs))

    def finish(self, plan: StepPlan, sampled: np.ndarray) -> None:
        """vLLM's ``_process_model_outputs``: computed tokens, samples, free finished."""
        per_seq: Dict[int, List[int]] = {}
        at = 0
        for sid, k in zip(plan.seq_ids.tolist(), plan.num_samples.tolist()):
            per_seq[sid] = sampled[at : at + k].tolist()
            at += k
        do_sample = {sg.seq_group.request_id: meta.do_sample for sg, meta in self._last}
        driver.process_outputs(
            self.scheduler,
            self._out,
            lambda sg: do_sample[sg.seq_group.request_id],
            lambda group: self._process_samples(group, per_seq),
        )

    def _process_samples(self, group: SequenceGroup, per_seq: Dict[int, List[int]]) -> None:
        """vLLM 0.4.2's ``_process_sequence_group_outputs`` (no beam search;
        :func:`pagedkv.bench.vllm_042.driver.process_group_samples`) with the model's samples:
        a parent's runners-up go to children forked from it, its best to itself."""
        params, sched_cfg = group.sampling_params, self.scheduler.scheduler_config
        driver.process_group_samples(
            self.scheduler,
            group,
            lambda parent: per_seq[parent.seq_id],
            self.new_seq_id,
            lambda seq: _stop_check(seq, params, sched_cfg),
            SequenceStatus.RUNNING,
            Logprob,
        )


def _stop_check(seq: Sequence, params: SamplingParams, sched_cfg: SchedulerConfig) -> None:
    """vLLM 0.4.2's ``StopChecker`` without stop strings, in its order."""
    if seq.get_output_len() < params.min_tokens:
        return
    last = seq.get_last_token_id()
    if (not params.ignore_eos and last == seq.eos_token_id) or last in params.stop_token_ids:
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif seq.get_len() > sched_cfg.max_model_len or seq.get_output_len() == params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED


class _Row(NamedTuple):
    """One row of model inputs, as the compat path builds it from the metadata."""

    seq_id: int
    samples: int
    cached: int
    context_len: int
    table: List[int]
    tokens: List[int]
    positions: List[int]
    slots: List[int]


def _rows_from_metadata(sg: Any, meta: Any, bs: int) -> List[_Row]:
    """One group's rows by vLLM 0.4.2's model runner (``_prepare_prompt`` /
    ``_prepare_decode``): a prompt starts after its computed blocks (the demo does not
    chunk prompts; vLLM refuses prefix caching with chunked prefill); a decode feeds its
    last token."""
    group, rows = sg.seq_group, []
    samples = 0
    if meta.do_sample:  # the batch step's rule: the first sample of a lone sequence forks
        samples = group.sampling_params.best_of if len(group.get_seqs()) == 1 else 1
    for sid, data in meta.seq_data.items():
        table = list(meta.block_tables[sid])
        if meta.is_prompt:
            computed = data.get_num_computed_tokens()
            end = min(data.get_len(), computed + sg.token_chunk_size)
            start = len(meta.computed_block_nums or []) * bs or computed
            tokens = data.get_token_ids()[start:end]
        else:
            end = data.get_len()
            start = computed = end - 1
            tokens = [data.get_last_token_id()]
        positions = list(range(start, end))
        slots = [table[p // bs] * bs + p % bs for p in positions]
        rows.append(_Row(sid, samples, start - computed, end, table, tokens, positions, slots))
    return rows


def _plan_from_rows(step: int, out: Any, rows: List[_Row], num_prompt_rows: int) -> StepPlan:
    """The compat path's :class:`StepPlan`: the rows packed, the decisions' dicts as pairs."""

    def pairs(d: Dict[int, Any]) -> np.ndarray:
        flat = [(a, b) for a, v in d.items() for b in ([v] if isinstance(v, int) else v)]
        return np.array(flat, np.int32).reshape(-1, 2)

    def flat(name: str, dtype: Any = np.int32) -> np.ndarray:
        return np.array([x for r in rows for x in getattr(r, name)], dtype)

    def col(name: str, dtype: Any = np.int32) -> np.ndarray:
        return np.array([getattr(r, name) for r in rows], dtype)

    tables = np.zeros((len(rows), max([len(r.table) for r in rows], default=0)), np.int32)
    for i, r in enumerate(rows):
        tables[i, : len(r.table)] = r.table
    return StepPlan(
        step,
        pairs(out.blocks_to_swap_out),
        pairs(out.blocks_to_swap_in),
        pairs(out.blocks_to_copy),
        num_prompt_rows,
        col("seq_id", np.int64),
        col("samples"),
        col("cached"),
        col("context_len"),
        tables,
        np.cumsum([0] + [len(r.tokens) for r in rows], dtype=np.int32),
        flat("tokens"),
        flat("positions"),
        flat("slots"),
    )


#: ``DemoConfig.path`` -> the driver class
PATHS = {"batch": BatchPath, "compat": CompatPath}
