//! `update_from_output`'s grammar advance in the native loop: vLLM's
//! `structured_output_manager.accept_tokens(request, tokens)` for each row with kept tokens,
//! and its rejection logged as vLLM's loop logs it.
//!
//! How is decided once per `update_from_output` that has a row with tokens
//! (`pagedkv.vllm_v1._grammar.manager_kind`, one Python call), as an [`Acceptor`]:
//! * vLLM's own manager without a reasoning parser (`Plain`): vLLM's method reduces to three
//!   steps, made here in its order: read `structured_output_request.grammar` (as vLLM's
//!   property returns it, `grammar_rows::grammar_of`), set
//!   `reasoning_ended = True`, call the grammar's `accept_tokens(request_id, copy of the
//!   tokens)`; a row without structured output is accepted at once, as vLLM's method
//!   accepts it. Cost per structured row: one grammar call and three attribute accesses
//!   (vLLM's method adds two Python frames and the bounds it derives).
//! * vLLM's own manager with a reasoning parser (`VllmsOwn`): the manager's method for a
//!   structured row, a row without structured output accepted at once (the method's first
//!   line).
//! * Any other manager (`Foreign`: a subclass, a plugin's patch): its method for every row
//!   with tokens, as vLLM's loop calls it.

use crate::vllm_v1::engine::PyEngine;
use crate::vllm_v1::engine_requests::PyReq;
use crate::vllm_v1::grammar_rows::grammar_of;
use crate::vllm_v1::loop_::Objects;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// `_grammar.manager_kind`'s answers: vLLM's own manager without a reasoning parser, and a
/// manager that is not vLLM's own code (any other answer: vLLM's own with a parser).
pub const PLAIN: u8 = 0;
pub const FOREIGN: u8 = 2;

/// `_grammar.manager_kind(manager)` (one Python call).
pub fn manager_kind(objs: &Objects, manager: &Bound<'_, PyAny>) -> PyResult<u8> {
    let kind = objs.grammar_manager_kind.bind(manager.py());
    kind.call1((manager,))?.extract()
}

/// How this call's rows advance their grammar (see the module's text).
pub enum Acceptor<'py> {
    Plain,
    VllmsOwn(Bound<'py, PyAny>),
    Foreign(Bound<'py, PyAny>),
}

impl<'py> Acceptor<'py> {
    fn of(e: &PyEngine<'_, 'py>) -> PyResult<Self> {
        let manager = e
            .sched
            .getattr(intern!(e.py(), "structured_output_manager"))?;
        Ok(match manager_kind(&e.lp.objs, &manager)? {
            PLAIN => Acceptor::Plain,
            FOREIGN => Acceptor::Foreign(manager),
            _ => Acceptor::VllmsOwn(manager),
        })
    }

    fn accept(&self, r: &PyReq<'py>, tokens: &Bound<'py, PyList>) -> PyResult<bool> {
        let py = tokens.py();
        if tokens.is_empty() {
            return Ok(true); // vLLM's loop asks only for a row with tokens
        }
        let manager = match self {
            Acceptor::Foreign(m) => m,
            _ if !r.f.structured => return Ok(true),
            Acceptor::Plain => return accept_plain(r, tokens),
            Acceptor::VllmsOwn(m) => m,
        };
        manager
            .call_method1(intern!(py, "accept_tokens"), (&r.obj, tokens))?
            .is_truthy()
    }
}

/// vLLM's `accept_tokens` when the constraint starts at the first token (the request's id
/// is its fixed field: `request.request_id`).
fn accept_plain(r: &PyReq<'_>, tokens: &Bound<'_, PyList>) -> PyResult<bool> {
    let py = tokens.py();
    let structured = r.obj.getattr(intern!(py, "structured_output_request"))?;
    let grammar = grammar_of(&structured)?;
    structured.setattr(intern!(py, "reasoning_ended"), true)?;
    let kept = tokens.get_slice(0, tokens.len());
    grammar
        .call_method1(intern!(py, "accept_tokens"), (r.f.id.bind(py), kept))?
        .is_truthy()
}

/// The row's grammar advanced by its kept `tokens`; a rejection is logged on vLLM's
/// scheduler logger with vLLM's message (the caller finishes the request with an error).
pub fn accept_tokens<'py>(
    e: &mut PyEngine<'_, 'py>,
    r: &PyReq<'py>,
    tokens: &Bound<'py, PyList>,
) -> PyResult<bool> {
    // The step's acceptor, decided at its first row with tokens, lent out for this row.
    let acceptor = match e.io.as_mut().and_then(|io| io.grammar.take()) {
        Some(acceptor) => acceptor,
        None => Acceptor::of(e)?,
    };
    let accepted = acceptor.accept(r, tokens);
    if let Some(io) = e.io.as_mut() {
        io.grammar = Some(acceptor);
    }
    let accepted = accepted?;
    if !accepted {
        let py = tokens.py();
        let logger = py
            .import("vllm.v1.core.sched.scheduler")?
            .getattr("logger")?;
        let message = "Unexpected: grammar rejected tokens %s for request %s. Terminating request.";
        let id = r.f.id.bind(py);
        logger.call_method1("error", (message, tokens, id))?;
    }
    Ok(accepted)
}
