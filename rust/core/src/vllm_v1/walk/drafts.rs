//! The walk's speculative decoding part (drafts proposed between steps, vLLM's n-gram /
//! suffix / draft-model path): which of a running row's proposed drafts are scheduled with it,
//! `skip_drafts` (`_drafts_unused`), the padding of a resumed one-token decode to `1 +
//! num_spec_tokens`, and the rollback of rejected drafts in `update_from_output`.
//!
//! Invariants:
//! * Nothing here runs without speculative decoding (`num_spec_tokens == 0`): no engine call.
//! * A row's drafts are scheduled once, when the row is committed; the request's proposed
//!   list is emptied then (vLLM: `request.spec_token_ids = []`), so the next step schedules
//!   only what the drafter proposes after this one.
//! * `drafts_needed` only turns true within a call (read again only while false).
//!
//! Cost: O(1) engine calls per scheduled row with speculative decoding (the drafts list is
//! sliced by the engine once), O(1) per row with drafts in `update_from_output`.

use super::Walk;
use crate::vllm_v1::engine::{Drafts, Engine};
use crate::vllm_v1::policy::{self, RunningRow};

impl<E: Engine> Walk<'_, E> {
    /// A scheduled running row's drafts: the proposed ones that fit the scheduled tokens go
    /// into `scheduled_spec_decode_tokens` (the request's list is emptied either way); also
    /// the step's `drafts_needed`. Returns the drafts scheduled.
    pub(super) fn running_row_drafts(
        &mut self,
        req: &E::Req,
        row: &RunningRow,
        num_tokens: u64,
        n: u64,
    ) -> Result<u64, E::Error> {
        if self.set.spec.num_spec_tokens == 0 {
            return Ok(0);
        }
        let computed = row.num_computed_tokens;
        let placeholders = row.num_output_placeholders;
        self.note_drafts_needed(req, computed, n, num_tokens, placeholders)?;
        let proposed = row.num_tokens_with_spec - num_tokens;
        if proposed == 0 {
            return Ok(0);
        }
        let fit = (n + computed).saturating_sub(num_tokens + placeholders);
        let k = proposed.min(fit);
        self.e.schedule_drafts(req, Drafts::Proposed(k))?;
        Ok(k)
    }

    /// `drafts_needed |= not _drafts_unused(...)` (read only while it can still change).
    pub(super) fn note_drafts_needed(
        &mut self,
        req: &E::Req,
        computed: u64,
        n: u64,
        num_tokens: u64,
        placeholders: u64,
    ) -> Result<(), E::Error> {
        if self.drafts_needed {
            return Ok(());
        }
        let outputs = self.e.num_output_tokens(req)?;
        let max_tokens = self.e.max_tokens(req);
        let unused = policy::drafts_unused(
            computed,
            n,
            num_tokens,
            outputs,
            placeholders > 0,
            max_tokens,
        );
        self.drafts_needed = !unused;
        Ok(())
    }

    /// vLLM pads a waiting request with one token left (a resumed decode) to `1 +
    /// num_spec_tokens` when no running row this step is a prefill chunk and it is not the
    /// step's first row (or it has computed tokens); never under a dynamic schedule.
    pub(super) fn draft_padding(&self, num_computed: u64) -> Option<u64> {
        let k = self.set.spec.num_spec_tokens;
        let pad = k > 0
            && !self.set.spec.dynamic
            && !self.prefill_scheduled
            && (self.running_rows > 0 || num_computed > 0);
        pad.then_some(1 + k)
    }

    /// The admitted request leaves `waiting` for `running` with its whole block table.
    /// A row's drafts: all but the one sampled token are accepted drafts; the rejected ones
    /// roll back `num_computed_tokens` (and the async placeholders, which counted them),
    /// unless the output is stale (it predates the preemption that reset both).
    pub(super) fn reject_drafts(
        &mut self,
        req: &E::Req,
        drafts: u64,
        returned: u64,
        stale: bool,
    ) -> Result<(), E::Error> {
        let accepted = returned - 1;
        let rejected = drafts.saturating_sub(accepted);
        if !stale {
            let computed = self.e.num_computed_tokens(req)?;
            if computed > 0 {
                self.e
                    .set_num_computed_tokens(req, computed.saturating_sub(rejected))?;
            }
            let placeholders = self.placeholders(req)?;
            if placeholders > 0 {
                let left = placeholders.saturating_sub(rejected);
                self.e.set_num_output_placeholders(req, left)?;
            }
        }
        self.e.record_drafts(req, drafts, accepted)
    }
}
