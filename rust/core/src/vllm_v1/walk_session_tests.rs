//! The walk's behaviours for streaming sessions (resumable requests), written from vLLM's
//! `scheduler.py` (0.32 / 0.33): `_handle_stopped_request`, `_update_request_as_session`,
//! `_enqueue_waiting_request`, the waiting pass draining `kv_holding_waiting` first
//! (`step_skipped_kv_holding` put back at its head), the active limit
//! `len(running) + num_waiting_for_streaming_input`, and `update_from_output` enqueueing the
//! continuing sessions after the stopped requests left their queues (0.33).

use super::*;

/// `add` a streaming session (`resumable`): its turn stops at `max_tokens`.
fn add_session(e: &mut TestEngine, prompt: u64, max_tokens: u64) -> usize {
    let r = e.add(prompt, max_tokens);
    e.reqs[r].resumable = true;
    r
}

fn update(prompt: &[i64], max_tokens: u64) -> Option<Update> {
    Some(Update {
        prompt: prompt.to_vec(),
        max_tokens,
    })
}

/// Steps until `r` stops its turn (at most `limit` steps), with token 50 sampled.
fn run_turn(e: &mut TestEngine, mode: Mode, r: usize, limit: usize) {
    let before = e
        .outputs
        .iter()
        .filter(|o| o.0 == r && o.2.is_some())
        .count();
    for _ in 0..limit {
        e.step(mode, 50);
        if e.outputs
            .iter()
            .filter(|o| o.0 == r && o.2.is_some())
            .count()
            > before
        {
            return;
        }
    }
    panic!("the session's turn did not stop in {limit} steps");
}

#[test]
fn a_stopped_session_waits_for_input_holding_its_blocks() {
    for release in [V33, V32] {
        let mut e = TestEngine::new(64, 100);
        e.release = release;
        let a = add_session(&mut e, 6, 2);
        run_turn(&mut e, sync(release), a, 4);
        // The turn's stop is reported, but the request is neither freed nor forgotten.
        assert_eq!(e.outputs.last().unwrap().2, Some(Stop::Length));
        assert!(e.freed.is_empty());
        assert_eq!(e.r(a).status, Status::OtherWaiting);
        assert!(e.r(a).waiting_input && e.paused == 1);
        assert_eq!(e.kv_holding, [a]);
        assert!(e.running.is_empty() && e.waiting.is_empty());
        assert!(e.deferred.contains(&a));
        assert!(!e.mgr.blocks("r0").is_empty());
        // Safe frontier: the last sampled token is not computed.
        assert_eq!(e.r(a).computed, 7);
        assert!(e.r(a).drop_stale);
        // Waiting for input: skipped every step, kept at the head of kv_holding_waiting.
        assert!(e.schedule(sync(release)).is_empty());
        assert_eq!(e.kv_holding, [a]);
    }
}

#[test]
fn an_update_resumes_the_session_from_its_kept_tokens() {
    for release in [V33, V32] {
        let mut e = TestEngine::new(64, 100);
        e.release = release;
        let a = add_session(&mut e, 6, 2);
        run_turn(&mut e, sync(release), a, 4);
        e.scheduled.clear();
        e.stream(a, update(&[300, 301, 302], 3));
        assert_eq!(e.r(a).status, Status::Waiting);
        assert_eq!(e.paused, 0);
        // The first output token is kept (now prompt), the last sampled one dropped.
        assert_eq!(e.r(a).all.len(), 6 + 1 + 3);
        assert_eq!((e.r(a).prompt, e.r(a).outs.len()), (10, 0));
        // Admitted from kv_holding_waiting with what is not computed yet, as a new request.
        assert_eq!(e.schedule(sync(release)), vec![(a, 3)]);
        assert_eq!(e.running, [a]);
        assert!(e.kv_holding.is_empty() && !e.deferred.contains(&a));
        e.next.insert(a, vec![50]);
        e.update(sync(release));
        run_turn(&mut e, sync(release), a, 4);
        assert_eq!(e.r(a).outs.len(), 3);
        e.stream(a, None); // the session ends while waiting for input: aborted
        assert!(e.kv_holding.is_empty() && e.paused == 0);
        assert_eq!(e.r(a).status, Status::Finished);
    }
}

#[test]
fn a_queued_update_continues_the_session_at_its_stop() {
    for release in [V33, V32] {
        let mut e = TestEngine::new(64, 100);
        e.release = release;
        let a = add_session(&mut e, 6, 2);
        e.stream(a, update(&[300, 301], 4)); // queued: the session is running
        e.stream(a, None);
        run_turn(&mut e, sync(release), a, 4);
        assert_eq!(e.r(a).status, Status::Waiting);
        assert_eq!(e.paused, 0);
        assert_eq!(e.kv_holding, [a]);
        assert!(!e.deferred.contains(&a));
        assert_eq!(e.r(a).rule.max_tokens, 4);
        run_turn(&mut e, sync(release), a, 8);
        // The final update ends the session at the next stop: freed then.
        assert_eq!(e.freed, [a]);
        assert!(e.kv_holding.is_empty() && e.running.is_empty());
        assert_eq!(e.mgr.blocks("r0"), &[] as &[u32]);
    }
}

#[test]
fn kv_holding_waiting_is_drained_before_waiting() {
    let mut e = TestEngine::new(64, 100);
    let a = add_session(&mut e, 6, 1);
    e.stream(a, update(&[300, 301, 302, 303], 2));
    e.stream(a, None);
    run_turn(&mut e, sync(V33), a, 2); // stopped; its update queued it in kv_holding_waiting
    e.scheduled.clear();
    let b = e.add(4, 5); // arrived before the session resumes, queued in `waiting`
    e.set.max_num_scheduled_tokens = 5;
    e.set.max_num_batched_tokens = 5;
    // The session first (4 tokens), then b with the budget left.
    assert_eq!(e.schedule(sync(V33)), vec![(a, 4), (b, 1)]);
}

#[test]
fn a_skipped_session_goes_back_to_the_head_of_kv_holding_waiting() {
    let mut e = TestEngine::new(64, 100);
    let (a, b) = (add_session(&mut e, 6, 1), add_session(&mut e, 6, 1));
    run_turn(&mut e, sync(V33), b, 2); // both stop in the same step: both wait for input
    assert_eq!(e.kv_holding, [a, b]);
    assert_eq!(e.paused, 2);
    e.stream(b, update(&[300], 3));
    let c = e.add(4, 5);
    // a is skipped (waiting for input) and put back ahead; b and c are admitted.
    assert_eq!(e.schedule(sync(V33)), vec![(b, 1), (c, 4)]);
    assert_eq!(e.kv_holding, [a]);
    assert!(e.deferred.contains(&a));
}

#[test]
fn sessions_waiting_for_input_count_against_the_active_limit() {
    let mut e = TestEngine::new(64, 100);
    e.set.max_num_active_reqs = 2;
    let a = add_session(&mut e, 6, 1);
    let b = e.add(4, 10);
    run_turn(&mut e, sync(V33), a, 2); // a waits for input; b runs
    e.scheduled.clear();
    let c = e.add(4, 10);
    // running (b) + one paused session fill the two slots: c waits.
    assert_eq!(e.schedule(sync(V33)), vec![(b, 1)]);
    assert_eq!(e.waiting, [c]);
    e.next.insert(b, vec![50]);
    e.update(sync(V33));
    e.stream(a, None); // the session ends: its slot is free
    assert_eq!(e.schedule(sync(V33)), vec![(b, 1), (c, 4)]);
}

#[test]
fn continuing_sessions_are_enqueued_in_output_order() {
    for release in [V33, V32] {
        let mut e = TestEngine::new(64, 100);
        e.release = release;
        let (a, b) = (add_session(&mut e, 6, 1), add_session(&mut e, 5, 1));
        let c = e.add(4, 1); // a plain request stopping in the same step is freed
        e.stream(b, update(&[300], 2));
        e.step(sync(release), 50);
        assert_eq!(e.kv_holding, [a, b]);
        assert_eq!(e.freed, [c]);
        assert!(e.running.is_empty());
        assert_eq!(e.r(b).status, Status::Waiting);
    }
}

#[test]
fn async_a_stopped_session_resumes_from_its_materialized_frontier() {
    let mut e = TestEngine::new(64, 100);
    let mode = asynchronous(V33);
    let a = add_session(&mut e, 6, 2);
    e.stream(a, update(&[300, 301], 2));
    e.stream(a, None);
    e.schedule(mode); // the prefill (samples)
    let prefill = e.scheduled.clone();
    e.schedule(mode); // a decode scheduled while the first output is in flight
    let decode = e.scheduled.clone();
    assert_eq!(e.r(a).placeholders, 2);
    e.scheduled = prefill;
    e.next.insert(a, vec![EOS]);
    e.update(mode); // the first output stops the turn: the in-flight decode becomes stale
    assert_eq!(e.r(a).computed, 6);
    assert_eq!((e.r(a).placeholders, e.r(a).stale), (0, 1));
    assert!(e.r(a).drop_stale);
    assert_eq!(e.kv_holding, [a]);
    e.scheduled = decode;
    e.next.insert(a, vec![51]);
    e.update(mode); // the stale output is dropped
    assert_eq!(e.r(a).stale, 0);
    assert_eq!(e.r(a).all.len(), 6 + 2);
}

#[test]
fn a_session_stopped_by_stale_output_is_requeued_on_033_and_lost_on_032() {
    // Preempted with its prefill's output in flight; that (stale, delivered) output stops the
    // turn. Not running, so it is a `stopped_preempted` request: 0.33 takes it out of
    // `waiting` and enqueues it again; 0.32's `_handle_stopped_request` enqueues it first and
    // the removal then takes it out of every queue (vLLM 0.32's behaviour, mirrored).
    for (release, requeued) in [(V33, true), (V32, false)] {
        let mut e = TestEngine::new(64, 100);
        e.release = release;
        let mode = asynchronous(release);
        let a = add_session(&mut e, 4, 2);
        e.schedule(mode);
        e.running.clear();
        e.preempt(&a).unwrap();
        e.scheduled = vec![(a, 4)];
        e.next.insert(a, vec![EOS]);
        e.update(mode);
        assert_eq!(e.outputs.last().unwrap().2, Some(Stop::Eos));
        assert!(e.freed.is_empty());
        assert_eq!((e.r(a).status, e.paused), (Status::OtherWaiting, 1));
        let expected: &[usize] = if requeued { &[a] } else { &[] };
        assert_eq!(e.waiting.iter().copied().collect::<Vec<_>>(), expected);
        assert_eq!(e.deferred.contains(&a), requeued);
    }
}
