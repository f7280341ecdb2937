//! The walk's `Scheduler.update_from_output()`: each scheduled row takes its sampled tokens
//! (`_update_request_with_output`, `check_stop`, the repetition check), rejected drafts are
//! rolled back, finished encoder inputs freed (`_free_encoder_inputs`), async output
//! placeholders resolved and the blocks they let be cached cached, structured output's
//! `accept_tokens` checked, and the stopped requests freed (`_free_request`) or, for a
//! streaming session whose turn ended, kept to be enqueued again (`_handle_stopped_request`).
//!
//! Release differences: 0.33 takes the sampled tokens dropped after a stop off the computed
//! tokens, resolves placeholders by every returned token and caches up to the computed tokens
//! not in flight (after every step with speculative decoding too), and enqueues the
//! continuing sessions after the removal in output order; 0.32 resolves by the kept tokens,
//! caches up to the computed tokens not placeholders, and enqueued each continuing session
//! already (so one that was not running leaves its queue again with the removal).
//!
//! Invariants: output from before a preemption (stale) resolves no placeholder and caches
//! nothing; a request finished while in flight gets nothing; the stopped requests leave their
//! queues together, once per call.
//!
//! Cost: O(1) engine calls per scheduled row and per sampled token it appends.

use super::Walk;
use crate::vllm_v1::engine::{Engine, Release, Status};
use crate::vllm_v1::policy::{self, Stop};

/// A row whose request stopped: whether it was running, and whether it goes on (a
/// streaming session's next turn).
struct Stopped {
    was_running: bool,
    continues: bool,
}

impl<E: Engine> Walk<'_, E> {
    /// `Scheduler.update_from_output()`: each scheduled row takes its sampled tokens; the
    /// stopped requests are freed (a streaming session's turn ends instead), then removed from
    /// their queues together; 0.33 then enqueues the continuing sessions in output order
    /// (0.32's `_handle_stopped_request` enqueued each already, so one that was not running
    /// leaves its queue again with the removal, as in vLLM 0.32).
    pub fn update_from_output(mut self) -> Result<(), E::Error> {
        let mut stopped_running = Vec::new();
        let mut stopped_other = Vec::new();
        let mut continuing = Vec::new();
        for (req, n, drafts) in self.e.scheduled_rows()? {
            let Some(stopped) = self.update_row(&req, n, drafts)? else {
                continue;
            };
            if stopped.continues {
                continuing.push(req.clone());
            }
            match stopped.was_running {
                true => stopped_running.push(req),
                false => stopped_other.push(req),
            }
        }
        self.e.remove_stopped(&stopped_running, &stopped_other)?;
        if self.mode.release == Release::V033 {
            for req in &continuing {
                self.e.enqueue_waiting(req)?;
            }
        }
        Ok(())
    }

    /// One row of `update_from_output`; `Some` when the request stopped.
    fn update_row(
        &mut self,
        req: &E::Req,
        n: u64,
        drafts: u64,
    ) -> Result<Option<Stopped>, E::Error> {
        let in_flight = self.e.num_in_flight_tokens(req)?;
        self.e
            .set_num_in_flight_tokens(req, in_flight.saturating_sub(n))?;
        let stale_tokens = self.e.num_stale_output_tokens(req)?;
        let stale = stale_tokens > 0;
        if stale {
            self.e
                .set_num_stale_output_tokens(req, stale_tokens.saturating_sub(n))?;
        }
        if self.e.load_failed(req)? {
            return Ok(None); // recomputed (or failed) as the connector's failure says
        }
        let status = self.e.status(req)?;
        let was_running = status == Status::Running;
        // Aborted or finished while in flight; or stale output the request drops.
        if status == Status::Finished || (stale && self.e.drop_stale_output(req)?) {
            return Ok(None);
        }
        let mut sampled = self.e.sampled(req)?;
        let returned = self.e.sampled_len(&sampled);
        if drafts > 0 && returned > 0 {
            self.reject_drafts(req, drafts, returned as u64, stale)?;
        }
        // After the rollback, as in vLLM: the inputs freed are those behind the computed
        // tokens that remain.
        self.encoder_done(req)?;
        let mut stop = None;
        if returned > 0 {
            stop = self.update_request_with_output(req, &mut sampled, stale)?;
            let kept = self.e.sampled_len(&sampled);
            self.resolve_placeholders(req, stale, was_running, returned, kept)?;
            // vLLM asks the manager for every row with tokens (its own manager answers
            // `True` at once for a request without structured output).
            if !self.e.accept_tokens(req, &sampled)? {
                // vLLM logs the rejection and finishes the request with an error.
                self.e.set_stopped(req, Stop::Error)?;
                stop = Some(Stop::Error);
            }
        } else if self.e.pooled(req)? {
            self.e.set_stopped(req, Stop::Pooled)?;
            stop = Some(Stop::Pooled);
        }
        let emit = returned > 0 || stop.is_some();
        let pending = self.e.begin_output(req, &sampled, emit)?;
        let continues = match stop {
            Some(_) => self.handle_stopped(req)?,
            None => false,
        };
        self.e.emit_output(req, pending, sampled, stop, emit)?;
        Ok(stop.map(|_| Stopped {
            was_running,
            continues,
        }))
    }

    /// A stopped request is freed, unless it is a streaming session whose turn ended and
    /// that goes on (then true: it is to be enqueued again).
    fn handle_stopped(&mut self, req: &E::Req) -> Result<bool, E::Error> {
        if self.e.resumable(req)? && !self.e.handle_stopped(req)? {
            return Ok(true);
        }
        self.e.free_request(req)?;
        Ok(false)
    }

    /// `_update_request_with_output`: append the sampled tokens one by one, stop at the first
    /// `check_stop` stops on and drop the rest (0.33 also takes them off the computed tokens).
    fn update_request_with_output(
        &mut self,
        req: &E::Req,
        sampled: &mut E::Sampled,
        stale: bool,
    ) -> Result<Option<Stop>, E::Error> {
        let rule = self.e.stop_rule(req);
        let count = self.e.sampled_len(sampled);
        let cap = self.set.limits.max_model_len;
        for k in 0..count {
            let last = self.e.append_output_token(req, sampled, k)?;
            let num_tokens = self.e.num_tokens(req);
            let num_out = self.e.num_output_tokens(req)?;
            let mut stop = policy::check_stop(&rule, last, num_tokens, num_out, cap);
            if let (None, Some(rep)) = (stop, policy::repetition_due(&rule, num_out)) {
                if self.e.repeats(req, rep)? {
                    stop = Some(Stop::Repetition);
                }
            }
            let Some(stop) = stop else {
                continue;
            };
            self.e.set_stopped(req, stop)?;
            let kept = k + 1;
            if kept < count {
                if self.mode.release == Release::V033 && !stale {
                    let c = self.e.num_computed_tokens(req)?;
                    let trimmed = (count - kept) as u64;
                    self.e
                        .set_num_computed_tokens(req, c.saturating_sub(trimmed))?;
                }
                self.e.truncate_sampled(sampled, kept)?;
            }
            return Ok(Some(stop));
        }
        Ok(None)
    }

    /// The async placeholders a row's output resolves, and the blocks it lets be cached: 0.33
    /// resolves by every returned token and caches up to the computed tokens not in flight;
    /// 0.32 resolves by the kept tokens and caches up to the computed tokens not placeholders.
    /// Stale output (from before a preemption) resolves nothing.
    fn resolve_placeholders(
        &mut self,
        req: &E::Req,
        stale: bool,
        was_running: bool,
        returned: usize,
        kept: usize,
    ) -> Result<(), E::Error> {
        let spec_033 = self.set.spec.num_spec_tokens > 0 && self.mode.release == Release::V033;
        if !self.mode.asynchronous && !spec_033 {
            return Ok(());
        }
        let before = self.placeholders(req)?;
        let cache_upto = match self.mode.release {
            Release::V033 => {
                if !stale && before > 0 {
                    let left = before.saturating_sub(returned as u64);
                    self.e.set_num_output_placeholders(req, left)?;
                }
                // 0.33 also caches after every step with speculative decoding.
                if stale || !was_running || (before == 0 && !spec_033) {
                    return Ok(());
                }
                let in_flight = self.e.num_in_flight_tokens(req)?;
                self.e.num_computed_tokens(req)?.saturating_sub(in_flight)
            }
            Release::V032 => {
                let left = match stale {
                    true => before,
                    false => before.saturating_sub(kept as u64),
                };
                if !stale {
                    self.e.set_num_output_placeholders(req, left)?;
                }
                if !was_running {
                    return Ok(());
                }
                self.e.num_computed_tokens(req)?.saturating_sub(left)
            }
        };
        self.e.cache_blocks(req, cache_upto)
    }
}
