"""Out-of-range values against every public entry of the 0.4.2 generation bindings that
crosses into Rust (the block manager, the pool, token stores and hashers, sequences, the
scheduler): each call raises a pagedkv error that also derives from the matching builtin, and
changes nothing (never ``pyo3_runtime.PanicException``, which is a ``BaseException``, and
never a bare ``OverflowError``). Plus the guard that a huge count is refused in constant time.

The README's "Errors, method by method" table is tests/test_error_table.py; this file is the
sweep of out-of-range numbers over every entry.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any, Callable, Dict, List, Tuple

import pytest

from pagedkv import (
    BlockHasher,
    BlockPool,
    BlockSpaceManager,
    SamplingParams,
    Scheduler,
    Sequence,
    SequenceData,
    SequenceGroup,
    SequenceStatus,
    TokenSeq,
    hash_blocks,
)
from pagedkv.engine_step import BatchEngine
from pagedkv.errors import PagedKVError
from pagedkv.scheduler import CacheConfig, SchedulerConfig

BLOCK = 4
NEGATIVE = (-1, -(2**63), -(2**64), -(2**200))
HUGE = (2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**200)
BAD_INTS = NEGATIVE + HUGE
BAD_REALS = (-1.0, math.nan, math.inf, -math.inf)


class State:
    """A manager with a running sequence (two blocks), a waiting one, and a freed one whose
    blocks stay cached; a pool with one held and one cached block; a token store."""

    def __init__(self, caching: bool) -> None:
        self.mgr = BlockSpaceManager(BLOCK, 8, 4, watermark=0.0, enable_caching=caching)
        self.seq = Sequence(0, "p", list(range(6)), block_size=BLOCK)
        self.group = SequenceGroup("r0", [self.seq], SamplingParams(), arrival_time=0.0)
        self.mgr.allocate(self.group)
        self.seq.status = SequenceStatus.RUNNING
        self.waiting = Sequence(1, "p", list(range(5)), block_size=BLOCK)
        self.wgroup = SequenceGroup("r1", [self.waiting], SamplingParams(), arrival_time=0.0)
        done = Sequence(2, "p", list(range(8)), block_size=BLOCK)
        self.mgr.allocate(SequenceGroup("r2", [done], SamplingParams(), arrival_time=0.0))
        self.mgr.free(done)
        self.pool = BlockPool(8, BLOCK)
        self.held = self.pool.allocate()
        self.cached = self.pool.allocate()
        self.pool.register(self.cached, 1234, [1, 2, 3, 4])
        self.pool.free(self.cached)
        self.tokens = TokenSeq(BLOCK, list(range(6)))
        self.sched = Scheduler(
            SchedulerConfig(64, 4, 64),
            CacheConfig(BLOCK, num_gpu_blocks=8, num_cpu_blocks=4),
        )
        self.sched.add_seq_group(
            SequenceGroup(
                "s0",
                [Sequence(9, "p", list(range(6)), block_size=BLOCK)],
                SamplingParams(),
                arrival_time=0.0,
            )
        )

        self.engine = BatchEngine(
            Scheduler(
                SchedulerConfig(64, 4, 64), CacheConfig(BLOCK, num_gpu_blocks=8, num_cpu_blocks=4)
            )
        )
        self.engine_seq = Sequence(20, "p", list(range(6)), block_size=BLOCK)
        self.engine.add_seq_group(
            SequenceGroup("e0", [self.engine_seq], SamplingParams(), arrival_time=0.0)
        )
        self.engine.step(now=0.0)  # the prefill: the next step takes one sampled token

    def observed(self) -> tuple:
        """Everything a refused call must leave as it was."""
        m = self.mgr
        tables = tuple(
            m.get_block_table(s) if m.has_table(s) else None for s in (self.seq, self.waiting)
        )
        m.check_invariants()
        self.pool.check_invariants()
        return (
            m.get_num_free_gpu_blocks(),
            m.get_num_free_cpu_blocks(),
            m.num_cached_blocks(),
            tables,
            self.seq.get_token_ids(),
            self.seq.data.get_num_computed_tokens(),
            self.pool.num_free,
            self.pool.num_cached,
            self.pool.ref_count(self.held),
            self.tokens.tokens(),
            self.tokens.block_hashes(),
            len(self.sched.waiting),
            len(self.sched.running),
            self.engine.num_expected_samples,
            len(self.engine.scheduler.running),
            self.engine_seq.get_token_ids(),
        )


Case = Callable[[State, Any], Any]


def _manager_cases() -> Dict[str, Case]:
    return {
        "BlockSpaceManager(block_size)": lambda s, v: BlockSpaceManager(v, 8, 4),
        "BlockSpaceManager(num_gpu_blocks)": lambda s, v: BlockSpaceManager(BLOCK, v, 4),
        "BlockSpaceManager(num_cpu_blocks)": lambda s, v: BlockSpaceManager(BLOCK, 8, v),
        "BlockSpaceManager(sliding_window)": lambda s, v: BlockSpaceManager(
            BLOCK, 8, 4, sliding_window=v
        ),
        "BlockSpaceManager(hash_seed)": lambda s, v: BlockSpaceManager(
            BLOCK, 8, 4, enable_caching=True, hash_seed=v
        ),
        "can_append_slots": lambda s, v: s.mgr.can_append_slots(s.group, v),
        "append_slots": lambda s, v: s.mgr.append_slots(s.seq, num_lookahead_slots=v),
        "can_swap_in": lambda s, v: s.mgr.can_swap_in(s.group, v),
        "swap_in": lambda s, v: s.mgr.swap_in(s.group, v),
        "ref_count(gpu)": lambda s, v: s.mgr.ref_count("gpu", v),
        "ref_count(cpu)": lambda s, v: s.mgr.ref_count("cpu", v),
        "block_info": lambda s, v: s.mgr.block_info("gpu", v),
        "access_all_blocks_in_seq(time)": lambda s, v: s.mgr.access_all_blocks_in_seq(s.seq, v),
        "num_cached_blocks(device)": lambda s, v: s.mgr.num_cached_blocks(v),
        "fill_block_tables(pad)": lambda s, v: _fill(s, v),
    }


def _fill(s: State, v: Any) -> Any:
    import numpy as np

    out = np.zeros((1, 4), dtype=np.int32)
    return s.mgr.fill_block_tables([s.seq], out, pad_value=v)


def _pool_cases() -> Dict[str, Case]:
    return {
        "BlockPool(num_blocks)": lambda s, v: BlockPool(v, BLOCK),
        "BlockPool(block_size)": lambda s, v: BlockPool(8, v),
        "pool.allocate_many": lambda s, v: s.pool.allocate_many(v),
        "pool.free": lambda s, v: s.pool.free(v),
        "pool.free_many": lambda s, v: s.pool.free_many([s.held, v]),
        "pool.incref(block)": lambda s, v: s.pool.incref(v),
        "pool.incref(n)": lambda s, v: s.pool.incref(s.held, v),
        "pool.ref_count": lambda s, v: s.pool.ref_count(v),
        "pool.block_hash": lambda s, v: s.pool.block_hash(v),
        "pool.is_evictable": lambda s, v: s.pool.is_evictable(v),
        "pool.last_accessed": lambda s, v: s.pool.last_accessed(v),
        "pool.touch(block)": lambda s, v: s.pool.touch(v, 1.0),
        "pool.touch(time)": lambda s, v: s.pool.touch(s.held, v),
        "pool.register(block)": lambda s, v: s.pool.register(v, 99, [1, 2, 3, 4]),
        "pool.register(hash)": lambda s, v: s.pool.register(s.held, v, [1, 2, 3, 4]),
        "pool.register(token)": lambda s, v: s.pool.register(s.held, 99, [1, 2, 3, v]),
        "pool.register(num_hashed_tokens)": lambda s, v: s.pool.register(
            s.held, 99, [1, 2, 3, 4], v
        ),
        "pool.register(parent)": lambda s, v: s.pool.register(
            s.held, 99, [1, 2, 3, 4], parent_block=v
        ),
        "pool.lookup(hash)": lambda s, v: s.pool.lookup(v, [1, 2, 3, 4]),
        "pool.lookup(token)": lambda s, v: s.pool.lookup(1234, [1, 2, 3, v]),
        "pool.lookup(parent)": lambda s, v: s.pool.lookup(1234, [1, 2, 3, 4], parent_block=v),
    }


def _token_cases() -> Dict[str, Case]:
    return {
        "TokenSeq(block_size)": lambda s, v: TokenSeq(v, [1, 2]),
        "TokenSeq(token)": lambda s, v: TokenSeq(BLOCK, [1, v]),
        "TokenSeq(lora_id)": lambda s, v: TokenSeq(BLOCK, [1], lora_id=v),
        "TokenSeq(hash_seed)": lambda s, v: TokenSeq(BLOCK, [1], hash_seed=v),
        "tokens.append": lambda s, v: s.tokens.append(v),
        "tokens.extend": lambda s, v: s.tokens.extend([1, v]),
        "tokens.block_tokens": lambda s, v: s.tokens.block_tokens(v),
        "tokens.hash_of_block": lambda s, v: s.tokens.hash_of_block(v),
        "tokens.token_slice(start)": lambda s, v: s.tokens.token_slice(v),
        "tokens.token_slice(end)": lambda s, v: s.tokens.token_slice(0, v),
        "BlockHasher(block_size)": lambda s, v: BlockHasher(v),
        "BlockHasher(lora_id)": lambda s, v: BlockHasher(BLOCK, lora_id=v),
        "BlockHasher.feed": lambda s, v: BlockHasher(BLOCK).feed([1, v]),
        "hash_blocks(token)": lambda s, v: hash_blocks([1, 2, 3, v], BLOCK),
        "hash_blocks(block_size)": lambda s, v: hash_blocks([1, 2, 3, 4], v),
        "hash_blocks(lora_id)": lambda s, v: hash_blocks([1, 2, 3, 4], BLOCK, lora_id=v),
    }


def _sequence_cases() -> Dict[str, Case]:
    return {
        "Sequence(seq_id)": lambda s, v: Sequence(v, "p", [1, 2], BLOCK),
        "Sequence(token)": lambda s, v: Sequence(3, "p", [1, v], BLOCK),
        "Sequence(block_size)": lambda s, v: Sequence(3, "p", [1, 2], v),
        "seq.hash_of_block": lambda s, v: s.seq.hash_of_block(v),
        "seq.num_hashed_tokens_of_block": lambda s, v: s.seq.num_hashed_tokens_of_block(v),
        "seq.block_token_ids": lambda s, v: s.seq.block_token_ids(v),
        "seq.append_token_id": lambda s, v: s.seq.append_token_id(v, {}),
        "SequenceData(token)": lambda s, v: SequenceData([1, v]),
        "SequenceData(block_size)": lambda s, v: SequenceData([1, 2], block_size=v),
        "data.update_num_computed_tokens": lambda s, v: s.seq.data.update_num_computed_tokens(v),
        "data.token_ids_from": lambda s, v: s.seq.data.token_ids_from(v),
    }


def _scheduler_cases() -> Dict[str, Case]:
    def sched(**kw: Any) -> Any:
        args = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
        cache = dict(block_size=BLOCK, num_gpu_blocks=8, num_cpu_blocks=4)
        for k, v in kw.items():
            (cache if k in cache else args)[k] = v
        return Scheduler(SchedulerConfig(**args), CacheConfig(**cache))

    cases = {
        f"Scheduler({k})": (lambda s, v, k=k: sched(**{k: v}))
        for k in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "num_lookahead_slots",
            "block_size",
            "num_gpu_blocks",
            "num_cpu_blocks",
        )
    }
    cases["Scheduler(delay_factor)"] = lambda s, v: sched(delay_factor=v)
    cases["BatchEngine.step(token)"] = lambda s, v: s.engine.step([v], now=1.0)
    cases["BatchEngine.step(time)"] = lambda s, v: s.engine.step([1], now=v)
    return cases


CASES = {**_manager_cases(), **_pool_cases(), **_token_cases(), **_sequence_cases()}
CASES.update(_scheduler_cases())

_U32 = (2**31,)  # token ids and counts stored as u32 take 2**31 (and 2**32 - 1)
_U64 = (2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
_I64 = (-1, -(2**63), 2**31, 2**32, 2**62, 2**63 - 1)
_ANY = BAD_INTS

#: Values an entry serves as given (not refusals), and why. Everything else must raise.
ACCEPTED: Dict[str, Tuple[Any, ...]] = {
    # vLLM's rule or the exact need says no: False / AllocStatus.NEVER, nothing reserved.
    "can_append_slots": _U64,
    "can_swap_in": _U64,
    # Accepted for vLLM's signature; the next append reserves the slots (or refuses them).
    "swap_in": _U64,
    # Windows past the pool, hash seeds, LoRA ids and hash values are just keys or bounds.
    "BlockSpaceManager(sliding_window)": (2**31, 2**32, 2**62),
    "BlockSpaceManager(hash_seed)": _U64,
    "TokenSeq(hash_seed)": _U64,
    "TokenSeq(lora_id)": _I64,
    "BlockHasher(lora_id)": _I64,
    "hash_blocks(lora_id)": _I64,
    "pool.register(hash)": _U64 + (2**64,),
    "pool.lookup(hash)": _U64 + (2**64,),
    # Token ids are u32: 2**31 is one.
    "TokenSeq(token)": _U32,
    "tokens.append": _U32,
    "tokens.extend": _U32,
    "BlockHasher.feed": _U32,
    "hash_blocks(token)": _U32,
    "pool.register(token)": _U32,
    "pool.lookup(token)": _U32,
    "Sequence(token)": _U32,
    "SequenceData(token)": _U32,
    "pool.register(num_hashed_tokens)": _U32,
    "pool.incref(n)": _U32,  # a ref count of 2**31 + 1 still fits
    "fill_block_tables(pad)": (-1,),
    # Python-side values, as vLLM keeps them: sequence ids, slices, index arithmetic.
    "Sequence(seq_id)": _ANY,
    "tokens.token_slice(start)": _U64,
    "tokens.token_slice(end)": _U64,
    "data.token_ids_from": _ANY,
    "seq.num_hashed_tokens_of_block": _ANY,
    # vLLM stores a negative chunk (docs in SequenceData.update_num_computed_tokens).
    "data.update_num_computed_tokens": NEGATIVE,
    # Times are floats: any value orders; no refusal.
    "access_all_blocks_in_seq(time)": BAD_REALS,
    "pool.touch(time)": BAD_REALS,
    "BatchEngine.step(time)": (-1.0,),  # finite: a time (non-finite ones are refused)
    # A batch budget beyond any step is a budget.
    "Scheduler(max_num_batched_tokens)": _U64,
}


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "caching"])
def test_out_of_range_values_raise_pagedkv_errors_and_change_nothing(caching: bool) -> None:
    problems: List[str] = []
    for name, call in CASES.items():
        values = BAD_REALS if _real(name) else BAD_INTS
        for v in values:
            state = State(caching)
            before = state.observed()
            try:
                call(state, v)
            except PagedKVError as e:
                if not isinstance(e, (ValueError, KeyError, IndexError, TypeError)):
                    problems.append(f"{name}({v!r}): {type(e).__name__} derives from no builtin")
                after = state.observed()
                if after != before:
                    problems.append(f"{name}({v!r}): raised {e!r} and changed {before} -> {after}")
            except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
                problems.append(f"{name}({v!r}): {type(e).__module__}.{type(e).__name__}: {e}")
            else:
                if v not in ACCEPTED.get(name, ()):
                    problems.append(f"{name}({v!r}): accepted")
    assert not problems, "\n".join(problems)


def _real(name: str) -> bool:
    return name.endswith("(time)") or name == "Scheduler(delay_factor)"


# ---- constant time: a huge count is refused at once (issue 23, item 5) ------------------
GUARD_S = 20  # a constant-time refusal takes microseconds; a linear one, hours

_HUGE_COUNTS = r"""
from pagedkv import BlockSpaceManager, SamplingParams, Sequence, SequenceGroup, SequenceStatus
from pagedkv.engine_step import BatchEngine
from pagedkv.errors import PagedKVError

for window in (None, 8):
    m = BlockSpaceManager(4, 8, 4, watermark=0.0, sliding_window=window)
    seq = Sequence(0, "p", list(range(6)), block_size=4)
    group = SequenceGroup("r0", [seq], SamplingParams(), arrival_time=0.0)
    m.allocate(group)
    seq.status = SequenceStatus.RUNNING
    for n in (2**40, 2**62, 2**63 - 1, 2**64 - 1):
        m.can_append_slots(group, n)
        m.can_swap_in(group, n)
        try:
            m.append_slots(seq, num_lookahead_slots=n)
        except PagedKVError:
            pass
        else:
            raise AssertionError(f"append_slots({n}) was accepted")
        assert m.get_num_free_gpu_blocks() == 6
print("done")
"""


def test_huge_counts_are_answered_in_constant_time() -> None:
    """``append_slots(seq, num_lookahead_slots=2**40)`` once walked every lookahead slot
    (2**36: 8 s): in a child process with a generous time limit, each huge count is answered."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        out = subprocess.run(
            [sys.executable, "-c", _HUGE_COUNTS],
            capture_output=True,
            text=True,
            timeout=GUARD_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"huge counts took over {GUARD_S} s: time linear in the count")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


def test_scheduler_with_a_huge_lookahead_is_refused() -> None:
    """The scheduler's lookahead slots are appended every step: a count past what int32
    slot numbers hold is refused when it is built."""
    with pytest.raises(PagedKVError):
        Scheduler(
            SchedulerConfig(64, 4, 64, num_lookahead_slots=2**40),
            CacheConfig(BLOCK, num_gpu_blocks=8, num_cpu_blocks=4),
        )
