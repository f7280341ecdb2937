//! vLLM v1's bindings (`pagedkv_core::vllm_v1`): the manager, KV events, block hashes and
//! the native scheduling loop over vLLM's own objects (see the crate's header).

pub mod call;
pub mod connector;
pub mod drafts;
pub mod encoder;
pub mod engine;
pub mod engine_impl;
pub mod engine_requests;
pub mod engine_update;
pub mod events;
pub mod grammar;
pub mod grammar_rows;
pub mod hash;
pub mod hybrid;
pub mod loop_;
pub mod loop_kv;
pub mod manager;
pub mod manager_inputs;
pub mod manager_vllm;
pub mod output;
pub mod queues;
pub mod settings;
