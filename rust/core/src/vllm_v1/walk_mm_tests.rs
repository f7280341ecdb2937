//! The walk's behaviours for multimodal requests: the encoder compute budget (it caps a row
//! before an image that does not fit, an exhausted budget leaves a request 0 tokens and the
//! pass goes on, a PRIORITY preemption gives a committed row's budget back) and the encoder
//! cache (an input already cached is not computed again). Written from vLLM's `scheduler.py`
//! (`schedule()`'s running and waiting passes, `_try_schedule_encoder_inputs`,
//! `_allocate_encoder_inputs`, `update_from_output`'s `_free_encoder_inputs`).
//!
//! [`MmSim`] stands in for vLLM's encoder cache manager with an unbounded cache: an input is
//! computed when its placeholder range meets the row's window, unless it is cached or already
//! chosen in this plan; one that does not fit the budget ends the row before it.

use super::*;
use std::collections::BTreeSet;

/// One multimodal input of a request: its placeholder range (every position an embedding)
/// and its identifier (the encoder cache's key).
#[derive(Clone, Debug)]
pub(super) struct Image {
    offset: u64,
    len: u64,
    id: &'static str,
}

#[derive(Default)]
pub(super) struct MmSim {
    pub(super) images: HashMap<usize, Vec<Image>>,
    /// `max_num_encoder_input_tokens`.
    pub(super) budget: u64,
    cached: BTreeSet<&'static str>,
    pending: Option<(usize, Vec<usize>)>,
    /// This step's `scheduled_encoder_inputs`, in insertion order.
    pub(super) scheduled: Vec<(usize, Vec<usize>)>,
    /// Requests `encoder_cache_manager.free` ran for (an admission that did not fit).
    pub(super) unfit: Vec<usize>,
    /// Requests `_free_encoder_inputs` ran for, with their computed tokens at the call.
    pub(super) done: Vec<(usize, u64)>,
}

impl MmSim {
    /// `_try_schedule_encoder_inputs` over this sim's cache.
    pub(super) fn plan(&mut self, r: usize, c: u64, n: u64, mut budget: u64) -> EncoderPlan {
        let mut chosen = Vec::new();
        let mut ids: Vec<&str> = Vec::new();
        let mut tokens = n;
        for (i, img) in self.images[&r].iter().enumerate() {
            let outside = img.offset >= c + n || img.offset + img.len <= c;
            if outside || ids.contains(&img.id) || self.cached.contains(img.id) {
                continue;
            }
            if img.len > budget {
                tokens = img.offset.saturating_sub(c);
                break;
            }
            budget -= img.len;
            ids.push(img.id);
            chosen.push(i);
        }
        let scheduled = !chosen.is_empty();
        self.pending = Some((r, chosen));
        EncoderPlan {
            tokens,
            budget,
            scheduled,
        }
    }

    /// `_allocate_encoder_inputs`: the chosen inputs are cached; the row's entry is recorded.
    pub(super) fn commit(&mut self, r: usize) {
        let Some((p, chosen)) = self.pending.take() else {
            panic!("a commit without a plan");
        };
        assert_eq!(p, r, "the commit is for the last plan's request");
        for &i in &chosen {
            self.cached.insert(self.images[&r][i].id);
        }
        self.scheduled.push((r, chosen));
    }
}

/// `add` a request whose prompt holds `images` as `(offset, length, identifier)`.
fn add_mm(e: &mut TestEngine, prompt: u64, images: &[(u64, u64, &'static str)]) -> usize {
    let r = e.add(prompt, 10);
    let images = images
        .iter()
        .map(|&(offset, len, id)| Image { offset, len, id });
    e.mm.images.insert(r, images.collect());
    r
}

/// One `schedule()`, with this step's `scheduled_encoder_inputs` alone in `e.mm.scheduled`.
fn schedule(e: &mut TestEngine) -> Vec<(usize, u64)> {
    e.mm.scheduled.clear();
    e.schedule(sync(V33))
}

/// `update_from_output`: a token for each row of the last step, none for the `chunks`.
fn update(e: &mut TestEngine, chunks: &[usize]) {
    for (r, _) in e.scheduled.clone() {
        let tokens = if chunks.contains(&r) {
            vec![]
        } else {
            vec![50]
        };
        e.next.insert(r, tokens);
    }
    e.update(sync(V33));
}

#[test]
fn the_encoder_budget_caps_a_row_before_an_image_that_does_not_fit() {
    let mut e = TestEngine::new(64, 100);
    e.mm.budget = 10;
    let a = add_mm(&mut e, 8, &[(0, 6, "x")]);
    let b = add_mm(&mut e, 12, &[(2, 6, "y")]);
    // a's image takes 6 of 10; b's (6) does not fit: b stops at its image's start.
    assert_eq!(schedule(&mut e), vec![(a, 8), (b, 2)]);
    assert_eq!(e.mm.scheduled, vec![(a, vec![0])]);
    assert_eq!(e.r(b).computed, 2);
    update(&mut e, &[b]);
    assert_eq!(
        e.mm.done,
        [(a, 8), (b, 2)],
        "update frees each multimodal row's consumed inputs"
    );
    // The next step's budget is whole again: b's image fits and b finishes its prompt.
    assert_eq!(schedule(&mut e), vec![(a, 1), (b, 10)]);
    assert_eq!(e.mm.scheduled, vec![(b, vec![0])]);
}

#[test]
fn an_exhausted_budget_leaves_zero_tokens_and_the_passes_go_on() {
    let mut e = TestEngine::new(64, 100);
    e.mm.budget = 6;
    let a = add_mm(&mut e, 6, &[(0, 6, "x")]);
    let b = add_mm(&mut e, 6, &[(0, 6, "y")]);
    let c = e.add(4, 10);
    // The waiting pass: b's image starts at its first token: 0 tokens, b is skipped
    // (deferred, back at the head after the pass) and c is admitted behind it.
    assert_eq!(schedule(&mut e), vec![(a, 6), (c, 4)]);
    assert_eq!(e.waiting, [b]);
    assert!(e.deferred.contains(&b));
    assert_eq!(e.mm.unfit, Vec::<usize>::new());
    // The next step's budget is whole again: b is admitted behind the running rows.
    update(&mut e, &[]);
    assert_eq!(schedule(&mut e), vec![(a, 1), (c, 1), (b, 6)]);
}

#[test]
fn on_0_32_a_waiting_request_left_no_token_ends_the_waiting_pass() {
    let mut e = TestEngine::new(64, 100);
    e.mm.budget = 6;
    let a = add_mm(&mut e, 6, &[(0, 6, "x")]);
    let b = add_mm(&mut e, 6, &[(0, 6, "y")]);
    let c = e.add(4, 10);
    assert_eq!(e.schedule(sync(V32)), vec![(a, 6)]);
    assert_eq!(e.waiting, [b, c]);
    assert!(!e.deferred.contains(&b));
}

#[test]
fn a_running_row_with_no_budget_is_passed_over() {
    let mut e = TestEngine::new(64, 100);
    e.mm.budget = 6;
    let a = add_mm(&mut e, 12, &[(0, 6, "x"), (6, 6, "y")]);
    let b = add_mm(&mut e, 12, &[(6, 6, "z")]);
    let c = e.add(4, 10);
    // a takes x and stops before y; b stops before z; c is plain.
    assert_eq!(schedule(&mut e), vec![(a, 6), (b, 6), (c, 4)]);
    update(&mut e, &[a, b]);
    // Running pass: a takes y (the whole budget); b's z cannot: 0 tokens, b is passed over
    // (not the end of the pass), c decodes.
    assert_eq!(schedule(&mut e), vec![(a, 6), (c, 1)]);
    assert_eq!(e.mm.scheduled, vec![(a, vec![1])]);
    assert_eq!(e.r(b).computed, 6);
}

#[test]
fn a_priority_preemption_gives_the_victims_encoder_budget_back() {
    // 7 usable blocks of 4 tokens; v has the lowest priority (the largest value).
    let mut e = TestEngine::new(8, 100);
    e.set.priority = true;
    e.mm.budget = 10;
    let v = add_mm(&mut e, 16, &[(0, 6, "v1"), (10, 6, "v2")]);
    let r = e.add(4, 10);
    let w = add_mm(&mut e, 16, &[(8, 6, "w")]);
    e.reqs[v].priority = 9;
    e.reqs[w].priority = 1;
    // v takes v1 (4 left) and stops before v2; w stops before its image.
    assert_eq!(schedule(&mut e), vec![(v, 10), (r, 4), (w, 8)]);
    update(&mut e, &[v, w]);
    // v commits v2 (4 left) and its 4th block; r's decode needs a block: v is preempted and
    // gives back v2's 6; so w's image (6) fits and w finishes its prompt.
    assert_eq!(schedule(&mut e), vec![(r, 1), (w, 8)]);
    assert_eq!(e.r(v).status, Status::Preempted);
    assert_eq!(e.mm.scheduled, vec![(w, vec![0])]);
}

#[test]
fn an_input_already_cached_is_not_computed_again() {
    let mut e = TestEngine::new(64, 100);
    e.mm.budget = 6;
    let a = add_mm(&mut e, 8, &[(0, 6, "same")]);
    let b = add_mm(&mut e, 8, &[(2, 6, "same")]);
    // a computes the input; b finds it cached and takes its whole prompt with no budget.
    assert_eq!(schedule(&mut e), vec![(a, 8), (b, 8)]);
    assert_eq!(e.mm.scheduled, vec![(a, vec![0])]);
}

#[test]
fn an_admission_that_does_not_fit_frees_its_encoder_cache_entries() {
    let mut e = TestEngine::new(3, 100); // 2 usable blocks
    e.mm.budget = 10;
    let a = e.add(8, 10);
    let b = add_mm(&mut e, 8, &[(0, 6, "x")]);
    assert_eq!(schedule(&mut e), vec![(a, 8)]);
    assert_eq!(e.mm.unfit, [b]);
    assert!(e.mm.scheduled.is_empty());
    assert_eq!(e.waiting, [b]);
}

#[test]
fn the_preempting_rows_own_plan_overwrites_a_budget_given_back() {
    // vLLM assigns a committed row's planned budget: what a victim gave back while that row
    // was allocating is lost when the row schedules inputs of its own.
    let mut e = TestEngine::new(5, 100); // 4 usable blocks
    e.set.priority = true;
    e.set.limits.long_prefill_token_threshold = 4;
    e.mm.budget = 10;
    let v = add_mm(&mut e, 16, &[(0, 6, "v1"), (6, 6, "v2")]);
    let r = add_mm(&mut e, 12, &[(4, 3, "r")]);
    let w = add_mm(&mut e, 16, &[(6, 6, "w")]);
    e.reqs[v].priority = 9;
    e.reqs[w].priority = 1;
    assert_eq!(schedule(&mut e), vec![(v, 4), (r, 4), (w, 4)]);
    update(&mut e, &[v, r, w]);
    // v plans v2 (10 -> 4) and takes the 4th block; r plans its image (4 -> 1), finds no
    // block and preempts v (the budget is 10 again), then commits: the budget is r's 1, so
    // w's image (6) does not fit and w stops before it.
    assert_eq!(schedule(&mut e), vec![(r, 4), (w, 2)]);
    assert_eq!(e.r(v).status, Status::Preempted);
    assert_eq!(e.mm.scheduled, vec![(r, vec![0])]);
}

#[test]
fn encoder_inputs_are_freed_after_rejected_drafts_roll_back() {
    let mut e = TestEngine::new(64, 100);
    e.set.spec = SpecSettings {
        num_spec_tokens: 3,
        num_lookahead_tokens: 3,
        draft_slots: 0,
        can_skip_drafts: false,
        dynamic: false,
        prefill_lookahead: 0,
    };
    e.mm.budget = 100;
    let a = add_mm(&mut e, 4, &[(0, 4, "x")]);
    assert_eq!(schedule(&mut e), vec![(a, 4)]);
    update(&mut e, &[]);
    e.reqs[a].spec = vec![60, 61, 62];
    assert_eq!(schedule(&mut e), vec![(a, 4)]); // the sampled token + 3 drafts
    e.mm.done.clear();
    e.next.insert(a, vec![60, 70]); // one draft accepted: two rejected
    e.update(sync(V33));
    // vLLM frees behind the computed tokens that remain: 8 computed, 2 rejected.
    assert_eq!(e.mm.done, [(a, 6)]);
}
