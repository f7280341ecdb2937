//! vLLM's per-step speculative decoding stats (`SpecDecodingStats`, `vllm/v1/spec_decode/
//! metrics.py`, the same in 0.32 and 0.33), tallied natively: `update_from_output` observes
//! each row's drafts (`make_spec_decoding_stats` -> `observe_draft`) and the caller builds
//! vLLM's object once per step from the tally.
//!
//! Invariants:
//! * the per-position lists have `num_spec_tokens` entries, as `SpecDecodingStats.new` makes;
//! * an observation vLLM's `observe_draft` would fail on (more accepted tokens than
//!   `num_spec_tokens`: its assert; more draft tokens: an index past its list) is refused and
//!   changes nothing;
//! * a row with no draft tokens is not observed (`make_spec_decoding_stats` returns before
//!   `observe_draft`); one whose drafts were all grammar-invalidated is, with 0 proposed.
//!
//! Cost: O(num_spec_tokens) per observed row; no allocation after construction.

use crate::Error;

/// `SpecDecodingStats` of one step, before vLLM's object is built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecTally {
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub accepted_per_pos: Vec<u64>,
    pub draft_per_pos: Vec<u64>,
}

impl SpecTally {
    pub fn new(num_spec_tokens: usize) -> Self {
        SpecTally {
            accepted_per_pos: vec![0; num_spec_tokens],
            draft_per_pos: vec![0; num_spec_tokens],
            ..SpecTally::default()
        }
    }

    /// `make_spec_decoding_stats(..., num_draft_tokens, num_accepted_tokens,
    /// num_invalid_spec_tokens)` for one row: `invalid` drafts (grammar-rejected) are not
    /// counted as proposed.
    pub fn observe(&mut self, drafts: u64, accepted: u64, invalid: u64) -> Result<(), Error> {
        if drafts == 0 {
            return Ok(());
        }
        // Taken off after the check: a row whose drafts were all invalid is still a draft.
        let drafts = drafts.saturating_sub(invalid);
        let k = self.draft_per_pos.len() as u64;
        if accepted > k || drafts > k {
            return Err(Error::invalid(format!(
                "{drafts} drafts, {accepted} accepted: more than num_spec_tokens {k}"
            )));
        }
        self.num_drafts += 1;
        self.num_draft_tokens += drafts;
        self.num_accepted_tokens += accepted;
        for n in &mut self.accepted_per_pos[..accepted as usize] {
            *n += 1;
        }
        for n in &mut self.draft_per_pos[..drafts as usize] {
            *n += 1;
        }
        Ok(())
    }

    /// Whether any row was observed (vLLM's stats stay `None` otherwise).
    pub fn observed(&self) -> bool {
        self.num_drafts > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_add_up_per_position() {
        let mut t = SpecTally::new(3);
        t.observe(3, 1, 0).unwrap();
        t.observe(2, 2, 0).unwrap();
        assert_eq!(
            (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens),
            (2, 5, 3)
        );
        assert_eq!(t.accepted_per_pos, [2, 1, 0]);
        assert_eq!(t.draft_per_pos, [2, 2, 1]);
    }

    #[test]
    fn invalid_drafts_are_not_proposed_and_an_empty_row_is_not_observed() {
        let mut t = SpecTally::new(3);
        t.observe(3, 0, 1).unwrap();
        assert_eq!((t.num_drafts, t.draft_per_pos.clone()), (1, vec![1, 1, 0]));
        t.observe(2, 0, 2).unwrap(); // all invalid: still a draft, none proposed
        assert_eq!((t.num_drafts, t.num_draft_tokens), (2, 2));
        t.observe(0, 0, 0).unwrap(); // no drafts: vLLM returns before observing
        assert_eq!(t.num_drafts, 2);
        assert!(!SpecTally::new(3).observed() && t.observed());
    }

    #[test]
    fn more_than_num_spec_tokens_is_refused_unchanged() {
        let mut t = SpecTally::new(2);
        t.observe(2, 1, 0).unwrap();
        let before = t.clone();
        assert!(t.observe(3, 0, 0).is_err());
        assert!(t.observe(2, 3, 0).is_err());
        assert_eq!(t, before);
    }
}
