"""A pooling model (``runner="pooling"``, an embedding model): vLLM samples no token after a
prefill (``num_sampled_tokens_per_step`` 0, so a prompt of ``max_model_len`` tokens fits), a
request has pooling parameters in place of sampling ones and stops (``FINISHED_STOPPED``) at
the pooler output its prompt's last chunk returns, which its ``EngineCoreOutput`` carries
(``pooling_output``). pagedkv's native loop against vLLM's scheduler in lockstep
(``v1_harness.Lockstep``): every step compared (SchedulerOutput, EngineCoreOutputs with the
pooler outputs, KV events, scheduler state) and native, with chunked prefill, preemption,
prefix caching, aborts, priorities, sync and async."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import v1_harness as h
from test_differential import assert_native_loop


def pooling_seed(seed: int) -> tuple[h.SchedConfig, list[h.RequestSpec]]:
    """``v1_harness.random_config``'s engine and workload as a pooling model's: no drafts,
    masks, grammars, LoRA, prompt embeddings, repetition checks or streaming sessions (none
    applies to pooling requests), every request pooling."""
    rng = random.Random(seed)
    cfg = dataclasses.replace(
        h.random_config(rng),
        pooling=True,
        num_spec_tokens=0,
        sampling_mask=False,
        spec_metrics="none",
        dynamic_sd=None,
    )
    specs = [
        dataclasses.replace(s, pooling=True, repetition=False, updates=(), held=False)
        for s in h.random_workload(rng, cfg)
    ]
    return cfg, specs


@pytest.mark.parametrize("seed", range(24))
def test_pooling_lockstep(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    cfg, specs = pooling_seed(seed)
    lockstep = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls)
    assert lockstep.ref.num_sampled_tokens_per_step == 0
    stats = lockstep.run()
    assert stats["pooled"] > 0 and stats["finish_reasons"]["STOP"] > 0, stats
    assert_native_loop(stats, manager_cls)


def test_a_prompt_of_max_model_len_is_pooled(tiny_model_dir: Path, manager_cls: type) -> None:
    """No slot is kept for a sampled token: the prompt of ``max_model_len`` tokens runs whole
    (a sampling model's room rule would stop one short), and its output carries the vector."""
    import torch

    cfg = dataclasses.replace(h.SchedConfig(), pooling=True, max_model_len=64)
    sched = h.make_scheduler(cfg, tiny_model_dir, manager_cls)
    spec = h.RequestSpec("p", tuple(range(1, 65)), 1, True, 0, pooling=True)
    sched.add_request(h.build_request(spec, h.request_block_hasher(cfg)))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p": 64}
    vector = torch.tensor([1.0, 2.0])
    mro = h.model_runner_output(["p"], [[]], None, [vector])
    (outputs,) = sched.update_from_output(out, mro).values()
    (o,) = outputs.outputs
    assert o.pooling_output is vector and o.finish_reason.name == "STOP" and not o.new_token_ids
    assert "p" not in sched.requests
    if hasattr(sched, "pagedkv_steps"):
        assert sched.pagedkv_steps == {"native": 1}
