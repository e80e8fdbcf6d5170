//! Properties of the tenant-limit arithmetic that must hold for any time and any traffic.
//! Time is a number passed in: no clock is read.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use quantrouter_policy::limits::{
    admit, exceeded, used_share, Counters, LimitKind, Outcome, Quota, WindowedCounters, Windows,
    DAY_MS, MINUTE_MS,
};

/// Any instant from 1970 to about the year 10 000.
fn any_time() -> impl Strategy<Value = u64> {
    0u64..253_402_300_800_000
}

fn any_limit() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![
        Just(None),
        (1u64..200).prop_map(Some),
        any::<u64>().prop_map(Some)
    ]
}

fn any_quota() -> impl Strategy<Value = Quota> {
    (
        any_limit(),
        any_limit(),
        any_limit(),
        any_limit(),
        prop_oneof![Just(1.0), 0.01f64..1.0],
    )
        .prop_map(|(rpm, tpm, day, month, soft)| Quota {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            budget_per_day: day,
            budget_per_month: month,
            soft_limit: soft,
        })
}

fn any_counters() -> impl Strategy<Value = Counters> {
    let n = || prop_oneof![0u64..300, any::<u64>()];
    (n(), n(), n(), n()).prop_map(|(requests, tokens, spend_day, spend_month)| Counters {
        requests,
        tokens,
        spend_day,
        spend_month,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn every_instant_lies_in_its_windows_and_each_window_ends_where_the_next_begins(
        now in any_time(),
    ) {
        let w = Windows::at(now);
        for (end, length) in [(w.minute_end_ms(), MINUTE_MS), (w.day_end_ms(), DAY_MS)] {
            prop_assert!(end > now && end - now <= length);
        }
        prop_assert_eq!(Windows::at(w.minute_end_ms() - 1).minute, w.minute);
        prop_assert_eq!(Windows::at(w.minute_end_ms()).minute, w.minute + 1);
        prop_assert_eq!(Windows::at(w.day_end_ms()).day, w.day + 1);
        let month_end = w.month_end_ms();
        prop_assert!(month_end > now && month_end - now <= 31 * DAY_MS);
        prop_assert_eq!(month_end % DAY_MS, 0);
        prop_assert_eq!(Windows::at(month_end - 1).month, w.month);
        prop_assert_eq!(Windows::at(month_end).month, w.month + 1);
        // The labels agree with each other: the day is in the month, the minute in the day.
        prop_assert!(w.day_label().starts_with(&w.month_label()));
        prop_assert!(w.minute_label().starts_with(&w.day_label()));
        prop_assert!(Windows::at(month_end).day_label().ends_with("01"));
    }

    #[test]
    fn a_minute_never_admits_past_its_request_or_token_limit(
        quota in any_quota(),
        start in any_time(),
        requests in prop::collection::vec((0u64..2_000, 0u64..60_000), 1..300),
    ) {
        let minute_start = start - start % MINUTE_MS;
        let mut used = WindowedCounters::new(minute_start);
        let (mut admitted, mut tokens) = (0u64, 0u64);
        for (estimate, offset) in requests {
            let now = minute_start + offset;
            let decision = admit(&quota, &used.at(now), estimate, now);
            if !matches!(decision.outcome, Outcome::Refuse { .. }) {
                used.charge(now, 1, estimate as i64, 0);
                admitted += 1;
                tokens += estimate;
            }
        }
        prop_assert!(quota.requests_per_minute.is_none_or(|l| admitted <= l));
        prop_assert!(quota.tokens_per_minute.is_none_or(|l| tokens <= l));
    }

    #[test]
    fn once_a_budget_is_spent_nothing_more_is_admitted_that_day(
        budget in 1u64..50_000,
        costs in prop::collection::vec(0u64..5_000, 1..200),
        start in any_time(),
    ) {
        let quota = Quota { budget_per_day: Some(budget), ..Quota::UNLIMITED };
        let day_start = start - start % DAY_MS;
        let mut spent = WindowedCounters::new(day_start);
        for (i, cost) in costs.into_iter().enumerate() {
            let now = day_start + i as u64 * 1000;
            let before = spent.at(now).spend_day;
            match admit(&quota, &spent.at(now), 0, now).outcome {
                Outcome::Refuse { limit, .. } => {
                    prop_assert_eq!(limit, LimitKind::BudgetPerDay);
                    prop_assert!(before >= budget);
                }
                // Admitted only while something is left: the overshoot is at most the cost
                // of the request that crossed the budget.
                _ => {
                    prop_assert!(before < budget);
                    spent.charge(now, 1, 0, cost);
                }
            }
        }
    }

    #[test]
    fn downgrades_exactly_from_the_soft_limit_to_the_hard_limit(
        quota in any_quota(),
        before in any_counters(),
        tokens in 0u64..5_000,
        now in any_time(),
    ) {
        let decision = admit(&quota, &before, tokens, now);
        let refused = exceeded(&quota, &before, tokens);
        match decision.outcome {
            Outcome::Refuse { limit, retry_after_s } => {
                prop_assert_eq!(Some(limit), refused);
                prop_assert!(retry_after_s >= 1);
            }
            Outcome::Downgrade => {
                prop_assert!(refused.is_none());
                prop_assert!(quota.soft_limit < 1.0 && decision.used >= quota.soft_limit);
            }
            Outcome::Admit => {
                prop_assert!(refused.is_none());
                prop_assert!(quota.soft_limit >= 1.0 || decision.used < quota.soft_limit);
            }
        }
        // More use never lowers the share in use.
        let more = before.plus_request(tokens);
        prop_assert!(used_share(&quota, &more) >= used_share(&quota, &before));
    }

    #[test]
    fn after_retry_after_the_refusing_window_is_over(
        quota in any_quota(),
        before in any_counters(),
        tokens in 0u64..5_000,
        now in any_time(),
    ) {
        if let Outcome::Refuse { limit, retry_after_s } = admit(&quota, &before, tokens, now).outcome {
            let later = now + retry_after_s * 1000;
            let (w, v) = (Windows::at(now), Windows::at(later));
            let over = match limit {
                LimitKind::Requests | LimitKind::Tokens => v.minute != w.minute,
                LimitKind::BudgetPerDay => v.day != w.day,
                LimitKind::BudgetPerMonth => v.month != w.month,
            };
            prop_assert!(over, "{limit:?} still in its window after {retry_after_s} s");
            // ...and not a whole second later than needed.
            let earlier = now + (retry_after_s - 1) * 1000;
            prop_assert!(retry_after_s == 1 || limit.window_end_ms(w) > earlier);
        }
    }

    #[test]
    fn rate_headers_count_down_to_zero_and_reset_within_the_minute(
        quota in any_quota(),
        before in any_counters(),
        tokens in 0u64..5_000,
        now in any_time(),
    ) {
        let d = admit(&quota, &before, tokens, now);
        for state in [d.headers.requests, d.headers.tokens].into_iter().flatten() {
            prop_assert!(state.remaining <= state.limit);
            prop_assert!(state.reset_ms >= 1 && state.reset_ms <= MINUTE_MS);
        }
        prop_assert_eq!(d.headers.requests.is_some(), quota.requests_per_minute.is_some());
        prop_assert_eq!(d.headers.tokens.is_some(), quota.tokens_per_minute.is_some());
        prop_assert_eq!(d.headers.pairs().len(), 3 * (usize::from(d.headers.requests.is_some())
            + usize::from(d.headers.tokens.is_some())));
    }

    #[test]
    fn local_shares_add_up_to_the_headroom_give_or_take_one_per_replica(
        limit in 1u64..1_000_000,
        used in 0u64..1_100_000,
        replicas in 1u64..50,
    ) {
        let quota = Quota { requests_per_minute: Some(limit), ..Quota::UNLIMITED };
        let seen = Counters { requests: used, ..Counters::default() };
        let share = quota.local_share(&seen, replicas).requests_per_minute.unwrap();
        let headroom = limit.saturating_sub(used);
        let total = share * replicas;
        if headroom == 0 {
            prop_assert_eq!(share, 0);
        } else {
            prop_assert!(total <= headroom.max(replicas));
            prop_assert!(total + replicas > headroom);
        }
    }

    #[test]
    fn replicas_admitting_on_their_shares_stay_near_the_limit(
        limit in 1u64..500,
        replicas in 1u64..8,
        burst in prop::collection::vec(0u64..8, 0..1_000),
    ) {
        // Redis is out of reach from the start: each replica counts only what it admitted.
        let quota = Quota { requests_per_minute: Some(limit), ..Quota::UNLIMITED };
        let share = quota.local_share(&Counters::default(), replicas);
        let mut own = vec![Counters::default(); replicas as usize];
        let mut admitted = 0;
        for replica in burst.into_iter().filter(|r| *r < replicas) {
            let counters = &mut own[replica as usize];
            if exceeded(&share, counters, 0).is_none() {
                *counters = counters.plus_request(0);
                admitted += 1;
            }
        }
        prop_assert!(admitted <= limit.max(replicas));
    }

    #[test]
    fn rolling_keeps_what_counts_in_a_window_that_has_not_ended(
        start in any_time(),
        steps in prop::collection::vec((0u64..3 * DAY_MS, 0u64..10, -50i64..100, 0u64..1_000), 1..50),
    ) {
        let mut counters = WindowedCounters::new(start);
        let mut now = start;
        for (advance, requests, tokens, spend) in steps {
            let before = counters.at(now);
            now += advance;
            let (w, v) = (Windows::at(now - advance), Windows::at(now));
            let rolled = counters.at(now);
            prop_assert_eq!(rolled.requests, if v.minute == w.minute { before.requests } else { 0 });
            prop_assert_eq!(rolled.spend_day, if v.day == w.day { before.spend_day } else { 0 });
            prop_assert_eq!(rolled.spend_month, if v.month == w.month { before.spend_month } else { 0 });
            counters.charge(now, requests, tokens, spend);
            let after = counters.at(now);
            prop_assert_eq!(after.requests, rolled.requests + requests);
            prop_assert_eq!(after.tokens, rolled.tokens.saturating_add_signed(tokens));
            prop_assert_eq!(after.spend_day, rolled.spend_day + spend);
        }
    }
}
