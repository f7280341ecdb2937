//! The scheduler's settings the walk reads at each call's start
//! (`pagedkv_core::vllm_v1::engine::Settings`), read off vLLM's scheduler as its own loop reads
//! them each step (vLLM's tests change some after construction); the speculative config's
//! draft slots were read when the loop was built.

use crate::vllm_v1::loop_::PyV1Loop;
use pagedkv_core::vllm_v1::engine::{MambaSplitRule, Runner, Settings, SpecSettings};
use pagedkv_core::vllm_v1::mamba_split::MambaSplit;
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
        mamba_split: mamba_split(sched, lp)?,
    })
}

/// `_mamba_block_aligned_split`'s rule, when `need_mamba_block_aligned_split` is set:
/// vLLM's own method (its inputs) or another the scheduler runs instead.
fn mamba_split(sched: &Bound<'_, PyAny>, lp: &PyV1Loop) -> PyResult<Option<MambaSplitRule>> {
    let py = sched.py();
    if !flag(sched, intern!(py, "need_mamba_block_aligned_split"))? {
        return Ok(None);
    }
    if !runs_vllms_split(sched, lp)? {
        return Ok(Some(MambaSplitRule::Custom));
    }
    let cache = sched.getattr(intern!(py, "cache_config"))?;
    let cfg = sched.getattr(intern!(py, "scheduler_config"))?;
    let max_scheduled = get_u64(sched, intern!(py, "max_num_scheduled_tokens"))?;
    let threshold = get_u64(&cfg, intern!(py, "long_prefill_token_threshold"))?;
    let alignment: Option<u64> = sched
        .getattr(intern!(py, "mamba_prefill_checkpoint_alignment"))?
        .extract()?;
    let lookahead = match sched.getattr_opt(intern!(py, "num_hash_lookahead_tokens"))? {
        Some(v) => v.extract()?,
        None => 0,
    };
    Ok(Some(MambaSplitRule::Vllm(MambaSplit {
        block_size: get_u64(&cache, intern!(py, "block_size"))?,
        hash_block_size: get_u64(sched, intern!(py, "hash_block_size"))?,
        partial_cache_hit: flag(sched, intern!(py, "mamba_partial_cache_hit"))?,
        shared_prefix_checkpoint: flag(sched, intern!(py, "mamba_shared_prefix_checkpoint"))?,
        drop_eagle_block: flag(sched, intern!(py, "use_eagle_block_drop"))?,
        num_hash_lookahead_tokens: lookahead,
        has_checkpoint_blocks: flag(sched, intern!(py, "mamba_has_prefill_checkpoint_blocks"))?,
        checkpoint_alignment: alignment.unwrap_or(0),
        max_prefill_tokens: match threshold {
            0 => max_scheduled,
            t => max_scheduled.min(t),
        },
    })))
}

/// Whether the scheduler's `_mamba_block_aligned_split` runs vLLM's own code (not a
/// platform plugin's patch, a subclass's override or an instance's stand-in).
fn runs_vllms_split(sched: &Bound<'_, PyAny>, lp: &PyV1Loop) -> PyResult<bool> {
    let py = sched.py();
    let Some(vllms) = &lp.objs.vllm_mamba_split_code else {
        return Ok(false);
    };
    let method = sched.getattr(intern!(py, "_mamba_block_aligned_split"))?;
    let func = method
        .getattr_opt(intern!(py, "__func__"))?
        .unwrap_or(method);
    Ok(match func.getattr_opt(intern!(py, "__code__"))? {
        Some(code) => code.is(vllms.bind(py)),
        None => false,
    })
}

/// `num_spec_tokens`, `num_lookahead_tokens`, `num_prefill_lookahead`, `can_skip_drafts`
/// (0.33), read each call; the draft slots of the speculative config, read at construction.
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
        prefill_lookahead: get_u64(sched, intern!(py, "num_prefill_lookahead"))?,
    })
}
