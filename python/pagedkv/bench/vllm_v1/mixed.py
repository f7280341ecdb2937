"""The MIXED workload of the v1 bench: W1's requests (the same prompts, output lengths, ``n=2``
forks and predetermined tokens, ids ``mixed-<i>``) where a share of them are the kinds of
request production serves besides plain sampling:

* ``json``: structured output in JSON mode (``StructuredOutputsParams(json_object=True)``);
* ``lora``: a LoRA adapter, alternately the first and the second of ``num_loras`` (the engine
  runs with ``LoRAConfig(max_loras=num_loras)``, so at most that many adapters per step);
* ``repetition``: repetition detection on (``RepetitionDetectionParams``), and from its 16th
  output token on the request repeats a 4-token pattern, so the detection ends it early;
* ``embeds``: the prompt given as embeddings (``prompt_embeds``, no token ids).

The kinds are disjoint, drawn at random by the seed (:func:`generate`); the rest stay plain.

There is no model and no grammar compiler: a structured-output request gets an
``AllowAllGrammar`` (it accepts every token, its bitmask allows every token;
:func:`allow_all_classes`) set on its ``StructuredOutputRequest`` as ``EngineCore`` sets the
compiled grammar, and the scheduler's ``StructuredOutputManager`` gets an ``AllowAllBackend``
for the bitmask it allocates. The
request still starts in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``; the scheduler promotes it
once it sees the grammar ready, as it does in production.

Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np

from pagedkv.bench.workload import W1_FULL, W1_QUICK, Workload, WorkloadConfig
from pagedkv.bench.workload import generate as generate_plain

#: The request kinds of the mixed workload, besides ``"plain"``.
KINDS = ("json", "lora", "repetition", "embeds")

#: From which output position a ``repetition`` request repeats, and the pattern's length.
REPEAT_FROM = 16
REPEAT_PERIOD = 4


@dataclass(frozen=True)
class MixedConfig:
    """The mix over a W1 config ``base``: the share of each kind (the rest plain)."""

    base: WorkloadConfig = W1_FULL
    json_share: float = 0.25
    lora_share: float = 0.10
    num_loras: int = 2
    repetition_share: float = 0.03
    embeds_share: float = 0.03

    def shares(self) -> Tuple[float, ...]:
        return (self.json_share, self.lora_share, self.repetition_share, self.embeds_share)

    @property
    def watermark(self) -> float:
        return self.base.watermark


MIXED_FULL = MixedConfig()
MIXED_QUICK = MixedConfig(base=W1_QUICK)


@dataclass
class MixedWorkload(Workload):
    """A :class:`Workload` whose requests have kinds: request id -> kind (plain ones absent)."""

    kinds: Dict[str, str]
    num_loras: int


def generate(mix: MixedConfig, seed: int = 0) -> MixedWorkload:
    """W1's requests (``mix.base``, named MIXED) with kinds drawn by ``seed``."""
    if sum(mix.shares()) > 1.0 or min(mix.shares()) < 0 or mix.num_loras < 1:
        raise ValueError("shares must be >= 0 and sum to at most 1; num_loras >= 1")
    cfg = dataclasses.replace(mix.base, name="MIXED")
    plain = generate_plain(cfg, seed=seed)
    rng = np.random.default_rng(np.random.SeedSequence([0x4D58, seed]))
    order = rng.permutation(len(plain.requests)).tolist()
    kinds: Dict[str, str] = {}
    start = 0
    for kind, share in zip(KINDS, mix.shares()):
        count = int(round(share * len(order)))
        for i in order[start : start + count]:
            kinds[plain.requests[i].request_id] = kind
        start += count
    for r in plain.requests:
        if kinds.get(r.request_id) == "repetition":
            r.output_token_ids = [_repeating(row) for row in r.output_token_ids]
    fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(Workload)}
    return MixedWorkload(**fields, kinds=kinds, num_loras=mix.num_loras)


def _repeating(row: List[int]) -> List[int]:
    """``row`` whose tokens from :data:`REPEAT_FROM` on repeat its first
    :data:`REPEAT_PERIOD` tokens from there."""
    if len(row) <= REPEAT_FROM:
        return list(row)
    pattern = row[REPEAT_FROM : REPEAT_FROM + REPEAT_PERIOD]
    tail = [pattern[k % len(pattern)] for k in range(len(row) - REPEAT_FROM)]
    return row[:REPEAT_FROM] + tail


def request_fields(kind: str, index: int, prompt: List[int], num_loras: int) -> Tuple[dict, dict]:
    """``(SamplingParams fields, Request fields)`` that make a request of ``kind`` (the
    workload request's ``index`` picks its LoRA adapter)."""
    if kind == "json":
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(json_object=True)}, {}
    if kind == "lora":
        from vllm.lora.request import LoRARequest

        lora_id = 1 + index % num_loras
        lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/nonexistent/adapter-{lora_id}")
        return {}, {"lora_request": lora}
    if kind == "repetition":
        from vllm.sampling_params import RepetitionDetectionParams

        detect = RepetitionDetectionParams(max_pattern_size=REPEAT_PERIOD, min_count=3)
        return {"repetition_detection": detect}, {}
    if kind == "embeds":
        import torch

        # Embeddings made of the token ids: prompts sharing a prefix share its blocks.
        embeds = torch.tensor(prompt, dtype=torch.float32)[:, None].repeat(1, 4)
        return {}, {"prompt_token_ids": None, "prompt_embeds": embeds}
    if kind != "plain":
        raise ValueError(f"unknown request kind {kind!r}; choose one of {KINDS}")
    return {}, {}


def lora_config(num_loras: int) -> Any:
    """vLLM's ``LoRAConfig`` for ``num_loras`` adapters per step."""
    from vllm.config import LoRAConfig

    return LoRAConfig(max_loras=num_loras)


def ready_grammar(request: Any) -> None:
    """What ``EngineCore.add_request`` does for a structured-output request (its grammar
    compiled): an :func:`allow_all_classes` grammar on its ``StructuredOutputRequest``."""
    if request.structured_output_request is not None:
        request.structured_output_request.grammar = allow_all_classes()[0]()


def install_backend(scheduler: Any, vocab_size: int) -> None:
    """The scheduler's ``StructuredOutputManager`` gets a backend allocating all-allowed
    bitmasks (what ``grammar_init`` sets up for the first structured request)."""
    manager = scheduler.structured_output_manager
    manager.backend = allow_all_classes()[1](manager.vllm_config, None, vocab_size)
    manager.backend_name = "pagedkv-allow-all"


@functools.cache
def allow_all_classes() -> Tuple[type, type]:
    """``(AllowAllGrammar, AllowAllBackend)``: vLLM's ``StructuredOutputGrammar`` and
    ``StructuredOutputBackend`` interfaces, every token accepted and allowed."""
    from vllm.v1.structured_output.backend_types import (
        StructuredOutputBackend,
        StructuredOutputGrammar,
    )

    class AllowAllGrammar(StructuredOutputGrammar):
        def __init__(self) -> None:
            self.num_accepted = 0

        def accept_tokens(self, request_id: str, tokens: List[int]) -> bool:
            self.num_accepted += len(tokens)
            return True

        def validate_tokens(self, tokens: List[int]) -> List[int]:
            return list(tokens)

        def rollback(self, num_tokens: int) -> None:
            self.num_accepted -= num_tokens

        def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
            bitmask[batch_index].fill_(-1)

        def is_terminated(self) -> bool:
            return False

        def reset(self) -> None:
            self.num_accepted = 0

    class AllowAllBackend(StructuredOutputBackend):
        def compile_grammar(self, request_type: Any, grammar_spec: str, **_: Any) -> Any:
            return AllowAllGrammar()

        def allocate_token_bitmask(self, max_num_seqs: int) -> Any:
            import torch

            words = (self.vocab_size + 31) // 32
            return torch.full((max_num_seqs, words), -1, dtype=torch.int32)

        def destroy(self) -> None:
            pass

    return AllowAllGrammar, AllowAllBackend
