//! The walk's behaviours with a KV connector: external tokens loaded with the request's first
//! step (`has_sync_kv_loads`), an asynchronous load (the request holds its blocks in
//! `kv_holding_waiting`, `WAITING_FOR_REMOTE_KVS`, until the load is done, then runs the rest
//! of its prompt), a connector that cannot tell its hit yet (the request is skipped), the
//! running pass waiting for the connector's pending frees or for a victim whose blocks an
//! in-flight step may still write (no preemption), a row whose load failed taking nothing
//! in `update_from_output`. Written from vLLM's `scheduler.py`
//! (`schedule()`'s waiting pass from the prefix lookup to `skip_request`, the running pass's
//! allocation loop, `_handle_blocked_waiting_request`, `_update_waiting_for_remote_kv`).
//!
//! [`ConnectorSim`] stands in for the connector and for what vLLM's scheduler does around it.

use super::*;
use std::collections::BTreeSet;

/// A connector's answers and what the walk told it.
#[derive(Default)]
pub(super) struct ConnectorSim {
    /// Per request: the tokens the connector loads past the local hit and whether
    /// asynchronously (`None`: it cannot tell yet; asked again next step).
    pub(super) hits: HashMap<usize, Option<(u64, bool)>>,
    /// `update_state_after_alloc` calls: (request, external tokens, queries, async).
    pub(super) allocated: Vec<(usize, u64, u64, bool)>,
    /// Requests waiting for remote KV, and those whose load is done.
    pub(super) loading: BTreeSet<usize>,
    pub(super) loaded: BTreeSet<usize>,
    /// The blocks an asynchronous load leaves free (`reserved_blocks`).
    pub(super) reserved: u64,
    /// `has_pending_block_frees()`.
    pub(super) pending_frees: bool,
    /// Requests whose blocks an in-flight step may still write.
    pub(super) pinned: BTreeSet<usize>,
    /// `has_sync_kv_loads` of each step's end.
    pub(super) step_ends: Vec<bool>,
    /// Requests whose load the next update reports failed (`failed_kv_load_req_ids`).
    pub(super) failed: BTreeSet<usize>,
}

impl<K: TestKv> TestEngine<K> {
    /// The connector's side of `prefix_hit` (caching is off: no local hit).
    pub(super) fn connector_hit(&mut self, r: usize) -> Option<PrefixHit<K::Blocks>> {
        let Some(answer) = self.kv.hits.get(&r).copied() else {
            return Some(PrefixHit::local(None, 0));
        };
        let (num_external, load_async) = answer?;
        Some(PrefixHit {
            blocks: None,
            num_local: 0,
            num_external,
            load_async,
        })
    }

    /// `_handle_blocked_waiting_request` for a request waiting for remote KV: skipped until its
    /// load is done, then `_update_waiting_for_remote_kv` (a whole prompt leaves its last
    /// token to compute) and `WAITING` (or `PREEMPTED`).
    pub(super) fn unblock_remote(&mut self, r: usize) -> bool {
        if !self.kv.loaded.remove(&r) {
            return false;
        }
        self.kv.loading.remove(&r);
        let q = &mut self.reqs[r];
        if q.computed == q.prompt + q.outs.len() as u64 {
            q.computed -= 1;
        }
        q.status = match q.preemptions {
            0 => Status::Waiting,
            _ => Status::Preempted,
        };
        true
    }
}

/// An engine with room for `num_blocks - 1` blocks of 4 tokens and a budget of 100 tokens.
fn engine(num_blocks: u32) -> TestEngine {
    TestEngine::new(num_blocks, 100)
}

#[test]
fn external_tokens_loaded_with_the_first_step_run_the_rest_of_the_prompt() {
    let mut e = engine(64);
    let a = e.add(10, 5);
    e.kv.hits.insert(a, Some((8, false)));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 2)]);
    assert_eq!(e.r(a).computed, 10);
    assert_eq!(e.kv.allocated, vec![(a, 8, 10, false)]);
    assert_eq!(e.kv.step_ends, vec![true]);
    // The connector's blocks and the step's: all 10 tokens held.
    assert_eq!(e.mgr.blocks("r0").len(), 3);
}

#[test]
fn an_asynchronous_load_holds_its_blocks_until_done_then_runs_its_last_token() {
    let mut e = engine(64);
    let a = e.add(12, 5);
    let b = e.add(4, 5);
    e.kv.hits.insert(a, Some((12, true)));
    // a allocates for its 12 tokens and waits; b runs.
    assert_eq!(e.step(sync(V33), 50), vec![(b, 4)]);
    assert_eq!(e.kv.allocated[0], (a, 12, 12, true));
    assert!(e.kv.loading.contains(&a) && e.r(a).status == Status::OtherWaiting);
    assert_eq!((e.r(a).computed, e.mgr.blocks("r0").len()), (12, 3));
    assert_eq!(e.kv_holding, [a]);
    assert!(e.deferred.contains(&a) && e.inflight.contains(&a));
    assert_eq!(e.kv.step_ends, vec![false]);
    // Still loading: skipped again.
    assert_eq!(e.step(sync(V33), 50), vec![(b, 1)]);
    e.kv.loaded.insert(a);
    // Done: its last prompt token runs, without a second lookup.
    assert_eq!(e.schedule(sync(V33)), vec![(b, 1), (a, 1)]);
    assert_eq!(e.kv.allocated.last(), Some(&(a, 0, 0, false)));
    assert_eq!(e.kv.allocated.iter().filter(|c| c.0 == a).count(), 2);
    assert!(e.kv_holding.is_empty() && !e.deferred.contains(&a));
}

#[test]
fn a_connector_that_cannot_tell_yet_skips_the_request() {
    let mut e = engine(64);
    let a = e.add(8, 5);
    let b = e.add(4, 5);
    e.kv.hits.insert(a, None);
    assert_eq!(e.step(sync(V33), 50), vec![(b, 4)]);
    assert_eq!(e.waiting, [a]);
    assert!(e.deferred.contains(&a));
    assert_eq!(e.kv.allocated, vec![(b, 0, 4, false)]); // a was never allocated
    e.kv.hits.insert(a, Some((0, false)));
    assert_eq!(e.schedule(sync(V33)), vec![(b, 1), (a, 8)]);
}

#[test]
fn an_asynchronous_load_is_admitted_only_past_the_reserved_blocks() {
    let mut e = engine(6); // 5 usable blocks
    let a = e.add(16, 5);
    e.kv.hits.insert(a, Some((16, true)));
    e.kv.reserved = 2; // 4 blocks + 2 reserved > 5
    assert!(e.step(sync(V33), 50).is_empty());
    assert_eq!(e.waiting, [a]);
    assert!(e.kv.allocated.is_empty() && e.mgr.blocks("r0").is_empty());
    e.kv.reserved = 1;
    assert!(e.step(sync(V33), 50).is_empty());
    assert_eq!(e.kv_holding, [a]);
}

/// Two running requests filling the cache: the next decode of the second does not fit.
fn full_running() -> (TestEngine, usize, usize) {
    let mut e = engine(5); // 4 usable blocks
    let a = e.add(8, 20);
    let b = e.add(8, 20);
    e.step(sync(V33), 50);
    assert_eq!(e.running, [a, b]);
    (e, a, b)
}

#[test]
fn pending_connector_frees_end_the_running_pass_without_preempting() {
    let (mut e, a, _b) = full_running();
    e.kv.pending_frees = true;
    assert_eq!(e.schedule(sync(V33)), vec![]);
    assert_eq!(e.running.len(), 2);
    e.kv.pending_frees = false;
    e.scheduled.clear();
    // Without them the last running request is preempted for the first.
    assert_eq!(e.schedule(sync(V33)), vec![(a, 1)]);
    assert_eq!(e.running, [a]);
}

#[test]
fn a_victim_whose_blocks_are_still_written_is_not_preempted() {
    let (mut e, a, b) = full_running();
    e.kv.pinned.insert(b);
    assert_eq!(e.schedule(sync(V33)), vec![]);
    assert_eq!(e.running, [a, b]);
    assert_eq!(e.r(b).preemptions, 0);
}

#[test]
fn an_empty_asynchronous_load_is_refused() {
    let mut e = engine(64);
    let a = e.add(8, 5);
    e.kv.hits.insert(a, Some((0, true)));
    let throttle = e.throttle;
    assert!(Walk::new(&mut e, sync(V33))
        .unwrap()
        .schedule(throttle)
        .is_err());
}

#[test]
fn a_row_whose_load_failed_takes_nothing_but_leaves_flight() {
    let mut e = engine(64);
    let a = e.add(10, 5);
    let b = e.add(4, 5);
    e.kv.hits.insert(a, Some((8, false)));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 2), (b, 4)]);
    assert_eq!(e.r(a).in_flight, 2);
    // vLLM's `_handle_invalid_blocks` took a's computed tokens back before the update.
    e.reqs[a].computed = 4;
    e.kv.failed.insert(a);
    e.next.insert(a, vec![50]);
    e.next.insert(b, vec![51]);
    e.update(sync(V33));
    assert_eq!((e.r(a).in_flight, e.r(a).computed), (0, 4));
    assert!(e.r(a).outs.is_empty() && e.outputs.iter().all(|o| o.0 != a));
    assert_eq!(e.r(b).outs, [51]);
}
