"""Structured output on the native step (``pagedkv.vllm_v1._grammar`` and the bindings'
``grammar.rs``): which calls go to vLLM's ``StructuredOutputManager`` and which the native
step makes itself.

The results are held to vLLM's by the lockstep differential (test_request_kinds.py: every
step's ``get_grammar_bitmask`` and each grammar's position and ``reasoning_ended`` compared
with vLLM's scheduler). These tests hold the routing: the plain case, and every way a
manager stops being plain (a reasoning parser, a subclass, a patched class, a patched
instance, drafts), where vLLM's manager must be called as vLLM's loop calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import request_kinds as kinds
import torch
import v1_harness as h
from vllm.v1.structured_output import StructuredOutputManager

from pagedkv.vllm_v1 import _grammar
from pagedkv.vllm_v1._manager import KVCacheManager

ROOMY = h.SchedConfig(
    block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64
)


def structured_run(model_dir: Path, seed: int = 3, num_spec_tokens: int = 0) -> h.Lockstep:
    """pagedkv's scheduler against vLLM's over six structured-output requests (two of them
    terminate early, one rejects tokens) beside two plain ones."""
    rng = random.Random(seed)
    grammars = [kinds.GrammarSpec(), kinds.GrammarSpec(length=3), kinds.GrammarSpec(reject_mod=7)]
    specs = [
        h.RequestSpec(
            f"r{i}",
            tuple(rng.randrange(3, h.VOCAB_SIZE) for _ in range(5 + 3 * i)),
            arrival_step=i // 3,
            max_tokens=10,
            ignore_eos=True,
            grammar=grammars[i % 3] if i < 6 else None,
        )
        for i in range(8)
    ]
    cfg = dataclasses.replace(ROOMY, num_spec_tokens=num_spec_tokens)
    return h.Lockstep(cfg, specs, seed, model_dir, KVCacheManager)


@pytest.fixture
def manager(tiny_model_dir: Path) -> Iterator[Any]:
    run = structured_run(tiny_model_dir)
    yield run.test.structured_output_manager


def test_vllms_own_manager_without_reasoning_is_plain(manager: Any) -> None:
    assert type(manager) is StructuredOutputManager
    assert manager.reasoner_cls is None and _grammar.plain_manager(manager)
    assert _grammar.manager_kind(manager) == _grammar.PLAIN


def test_a_reasoning_parser_is_not_plain_unless_reasoning_is_constrained(manager: Any) -> None:
    manager.reasoner_cls = object  # any parser class: its rows may start unconstrained
    manager.enable_in_reasoning = False
    assert not _grammar.plain_manager(manager)
    assert _grammar.manager_kind(manager) == _grammar.VLLMS_OWN
    manager.enable_in_reasoning = True  # vLLM constrains every row from its first token
    assert _grammar.plain_manager(manager)


@pytest.mark.parametrize("name", _grammar._MIRRORED)
def test_a_method_replaced_on_the_instance_is_not_plain(manager: Any, name: str) -> None:
    setattr(manager, name, getattr(manager, name))
    assert not _grammar.plain_manager(manager)
    assert _grammar.manager_kind(manager) == _grammar.FOREIGN
    delattr(manager, name)
    assert _grammar.plain_manager(manager)


@pytest.mark.parametrize("name", _grammar._MIRRORED)
def test_a_method_patched_on_the_class_is_not_plain(
    manager: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin's wrapper, even one that keeps vLLM's function under ``__wrapped__``."""
    import functools

    original = getattr(StructuredOutputManager, name)

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    assert _grammar.plain_manager(manager)
    monkeypatch.setattr(StructuredOutputManager, name, patched)
    assert not _grammar.plain_manager(manager)
    monkeypatch.undo()
    assert _grammar.plain_manager(manager)


def test_a_subclass_is_not_plain(manager: Any) -> None:
    class Subclass(StructuredOutputManager):
        pass

    manager.__class__ = Subclass
    assert not _grammar.plain_manager(manager)


def _spy(manager: Any, name: str, calls: list) -> Callable[..., Any]:
    """The instance's ``name`` recording its calls (which makes the manager foreign): the
    method and the request ids it was asked about."""
    original = getattr(manager, name)

    def spy(*args: Any) -> Any:
        if name == "grammar_bitmask":
            calls.append((name, list(args[1])))
        else:
            calls.append((name, args[0].request_id))
        return original(*args)

    return spy


@pytest.mark.parametrize("num_spec_tokens", [0, 2])
def test_the_plain_case_leaves_vllms_manager_out(
    tiny_model_dir: Path, monkeypatch: Any, num_spec_tokens: int
) -> None:
    """Every step native and equal to vLLM's, with drafts or without; pagedkv's side asks
    vLLM's manager only to allocate the bitmask (its first ``grammar_bitmask``, if the
    bitmask is not there yet), then fills the bitmask and advances the grammars itself.
    (The spies on the class are not vLLM's code: the class check is forced.)"""
    run = structured_run(tiny_model_dir, num_spec_tokens=num_spec_tokens)
    test_manager = run.test.structured_output_manager
    allocations = 1 if test_manager._grammar_bitmask is None else 0
    calls: list = []
    for name in ("grammar_bitmask", "accept_tokens"):
        original = getattr(StructuredOutputManager, name)

        def spy(self: Any, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append((_name, "pagedkv" if self is test_manager else "vllm"))
            return _original(self, *args)

        monkeypatch.setattr(StructuredOutputManager, name, spy)
    monkeypatch.setattr(_grammar, "_vllm_class_of", lambda cls: True)
    filled: list = []
    fill = _grammar.fill_plain_bitmask
    monkeypatch.setattr(
        _grammar, "fill_plain_bitmask", lambda *a: filled.append(any(a[3].values())) or fill(*a)
    )
    stats = run.run()
    assert set(stats["loops"]) == {"native"}, stats
    assert ("grammar_bitmask", "vllm") in calls and ("accept_tokens", "vllm") in calls
    assert [c for c in calls if c[1] == "pagedkv"] == [("grammar_bitmask", "pagedkv")] * allocations
    assert len(filled) == stats["bitmasks"] - allocations > 0
    assert any(filled) == bool(num_spec_tokens)  # some rows had drafts


SPIED = ("grammar_bitmask", "accept_tokens", "validate_tokens")


@pytest.mark.parametrize("num_spec_tokens", [0, 2])
def test_a_foreign_manager_is_called_as_vllms_loop_calls_it(
    tiny_model_dir: Path, num_spec_tokens: int
) -> None:
    """Spies on both sides' manager instances (each then foreign): pagedkv's native steps
    ask it exactly what vLLM's loop asks, in the same order: ``grammar_bitmask`` with the
    same rows, ``accept_tokens`` for every row with tokens and, with drafts,
    ``validate_tokens`` for every row given drafts (plain requests too)."""
    run = structured_run(tiny_model_dir, num_spec_tokens=num_spec_tokens)
    calls: dict = {"vllm": [], "pagedkv": []}
    for side, sched in (("vllm", run.ref), ("pagedkv", run.test)):
        manager = sched.structured_output_manager
        for name in SPIED:
            setattr(manager, name, _spy(manager, name, calls[side]))
        assert _grammar.manager_kind(manager) == _grammar.FOREIGN
    stats = run.run()
    assert set(stats["loops"]) == {"native"}, stats
    assert calls["pagedkv"] == calls["vllm"]
    for name in ("accept_tokens", "validate_tokens")[: 1 + bool(num_spec_tokens)]:
        asked = {rid for method, rid in calls["vllm"] if method == name}
        assert {"r6", "r7"} <= asked, name  # the plain requests are asked too
    assert sum(name == "grammar_bitmask" for name, _ in calls["vllm"]) == stats["bitmasks"]


class EndsReasoningAtMultiplesOfFive:
    """A reasoning parser stand-in (vLLM builds one per structured request): reasoning
    ends at the first token divisible by 5; the grammar constrains what follows."""

    def __init__(self, tokenizer: Any, **_: Any) -> None:
        pass

    def is_reasoning_end(self, input_ids: Any) -> bool:
        return False

    def is_reasoning_end_streaming(self, input_ids: Any, delta_ids: Any) -> bool:
        return any(t % 5 == 0 for t in delta_ids)


def test_a_reasoning_parser_runs_natively_through_vllms_manager(tiny_model_dir: Path) -> None:
    """vLLM's own manager with a reasoning parser: pagedkv's native steps ask its
    ``grammar_bitmask`` and ``accept_tokens`` (structured rows only; the manager accepts any
    other row at once); every step equal to vLLM's, the grammars' positions and
    ``reasoning_ended`` included, and some grammar advanced after its reasoning ended."""
    run = structured_run(tiny_model_dir)
    for sched in (run.ref, run.test):
        manager = sched.structured_output_manager
        manager.reasoner_cls = EndsReasoningAtMultiplesOfFive
        manager.tokenizer = None
        assert _grammar.manager_kind(manager) == _grammar.VLLMS_OWN
    added: list = []
    add = run.test.add_request
    run.test.add_request = lambda request: added.append(request) or add(request)
    stats = run.run()
    assert set(stats["loops"]) == {"native"}, stats
    structured = [r.structured_output_request for r in added if r.use_structured_output]
    assert len(structured) == 6 and stats["bitmasks"] > 0
    ended = [s for s in structured if s.reasoning_ended]
    assert ended and any(s._grammar.num_processed_tokens > 0 for s in ended)
    assert any(not s.reasoning_ended for s in structured)  # one still reasoned at its end


@pytest.mark.parametrize(
    ("drafts", "diffusion", "rows", "plain"),
    [
        (0, False, 8, True),
        (0, False, 129, False),
        (2, False, 8, True),
        (2, False, 129, True),
        (0, True, 8, False),
        (2, True, 8, False),
    ],
)
def test_the_plain_bitmask_needs_one_row_per_request_on_this_thread(
    manager: Any, drafts: int, diffusion: bool, rows: int, plain: bool
) -> None:
    """A diffusion model (no bonus row) and, without drafts, more rows than vLLM fills on
    one thread take vLLM's ``grammar_bitmask`` (with drafts vLLM always fills on one
    thread); so does a bitmask not allocated."""
    from types import SimpleNamespace

    assert manager.fill_bitmask_parallel_threshold == 128
    manager._grammar_bitmask = None
    assert not _grammar._plain_bitmask(manager, 1)
    manager._grammar_bitmask = torch.zeros((8, 4), dtype=torch.int32)
    manager.vllm_config = SimpleNamespace(
        num_speculative_tokens=drafts, model_config=SimpleNamespace(is_diffusion=diffusion)
    )
    assert _grammar._plain_bitmask(manager, rows) is plain


class _Records(logging.Handler):
    """The messages a logger emits, formatted."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


def _random_batch(rng: random.Random, num_spec_tokens: int) -> tuple:
    """Grammar specs, positions and drafts for one ``grammar_bitmask`` call: grammars that
    reject tokens, terminate (some already terminated), drafts of every length up to
    ``num_spec_tokens`` (some none), rejected drafts, ``-1`` padding."""
    batch = []
    for k in range(rng.randrange(1, 9)):
        spec = kinds.GrammarSpec(
            reject_mod=rng.choice((0, 3, 5)), length=rng.choice((None, 1, 3, 6))
        )
        position = rng.randrange(0, 5)
        drafts = [rng.randrange(1, h.VOCAB_SIZE) for _ in range(rng.randrange(num_spec_tokens + 1))]
        if drafts and rng.random() < 0.3:
            cut = rng.randrange(len(drafts))
            drafts[cut:] = [-1] * (len(drafts) - cut)
        batch.append((f"q{k}", spec, position, drafts if drafts or rng.random() < 0.5 else None))
    return batch


class CountingGrammar(kinds.FakeGrammar):
    """A fake grammar whose rows also record how many rows it filled (in word 0), so a row
    copied where vLLM copies and a row filled again tell apart."""

    fills = 0

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        super().fill_bitmask(bitmask, batch_index)
        self.fills += 1
        bitmask[batch_index, 0] = self.fills


def _requests(batch: list, holder: str = "namespace") -> dict:
    """Fresh requests for ``batch``, each grammar advanced to its position, held as
    ``holder`` says: by a stand-in's ``grammar`` attribute, in vLLM's
    ``StructuredOutputRequest`` (``vllm``), or there as a finished ``Future`` of it
    (``future``, what a compile in flight leaves until the property resolves it)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.request import StructuredOutputRequest

    requests = {}
    for req_id, spec, position, _ in batch:
        grammar = CountingGrammar(spec, h.VOCAB_SIZE)
        grammar.num_processed_tokens = position
        if holder == "namespace":
            structured = SimpleNamespace(grammar=grammar, reasoning_ended=None, reasoner=None)
        else:
            structured = StructuredOutputRequest(params=StructuredOutputsParams(regex="a+"))
            structured.grammar = grammar
            if holder == "future":
                structured.grammar = Future()
                structured._grammar.set_result(grammar)
        requests[req_id] = SimpleNamespace(request_id=req_id, structured_output_request=structured)
    return requests


@pytest.mark.parametrize("holder", ["namespace", "vllm", "future"])
@pytest.mark.parametrize("num_spec_tokens", [0, 1, 3])
def test_the_plain_bitmask_is_vllms_grammar_bitmask(
    manager: Any, num_spec_tokens: int, holder: str
) -> None:
    """Function against function on random batches: vLLM's ``grammar_bitmask`` and
    :func:`_grammar.fill_plain_bitmask` from the same bitmask contents (stale rows included)
    over grammars in the same states give the same array, leave the grammars in the same
    states and the bitmask in the same contents, and log the same errors (rejected drafts).
    The grammars are held by stand-ins, by vLLM's ``StructuredOutputRequest`` (read from its
    slot) and there behind a finished ``Future`` (resolved by vLLM's property, both sides)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from vllm.v1 import structured_output

    manager.vllm_config = SimpleNamespace(
        num_speculative_tokens=num_spec_tokens,
        model_config=SimpleNamespace(is_diffusion=False),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    words = (h.VOCAB_SIZE + 31) // 32
    rng = random.Random(num_spec_tokens)
    records = _Records()
    structured_output.logger.addHandler(records)
    failures = 0
    try:
        for _ in range(60):
            batch = _random_batch(rng, num_spec_tokens)
            ids = [b[0] for b in batch]
            drafts = {b[0]: b[3] for b in batch if b[3] is not None}
            start = torch.randint(-(2**31), 2**31 - 1, (8 * (num_spec_tokens + 1), words))
            results = []
            for fill in (manager.grammar_bitmask, _grammar_fill(manager)):
                manager._grammar_bitmask = start.to(torch.int32).clone()
                requests = _requests(batch, holder)
                records.messages.clear()
                array = fill(requests, ids, drafts).copy()
                grammars = [r.structured_output_request.grammar for r in requests.values()]
                state = [(g.num_processed_tokens, list(g.accepted), g.fills) for g in grammars]
                after = manager._grammar_bitmask.clone()
                results.append((array, after, state, records.messages[:]))
            (ref, ref_all, ref_state, ref_log), (got, got_all, got_state, got_log) = results
            assert np.array_equal(got, ref) and torch.equal(got_all, ref_all)
            assert got_state == ref_state and got_log == ref_log
            failures += bool(ref_log)
            if holder == "future":  # resolved in place, as vLLM's property leaves it
                assert all(
                    not isinstance(r.structured_output_request._grammar, Future)
                    for r in requests.values()
                )
    finally:
        structured_output.logger.removeHandler(records)
    assert failures > 0 or num_spec_tokens == 0


def _grammar_fill(manager: Any) -> Callable[..., Any]:
    return lambda requests, ids, drafts: _grammar.fill_plain_bitmask(manager, requests, ids, drafts)
