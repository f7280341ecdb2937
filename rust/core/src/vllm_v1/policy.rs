//! vLLM v1's scheduling rules (0.32 and 0.33) on the path pagedkv runs natively: how many
//! tokens a running or waiting request gets this step, whether its prefills wait, which
//! running request a PRIORITY preemption picks, and when an appended token stops a request.
//!
//! Each rule is a pure function of numbers the caller reads off vLLM's `Request` and the
//! scheduler (no state here): the walk ([`super::walk`]) calls these in vLLM's order. Sources:
//! `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`) and `vllm/v1/core/sched/utils.py`
//! (`check_stop`). Every function is O(1) but [`priority_victim`], O(running).

use super::engine::PrefillGate;

/// The scheduler's limits that the rules read (vLLM's attribute names).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// `max_model_len`.
    pub max_model_len: u64,
    /// `scheduler_config.long_prefill_token_threshold` (0: none).
    pub long_prefill_token_threshold: u64,
    /// `scheduler_config.long_prefill_token_threshold_adaptive` (0.33; false on 0.32).
    pub adaptive_threshold: bool,
    /// `scheduler_config.enable_chunked_prefill`.
    pub chunked_prefill: bool,
    /// `num_sampled_tokens_per_step`: 1 for generation (the sampled token must fit).
    pub sampled_per_step: u64,
}

/// vLLM's `_reserve_prefill_lookahead` (multi-module MTP's drafter reads `lookahead` prefill
/// tokens past a chunk): a chunk of `n` from `num_computed` may not end fewer than
/// `lookahead` tokens before the request's `num_tokens`; it ends `lookahead` before instead
/// (0 if that leaves nothing). A no-op for a lookahead of 0 or 1 (EAGLE-family drafters).
pub fn reserve_prefill_lookahead(
    num_tokens: u64,
    num_computed: u64,
    n: u64,
    lookahead: u64,
) -> u64 {
    let remaining = i128::from(num_tokens) - i128::from(num_computed) - i128::from(n);
    if remaining > 0 && remaining < i128::from(lookahead) {
        let cut = i128::from(lookahead) - remaining;
        return u64::try_from(i128::from(n) - cut).unwrap_or(0);
    }
    n
}

/// Whether vLLM's `defer_prefills` may hold this step, short of its last condition (some
/// running request is decoding, `not is_prefill_chunk`, which the walk reads only when this
/// is true): a data-parallel rank's throttled step (`throttle_prefills`), or 0.33's local
/// cadence (this step, executed step `num_executed_steps + 1`, comes fewer than `interval`
/// steps after the last prefill-carrying one); neither while the last undeferred waiting
/// pass was capacity-bound (`prefill_capacity_bound`).
pub fn prefills_may_defer(throttle: bool, gate: &PrefillGate, num_executed_steps: u64) -> bool {
    if gate.capacity_bound {
        return false;
    }
    let this_step = i128::from(num_executed_steps) + 1;
    throttle
        || (gate.interval > 1
            && this_step - i128::from(gate.last_prefill_step) < i128::from(gate.interval))
}

/// The step's two budgets: `token_budget` and `input_budget`, and the draft slots every
/// scheduled request also takes of the input budget (`max_num_new_slots_for_drafting` of the
/// speculative config; 0 without one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub tokens: u64,
    pub input: u64,
    pub draft_slots: u64,
}

impl Budget {
    /// What one request may take: `min(token_budget, input_budget - draft_slots)`.
    pub fn room(&self) -> u64 {
        self.tokens.min(self.input.saturating_sub(self.draft_slots))
    }

    /// Whether a pass may look at another request: input room past the draft slots.
    pub fn has_input(&self) -> bool {
        self.input > self.draft_slots
    }

    /// A scheduled request takes `n` tokens, and its draft slots of the input budget.
    pub fn take(&mut self, n: u64) {
        self.tokens -= n;
        self.input -= n + self.draft_slots;
    }

    pub fn give_back(&mut self, n: u64) {
        self.tokens += n;
        self.input += n + self.draft_slots;
    }
}

/// The step's `long_prefill_token_threshold`: none for a lone request (running + waiting
/// <= 1), raised to a fair share of the input budget when adaptive.
pub fn long_prefill_threshold(lim: &Limits, num_eligible: u64, input_budget: u64) -> u64 {
    if num_eligible <= 1 {
        return 0;
    }
    let t = lim.long_prefill_token_threshold;
    if t > 0 && lim.adaptive_threshold {
        t.max(input_budget / num_eligible)
    } else {
        t
    }
}

/// A running request's fields the running loop reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunningRow {
    pub num_computed_tokens: u64,
    /// `num_tokens_with_spec`: prompt + outputs + draft tokens.
    pub num_tokens_with_spec: u64,
    pub num_output_placeholders: u64,
    pub num_prompt_tokens: u64,
    pub max_tokens: u64,
}

/// Tokens the running loop schedules for `row` (0: the request is passed over this step, the
/// loop goes on): vLLM's async max-tokens skip, then `num_tokens_with_spec + placeholders -
/// num_computed` capped by the threshold, the budget and `max_model_len` (room for the
/// sampled token).
pub fn running_tokens(lim: &Limits, row: &RunningRow, threshold: u64, budget: &Budget) -> u64 {
    let computed = row.num_computed_tokens;
    let placeholders = row.num_output_placeholders;
    if placeholders > 0 && computed + 2 >= row.num_prompt_tokens + row.max_tokens + placeholders {
        return 0;
    }
    let mut n = (row.num_tokens_with_spec + placeholders).saturating_sub(computed);
    if threshold > 0 && threshold < n {
        n = threshold;
    }
    n = n.min(budget.room());
    let room = lim
        .max_model_len
        .saturating_sub(computed)
        .saturating_sub(lim.sampled_per_step);
    n.min(room)
}

/// Tokens the waiting loop schedules for a request with `num_tokens` tokens of which
/// `num_computed` are computed (prefix hit or none), and whether they were padded to a
/// uniform speculative decode (`pad`: `1 + num_spec_tokens` where vLLM pads this request: a
/// single token left, see the walk); `None` ends the waiting loop (chunked prefill off and the
/// request does not fit the budget, or a padded decode that does not fit).
pub fn waiting_tokens(
    lim: &Limits,
    num_tokens: u64,
    num_computed: u64,
    threshold: u64,
    budget: &Budget,
    pad: Option<u64>,
) -> Option<(u64, bool)> {
    let mut n = num_tokens.saturating_sub(num_computed);
    let room = budget.room();
    let mut padded = false;
    if let (Some(p), 1) = (pad, n) {
        // Only where the sampled token(s) still fit; a padded decode is not cut short.
        if num_computed + p + lim.sampled_per_step <= lim.max_model_len {
            if p > room {
                return None;
            }
            (n, padded) = (p, true);
        }
    }
    if threshold > 0 && threshold < n {
        n = threshold;
    }
    if !lim.chunked_prefill && n > room {
        return None;
    }
    Some((n.min(room), padded))
}

/// vLLM's `_drafts_unused`: the drafts proposed after this step are sure to go unused (a
/// non-final prefill chunk samples nothing; a step that samples the last output token
/// finishes the request even if every draft is rejected).
pub fn drafts_unused(
    num_computed: u64,
    num_new: u64,
    num_tokens: u64,
    num_output_tokens: u64,
    has_placeholders: bool,
    max_tokens: u64,
) -> bool {
    if num_computed + num_new < num_tokens {
        return true;
    }
    num_output_tokens + 1 + u64::from(has_placeholders) >= max_tokens
}

/// The running request a PRIORITY preemption takes: the first maximum of `(priority,
/// arrival_time)` in running order (Python's `max` keeps the first of equal keys).
pub fn priority_victim(keys: impl IntoIterator<Item = (i64, f64)>) -> Option<usize> {
    let mut best: Option<(usize, (i64, f64))> = None;
    for (i, k) in keys.into_iter().enumerate() {
        let better = match best {
            None => true,
            Some((_, b)) => k.0 > b.0 || (k.0 == b.0 && k.1 > b.1),
        };
        if better {
            best = Some((i, k));
        }
    }
    best.map(|(i, _)| i)
}

/// The length cap the rules apply: `max_model_len`, or the KV cache's size (`pool_tokens`,
/// the null block excluded) where the cache holds fewer tokens. vLLM's own boundary at
/// `max_model_len`, with the cache standing in for it: the room rule leaves a slot for the
/// sampled token (`cap - 1 - num_computed_tokens`), `check_stop` stops a request at `cap`
/// tokens, so a request holds at most `cap - 1` tokens of KV cache and never outgrows it.
pub fn length_cap(max_model_len: u64, pool_tokens: u64) -> u64 {
    max_model_len.min(pool_tokens)
}

/// A prompt the request can never be prefilled and sampled within: `num_prompt +
/// sampled_per_step > cap`. vLLM's input processor refuses a generation prompt of
/// `max_model_len` tokens or more (there must be room for one output token) and a pooling
/// model's of more (it samples none); pagedkv refuses the same prompts at the cache's size.
/// Where the cache holds `max_model_len`, these are exactly the prompts vLLM's processor
/// never lets reach the scheduler.
pub fn refuses_prompt(num_prompt: u64, cap: u64, sampled_per_step: u64) -> bool {
    num_prompt > cap.saturating_sub(sampled_per_step)
}

/// `check_stop`'s length rule: a request of `num_tokens >= cap` tokens is finished with
/// `FINISHED_LENGTH_CAPPED` (its room for another token is 0).
pub fn length_capped(num_tokens: u64, cap: u64) -> bool {
    num_tokens >= cap
}

/// Why an appended token stops a request (`check_stop`'s outcomes in scope).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The EOS token: `FINISHED_STOPPED`, no stop reason.
    Eos,
    /// One of `stop_token_ids`: `FINISHED_STOPPED`, the token is the stop reason.
    StopToken(i64),
    /// `max_model_len` or `max_tokens` reached: `FINISHED_LENGTH_CAPPED`.
    Length,
    /// A repeating pattern at the output's tail (`repetition_detection`):
    /// `FINISHED_REPETITION`, stop reason `"repetition_detected"`.
    Repetition,
    /// The structured-output grammar rejected the row's tokens (`update_from_output`, after
    /// `check_stop`): `FINISHED_ERROR`.
    Error,
    /// A pooling request's pooler output arrived (pooling stops at its first output):
    /// `FINISHED_STOPPED`, no stop reason.
    Pooled,
}

/// `SamplingParams.repetition_detection` (`RepetitionDetectionParams`), as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repetition {
    pub min_pattern_size: i64,
    pub max_pattern_size: i64,
    pub min_count: i64,
}

impl Repetition {
    /// The pattern lengths vLLM tries, `None` when the parameters disable the check
    /// (`max_pattern_size <= 0`, `min_count < 2`, or `min > max` after raising `min` to 1).
    fn pattern_lengths(&self) -> Option<std::ops::RangeInclusive<u64>> {
        let min = self.min_pattern_size.max(1);
        let (max, count) = (self.max_pattern_size, self.min_count);
        if max <= 0 || count < 2 || min > max {
            return None;
        }
        Some(min as u64..=max as u64)
    }

    /// How many of the output's last tokens [`has_repetition`] reads (at most).
    pub fn tail_len(&self) -> u64 {
        match self.pattern_lengths() {
            Some(r) => r.end().saturating_mul(self.min_count as u64),
            None => 0,
        }
    }
}

/// vLLM's `check_sequence_repetition(output_token_ids, params)`: for each pattern length
/// from the smallest, whether the last `len` tokens repeat `min_count` times back to back;
/// the search ends at the first length whose repeats do not fit in the output. `tail` is the
/// output's last `min(num_output, tail_len)` tokens, `num_output` its whole length.
/// O(max_pattern_size^2 * min_count).
pub fn has_repetition(tail: &[i64], num_output: u64, rep: &Repetition) -> bool {
    let Some(lengths) = rep.pattern_lengths() else {
        return false;
    };
    let count = rep.min_count as u64;
    for len in lengths {
        if len.saturating_mul(count) > num_output || len.saturating_mul(count) > tail.len() as u64 {
            return false;
        }
        let at = |back: u64| tail[tail.len() - back as usize];
        let repeats = (1..=len).all(|n| (1..count).all(|m| at(len * m + n) == at(n)));
        if repeats {
            return true;
        }
    }
    false
}

/// The sampling fields `check_stop` reads.
#[derive(Clone, Debug, Default)]
pub struct StopRule {
    /// `None` under `ignore_eos`.
    pub eos_token_id: Option<i64>,
    pub stop_token_ids: Vec<i64>,
    pub max_tokens: u64,
    /// `min_tokens`: repetition is not checked before this many outputs.
    pub min_tokens: u64,
    /// `repetition_detection` (`None`: off).
    pub repetition: Option<Repetition>,
}

/// vLLM's `check_stop` after `last` was appended, in its order: EOS, stop ids, then length
/// (`max_model_len`: the [`length_cap`]). `min_tokens` gates only repetition detection, which
/// the caller checks after this ([`repetition_due`], [`has_repetition`]): a sampled EOS stops
/// even before `min_tokens`; the sampler masks it there.
/// `last` is `None` for a sampled id outside i64: it equals no EOS or stop id (the native
/// loop serves only requests whose ids are within i64), so only the length rules apply.
pub fn check_stop(
    rule: &StopRule,
    last: Option<i64>,
    num_tokens: u64,
    num_output_tokens: u64,
    max_model_len: u64,
) -> Option<Stop> {
    if let Some(last) = last {
        if rule.eos_token_id == Some(last) {
            return Some(Stop::Eos);
        }
        if rule.stop_token_ids.contains(&last) {
            return Some(Stop::StopToken(last));
        }
    }
    if length_capped(num_tokens, max_model_len) || num_output_tokens >= rule.max_tokens {
        return Some(Stop::Length);
    }
    None
}

/// Whether `check_stop`, not stopped by [`check_stop`]'s rules, goes on to repetition
/// detection: the request asks for it and has `min_tokens` outputs.
pub fn repetition_due(rule: &StopRule, num_output_tokens: u64) -> Option<&Repetition> {
    match &rule.repetition {
        Some(rep) if num_output_tokens >= rule.min_tokens => Some(rep),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefills_wait_for_the_throttle_or_the_cadence_unless_capacity_bound() {
        let gate = |capacity_bound, interval, last_prefill_step| PrefillGate {
            capacity_bound,
            interval,
            last_prefill_step,
        };
        // A throttled data-parallel step defers; a capacity-bound engine never does.
        assert!(prefills_may_defer(true, &gate(false, 1, -1), 7));
        assert!(!prefills_may_defer(true, &gate(true, 1, -1), 7));
        assert!(!prefills_may_defer(false, &gate(false, 1, -1), 7));
        // 0.33's cadence of 4 after a prefill at executed step 5: steps 6, 7, 8 wait, 9 runs.
        assert!(prefills_may_defer(false, &gate(false, 4, 5), 5));
        assert!(prefills_may_defer(false, &gate(false, 4, 5), 7));
        assert!(!prefills_may_defer(false, &gate(false, 4, 5), 8));
        assert!(!prefills_may_defer(false, &gate(true, 4, 5), 5));
        // The first step is never held (last_prefill_step starts a full interval back).
        assert!(!prefills_may_defer(false, &gate(false, 4, -4), 0));
    }

    fn lim() -> Limits {
        Limits {
            max_model_len: 100,
            long_prefill_token_threshold: 0,
            adaptive_threshold: false,
            chunked_prefill: true,
            sampled_per_step: 1,
        }
    }

    fn budget(n: u64) -> Budget {
        Budget {
            tokens: n,
            input: n,
            draft_slots: 0,
        }
    }

    #[test]
    fn threshold_applies_only_with_company_and_adapts_to_a_fair_share() {
        let mut l = lim();
        l.long_prefill_token_threshold = 8;
        assert_eq!(long_prefill_threshold(&l, 1, 64), 0);
        assert_eq!(long_prefill_threshold(&l, 2, 64), 8);
        l.adaptive_threshold = true;
        assert_eq!(long_prefill_threshold(&l, 2, 64), 32);
        assert_eq!(long_prefill_threshold(&l, 16, 64), 8);
    }

    #[test]
    fn running_row_is_capped_by_threshold_budget_and_model_length() {
        let row = RunningRow {
            num_computed_tokens: 10,
            num_tokens_with_spec: 50,
            num_prompt_tokens: 50,
            max_tokens: 10,
            ..Default::default()
        };
        assert_eq!(running_tokens(&lim(), &row, 0, &budget(64)), 40);
        assert_eq!(running_tokens(&lim(), &row, 16, &budget(64)), 16);
        assert_eq!(running_tokens(&lim(), &row, 0, &budget(7)), 7);
        let mut short = lim();
        short.max_model_len = 30;
        assert_eq!(running_tokens(&short, &row, 0, &budget(64)), 19);
        let done = RunningRow {
            num_computed_tokens: 50,
            ..row
        };
        assert_eq!(running_tokens(&lim(), &done, 0, &budget(64)), 0);
    }

    #[test]
    fn async_request_whose_last_token_is_in_flight_is_passed_over() {
        // 5 prompt + max 3: computed 7 with one placeholder -> the in-flight step ends it.
        let row = RunningRow {
            num_computed_tokens: 7,
            num_tokens_with_spec: 7,
            num_output_placeholders: 1,
            num_prompt_tokens: 5,
            max_tokens: 3,
        };
        assert_eq!(running_tokens(&lim(), &row, 0, &budget(64)), 0);
        let earlier = RunningRow {
            num_computed_tokens: 6,
            num_tokens_with_spec: 6,
            ..row
        };
        assert_eq!(running_tokens(&lim(), &earlier, 0, &budget(64)), 1);
    }

    #[test]
    fn waiting_request_breaks_without_chunking_only_when_over_budget() {
        let mut l = lim();
        assert_eq!(
            waiting_tokens(&l, 40, 16, 0, &budget(8), None),
            Some((8, false))
        );
        l.chunked_prefill = false;
        assert_eq!(waiting_tokens(&l, 40, 16, 0, &budget(8), None), None);
        assert_eq!(
            waiting_tokens(&l, 40, 16, 0, &budget(24), None),
            Some((24, false))
        );
        assert_eq!(
            waiting_tokens(&l, 40, 16, 4, &budget(8), None),
            Some((4, false))
        );
    }

    #[test]
    fn draft_slots_take_their_share_of_the_input_budget() {
        let mut b = Budget {
            tokens: 100,
            input: 20,
            draft_slots: 3,
        };
        assert_eq!(b.room(), 17);
        b.take(5);
        assert_eq!((b.tokens, b.input), (95, 12));
        b.take(9);
        assert_eq!((b.input, b.has_input()), (0, false));
        b.give_back(9);
        assert_eq!((b.tokens, b.input, b.room()), (95, 12, 9));
        let edge = Budget { input: 3, ..b };
        assert!(!edge.has_input() && edge.room() == 0);
    }

    #[test]
    fn a_single_decode_token_is_padded_to_a_uniform_spec_decode() {
        let l = lim();
        // One token left (a resumed decode): padded to 1 + 3 drafts.
        assert_eq!(
            waiting_tokens(&l, 10, 9, 0, &budget(8), Some(4)),
            Some((4, true))
        );
        // Padding that does not fit the budget ends the pass instead of going unpadded.
        assert_eq!(waiting_tokens(&l, 10, 9, 0, &budget(3), Some(4)), None);
        // More than one token left, or no room for the sampled token: not padded.
        assert_eq!(
            waiting_tokens(&l, 10, 8, 0, &budget(8), Some(4)),
            Some((2, false))
        );
        let mut short = lim();
        short.max_model_len = 13;
        assert_eq!(
            waiting_tokens(&short, 10, 9, 0, &budget(8), Some(4)),
            Some((1, false))
        );
    }

    #[test]
    fn drafts_go_unused_after_a_chunk_or_the_last_token() {
        assert!(drafts_unused(0, 8, 10, 0, false, 100)); // a non-final chunk
        assert!(!drafts_unused(8, 2, 10, 0, false, 100)); // the prefill's end: drafts verify
        assert!(drafts_unused(9, 1, 10, 4, false, 5)); // samples the last output token
        assert!(!drafts_unused(9, 1, 10, 3, false, 5));
        assert!(drafts_unused(9, 1, 10, 3, true, 5)); // a step in flight adds one more
    }

    #[test]
    fn priority_victim_is_the_first_maximum() {
        assert_eq!(priority_victim([]), None);
        assert_eq!(
            priority_victim([(0, 1.0), (2, 0.0), (2, 0.0), (1, 9.0)]),
            Some(1)
        );
        assert_eq!(priority_victim([(1, 1.0), (1, 2.0), (0, 3.0)]), Some(1));
    }

    #[test]
    fn length_cap_is_the_cache_only_where_it_is_smaller() {
        assert_eq!(length_cap(64, 48), 48);
        assert_eq!(length_cap(64, 64), 64);
        assert_eq!(length_cap(64, 80), 64);
    }

    #[test]
    fn a_prompt_of_the_caps_size_is_refused_as_vllms_processor_refuses_max_model_len() {
        // Block 16, max_model_len 64, 4 GPU blocks: a 48-token cache.
        let cap = length_cap(64, 48);
        assert!(refuses_prompt(49, cap, 1));
        assert!(refuses_prompt(48, cap, 1));
        assert!(!refuses_prompt(47, cap, 1));
        // The cache holds max_model_len: only what vLLM's processor refuses (>= 64).
        let cap = length_cap(64, 80);
        assert!(refuses_prompt(64, cap, 1));
        assert!(!refuses_prompt(63, cap, 1));
        // A pooling model samples nothing: vLLM's processor lets a prompt of max_model_len in.
        assert!(refuses_prompt(65, cap, 0));
        assert!(!refuses_prompt(64, cap, 0));
        assert!(!refuses_prompt(u64::MAX, u64::MAX, 0));
        assert!(refuses_prompt(u64::MAX, u64::MAX, 1));
    }

    #[test]
    fn a_request_at_the_cap_is_length_capped_and_has_no_room() {
        let cap = length_cap(64, 48);
        assert!(!length_capped(47, cap));
        assert!(length_capped(48, cap));
        assert!(length_capped(49, cap));
        // The largest prompt admitted (47) is prefilled whole, then its one sampled token
        // makes 48 tokens: stopped with 47 tokens of KV, within the 48-token cache.
        let mut l = lim();
        l.max_model_len = cap;
        let prompt = RunningRow {
            num_computed_tokens: 0,
            num_tokens_with_spec: 47,
            num_prompt_tokens: 47,
            max_tokens: 100,
            ..Default::default()
        };
        assert_eq!(running_tokens(&l, &prompt, 0, &budget(64)), 47);
        let rule = StopRule {
            eos_token_id: None,
            stop_token_ids: vec![],
            max_tokens: 100,
            ..StopRule::default()
        };
        assert_eq!(check_stop(&rule, Some(5), 48, 1, cap), Some(Stop::Length));
        assert_eq!(check_stop(&rule, Some(5), 47, 1, cap), None);
    }

    #[test]
    fn stop_checks_run_in_vllms_order() {
        let rule = StopRule {
            eos_token_id: Some(2),
            stop_token_ids: vec![7, 2],
            max_tokens: 4,
            ..StopRule::default()
        };
        assert_eq!(check_stop(&rule, Some(2), 10, 4, 100), Some(Stop::Eos));
        assert_eq!(
            check_stop(&rule, Some(7), 10, 4, 100),
            Some(Stop::StopToken(7))
        );
        assert_eq!(check_stop(&rule, Some(5), 10, 4, 100), Some(Stop::Length));
        assert_eq!(check_stop(&rule, Some(5), 100, 1, 100), Some(Stop::Length));
        assert_eq!(check_stop(&rule, Some(5), 10, 1, 100), None);
        // An id outside i64 stops only by length.
        assert_eq!(check_stop(&rule, None, 10, 1, 100), None);
        assert_eq!(check_stop(&rule, None, 10, 4, 100), Some(Stop::Length));
        let ignore_eos = StopRule {
            eos_token_id: None,
            ..rule
        };
        assert_eq!(
            check_stop(&ignore_eos, Some(2), 10, 1, 100),
            Some(Stop::StopToken(2))
        );
    }

    fn rep(min: i64, max: i64, count: i64) -> Repetition {
        Repetition {
            min_pattern_size: min,
            max_pattern_size: max,
            min_count: count,
        }
    }

    #[test]
    fn repetition_finds_a_pattern_repeated_min_count_times_at_the_tail() {
        let r = rep(0, 2, 3);
        assert_eq!(r.tail_len(), 6);
        assert!(has_repetition(&[9, 4, 4, 4], 4, &r)); // "4" three times
        assert!(has_repetition(&[1, 2, 1, 2, 1, 2], 6, &r)); // "1 2" three times
        assert!(!has_repetition(&[1, 2, 1, 2, 1, 3], 6, &r));
        assert!(!has_repetition(&[4, 4], 2, &r)); // two repeats of three
    }

    #[test]
    fn repetition_search_ends_at_the_first_length_that_does_not_fit() {
        // Length 1 does not repeat; length 2 needs 6 tokens of 5: vLLM returns false there,
        // even though the tail would repeat with length 3 were it longer.
        let r = rep(1, 3, 3);
        assert!(!has_repetition(&[1, 2, 1, 2, 1], 5, &r));
        // min_pattern_size skips the short lengths.
        assert!(!has_repetition(&[7, 7, 7, 7, 7, 7], 6, &rep(2, 2, 4)));
        assert!(has_repetition(&[7, 7, 7, 7, 7, 7, 7, 7], 8, &rep(2, 2, 4)));
    }

    #[test]
    fn repetition_parameters_that_disable_the_check() {
        for r in [rep(1, 0, 3), rep(1, 2, 1), rep(3, 2, 3), rep(1, -5, 3)] {
            assert!(!has_repetition(&[5; 12], 12, &r), "{r:?}");
            assert_eq!(r.tail_len(), 0);
        }
        // A huge count saturates instead of overflowing and finds nothing.
        let big = rep(1, i64::MAX, i64::MAX);
        assert_eq!(big.tail_len(), u64::MAX);
        assert!(!has_repetition(&[5; 4], 4, &big));
    }

    #[test]
    fn repetition_waits_for_min_tokens() {
        let rule = StopRule {
            min_tokens: 3,
            repetition: Some(rep(1, 1, 2)),
            ..StopRule::default()
        };
        assert!(repetition_due(&rule, 2).is_none());
        assert!(repetition_due(&rule, 3).is_some());
        assert!(repetition_due(&StopRule::default(), 9).is_none());
    }

    #[test]
    fn a_chunk_never_ends_within_the_prefill_lookahead() {
        // 17 tokens, 16 scheduled: 1 would remain, under a lookahead of 4: 3 fewer.
        assert_eq!(reserve_prefill_lookahead(17, 0, 16, 4), 13);
        assert_eq!(reserve_prefill_lookahead(19, 0, 16, 4), 15);
        // Exactly the lookahead left, the prompt finished, or no lookahead: unchanged.
        assert_eq!(reserve_prefill_lookahead(20, 0, 16, 4), 16);
        assert_eq!(reserve_prefill_lookahead(17, 1, 16, 4), 16);
        assert_eq!(reserve_prefill_lookahead(17, 0, 16, 1), 16);
        assert_eq!(reserve_prefill_lookahead(17, 0, 16, 0), 16);
        // Drafts past the end (a decode): nothing remains, unchanged.
        assert_eq!(reserve_prefill_lookahead(17, 16, 5, 4), 5);
        // Too small a chunk to keep the lookahead: nothing is scheduled.
        assert_eq!(reserve_prefill_lookahead(10, 0, 8, 4), 6);
        assert_eq!(reserve_prefill_lookahead(10, 7, 2, 4), 0);
        assert_eq!(reserve_prefill_lookahead(u64::MAX, 0, 1, u64::MAX), 0);
    }
}
