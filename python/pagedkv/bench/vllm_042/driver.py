"""The one driver of vLLM 0.4.2's engine loop (the V0-era scheduler API, also 0.5.0's) that the
bench, the tests and the demo share: the scheduler's configuration, and what vLLM's
``LLMEngine.step()`` does with a step's sampled tokens (its single-step output processor).

* :func:`make_backend`: the scheduler and Sequence family of an engine (vLLM's own classes,
  pagedkv's dropped in, pagedkv's manager under vLLM's scheduler, or :class:`pagedkv.Scheduler`):
  the one way the bench puts pagedkv into vLLM 0.4.2's scheduler;
* :func:`scheduler_configs`: ``SchedulerConfig`` and ``CacheConfig`` of a config module (vLLM's
  ``vllm.config`` of a release loaded by :mod:`pagedkv.vllm_release`, or
  :mod:`pagedkv.vllm_042.scheduler`)
  with the GPU and CPU block counts set, as ``LLMEngine`` leaves them after profiling;
* :func:`process_group_samples`: vLLM 0.4.2's ``_process_sequence_group_outputs`` without beam
  search: per running parent, its sampled tokens (the last one the parent's own, each other one
  a child forked from the parent before the parent's token is appended), the stop check of
  every new token, the live children added and forked in the block manager, finished parents
  freed;
* :func:`process_outputs`: ``_process_model_outputs``: each scheduled group's computed tokens,
  its samples where it samples, then ``free_finished_seq_groups()``.

The caller brings the model's part (which tokens) and the stop check. Nothing here imports
vLLM: :func:`make_backend` loads a release's files through :mod:`pagedkv.vllm_release`.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

# ---- the schedulers ------------------------------------------------------------------------

BACKENDS = ("vllm", "pagedkv-dropin", "pagedkv-manager", "pagedkv-scheduler")


@dataclass
class Backend:
    """The classes one engine uses: a vLLM-API ``Scheduler`` factory and the Sequence family
    (module with ``Sequence``, ``SequenceGroup``, ``SequenceStatus``, ``Logprob``) plus
    ``SamplingParams``. ``make_scheduler(scheduler_config, cache_config)``."""

    name: str
    version: str
    release: types.SimpleNamespace  # the vllm_release load whose config classes are used
    sequence: Any
    sampling_params: Any
    make_scheduler: Callable[[Any, Any], Any]


def make_backend(version: str, name: str) -> Backend:
    """One of :data:`BACKENDS` for vLLM ``version`` (fetched and loaded by vllm_release)."""
    from pagedkv import vllm_release

    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if name == "pagedkv-scheduler":
        return scheduler_backend(version)
    ns = vllm_release.load(version, "pagedkv" if name == "pagedkv-dropin" else "vllm")

    def scheduler(sched_cfg: Any, cache_cfg: Any) -> Any:
        return ns.scheduler.Scheduler(sched_cfg, cache_cfg, None)

    make = scheduler
    if name == "pagedkv-manager":
        make = _with_pagedkv_manager(ns, version)
    return Backend(name, version, ns, ns.sequence, ns.sampling_params.SamplingParams, make)


def scheduler_backend(version: Optional[str] = None) -> Backend:
    """:class:`pagedkv.Scheduler` (it mirrors vLLM 0.4.2) over pagedkv's Sequence family,
    configured with vLLM ``version``'s own config objects, or without one with the config
    classes of :mod:`pagedkv.vllm_042.scheduler` (no vLLM release needed)."""
    import pagedkv
    from pagedkv import scheduler as config
    from pagedkv import sequence, vllm_release

    if version not in (None, "0.4.2"):
        raise ValueError("pagedkv.Scheduler mirrors vLLM 0.4.2; compare it against 0.4.2")
    ns = vllm_release.load(version, "pagedkv") if version else types.SimpleNamespace(config=config)

    def make(sched_cfg: Any, cache_cfg: Any) -> Any:
        return pagedkv.Scheduler(sched_cfg, cache_cfg, None)

    return Backend("pagedkv-scheduler", "0.4.2", ns, sequence, pagedkv.SamplingParams, make)


def _with_pagedkv_manager(ns: types.SimpleNamespace, version: str) -> Callable[[Any, Any], Any]:
    """A Scheduler of the ``vllm`` load whose block manager is pagedkv's (in the result shape
    of that release)."""
    import pagedkv
    from pagedkv.vllm_042.block_manager import BlockSpaceManagerPairs

    manager = BlockSpaceManagerPairs if version != "0.4.2" else pagedkv.BlockSpaceManager

    def make(sched_cfg: Any, cache_cfg: Any) -> Any:
        cls = ns.interfaces.BlockSpaceManager
        original = cls.__dict__["get_block_space_manager_class"]
        cls.get_block_space_manager_class = staticmethod(lambda version: manager)
        try:
            return ns.scheduler.Scheduler(sched_cfg, cache_cfg, None)
        finally:
            cls.get_block_space_manager_class = original

    return make


# ---- the engine loop ------------------------------------------------------------------------

#: ``(sequence, the parent it continues)``: ``seq is parent`` for a parent's own sample.
Pair = Tuple[Any, Any]


def scheduler_configs(
    config_module: Any,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    *,
    chunked_prefill: bool = False,
    caching: bool = False,
    scheduler_fields: Optional[dict] = None,
    cache_fields: Optional[dict] = None,
) -> Tuple[Any, Any]:
    """``(SchedulerConfig, CacheConfig)`` of ``config_module`` (vLLM 0.4.2's signatures: GPU
    memory 0.9, swap space 1 GiB, cache dtype ``"auto"``), the block counts set;
    ``scheduler_fields`` / ``cache_fields``: more keyword fields of each."""
    sched_cfg = config_module.SchedulerConfig(
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        enable_chunked_prefill=chunked_prefill,
        **dict(scheduler_fields or {}),
    )
    cache_cfg = config_module.CacheConfig(
        block_size, 0.9, 1, "auto", enable_prefix_caching=caching, **dict(cache_fields or {})
    )
    cache_cfg.num_gpu_blocks = num_gpu_blocks
    cache_cfg.num_cpu_blocks = num_cpu_blocks
    return sched_cfg, cache_cfg


def process_group_samples(
    scheduler: Any,
    group: Any,
    samples: Callable[[Any], List[int]],
    new_seq_id: Callable[[], int],
    stop: Callable[[Any], None],
    running: Any,
    logprob: Any,
) -> List[Pair]:
    """vLLM 0.4.2's single-step processing of one group's samples (no beam search).

    ``samples(parent)``: the tokens sampled for a running parent, the parent's own last (more
    than one only where the group forks: ``best_of`` tokens from a group's one sequence);
    ``new_seq_id()``: a child's id; ``stop(seq)`` sets a finished status on a sequence after its
    token; ``running``: the family's ``SequenceStatus.RUNNING``; ``logprob``: its ``Logprob``.
    Returns the ``(sequence, parent)`` pairs, children first per parent."""
    pairs: List[Pair] = []
    for parent in group.get_seqs(status=running):
        *runners_up, own = samples(parent)
        for tok in runners_up:
            child = parent.fork(new_seq_id())
            child.append_token_id(tok, {tok: logprob(0.0)})
            pairs.append((child, parent))
        parent.append_token_id(own, {own: logprob(0.0)})
        pairs.append((parent, parent))
    for seq, _ in pairs:
        stop(seq)
    for seq, parent in pairs:
        if seq is not parent:
            group.add(seq)
            if not seq.is_finished():
                scheduler.fork_seq(parent, seq)
    for seq, parent in pairs:
        if seq is parent and seq.is_finished():
            scheduler.free_seq(seq)
    return pairs


def process_outputs(
    scheduler: Any,
    out: Any,
    samples_in: Callable[[Any], bool],
    sample_group: Callable[[Any], Any],
) -> None:
    """vLLM 0.4.2's ``_process_model_outputs`` for the step's ``SchedulerOutputs`` ``out``:
    every scheduled group's computed tokens advance by its chunk; a group where
    ``samples_in(scheduled_group)`` (``do_sample``: its prompt done) gets
    ``sample_group(group)`` (:func:`process_group_samples` with the caller's tokens); then the
    finished groups are freed."""
    for sg in out.scheduled_seq_groups:
        group = sg.seq_group
        group.update_num_computed_tokens(sg.token_chunk_size)
        if samples_in(sg):
            sample_group(group)
    scheduler.free_finished_seq_groups()
