//! The walk's speculative decoding (vLLM's ngram / draft-model path, the drafts proposed
//! between steps through `update_draft_token_ids`): drafts scheduled with a running row,
//! the draft slots of the input budget, a resumed decode padded to a uniform spec decode,
//! rejected drafts rolled back, PRIORITY preemption taking drafts back, async placeholders,
//! `skip_drafts`. Each written from vLLM 0.32 / 0.33 `scheduler.py` and `async_scheduler.py`.

use super::*;

fn with_spec(e: &mut TestEngine, k: u64) {
    e.set.spec = SpecSettings {
        num_spec_tokens: k,
        num_lookahead_tokens: k,
        draft_slots: 0,
        can_skip_drafts: false,
        dynamic: false,
        prefill_lookahead: 0,
    };
}

/// A request prefilled and decoding (one output token), with `drafts` proposed.
fn decoding(e: &mut TestEngine, mode: Mode, drafts: &[i64]) -> usize {
    let a = e.add(4, 50);
    e.step(mode, 50);
    e.reqs[a].spec = drafts.to_vec();
    a
}

#[test]
fn a_running_row_carries_its_proposed_drafts_and_the_list_is_emptied() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 3);
    let a = decoding(&mut e, sync(V33), &[60, 61, 62]);
    assert_eq!(e.schedule(sync(V33)), vec![(a, 4)]); // the sampled token + 3 drafts
    assert_eq!(e.drafts[&a], [60, 61, 62]);
    assert!(e.r(a).spec.is_empty());
    // Lookahead slots: 5 computed + 4 scheduled + 3 lookahead = 12 tokens, 3 blocks of 4.
    assert_eq!(e.mgr.blocks("r0").len(), 3);
}

#[test]
fn drafts_past_the_budget_are_cut_to_the_scheduled_tokens() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 3);
    let a = decoding(&mut e, sync(V33), &[60, 61, 62]);
    e.set.max_num_scheduled_tokens = 3;
    assert_eq!(e.schedule(sync(V33)), vec![(a, 3)]);
    assert_eq!(e.drafts[&a], [60, 61]);
}

#[test]
fn draft_slots_take_input_budget_per_scheduled_request() {
    let mut e = TestEngine::new(64, 10);
    with_spec(&mut e, 2);
    e.set.spec.draft_slots = 2;
    let a = e.add(4, 10);
    let b = e.add(4, 10);
    // a: 4 tokens and 2 slots, 4 input left; b may take min(10 - 4, 4 - 2) = 2.
    assert_eq!(e.schedule(sync(V33)), vec![(a, 4), (b, 2)]);
    let c = e.add(4, 10);
    let mut f = TestEngine::new(64, 10);
    with_spec(&mut f, 2);
    f.set.spec.draft_slots = 3;
    let x = f.add(4, 10);
    let _y = f.add(4, 10);
    // x takes 4 + 3 of 10: 3 left, no more than the draft slots: the pass ends.
    assert_eq!(f.schedule(sync(V33)), vec![(x, 4)]);
    assert!(e.waiting.contains(&c));
}

#[test]
fn rejected_drafts_roll_back_the_computed_tokens() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 3);
    let a = decoding(&mut e, sync(V33), &[60, 61, 62]);
    e.schedule(sync(V33));
    assert_eq!(e.r(a).computed, 8); // 4 + the sampled token and 3 drafts
    e.next.insert(a, vec![60, 70]); // one draft accepted, then the bonus token
    e.update(sync(V33));
    assert_eq!(e.r(a).computed, 6); // two rejected
    assert_eq!(e.r(a).outs, [50, 60, 70]);
    assert_eq!(e.recorded, [(a, 3, 1)]);
    // 0.33 caches after a speculative step (computed minus in flight); 0.32 does not.
    assert_eq!(e.cached, [(a, 4), (a, 6)]);
    let mut f = TestEngine::new(64, 100);
    with_spec(&mut f, 3);
    let b = decoding(&mut f, sync(V32), &[60, 61, 62]);
    f.schedule(sync(V32));
    f.next.insert(b, vec![60, 70]);
    f.update(sync(V32));
    assert_eq!((f.r(b).computed, f.cached.len()), (6, 0));
}

#[test]
fn a_resumed_decode_is_padded_to_a_uniform_spec_decode() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 2);
    let a = decoding(&mut e, sync(V33), &[]);
    let b = decoding(&mut e, sync(V33), &[]);
    // Preempt b as vLLM does; it resumes with its 6 tokens: a hit of none, 6 to compute.
    e.running.retain(|&r| r != b);
    e.preempt(&b).unwrap();
    e.reqs[b].computed = 4; // as if its prefix were computed: one token of 5 left
    e.schedule(sync(V33));
    assert_eq!(e.scheduled, vec![(a, 1), (b, 3)]);
    assert_eq!(e.drafts[&b], [-1, -1]);
}

#[test]
fn a_dynamic_schedule_pads_no_resumed_decode() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 2);
    e.set.spec.dynamic = true;
    let a = decoding(&mut e, sync(V33), &[]);
    let b = decoding(&mut e, sync(V33), &[]);
    e.running.retain(|&r| r != b);
    e.preempt(&b).unwrap();
    e.reqs[b].computed = 4;
    e.schedule(sync(V33));
    // The same step as above, under num_speculative_tokens_per_batch_size: b takes its one
    // token and no placeholder drafts.
    assert_eq!(e.scheduled, vec![(a, 1), (b, 1)]);
    assert!(!e.drafts.contains_key(&b));
}

#[test]
fn no_padding_after_a_running_prefill_chunk_or_for_the_steps_first_row() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 2);
    let a = e.add(4, 10);
    e.step(sync(V33), 50);
    e.running.clear();
    e.preempt(&a).unwrap();
    // The step's first row with nothing computed: no padding (the whole 5 tokens anyway).
    assert_eq!(e.schedule(sync(V33)), vec![(a, 5)]);
    assert!(e.drafts.is_empty());
    // A running prefill chunk this step: a one-token resume is not padded.
    let mut f = TestEngine::new(64, 100);
    with_spec(&mut f, 2);
    let chunked = f.add(4, 10);
    f.schedule(sync(V33));
    f.reqs[chunked].chunk = true;
    f.reqs[chunked].computed = 2; // still prefilling
    f.scheduled.clear();
    let b = f.add(1, 10);
    f.schedule(sync(V33));
    assert_eq!(f.scheduled, vec![(chunked, 2), (b, 1)]);
    assert!(f.drafts.is_empty());
}

#[test]
fn a_priority_victim_scheduled_this_step_gives_back_its_drafts() {
    let mut e = TestEngine::new(5, 100); // 4 usable blocks of 4
    with_spec(&mut e, 1);
    e.set.priority = true;
    let b = e.add(4, 50);
    e.reqs[b].priority = 5; // the victim, first in running order
    let a = e.add(4, 50);
    e.step(sync(V33), 50); // each holds 2 blocks (4 tokens + 1 lookahead)
    e.reqs[b].spec = vec![61];
    e.reqs[a].spec = vec![60];
    e.reqs[a].all.extend([51; 6]); // a now needs 4 blocks: b, scheduled first, is taken back
    let rows = e.schedule(sync(V33));
    assert_eq!(rows, vec![(a, 8)]);
    assert_eq!(e.drafts.keys().collect::<Vec<_>>(), [&a]);
    assert_eq!(e.r(b).status, Status::Preempted);
}

#[test]
fn async_placeholders_count_the_drafts_and_rejections_take_them_back() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 2);
    let mode = asynchronous(V33);
    let a = e.add(4, 50);
    e.schedule(mode); // the prefill: one placeholder
    e.next.insert(a, vec![50]);
    e.update(mode);
    e.reqs[a].spec = vec![-1, -1]; // the async placeholders for the drafts
    e.schedule(mode);
    assert_eq!(e.r(a).placeholders, 3); // 1 sampled + 2 drafts
    e.next.insert(a, vec![70]); // both drafts rejected
    e.update(mode);
    assert_eq!(e.r(a).placeholders, 0);
    assert_eq!(e.r(a).computed, 5);
}

#[test]
fn skip_drafts_when_no_scheduled_request_can_use_them() {
    let mut e = TestEngine::new(64, 100);
    with_spec(&mut e, 2);
    e.set.spec.can_skip_drafts = true;
    let a = e.add(8, 1);
    e.schedule(sync(V33)); // samples the only output token: drafts unused
    assert!(e.skip_drafts);
    e.scheduled.clear();
    let mut f = TestEngine::new(64, 100);
    with_spec(&mut f, 2);
    f.set.spec.can_skip_drafts = true;
    f.add(8, 10);
    f.schedule(sync(V33));
    assert!(!f.skip_drafts);
    assert_eq!(e.r(a).status, Status::Running);
}
