"""The speculative-decoding workloads of the v1 bench: ``spec`` (W1's requests) and
``mixed-spec`` (the MIXED workload's), the engine configured for n-gram speculative decoding
(``SpeculativeConfig(model="ngram", num_speculative_tokens=3)``), synchronous scheduling
(vLLM refuses async scheduling with the n-gram drafter on its V1 runner).

The model stand-in plays both drafter and verifier (:class:`Drafter`), deterministically and
alike for every engine:

* **drafting** (after each step, as ``EngineCore.post_step`` takes the runner's draft tokens
  and hands them to ``scheduler.update_draft_token_ids``): every request that sampled a token
  in the step gets ``num_spec_tokens`` drafts, the next tokens of its predetermined output,
  each one deliberately wrong with probability ``1 - accept_rate``; a share ``no_match_share``
  of the proposals are empty (the n-gram finds no match). The draws are hashes of the
  request id, its output position and the draft's slot, so they do not depend on the engine;
* **verifying** (the step's sampled tokens): a row with scheduled drafts gets the prefix of
  its drafts that equals its predetermined next tokens, plus one bonus token (the
  predetermined token after them), as vLLM's rejection sampler does under greedy sampling.
  The predetermined output is what every engine samples, so the engines stay in lockstep.

Past the end of a request's predetermined output (drafts and a bonus token the scheduler
drops at ``max_tokens``) the stand-in uses :data:`FILLER`.

``eagle`` (the ``eagle`` workload: W1 with EAGLE's KV cache rules): the same drafts, but the
scheduler is built as for an EAGLE-family drafter, scheduler-only as vLLM's own scheduler
tests build one (:func:`eagle_engine`): on 0.33 with prefix caching that is vLLM's default of
lookahead block hashes (one token past each block, no dropped block), on 0.32 the dropped
last block of a hit.

Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from pagedkv.bench.vllm_v1 import mixed
from pagedkv.bench.workload import W1_FULL, W1_QUICK, Workload, WorkloadConfig
from pagedkv.bench.workload import generate as generate_plain

#: The token the stand-in uses past the end of a predetermined output.
FILLER = 0


@dataclass(frozen=True)
class Drafter:
    """The deterministic n-gram drafter and verifier stand-in (see the module's docstring)."""

    num_spec_tokens: int = 3
    accept_rate: float = 0.7
    no_match_share: float = 0.15
    seed: int = 0
    vocab_size: int = 32000
    #: The engine is built as for an EAGLE-family drafter (see the module's docstring).
    eagle: bool = False

    def _draw(self, rid: str, pos: int, slot: int) -> float:
        """A uniform draw in [0, 1) fixed by the request, its output position and the slot."""
        key = f"{self.seed}:{rid}:{pos}:{slot}".encode()
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0**64

    def propose(self, rid: str, pos: int, truth: Sequence[int]) -> List[int]:
        """The drafts of request ``rid`` whose next output token is ``truth[pos]``."""
        if self._draw(rid, pos, -1) < self.no_match_share:
            return []
        drafts = []
        for slot in range(self.num_spec_tokens):
            token = _at(truth, pos + slot)
            if self._draw(rid, pos, slot) >= self.accept_rate:
                token = (token + 1) % self.vocab_size  # a wrong draft
            drafts.append(token)
        return drafts


def verify(drafts: Sequence[int], pos: int, truth: Sequence[int]) -> Tuple[List[int], int]:
    """The tokens a greedy verifier samples for a row whose next output token is
    ``truth[pos]`` and whose scheduled drafts are ``drafts``: the drafts' prefix that matches
    ``truth``, then the bonus token. Returns (tokens, drafts accepted)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == _at(truth, pos + accepted):
        accepted += 1
    return list(drafts[:accepted]) + [_at(truth, pos + accepted)], accepted


def _at(truth: Sequence[int], pos: int) -> int:
    return truth[pos] if pos < len(truth) else FILLER


@dataclass
class DraftCounts:
    """What the stand-in saw over a run: drafts proposed, scheduled, accepted, and rows
    verified with drafts."""

    proposed: int = 0
    scheduled: int = 0
    accepted: int = 0
    rows: int = 0

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


def sampled_tokens(
    so: Any,
    requests: Mapping[str, Any],
    outputs: Mapping[str, Sequence[int]],
    counts: DraftCounts,
) -> Tuple[List[str], List[List[int]]]:
    """The verifier: per scheduled request its id and sampled tokens (:func:`verify` over its
    scheduled drafts once its prompt is computed, ``[]`` for a prompt chunk)."""
    ids = list(so.num_scheduled_tokens)
    spec_tokens = so.scheduled_spec_decode_tokens
    sampled = []
    for rid in ids:
        req = requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
            continue
        drafts = spec_tokens.get(rid) or ()
        tokens, accepted = verify(drafts, len(req.output_token_ids), outputs[rid])
        if drafts:
            counts.rows += 1
            counts.scheduled += len(drafts)
            counts.accepted += accepted
        sampled.append(tokens)
    return ids, sampled


def draft_token_ids(
    drafter: Drafter,
    mro: Any,
    requests: Mapping[str, Any],
    outputs: Mapping[str, Sequence[int]],
    counts: DraftCounts,
) -> Any:
    """The drafter, after the step's output is processed: vLLM's ``DraftTokenIds`` over the
    step's rows (what the runner's ``take_draft_token_ids`` returns), drafts for each row that
    sampled, none for the others."""
    from vllm.v1.outputs import DraftTokenIds

    drafts = []
    for rid, tokens in zip(mro.req_ids, mro.sampled_token_ids):
        req = requests[rid]
        row: List[int] = []
        if tokens and not req.is_finished():
            row = drafter.propose(rid, len(req.output_token_ids), outputs[rid])
        counts.proposed += len(row)
        drafts.append(row)
    return DraftTokenIds(list(mro.req_ids), drafts)


# ---- the workloads -------------------------------------------------------------------------

Base = Union[WorkloadConfig, mixed.MixedConfig]


@dataclass(frozen=True)
class SpecConfig:
    """A workload (W1's ``WorkloadConfig`` or a ``MixedConfig``) run with n-gram speculative
    decoding: ``num_spec_tokens`` drafts a step, each right with ``accept_rate``."""

    base: Base = W1_FULL
    name: str = "SPEC"
    num_spec_tokens: int = 3
    accept_rate: float = 0.7
    no_match_share: float = 0.15
    eagle: bool = False

    @property
    def watermark(self) -> float:
        return self.base.watermark

    def drafter(self, seed: int) -> Drafter:
        return Drafter(
            self.num_spec_tokens, self.accept_rate, self.no_match_share, seed, eagle=self.eagle
        )


SPEC_FULL = SpecConfig()
SPEC_QUICK = SpecConfig(base=W1_QUICK)
MIXED_SPEC_FULL = SpecConfig(base=mixed.MIXED_FULL)
MIXED_SPEC_QUICK = SpecConfig(base=mixed.MIXED_QUICK)
EAGLE_FULL = SpecConfig(name="EAGLE", eagle=True)
EAGLE_QUICK = SpecConfig(base=W1_QUICK, name="EAGLE", eagle=True)


@contextmanager
def eagle_engine(eagle: bool) -> Iterator[None]:
    """While open (``eagle``): vLLM's speculative configuration reports an EAGLE method
    (``SpeculativeConfig.use_eagle``), so a scheduler built meanwhile takes EAGLE's KV cache
    rules, as vLLM's own scheduler tests build one. Nothing else changes: the drafts stay
    :class:`Drafter`'s."""
    if not eagle:
        yield
        return
    from vllm.config import SpeculativeConfig

    saved = SpeculativeConfig.__dict__["use_eagle"]
    SpeculativeConfig.use_eagle = lambda self: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        SpeculativeConfig.use_eagle = saved  # type: ignore[method-assign]


def generate(cfg: SpecConfig, seed: int = 0) -> Workload:
    """The base workload (a plain one's requests named ``<name>-<i>``; a mixed one's as
    :func:`pagedkv.bench.vllm_v1.mixed.generate` names them), its ``drafter`` attached."""
    if isinstance(cfg.base, mixed.MixedConfig):
        work: Workload = mixed.generate(cfg.base, seed=seed)
    else:
        work = generate_plain(dataclasses.replace(cfg.base, name=cfg.name), seed=seed)
    work.drafter = cfg.drafter(seed)  # type: ignore[attr-defined]
    return work


def drafter_of(workload: Any) -> Optional[Drafter]:
    """The drafter a workload runs with (``None``: no speculative decoding)."""
    return getattr(workload, "drafter", None)
