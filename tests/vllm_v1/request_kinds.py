"""Request kinds beyond plain sampling, for the lockstep differential
(:mod:`v1_harness`): structured output over a fake grammar, LoRA adapters, prompt embeddings,
repetition detection.

vLLM 0.32 and 0.33 build all four the same way (checked against both releases' sources):

* structured output: ``SamplingParams(structured_outputs=StructuredOutputsParams(regex=...))``
  makes ``Request.__init__`` attach a ``StructuredOutputRequest`` and start the request in
  ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``. EngineCore's ``grammar_init`` would then set its
  ``grammar`` to a ``Future`` of a compiled grammar; the harness sets a ``Future`` of a
  :class:`FakeGrammar` itself (nothing compiles a real grammar: the tiny model has no
  tokenizer) and resolves it a set number of steps later, or fails it (a compile error);
* LoRA: ``VllmConfig.lora_config`` (the scheduler reads ``max_loras``) and a ``LoRARequest``
  per request (its name and path enter the block hash's extra keys);
* prompt embeddings: ``prompt_token_ids=None`` and a float tensor ``[num_tokens, hidden]``
  (the request's token list is zeros; the block hash's extra keys digest each block's slice
  of the tensor);
* repetition detection: ``SamplingParams.repetition_detection`` (``check_stop`` ends a request
  whose outputs repeat with ``FINISHED_REPETITION``, stop reason ``"repetition_detected"``).

Each scheduler of a lockstep pair gets its own grammar objects (a grammar advances as it
accepts tokens) that behave alike.
"""

from __future__ import annotations

import dataclasses
import random
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np
import torch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

#: What the requests' ``StructuredOutputsParams`` ask for (never compiled: the harness sets
#: the grammar itself).
FAKE_REGEX = "[a-z]+"
#: Width of the fake prompt embeddings (the scheduler never checks it against the model).
EMBED_WIDTH = 4
NUM_ADAPTERS = 4  # LoRA adapters a1..a4


class GrammarCompileError(ValueError):
    """What a grammar that fails to compile raises from its future."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """How one request's fake grammar behaves.

    ``ready_after``: scheduler steps after arrival until it is compiled (0: ready when the
    request arrives, still promoted from ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` by the
    first ``schedule()``). ``reject_mod``/``reject_residue``: it rejects a token ``t`` with
    ``t % reject_mod == reject_residue`` (``reject_mod`` 0: none). ``length``: it terminates
    after that many accepted tokens (then it ignores further tokens, as xgrammar's does).
    ``compile_error``: the future fails instead."""

    ready_after: int = 0
    reject_mod: int = 0
    reject_residue: int = 0
    length: Optional[int] = None
    compile_error: bool = False


class FakeGrammar(StructuredOutputGrammar):
    """A deterministic grammar: :class:`GrammarSpec` decides which tokens it rejects and when it
    terminates. Its bitmask rows allow every token but the rejected ones, and the row's last
    word holds the number of tokens processed, so a grammar advanced differently on the two
    sides of the lockstep shows in the bitmask."""

    def __init__(self, spec: GrammarSpec, vocab_size: int) -> None:
        self.spec = spec
        self.num_processed_tokens = 0
        self.accepted: list[int] = []  # for the tests: what it was fed, in order
        words = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
        for token in range(vocab_size):
            if self._rejects(token):
                words[token >> 5] &= ~np.uint32(1 << (token & 31))
        self._row = torch.from_numpy(words.view(np.int32).copy())

    def _rejects(self, token: int) -> bool:
        mod = self.spec.reject_mod
        return bool(mod) and token % mod == self.spec.reject_residue

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.is_terminated():
                return True
            if self._rejects(token):
                return False
            self.num_processed_tokens += 1
            self.accepted.append(token)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        valid = []
        room = None if self.spec.length is None else self.spec.length - self.num_processed_tokens
        for token in tokens:
            if self._rejects(token) or (room is not None and len(valid) >= room):
                break
            valid.append(token)
        return valid

    def rollback(self, num_tokens: int) -> None:
        self.num_processed_tokens -= num_tokens
        del self.accepted[len(self.accepted) - num_tokens :]

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        bitmask[batch_index].copy_(self._row)
        bitmask[batch_index, -1] = self.num_processed_tokens

    def is_terminated(self) -> bool:
        length = self.spec.length
        return length is not None and self.num_processed_tokens >= length

    def reset(self) -> None:
        self.num_processed_tokens = 0
        self.accepted.clear()


def resolve(future: Future, spec: GrammarSpec, vocab_size: int) -> None:
    """Grammar compilation finishes (EngineCore's ``grammar_init`` set ``future`` as the
    request's grammar): a :class:`FakeGrammar`, or the compile error."""
    if spec.compile_error:
        future.set_exception(GrammarCompileError("the fake grammar does not compile"))
    else:
        future.set_result(FakeGrammar(spec, vocab_size))


def structured_outputs_params() -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=FAKE_REGEX)


def lora_request(adapter: int) -> LoRARequest:
    return LoRARequest(lora_name=f"a{adapter}", lora_int_id=adapter, lora_path="/nonexistent")


def prompt_embeds(prompt: tuple[int, ...]) -> torch.Tensor:
    """A small float tensor, a function of the prompt's ids: two requests with the same ids
    have the same embeddings (a prefix hit between them), unlike a token-id request."""
    ids = torch.tensor(prompt, dtype=torch.float32).unsqueeze(1)
    return ids / 1000.0 + torch.arange(EMBED_WIDTH, dtype=torch.float32)


def grammar_state(request: Any) -> Any:
    """A request's grammar as the scheduler left it: none, or (pending, failed, or the fake
    grammar's position; ``reasoning_ended``, which vLLM's ``accept_tokens`` sets) (compared
    with the rest of the request's state)."""
    structured = request.structured_output_request
    if structured is None:
        return None
    return _grammar_position(structured), structured.reasoning_ended


def _grammar_position(structured: Any) -> Any:
    grammar = structured._grammar
    if isinstance(grammar, Future):
        return "pending" if not grammar.done() else "done"
    if isinstance(grammar, FakeGrammar):
        return ("grammar", grammar.num_processed_tokens, grammar.is_terminated())
    return type(grammar).__name__


# --------------------------------------------------------------------------- drawing


@dataclasses.dataclass(frozen=True)
class KindRates:
    """Per request, the chance of each kind (a request may have several)."""

    structured: float = 0.0
    lora: float = 0.0
    embeds: float = 0.0
    repetition: float = 0.0


def draw_rates(rng: random.Random) -> KindRates:
    """One seed in three mixes all kinds; the others draw each kind's rate on its own."""
    if rng.random() < 1 / 3:
        return KindRates(0.25, 0.3, 0.2, 0.2)
    rates = [rng.choice((0.0, 0.15, 0.35)) for _ in range(4)]
    if not any(rates):
        rates[rng.randrange(4)] = 0.3
    return KindRates(*rates)


def draw_grammar(rng: random.Random) -> GrammarSpec:
    mod = rng.choice((0, 0, 0, 11, 29, 61))
    return GrammarSpec(
        ready_after=rng.choice((0, 0, 1, 2, 5)),
        reject_mod=mod,
        reject_residue=rng.randrange(mod) if mod else 0,
        length=rng.choice((None, None, None, rng.randint(1, 20))),
        compile_error=rng.random() < 0.05,
    )


def with_request_kinds(rng: random.Random, cfg: Any, specs: list) -> tuple[Any, list]:
    """``cfg`` with ``max_loras`` drawn (where LoRA requests are drawn) and ``specs``
    (``v1_harness.RequestSpec``) with kinds drawn at :func:`draw_rates`' rates, over two to
    four adapters."""
    rates = draw_rates(rng)
    max_loras = rng.choice((1, 2, 3)) if rates.lora else None
    num_adapters = rng.randint(2, NUM_ADAPTERS)
    out = []
    for spec in specs:
        changes: dict[str, Any] = {}
        if rng.random() < rates.structured:
            changes["grammar"] = draw_grammar(rng)
        if max_loras and rng.random() < rates.lora:
            changes["lora"] = rng.randint(1, num_adapters)
        if rng.random() < rates.embeds:
            changes["embeds"] = True
        if rng.random() < rates.repetition:
            changes["repetition"] = True
        out.append(dataclasses.replace(spec, **changes))
    return dataclasses.replace(cfg, max_loras=max_loras), out


def is_kind(spec: Any) -> bool:
    """Whether a ``RequestSpec`` has any of these kinds (outside pagedkv's plain scope)."""
    return bool(spec.grammar or spec.lora or spec.embeds or spec.repetition)
