"""The Sequence/SequenceGroup calls vLLM's scheduler and engine make per group or per sequence
each step, built on vLLM 0.4.2's own classes and on pagedkv's, for side-by-side timing
(``benches/bench_vllm_sequence.py``, ``tests/test_vllm_dropin.py``)."""

from __future__ import annotations

import timeit
from types import SimpleNamespace
from typing import Callable, Dict

__all__ = ["CASES", "build_pair", "interleaved_ratio"]


def _objects(seq_mod, sampling_params, width: int, prompt_len: int = 600) -> SimpleNamespace:
    seqs = [seq_mod.Sequence(i, "", list(range(prompt_len)), 16) for i in range(width)]
    group = seq_mod.SequenceGroup("r", seqs, sampling_params(n=width, best_of=width), 0.0)
    for s in seqs:
        s.status = seq_mod.SequenceStatus.RUNNING
        s.data.update_num_computed_tokens(prompt_len)
    return SimpleNamespace(
        group=group,
        seq=seqs[0],
        running=seq_mod.SequenceStatus.RUNNING,
        finished=seq_mod.SequenceStatus.is_finished,
    )


def build_pair(version: str = "0.4.2") -> Dict[str, Dict[int, SimpleNamespace]]:
    """``{"vllm": {1: objs, 2: objs}, "pagedkv": {...}}``: a decoding group of 1 and of 2
    sequences (600-token prompts) on each side."""
    import pagedkv.vllm_042.sequence
    from pagedkv import vllm_release
    from pagedkv.vllm_042.types import SamplingParams

    v = vllm_release.load(version, "vllm")
    sides = {
        "vllm": (v.sequence, v.sampling_params.SamplingParams),
        "pagedkv": (pagedkv.vllm_042.sequence, SamplingParams),
    }
    return {name: {w: _objects(m, sp, w) for w in (1, 2)} for name, (m, sp) in sides.items()}


def _case(width: int, make: Callable[[SimpleNamespace], Callable[[], object]]):
    return lambda side: make(side[width])


CASES: Dict[str, Callable[[Dict[int, SimpleNamespace]], Callable[[], object]]] = {}
for _w in (1, 2):
    CASES.update(
        {
            f"group{_w}.get_seqs(RUNNING)": _case(
                _w, lambda o: lambda: o.group.get_seqs(status=o.running)
            ),
            f"group{_w}.get_seqs()": _case(_w, lambda o: o.group.get_seqs),
            f"group{_w}.num_seqs(RUNNING)": _case(
                _w, lambda o: lambda: o.group.num_seqs(status=o.running)
            ),
            f"group{_w}.num_seqs()": _case(_w, lambda o: o.group.num_seqs),
            f"group{_w}.get_max_num_running_seqs()": _case(
                _w, lambda o: o.group.get_max_num_running_seqs
            ),
            f"group{_w}.is_prefill()": _case(_w, lambda o: o.group.is_prefill),
            f"group{_w}.is_finished()": _case(_w, lambda o: o.group.is_finished),
            f"group{_w}.get_unfinished_seqs()": _case(_w, lambda o: o.group.get_unfinished_seqs),
            f"group{_w}.num_unfinished_seqs()": _case(_w, lambda o: o.group.num_unfinished_seqs),
            f"group{_w}.update_num_computed_tokens(0)": _case(
                _w, lambda o: lambda: o.group.update_num_computed_tokens(0)
            ),
        }
    )
CASES.update(
    {
        "group.lora_int_id": _case(1, lambda o: lambda: o.group.lora_int_id),
        "group.maybe_set_first_scheduled_time": _case(
            1, lambda o: lambda: o.group.maybe_set_first_scheduled_time(1.0)
        ),
        "seq.is_finished()": _case(1, lambda o: o.seq.is_finished),
        "seq.is_prefill()": _case(1, lambda o: o.seq.is_prefill),
        "seq.get_num_new_tokens()": _case(1, lambda o: o.seq.get_num_new_tokens),
        "seq.get_len()": _case(1, lambda o: o.seq.get_len),
        "seq.get_output_len()": _case(1, lambda o: o.seq.get_output_len),
        "seq.num_hashed_tokens_of_block(3)": _case(
            1, lambda o: lambda: o.seq.num_hashed_tokens_of_block(3)
        ),
        "SequenceStatus.is_finished(status)": _case(1, lambda o: lambda: o.finished(o.seq.status)),
    }
)


def interleaved_ratio(
    pair: Dict[str, Dict[int, SimpleNamespace]], case: str, number: int = 20000, rounds: int = 7
) -> float:
    """pagedkv's time over vLLM's for ``case``: the best of ``rounds`` alternating runs each
    (alternating, so that machine noise hits both alike)."""
    calls = {name: CASES[case](side) for name, side in pair.items()}
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], timeit.timeit(call, number=number))
    return best["pagedkv"] / best["vllm"]
