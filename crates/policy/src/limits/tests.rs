use super::*;

/// Unix milliseconds of a UTC date and time.
fn utc(year: u64, month: u32, day: u32, hour: u64, minute: u64, ms: u64) -> u64 {
    days_from_civil(year, month, day) * DAY_MS + hour * 3_600_000 + minute * MINUTE_MS + ms
}

fn quota() -> Quota {
    Quota {
        requests_per_minute: Some(60),
        tokens_per_minute: Some(10_000),
        budget_per_day: Some(to_micros(5.0)),
        budget_per_month: Some(to_micros(100.0)),
        soft_limit: 0.8,
    }
}

#[test]
fn civil_dates_match_known_unix_times() {
    assert_eq!(utc(1970, 1, 1, 0, 0, 0), 0);
    // 2000-03-01 (after a leap day in a year divisible by 400) and 2026-11-22.
    assert_eq!(utc(2000, 3, 1, 0, 0, 0), 951_868_800_000);
    assert_eq!(utc(2026, 11, 22, 0, 0, 0), 1_795_305_600_000);
    let now = utc(2024, 2, 29, 23, 59, 30_500);
    let w = Windows::at(now);
    assert_eq!(w.minute_label(), "202402292359");
    assert_eq!(w.day_label(), "20240229");
    assert_eq!(w.month_label(), "202402");
    assert_eq!(w.minute_end_ms() - now, 29_500);
    assert_eq!(w.day_end_ms(), utc(2024, 3, 1, 0, 0, 0));
    assert_eq!(w.month_end_ms(), utc(2024, 3, 1, 0, 0, 0));
    let december = Windows::at(utc(2025, 12, 31, 12, 0, 0));
    assert_eq!(december.month_label(), "202512");
    assert_eq!(december.month_end_ms(), utc(2026, 1, 1, 0, 0, 0));
}

#[test]
fn the_last_request_of_a_minute_is_admitted_downgraded_and_the_next_refused() {
    let now = utc(2026, 3, 15, 12, 4, 20_000);
    let before = Counters {
        requests: 59,
        ..Counters::default()
    };
    let d = admit(&quota(), &before, 100, now);
    assert_eq!(d.outcome, Outcome::Downgrade);
    let requests = d.headers.requests.unwrap();
    assert_eq!((requests.limit, requests.remaining), (60, 0));
    assert_eq!(requests.reset_ms, 40_000);

    let full = Counters {
        requests: 60,
        ..Counters::default()
    };
    let d = admit(&quota(), &full, 100, now);
    assert_eq!(
        d.outcome,
        Outcome::Refuse {
            limit: LimitKind::Requests,
            retry_after_s: 40
        }
    );
    assert_eq!(LimitKind::Requests.code(), "rate_limit_exceeded");
    assert_eq!(
        d.headers.pairs(),
        [
            (LIMIT_REQUESTS, "60".to_owned()),
            (REMAINING_REQUESTS, "0".to_owned()),
            (RESET_REQUESTS, "40s".to_owned()),
            (LIMIT_TOKENS, "10000".to_owned()),
            (REMAINING_TOKENS, "10000".to_owned()),
            (RESET_TOKENS, "40s".to_owned()),
        ]
    );
}

#[test]
fn a_request_that_would_pass_the_token_limit_is_refused() {
    let now = utc(2026, 3, 15, 12, 4, 59_750);
    let before = Counters {
        tokens: 9_900,
        ..Counters::default()
    };
    assert_eq!(
        admit(&quota(), &before, 100, now).outcome,
        Outcome::Downgrade
    );
    let d = admit(&quota(), &before, 101, now);
    assert_eq!(
        d.outcome,
        Outcome::Refuse {
            limit: LimitKind::Tokens,
            retry_after_s: 1
        }
    );
    assert_eq!(d.headers.tokens.unwrap().reset_ms, 250);
}

#[test]
fn budgets_downgrade_at_the_soft_limit_refuse_when_spent_and_reset_the_next_day() {
    let now = utc(2026, 3, 15, 18, 0, 0);
    let mut spent = WindowedCounters::new(now);
    spent.charge(now, 0, 0, to_micros(4.25));
    let d = admit(&quota(), &spent.at(now), 10, now);
    assert_eq!(d.outcome, Outcome::Downgrade);
    assert!((d.used - 0.85).abs() < 1e-9, "{}", d.used);

    spent.charge(now, 0, 0, to_micros(0.75));
    let d = admit(&quota(), &spent.at(now), 10, now);
    assert_eq!(
        d.outcome,
        Outcome::Refuse {
            limit: LimitKind::BudgetPerDay,
            retry_after_s: 6 * 3600
        }
    );
    assert_eq!(LimitKind::BudgetPerDay.code(), "insufficient_quota");

    let tomorrow = utc(2026, 3, 16, 0, 0, 1);
    let counters = spent.at(tomorrow);
    assert_eq!(counters.spend_day, 0);
    assert_eq!(counters.spend_month, to_micros(5.0));
    assert_eq!(
        admit(&quota(), &counters, 10, tomorrow).outcome,
        Outcome::Admit
    );
}

#[test]
fn a_spent_month_outranks_everything_else() {
    let now = utc(2026, 2, 10, 0, 0, 0);
    let before = Counters {
        requests: 60,
        spend_day: to_micros(5.0),
        spend_month: to_micros(100.0),
        ..Counters::default()
    };
    let d = admit(&quota(), &before, 1, now);
    assert_eq!(
        d.outcome,
        Outcome::Refuse {
            limit: LimitKind::BudgetPerMonth,
            retry_after_s: 19 * 86_400
        }
    );
}

#[test]
fn soft_limit_one_never_downgrades_and_no_limits_admit_everything() {
    let q = Quota {
        soft_limit: 1.0,
        ..quota()
    };
    let before = Counters {
        requests: 59,
        ..Counters::default()
    };
    assert_eq!(admit(&q, &before, 1, 0).outcome, Outcome::Admit);
    let busy = Counters {
        requests: u64::MAX,
        tokens: u64::MAX,
        spend_day: u64::MAX,
        spend_month: u64::MAX,
    };
    let d = admit(&Quota::UNLIMITED, &busy, u64::MAX, u64::MAX);
    assert_eq!(d.outcome, Outcome::Admit);
    assert!(d.headers.pairs().is_empty());
    assert!(!Quota::UNLIMITED.is_limited());
}

#[test]
fn reset_values_read_like_openais() {
    for (ms, text) in [
        (0, "0ms"),
        (250, "250ms"),
        (1000, "1s"),
        (59_500, "59.5s"),
        (1_020, "1.02s"),
        (60_000, "1m0s"),
        (360_000, "6m0s"),
        (3_723_000, "1h2m3s"),
        (86_400_000, "24h0m0s"),
    ] {
        assert_eq!(reset_value(ms), text);
    }
}

#[test]
fn local_shares_divide_the_headroom_among_replicas() {
    let seen = Counters {
        requests: 30,
        tokens: 10_000,
        spend_day: to_micros(1.0),
        ..Counters::default()
    };
    let share = quota().local_share(&seen, 3);
    assert_eq!(share.requests_per_minute, Some(10));
    assert_eq!(share.tokens_per_minute, Some(0), "nothing left to share");
    assert_eq!(share.budget_per_day, Some(to_micros(4.0) / 3));
    assert_eq!(share.budget_per_month, Some(to_micros(100.0) / 3));
    // A little headroom still lets each replica through once.
    let nearly = Counters {
        requests: 59,
        ..Counters::default()
    };
    assert_eq!(quota().local_share(&nearly, 3).requests_per_minute, Some(1));
    assert_eq!(
        quota().local_share(&Counters::default(), 0),
        quota().local_share(&Counters::default(), 1)
    );
}

#[test]
fn micros_round_costs_up_and_refuse_nonsense() {
    assert_eq!(to_micros(0.0000011), 2);
    assert_eq!(to_micros(-1.0), 0);
    assert_eq!(to_micros(f64::NAN), 0);
    assert_eq!(to_micros(f64::INFINITY), u64::MAX);
    assert_eq!(from_micros(1_500_000), 1.5);
    let tiny = TenantLimits {
        budget_per_day: Some(1e-9),
        ..TenantLimits::default()
    };
    assert_eq!(Quota::from(&tiny).budget_per_day, Some(1));
}

fn default_profiles() -> Vec<Profile> {
    crate::ProfileSet::from_json(crate::DEFAULT_PROFILE_SET)
        .unwrap()
        .profiles
}

#[test]
fn a_reservation_is_the_worst_case_over_the_profiles_that_may_serve() {
    let profiles = default_profiles();
    let r = Reservation::worst_case(100, Some(1_000), 1, &profiles);
    assert_eq!(r.tokens, 1_100);
    let dearest = profiles
        .iter()
        .map(|p| {
            to_micros(
                100.0 * p.cost_per_1m_input_tokens / 1e6
                    + 1_000.0 * p.cost_per_1m_output_tokens / 1e6,
            )
        })
        .max()
        .unwrap();
    assert_eq!(r.spend, dearest);
    assert!(r.spend > 0);

    // No max_tokens: the profile's context caps the default.
    let small = profiles
        .iter()
        .min_by_key(|p| p.max_context_tokens)
        .unwrap();
    let prompt = u64::from(small.max_context_tokens) - 10;
    let r = Reservation::worst_case(prompt, None, 1, [small]);
    assert_eq!(r.tokens, prompt + 10);
    let r = Reservation::worst_case(5, None, 1, [small]);
    assert_eq!(
        r.tokens,
        5 + DEFAULT_RESERVED_COMPLETION_TOKENS.min(u64::from(small.max_context_tokens) - 5)
    );
    // No profile at all: tokens only.
    let r = Reservation::worst_case(5, Some(7), 1, []);
    assert_eq!(r, Reservation::tokens(12));
    // Each of n choices may run to max_tokens.
    let r = Reservation::worst_case(100, Some(1_000), 8, &profiles);
    assert_eq!(r.tokens, 8_100);
    assert!(r.spend > dearest * 7);
}

#[test]
fn settling_a_reservation_corrects_by_the_difference() {
    let r = Reservation {
        tokens: 1_010,
        spend: 500,
    };
    assert_eq!(r.settle(400, 120), (-610, -380));
    assert_eq!(r.settle(2_000, 900), (990, 400));
}

#[test]
fn a_reservation_larger_than_the_token_limit_holds_the_whole_limit() {
    let q = quota();
    let r = q.reservable(Reservation {
        tokens: 50_000,
        spend: 7,
    });
    assert_eq!(
        r,
        Reservation {
            tokens: 10_000,
            spend: 7
        }
    );
    // Alone in its minute it passes; behind anything it waits.
    assert_eq!(exceeded(&q, &Counters::default(), r.tokens), None);
    let one = Counters::default().plus_request(1);
    assert_eq!(exceeded(&q, &one, r.tokens), Some(LimitKind::Tokens));
}

#[test]
fn concurrent_reservations_bound_tokens_and_spend() {
    // Forty requests of max_tokens 1,000 against 2,000 tokens a minute: reserved, only
    // what fits is admitted (the old estimate from the prompt alone let all forty in).
    let q = Quota {
        tokens_per_minute: Some(2_000),
        budget_per_day: Some(1_000),
        soft_limit: 1.0,
        ..Quota::UNLIMITED
    };
    let now = utc(2026, 3, 15, 12, 0, 0);
    let worst = Reservation {
        tokens: 1_010,
        spend: 300,
    };
    let mut counters = Counters::default();
    let mut admitted = 0;
    for _ in 0..40 {
        let r = q.reservable(worst);
        if !matches!(
            admit_reserving(&q, &counters, r, now).outcome,
            Outcome::Refuse { .. }
        ) {
            counters = counters.plus(r);
            admitted += 1;
        }
    }
    assert_eq!(admitted, 1);
    assert!(counters.tokens <= 2_000);

    // Spend: the budget plus one request's worst case at most.
    let q = Quota {
        budget_per_day: Some(1_000),
        soft_limit: 1.0,
        ..Quota::UNLIMITED
    };
    let mut counters = Counters::default();
    for _ in 0..100 {
        if !matches!(
            admit_reserving(&q, &counters, worst, now).outcome,
            Outcome::Refuse { .. }
        ) {
            counters = counters.plus(worst);
        }
    }
    assert!(counters.spend_day <= 1_000 + worst.spend, "{counters:?}");
    assert_eq!(counters.requests, 4);
}

#[test]
fn a_correction_lands_in_the_windows_its_request_counted_in() {
    let at = utc(2026, 3, 15, 12, 0, 55_000);
    let mut c = WindowedCounters::new(at);
    c.charge(at, 1, 1_000, 500);
    // Settled in the same minute: corrected.
    c.correct(at, 0, -600, -100);
    assert_eq!(c.at(at).tokens, 400);
    assert_eq!(c.at(at).spend_day, 400);
    // A refund of a request from a minute that is over changes nothing of this one's.
    let later = at + 10_000;
    c.roll(later);
    c.charge(later, 1, 50, 0);
    c.correct(at, -1, -400, -400);
    assert_eq!(c.at(later).requests, 1);
    assert_eq!(c.at(later).tokens, 50);
    // Same day: the spend refund applies, never below zero.
    assert_eq!(c.at(later).spend_day, 0);
}
