//! The walk's multimodal part: the encoder compute budget of one `schedule()` and the points
//! where vLLM's scheduler consults its encoder cache manager (`_try_schedule_encoder_inputs`
//! before a row's blocks, `_allocate_encoder_inputs` when the row is committed, the budget
//! given back when a PRIORITY preemption takes a committed row back, the cache freed when an
//! admission does not fit, `_free_encoder_inputs` in `update_from_output`).
//!
//! Which inputs an image needs, whether they are cached and whether they fit is vLLM's rule
//! over its own objects: the engine answers it ([`Engine::schedule_encoder_inputs`]). The walk
//! keeps the order and the budget.
//!
//! Invariants:
//! * `budget` is `None` until the step meets a request with encoder inputs, then the budget
//!   left: `max_num_encoder_input_tokens` minus the embeddings of the committed rows' inputs
//!   (plus what PRIORITY preemptions gave back since the last commit).
//! * `taken` holds each committed row that scheduled inputs, with the embeddings it took
//!   (`budget before - budget after` of its plan: vLLM subtracts each input's embeddings).
//! * Requests without encoder inputs make no engine call here (`has_encoder_inputs` is a
//!   field the engine read once).
//!
//! Cost: O(1) per request with encoder inputs and step, plus O(committed such rows) per
//! PRIORITY preemption of a committed row.

use super::Walk;
use crate::vllm_v1::engine::Engine;

/// The encoder side of one `schedule()` call.
pub(super) struct EncoderStep<R> {
    budget: Option<u64>,
    /// The last plan that scheduled inputs: its request, the budget after it, what it takes.
    pending: Option<(R, u64, u64)>,
    taken: Vec<(R, u64)>,
}

impl<R> EncoderStep<R> {
    pub(super) fn new() -> Self {
        EncoderStep {
            budget: None,
            pending: None,
            taken: Vec::new(),
        }
    }
}

impl<E: Engine> Walk<'_, E> {
    /// The tokens a row with `n` tokens may take once its encoder inputs are placed (vLLM's
    /// `_try_schedule_encoder_inputs`; `n` unchanged for a request without encoder inputs).
    pub(super) fn encoder_tokens(
        &mut self,
        req: &E::Req,
        num_computed: u64,
        n: u64,
    ) -> Result<u64, E::Error> {
        self.enc.pending = None;
        if n == 0 || !self.e.has_encoder_inputs(req) {
            return Ok(n);
        }
        let budget = match self.enc.budget {
            Some(b) => b,
            None => self.e.encoder_budget()?,
        };
        self.enc.budget = Some(budget);
        let plan = self
            .e
            .schedule_encoder_inputs(req, num_computed, n, budget)?;
        if plan.scheduled {
            let cost = budget.saturating_sub(plan.budget);
            self.enc.pending = Some((req.clone(), plan.budget, cost));
        }
        Ok(plan.tokens)
    }

    /// The row is committed: its plan's budget becomes the step's (vLLM assigns the budget
    /// the plan computed, so a budget given back by a preemption for this very row is
    /// overwritten) and the engine allocates its inputs.
    pub(super) fn commit_encoder(&mut self, req: &E::Req) -> Result<(), E::Error> {
        let Some((r, after, cost)) = self.enc.pending.take() else {
            return Ok(());
        };
        if r != *req {
            return Ok(());
        }
        self.enc.budget = Some(after);
        self.enc.taken.push((r, cost));
        self.e.commit_encoder_inputs(req)
    }

    /// A PRIORITY preemption took back the committed row of `victim`: its embeddings return
    /// to the budget and its inputs leave the step's output.
    pub(super) fn encoder_give_back(&mut self, victim: &E::Req) -> Result<(), E::Error> {
        let Some(k) = self.enc.taken.iter().position(|(r, _)| r == victim) else {
            return Ok(());
        };
        let (_, cost) = self.enc.taken.remove(k);
        if let Some(b) = self.enc.budget.as_mut() {
            *b = b.saturating_add(cost);
        }
        self.e.drop_encoder_inputs(victim)
    }

    /// An admission whose blocks did not fit: vLLM frees the request's encoder cache entries
    /// (those its plan referenced).
    pub(super) fn encoder_unfit(&mut self, req: &E::Req) -> Result<(), E::Error> {
        self.enc.pending = None;
        match self.e.has_encoder_inputs(req) {
            true => self.e.free_encoder_cache(req),
            false => Ok(()),
        }
    }

    /// `update_from_output`: the inputs the executed step consumed are freed.
    pub(super) fn encoder_done(&mut self, req: &E::Req) -> Result<(), E::Error> {
        match self.e.has_encoder_inputs(req) {
            true => self.e.free_encoder_inputs(req),
            false => Ok(()),
        }
    }
}
