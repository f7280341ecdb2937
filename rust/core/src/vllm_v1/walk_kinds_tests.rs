//! The walk's behaviours for the request kinds beyond plain sampling: structured output (a
//! grammar that compiles late, a grammar that rejects), LoRA (`max_loras`), repetition
//! detection. Each written from vLLM's `scheduler.py` (`_handle_blocked_waiting_request`,
//! `skip_request`, the `scheduled_loras` set, `_update_after_schedule`, `update_from_output`'s
//! `accept_tokens`) and `utils.check_stop`.

use super::*;
use crate::vllm_v1::policy::Repetition;

/// `add` a structured-output request: blocked until its grammar is ready after `wait` asks.
fn add_structured(e: &mut TestEngine, prompt: u64, max_tokens: u64, wait: u32) -> usize {
    let r = e.add(prompt, max_tokens);
    e.reqs[r].grammar_wait = Some(wait);
    e.reqs[r].status = Status::OtherWaiting;
    e.deferred.insert(r); // vLLM's `_enqueue_waiting_request` defers a blocked request
    r
}

#[test]
fn a_grammar_not_compiled_yet_is_skipped_and_keeps_its_place() {
    let mut e = TestEngine::new(64, 100);
    let a = add_structured(&mut e, 4, 10, 2);
    let b = e.add(4, 10);
    assert_eq!(e.step(sync(V33), 50), vec![(b, 4)]);
    assert_eq!(e.waiting, [a]);
    assert_eq!(e.r(a).status, Status::OtherWaiting);
    assert!(e.deferred.contains(&a));
    assert_eq!(e.step(sync(V33), 50), vec![(b, 1)]); // the second ask: still compiling
    let rows = e.schedule(sync(V33));
    assert_eq!(rows, vec![(b, 1), (a, 4)]);
    assert_eq!(e.r(a).status, Status::Running);
    assert!(!e.deferred.contains(&a));
}

#[test]
fn has_structured_output_requests_only_past_the_prefill() {
    let mut e = TestEngine::new(64, 6);
    let a = add_structured(&mut e, 8, 10, 0);
    e.schedule(sync(V33)); // a chunk of 6 of 8
    assert_eq!(e.structured_step, StructuredFlags::default());
    e.scheduled.clear();
    e.schedule(sync(V33)); // the prefill's last 2 tokens: a token is sampled
    assert!(e.structured_step.has_requests && !e.structured_step.pending_tokens);
    let plain = e.add(4, 10);
    e.running.retain(|&r| r != a);
    e.schedule(sync(V33));
    assert_eq!(e.scheduled, vec![(plain, 4)]);
    assert_eq!(e.structured_step, StructuredFlags::default());
}

#[test]
fn grammar_rows_are_the_structured_rows_past_their_prefill_in_the_output_order() {
    let mut e = TestEngine::new(64, 12);
    let a = add_structured(&mut e, 4, 10, 0);
    let plain = e.add(4, 10);
    let b = add_structured(&mut e, 8, 10, 0);
    // a and plain whole, b a chunk of 4 of 8
    assert_eq!(e.step(sync(V33), 50), vec![(a, 4), (plain, 4), (b, 4)]);
    assert_eq!(e.grammar_rows, vec![a]);
    // a and plain decode, b's last 4 prompt tokens sample a token
    let rows = e.step(sync(V33), 50);
    assert_eq!(
        rows.iter().map(|&(r, _)| r).collect::<Vec<_>>(),
        [a, plain, b]
    );
    assert_eq!(e.grammar_rows, vec![a, b]);
    e.abort(a);
    assert_eq!(e.step(sync(V33), 50), vec![(plain, 1), (b, 1)]);
    assert_eq!(e.grammar_rows, vec![b]);
    e.abort(b);
    e.step(sync(V33), 50);
    assert!(e.grammar_rows.is_empty(), "no structured row: not called");
}

#[test]
fn async_structured_output_with_output_in_flight_has_pending_tokens() {
    let mut e = TestEngine::new(64, 100);
    let mode = asynchronous(V33);
    add_structured(&mut e, 4, 10, 0);
    e.schedule(mode); // the prefill samples: no earlier output in flight
    let first = e.structured_step;
    assert!(first.has_requests && !first.pending_tokens);
    e.schedule(mode); // the next decode while the first output is in flight
    assert!(e.structured_step.has_requests && e.structured_step.pending_tokens);
}

#[test]
fn grammar_accepts_the_kept_tokens_and_a_rejection_finishes_with_an_error() {
    let mut e = TestEngine::new(64, 100);
    let a = add_structured(&mut e, 4, 10, 0);
    e.reqs[a].grammar_rejects = Some(66);
    e.schedule(sync(V33));
    e.next.insert(a, vec![50, 7, 51]); // stops at 7: 51 is dropped before the grammar
    e.update(sync(V33));
    assert_eq!(e.r(a).accepted, [50, 7]);
    assert_eq!(e.r(a).stop, Some(Stop::StopToken(7)));
    let b = add_structured(&mut e, 4, 10, 0);
    e.reqs[b].grammar_rejects = Some(66);
    e.step(sync(V33), 66);
    assert_eq!(e.r(b).stop, Some(Stop::Error));
    assert_eq!(e.outputs.last(), Some(&(b, vec![66], Some(Stop::Error))));
    assert!(e.freed.contains(&b) && e.running.is_empty());
}

#[test]
fn max_loras_skips_a_third_adapter_until_one_leaves() {
    let mut e = TestEngine::new(64, 100);
    e.set.max_loras = Some(2);
    let ids = [1, 2, 3, 1];
    let r: Vec<usize> = ids
        .iter()
        .map(|&id| {
            let r = e.add(4, 1);
            e.reqs[r].lora = Some(id);
            r
        })
        .collect();
    // Adapters 1 and 2 fill the limit; 3 is skipped, the second request of adapter 1 is not.
    let rows = e.step(sync(V33), 50); // max_tokens 1: all three finish
    assert_eq!(rows, vec![(r[0], 4), (r[1], 4), (r[3], 4)]);
    assert_eq!(e.waiting, [r[2]]);
    assert!(e.deferred.contains(&r[2]) && e.running.is_empty());
    assert_eq!(e.schedule(sync(V33)), vec![(r[2], 4)]);
}

#[test]
fn max_loras_counts_running_adapters_above_zero_only() {
    let mut e = TestEngine::new(64, 100);
    e.set.max_loras = Some(1);
    let zero = e.add(4, 10);
    e.reqs[zero].lora = Some(0);
    e.step(sync(V33), 50);
    // Running: adapter 0, which the running set leaves out; adapter 5 is admitted.
    let five = e.add(4, 10);
    e.reqs[five].lora = Some(5);
    assert_eq!(e.step(sync(V33), 50), vec![(zero, 1), (five, 4)]);
    // Now adapter 5 runs and fills the limit: adapter 6 waits, no-LoRA requests do not.
    let six = e.add(4, 10);
    e.reqs[six].lora = Some(6);
    let plain = e.add(4, 10);
    let rows = e.schedule(sync(V33));
    assert_eq!(rows.last(), Some(&(plain, 4)));
    assert_eq!(e.waiting, [six]);
}

/// vLLM 0.32 counts only the running pass's adapters: a running LoRA request scheduled
/// nothing (here, the v2 runner's stagger) lets another adapter in; the next step schedules
/// both, past `max_loras`, and vLLM 0.32 asserts. The walk admits as 0.32 does, then refuses
/// that step as vLLM does (0.33 counts every running request and never gets there).
#[test]
fn a_032_step_past_max_loras_is_refused_as_vllm_asserts() {
    for release in [V32, V33] {
        let mut e = TestEngine::new(64, 100);
        e.set.max_loras = Some(1);
        e.set.runner = Runner::V2;
        let one = e.add(4, 10);
        e.reqs[one].lora = Some(1);
        e.step(sync(release), 50);
        e.reqs[one].next_eligible = e.step + 2; // waits out the next step
        let two = e.add(4, 10);
        e.reqs[two].lora = Some(2);
        let rows = e.step(sync(release), 50);
        match release {
            V32 => assert_eq!(rows, vec![(two, 4)]),
            _ => assert!(rows.is_empty() && e.waiting == [two]),
        }
        let throttle = e.throttle;
        let next = Walk::new(&mut e, sync(release)).unwrap().schedule(throttle);
        assert_eq!(next.is_err(), release == V32, "{release:?}");
    }
}

#[test]
fn repetition_stops_after_min_tokens_with_its_own_reason() {
    let mut e = TestEngine::new(64, 100);
    let a = e.add(4, 20);
    e.reqs[a].rule.repetition = Some(Repetition {
        min_pattern_size: 1,
        max_pattern_size: 2,
        min_count: 3,
    });
    e.reqs[a].rule.min_tokens = 4;
    e.schedule(sync(V33));
    e.next.insert(a, vec![9, 9, 9]); // repeats, but only 3 outputs of min_tokens 4
    e.update(sync(V33));
    assert_eq!(e.r(a).stop, None);
    e.step(sync(V33), 9);
    assert_eq!(e.r(a).stop, Some(Stop::Repetition));
    assert_eq!(e.r(a).outs, [9, 9, 9, 9]);
}

#[test]
fn eos_and_length_come_before_repetition() {
    let mut e = TestEngine::new(64, 100);
    let a = e.add(4, 3);
    e.reqs[a].rule.repetition = Some(Repetition {
        min_pattern_size: 1,
        max_pattern_size: 1,
        min_count: 3,
    });
    e.schedule(sync(V33));
    e.next.insert(a, vec![9, 9, 9]);
    e.update(sync(V33));
    assert_eq!(e.r(a).stop, Some(Stop::Length)); // max_tokens 3 at the third 9
}

#[test]
fn loras_of_running_requests_not_scheduled_count_on_033_only() {
    // a (adapter 1) is running but passed over (async: its only output is in flight); b
    // (adapter 2) waits. 0.33 counts every running adapter, 0.32 the running pass's rows.
    for (release, admitted) in [(V33, false), (V32, true)] {
        let mut e = TestEngine::new(64, 100);
        e.set.max_loras = Some(1);
        let mode = asynchronous(release);
        let a = e.add(4, 1);
        e.reqs[a].lora = Some(1);
        e.schedule(mode);
        let b = e.add(4, 10);
        e.reqs[b].lora = Some(2);
        let rows = e.schedule(mode);
        assert_eq!(rows.contains(&(b, 4)), admitted, "{release:?}");
        assert!(!rows.iter().any(|&(r, _)| r == a));
    }
}

#[test]
fn a_pooling_request_stops_at_its_pooler_output_and_only_then_emits() {
    // A pooling model samples no token: no slot is kept for one (`sampled_per_step` 0).
    let mut e = TestEngine::new(64, 6);
    e.set.limits.sampled_per_step = 0;
    e.set.limits.max_model_len = 10;
    let a = e.add(10, 1);
    // The whole prompt of max_model_len fits: 6, then 4 (a sampling model would stop at 9).
    assert_eq!(e.schedule(sync(V33)), vec![(a, 6)]);
    e.next.insert(a, vec![]);
    e.update(sync(V33)); // a chunk: no pooler output, nothing emitted
    assert!(e.outputs.is_empty());
    assert_eq!(e.schedule(sync(V33)), vec![(a, 4)]);
    e.next.insert(a, vec![]);
    e.pooled.insert(a);
    e.update(sync(V33));
    assert_eq!(e.outputs, vec![(a, vec![], Some(Stop::Pooled))]);
    assert_eq!(e.r(a).status, Status::Finished);
    assert_eq!(e.freed, [a]);
    assert!(e.running.is_empty());
}
