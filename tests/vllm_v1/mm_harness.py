"""Multimodal requests for the lockstep differential (:mod:`v1_harness`): requests carrying
image placeholders (``mm_features``), and both schedulers given an encoder as vLLM's own
scheduler tests give one (``max_num_encoder_input_tokens`` and an ``EncoderCacheManager`` set
after construction: the tiny Llama is text-only, so vLLM would size both at 0, and the
scheduler never looks at the model beyond those two).

:class:`MmLockstep` is :class:`v1_harness.Lockstep` with requests built with their images and
the encoder cache manager's state compared wherever the scheduler state is. Images share
identifiers across requests (the encoder cache's hits and same-step duplicates), sit at any
offset (also inside shared prefixes, so a prefix hit can land past an image the cache no
longer holds) and each fits the encoder budget (else vLLM would never schedule past it).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Optional

import v1_harness as h
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.request import Request

#: The plain builder (:class:`MmLockstep` swaps the module's name during arrivals).
_plain_build_request = h.build_request


@dataclasses.dataclass(frozen=True)
class Image:
    offset: int
    length: int
    identifier: str


@dataclasses.dataclass(frozen=True)
class Encoder:
    """The encoder both schedulers get: ``budget`` (``max_num_encoder_input_tokens``), the
    cache's size in embeddings, and ``disable_chunked_mm_input``."""

    budget: int = 64
    cache_size: int = 96
    no_chunking: bool = False
    v2_runner: bool = False  # ``use_v2_model_runner`` (0.33: ``encoder_input_updates``)


def build_request(
    spec: h.RequestSpec,
    hasher: Any,
    images: tuple[Image, ...],
    update: Optional[h.SessionUpdate] = None,
) -> Request:
    """:func:`v1_harness.build_request` with ``images`` as the request's ``mm_features`` (set
    before the block hasher runs: the identifiers are extra keys of the blocks they touch);
    with ``update``, a streaming session's update (its images' offsets within the update's
    prompt: vLLM shifts them past the session's tokens)."""
    request = _plain_build_request(spec, None, update)
    features = [
        MultiModalFeatureSpec(
            data=_data(image.identifier),
            modality="image",
            identifier=image.identifier,
            mm_position=PlaceholderRange(offset=image.offset, length=image.length),
        )
        for image in images
    ]
    return Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        pooling_params=None,
        mm_features=features or None,
        client_index=spec.client_index,
        arrival_time=request.arrival_time,
        priority=request.priority,
        block_hasher=hasher,
        **({"resumable": True} if request.resumable else {}),
    )


_DATA: dict[str, Any] = {}


def _data(identifier: str) -> Any:
    """One data item per identifier, shared by both sides' requests (vLLM's dummy item is an
    uninitialized tensor: two would compare unequal)."""
    if identifier not in _DATA:
        _DATA[identifier] = MultiModalKwargsItem.dummy()
    return _DATA[identifier]


def give_encoder(sched: Any, encoder: Encoder) -> None:
    sched.max_num_encoder_input_tokens = encoder.budget
    sched.encoder_cache_manager = EncoderCacheManager(cache_size=encoder.cache_size)
    sched.scheduler_config.disable_chunked_mm_input = encoder.no_chunking
    if encoder.v2_runner:
        sched.use_v2_model_runner = True


def encoder_cache_state(sched: Any) -> dict:
    m = sched.encoder_cache_manager
    return {
        "num_free_slots": m.num_free_slots,
        "num_freeable_slots": m.num_freeable_slots,
        "cached": sorted((k, sorted(v)) for k, v in m.cached.items()),
        "freeable": list(m.freeable.items()),
        "freed": list(m.freed),
        "request_cached_ids": sorted(
            (k, sorted(v)) for k, v in getattr(m, "request_cached_ids", {}).items()
        ),
        "pending_inputs": sorted(
            (k, sorted(v)) for k, v in getattr(sched, "_pending_encoder_input_ids", {}).items()
        ),
        "mismatch": sorted(sched.encoder_cache_mismatch_reqs),
    }


class MmLockstep(h.Lockstep):
    """The lockstep over requests with images (``images``: request id -> its images)."""

    def __init__(
        self,
        cfg: h.SchedConfig,
        specs: list[h.RequestSpec],
        images: dict[Any, tuple[Image, ...]],
        encoder: Encoder,
        seed: int,
        model_dir: Path,
        manager_cls: type,
    ) -> None:
        super().__init__(cfg, specs, seed, model_dir, manager_cls)
        self.images = images
        self.encoder = encoder
        for sched in (self.ref, self.test):
            give_encoder(sched, encoder)
        self.stats.update(encoder_inputs=0, encoder_updates=0)
        self.finish_reasons: dict[str, str] = {}

    def _arrivals_and_aborts(self) -> None:
        # The base class builds requests with v1_harness.build_request: for the arrivals of
        # this step it builds them with their images instead.
        h.build_request = self._build
        try:
            super()._arrivals_and_aborts()
        finally:
            h.build_request = _plain_build_request

    def _build(
        self, spec: h.RequestSpec, hasher: Any, update: Optional[h.SessionUpdate] = None
    ) -> Request:
        """``images`` keys a request's images by its id, a session update's by ``(id,
        update step)``."""
        key: Any = spec.req_id if update is None else (spec.req_id, update.step)
        return build_request(spec, hasher, self.images.get(key, ()), update)

    def _update(self, p: Any) -> None:
        inputs = p.ref_out.scheduled_encoder_inputs
        self.stats["encoder_inputs"] += sum(map(len, inputs.values()))
        updates = getattr(p.ref_out, "encoder_input_updates", None) or {}
        self.stats["encoder_updates"] += sum(map(len, updates.values()))
        super()._update(p)

    def _count_finish(self, out: Any) -> None:
        super()._count_finish(out)
        self.finish_reasons[out.request_id] = str(out.finish_reason)

    def _check_state(self, when: str) -> None:
        super()._check_state(when)
        self.check(f"{when}: encoder cache", *map(encoder_cache_state, (self.ref, self.test)))


def mm_workload(
    rng: random.Random, cfg: h.SchedConfig, encoder: Encoder, n: Optional[int] = None
) -> tuple[list[h.RequestSpec], dict[str, tuple[Image, ...]]]:
    """Plain and multimodal requests over time (about half with 1-3 images), prompts from a
    few shared prefixes (some holding an image) so that prefix hits meet images; identifiers
    from a small pool, each always of one length (a client reusing one id for other content
    is vLLM's error case, :func:`mismatch_workload`)."""
    lengths: dict[str, int] = {}
    pool = [f"img{k}" for k in range(6)]
    limit = min(encoder.budget, encoder.cache_size)

    def image_in(size: int) -> Optional[Image]:
        """An image somewhere in a prompt of ``size`` tokens (``None``: the drawn one is
        longer than the prompt)."""
        ident = rng.choice(pool)
        length = lengths.setdefault(ident, rng.randint(2, min(limit, 24)))
        if length > size:
            return None
        return Image(rng.randrange(size - length + 1), length, ident)

    prefixes = []
    for _ in range(3):
        size = rng.randint(cfg.block_size, 4 * cfg.block_size)
        image = image_in(size) if rng.random() < 0.5 else None
        prefixes.append((h._tokens(rng, size), (image,) if image else ()))
    specs: list[h.RequestSpec] = []
    images: dict[str, tuple[Image, ...]] = {}
    step = 0
    for i in range(n or rng.randint(6, 24)):
        step += rng.choice((0, 0, 1, 2, 4))
        prefix, prefix_images = rng.choice(prefixes) if rng.random() < 0.6 else ([], ())
        prompt = list(prefix) + h._tokens(rng, rng.randint(4, 4 * cfg.block_size))
        max_tokens = rng.choice((1, 3, rng.randint(2, 16), rng.randint(8, 48)))
        prompt = prompt[: max(1, cfg.max_model_len - max_tokens - 1)]
        own = list(prefix_images)
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                image = image_in(len(prompt))
                if image is None:
                    continue
                end = image.offset + image.length
                if not any(o.offset < end and image.offset < o.offset + o.length for o in own):
                    own.append(image)
        req_id = f"m{i}" if own else f"p{i}"
        specs.append(
            h.RequestSpec(
                req_id=req_id,
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                ignore_eos=rng.random() < 0.5,
                arrival_step=step,
                abort_step=step + rng.randint(0, 10) if rng.random() < 0.1 else None,
                priority=rng.choice((0, 0, 1, 2, -1)),
                arrival_time=step + rng.choice((0.0, 0.0, 0.5, -0.5)),
            )
        )
        if own:
            images[req_id] = tuple(sorted(own, key=lambda im: im.offset))
    return specs, images


def mismatch_workload() -> tuple[list[h.RequestSpec], dict[str, tuple[Image, ...]]]:
    """Two requests reusing one identifier for images of different sizes, the second while the
    first's is cached: vLLM finishes the second with an error (``encoder_cache_mismatch_reqs``,
    reported by the next ``update_from_output``); a plain request runs alongside."""
    specs = [
        h.RequestSpec("a", tuple(range(10, 40)), 8, True, 0),
        h.RequestSpec("b", tuple(range(50, 80)), 8, True, 1),
        h.RequestSpec("c", tuple(range(90, 110)), 8, True, 1),
    ]
    images = {"a": (Image(4, 10, "same"),), "b": (Image(2, 6, "same"),)}
    return specs, images
