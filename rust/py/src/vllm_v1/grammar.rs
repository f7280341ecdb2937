//! `update_from_output`'s grammar advance in the native loop: vLLM's
//! `structured_output_manager.accept_tokens(request, tokens)` for each structured-output row
//! with kept tokens, and its rejection logged as vLLM's loop logs it.
//!
//! With vLLM's own manager and no reasoning parser (`pagedkv.vllm_v1._grammar.plain_manager`,
//! asked once per `update_from_output` that has such a row) vLLM's method reduces to three
//! steps, made here in its order: read `structured_output_request.grammar`, set
//! `reasoning_ended = True`, call the grammar's `accept_tokens(request_id, copy of the
//! tokens)`. Otherwise the manager's method is called. Cost per row: one grammar call and
//! three attribute accesses (vLLM's method adds two Python frames and the bounds it derives).

use crate::vllm_v1::engine::PyEngine;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// How this call's rows advance their grammar (decided at the first such row).
pub enum Acceptor<'py> {
    /// vLLM's own manager, every row constrained from its first token.
    Plain,
    /// Any other manager: its `accept_tokens`.
    Manager(Bound<'py, PyAny>),
}

impl<'py> Acceptor<'py> {
    fn of(e: &PyEngine<'_, 'py>) -> PyResult<Self> {
        let py = e.py();
        let manager = e.sched.getattr(intern!(py, "structured_output_manager"))?;
        let plain =
            e.lp.objs
                .plain_grammar_manager
                .bind(py)
                .call1((&manager,))?;
        Ok(if plain.is_truthy()? {
            Acceptor::Plain
        } else {
            Acceptor::Manager(manager)
        })
    }

    fn accept(&self, request: &Bound<'py, PyAny>, tokens: &Bound<'py, PyList>) -> PyResult<bool> {
        let py = request.py();
        let manager = match self {
            Acceptor::Manager(m) => m,
            Acceptor::Plain if tokens.is_empty() => return Ok(true),
            Acceptor::Plain => return accept_plain(request, tokens),
        };
        manager
            .call_method1(intern!(py, "accept_tokens"), (request, tokens))?
            .is_truthy()
    }
}

/// vLLM's `accept_tokens` when the constraint starts at the first token.
fn accept_plain(request: &Bound<'_, PyAny>, tokens: &Bound<'_, PyList>) -> PyResult<bool> {
    let py = request.py();
    let structured = request.getattr(intern!(py, "structured_output_request"))?;
    let grammar = structured.getattr(intern!(py, "grammar"))?;
    structured.setattr(intern!(py, "reasoning_ended"), true)?;
    let id = request.getattr(intern!(py, "request_id"))?;
    let kept = tokens.get_slice(0, tokens.len());
    grammar
        .call_method1(intern!(py, "accept_tokens"), (id, kept))?
        .is_truthy()
}

/// The row's grammar advanced by its kept `tokens`; a rejection is logged on vLLM's
/// scheduler logger with vLLM's message (the caller finishes the request with an error).
pub fn accept_tokens<'py>(
    e: &mut PyEngine<'_, 'py>,
    request: &Bound<'py, PyAny>,
    tokens: &Bound<'py, PyList>,
) -> PyResult<bool> {
    if e.io()?.grammar.is_none() {
        let acceptor = Acceptor::of(e)?;
        if let Some(io) = e.io.as_mut() {
            io.grammar = Some(acceptor);
        }
    }
    let accepted = match &e.io()?.grammar {
        Some(acceptor) => acceptor.accept(request, tokens)?,
        None => Acceptor::of(e)?.accept(request, tokens)?,
    };
    if !accepted {
        let py = request.py();
        let logger = py
            .import("vllm.v1.core.sched.scheduler")?
            .getattr("logger")?;
        let message = "Unexpected: grammar rejected tokens %s for request %s. Terminating request.";
        let id = request.getattr(intern!(py, "request_id"))?;
        logger.call_method1("error", (message, tokens, id))?;
    }
    Ok(accepted)
}
