//! The scheduler's settings the walk reads at each call's start
//! (`pagedkv_core::vllm_v1::engine::Settings`), read off vLLM's scheduler as its own loop reads
//! them each step (vLLM's tests change some after construction); the speculative config's
//! draft slots were read when the loop was built.

use crate::vllm_v1::loop_::PyV1Loop;
use pagedkv_core::vllm_v1::engine::{Runner, Settings, SpecSettings};
use pagedkv_core::vllm_v1::policy::{self, Limits};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyString;

fn get_u64(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<u64> {
    obj.getattr(name)?.extract()
}

/// An attribute's truth, false where the release has no such attribute.
fn flag(o: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<bool> {
    match o.getattr(name) {
        Ok(v) => v.is_truthy(),
        Err(_) => Ok(false),
    }
}

/// The scheduler's settings (read each call, as vLLM's loop reads them each step).
pub fn read_settings(sched: &Bound<'_, PyAny>, lp: &PyV1Loop) -> PyResult<Settings> {
    let py = sched.py();
    let cfg = sched.getattr(intern!(py, "scheduler_config"))?;
    let limits = Limits {
        max_model_len: policy::length_cap(
            get_u64(sched, intern!(py, "max_model_len"))?,
            lp.pool_tokens,
        ),
        long_prefill_token_threshold: get_u64(&cfg, intern!(py, "long_prefill_token_threshold"))?,
        adaptive_threshold: flag(sched, intern!(py, "adaptive_long_prefill_threshold"))?,
        chunked_prefill: flag(&cfg, intern!(py, "enable_chunked_prefill"))?,
        // 0 for a pooling model (no sampled token after prefill; diffusion stays vLLM's).
        sampled_per_step: match sched.getattr(intern!(py, "num_sampled_tokens_per_step")) {
            Ok(v) => v.extract()?,
            Err(_) => 1,
        },
    };
    let running = get_u64(sched, intern!(py, "max_num_running_reqs"))?;
    let active = match sched.getattr(intern!(py, "max_num_active_reqs")) {
        Ok(v) => v.extract()?,
        Err(_) => running,
    };
    let policy = sched.getattr(intern!(py, "policy"))?;
    let lora = sched.getattr(intern!(py, "lora_config"))?;
    let max_loras = match lora.is_none() {
        true => None,
        false => Some(
            lora.getattr(intern!(py, "max_loras"))?
                .extract::<crate::args::SatCount>()?
                .usize(),
        ),
    };
    Ok(Settings {
        limits,
        max_num_scheduled_tokens: get_u64(sched, intern!(py, "max_num_scheduled_tokens"))?,
        max_num_batched_tokens: get_u64(&cfg, intern!(py, "max_num_batched_tokens"))?,
        max_num_active_reqs: active as usize,
        max_num_running_reqs: running as usize,
        priority: policy.eq(lp.objs.priority.bind(py))?,
        reserve_full_isl: flag(sched, intern!(py, "scheduler_reserve_full_isl"))?,
        runner: match flag(sched, intern!(py, "use_v2_model_runner"))? {
            true => Runner::V2,
            false => Runner::V1,
        },
        max_loras,
        spec: spec_settings(sched, lp)?,
    })
}

/// `num_spec_tokens`, `num_lookahead_tokens`, `can_skip_drafts` (0.33), read each call; the
/// draft slots of the speculative config, read at construction.
fn spec_settings(sched: &Bound<'_, PyAny>, lp: &PyV1Loop) -> PyResult<SpecSettings> {
    let py = sched.py();
    Ok(SpecSettings {
        num_spec_tokens: get_u64(sched, intern!(py, "num_spec_tokens"))?,
        num_lookahead_tokens: get_u64(sched, intern!(py, "num_lookahead_tokens"))?,
        draft_slots: lp.draft_slots,
        can_skip_drafts: flag(sched, intern!(py, "can_skip_drafts"))?,
        dynamic: !sched
            .getattr_opt(intern!(py, "dynamic_sd_lookup"))?
            .is_none_or(|l| l.is_none()),
    })
}
