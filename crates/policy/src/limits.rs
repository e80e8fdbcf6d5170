//! Tenant limits as arithmetic: the windows an instant falls in, admission against
//! counters, the soft threshold that downgrades, the refusal with its OpenAI code and
//! `Retry-After`, the `x-ratelimit-*` header values, and each replica's share of a limit when
//! the shared counters are out of reach.
//!
//! No clock and no I/O: every function takes the time as Unix milliseconds (UTC) and the
//! counters the caller read, so a test moves time by passing another number. The Redis
//! script that enforces limits cluster-wide makes the same comparisons as [`exceeded`].
//!
//! Windows are fixed: requests and tokens per calendar minute, spend per UTC day and per
//! UTC calendar month. A fixed window resets all at once at its end, which is what
//! `x-ratelimit-reset-*` and `Retry-After` then say exactly.
//!
//! An admitted request holds a [`Reservation`] (its tokens and cost at worst) in the windows
//! it was admitted in, so concurrent requests cannot all pass a limit none of them has
//! reached yet; when it ends, [`Reservation::settle`] turns the reservation into what it
//! used, in the same windows.

use serde::Serialize;

use crate::profile::Profile;
use crate::tenant::TenantLimits;

/// Milliseconds in a minute window.
pub const MINUTE_MS: u64 = 60_000;
/// Milliseconds in a day window.
pub const DAY_MS: u64 = 86_400_000;

/// `x-ratelimit-limit-requests`: the requests per minute allowed.
pub const LIMIT_REQUESTS: &str = "x-ratelimit-limit-requests";
/// `x-ratelimit-remaining-requests`: requests left in this minute.
pub const REMAINING_REQUESTS: &str = "x-ratelimit-remaining-requests";
/// `x-ratelimit-reset-requests`: time until the request limit is whole again (`1s`, `6m0s`).
pub const RESET_REQUESTS: &str = "x-ratelimit-reset-requests";
/// `x-ratelimit-limit-tokens`: the tokens per minute allowed.
pub const LIMIT_TOKENS: &str = "x-ratelimit-limit-tokens";
/// `x-ratelimit-remaining-tokens`: tokens left in this minute.
pub const REMAINING_TOKENS: &str = "x-ratelimit-remaining-tokens";
/// `x-ratelimit-reset-tokens`: time until the token limit is whole again.
pub const RESET_TOKENS: &str = "x-ratelimit-reset-tokens";

/// The windows one instant falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Windows {
    /// Minutes since the Unix epoch.
    pub minute: u64,
    /// Days since the Unix epoch.
    pub day: u64,
    /// Calendar months since January 1970.
    pub month: u64,
}

/// What a tenant used in the current windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Requests admitted this minute.
    pub requests: u64,
    /// Tokens counted this minute (estimates until corrected from `usage`).
    pub tokens: u64,
    /// Spend today, in millionths of the currency unit.
    pub spend_day: u64,
    /// Spend this month, in millionths of the currency unit.
    pub spend_month: u64,
}

/// Counters tied to the windows they count in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowedCounters {
    pub windows: Windows,
    pub counters: Counters,
}

/// A tenant's limits in the units counters use; each `None` is no limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quota {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    /// Millionths of the currency unit per UTC day.
    pub budget_per_day: Option<u64>,
    /// Millionths of the currency unit per UTC month.
    pub budget_per_month: Option<u64>,
    /// Share of any limit from which requests are downgraded; 1 never downgrades.
    pub soft_limit: f64,
}

/// What an admitted request counts against its tenant's limits until its answer ends: the
/// most it may use. Settled to what it used ([`Reservation::settle`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservation {
    /// The prompt's estimate plus the most the answer may generate.
    pub tokens: u64,
    /// The worst-case cost, in millionths of the currency unit.
    pub spend: u64,
}

/// Completion tokens reserved for a request without `max_tokens` (less when the profile's
/// context leaves less): most answers end well below it, and one that runs on is charged
/// what it used when it ends.
pub const DEFAULT_RESERVED_COMPLETION_TOKENS: u64 = 4096;

/// Which limit a request ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    Requests,
    Tokens,
    BudgetPerDay,
    BudgetPerMonth,
}

/// What to do with one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitDecision {
    pub outcome: Outcome,
    /// Values of the `x-ratelimit-*` headers for the answer.
    pub headers: RateHeaders,
    /// The largest share of any limit in use once this request counts (0 without limits).
    pub used: f64,
}

/// Admit, admit routed cheaper, or refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Admit,
    /// Past the soft threshold: route with [`crate::Downgrade::NEAR_LIMIT`].
    Downgrade,
    /// At a hard limit: 429 with the limit's code and `Retry-After`.
    Refuse {
        limit: LimitKind,
        retry_after_s: u64,
    },
}

/// The `x-ratelimit-*` values; a limit the tenant does not have sends no headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub requests: Option<RateState>,
    pub tokens: Option<RateState>,
}

/// One rate limit as a client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateState {
    pub limit: u64,
    pub remaining: u64,
    /// Milliseconds until the window ends and the limit is whole again.
    pub reset_ms: u64,
}

// === impl Windows ===

impl Windows {
    /// The windows of an instant, in Unix milliseconds.
    pub fn at(unix_ms: u64) -> Self {
        let day = unix_ms / DAY_MS;
        let (year, month, _) = civil_from_days(day);
        Self {
            minute: unix_ms / MINUTE_MS,
            day,
            month: (year - 1970) * 12 + u64::from(month - 1),
        }
    }

    /// When this minute ends, in Unix milliseconds.
    pub fn minute_end_ms(self) -> u64 {
        self.minute.saturating_add(1).saturating_mul(MINUTE_MS)
    }

    /// When this UTC day ends, in Unix milliseconds.
    pub fn day_end_ms(self) -> u64 {
        self.day.saturating_add(1).saturating_mul(DAY_MS)
    }

    /// When this UTC month ends (the first of the next, midnight), in Unix milliseconds.
    pub fn month_end_ms(self) -> u64 {
        let next = self.month.saturating_add(1);
        let (year, month) = (1970 + next / 12, next % 12 + 1);
        days_from_civil(year, month as u32, 1).saturating_mul(DAY_MS)
    }

    /// `YYYYMMDDHHMM` of the minute (UTC), for counter keys an operator can read.
    pub fn minute_label(self) -> String {
        let minute_of_day = self.minute % (DAY_MS / MINUTE_MS);
        format!(
            "{}{:02}{:02}",
            self.day_label(),
            minute_of_day / 60,
            minute_of_day % 60
        )
    }

    /// `YYYYMMDD` of the day (UTC).
    pub fn day_label(self) -> String {
        let (year, month, day) = civil_from_days(self.day);
        format!("{year:04}{month:02}{day:02}")
    }

    /// `YYYYMM` of the month.
    pub fn month_label(self) -> String {
        format!("{:04}{:02}", 1970 + self.month / 12, self.month % 12 + 1)
    }
}

/// Year, month (1..=12) and day (1..=31) of a day since the Unix epoch (the proleptic
/// Gregorian calendar; H. Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u32, u32) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days since the Unix epoch of a date on or after 1970-01-01.
fn days_from_civil(year: u64, month: u32, day: u32) -> u64 {
    let year = year - u64::from(month <= 2);
    let era = year / 400;
    let yoe = year % 400;
    let mp = u64::from(if month > 2 { month - 3 } else { month + 9 });
    let doy = (153 * mp + 2) / 5 + u64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

// === impl Reservation ===

impl Reservation {
    /// A reservation of tokens alone (no budget to hold).
    pub fn tokens(tokens: u64) -> Self {
        Self { tokens, spend: 0 }
    }

    /// The worst case of a request whose prompt is estimated at `prompt_tokens`, asking for
    /// `choices` answers of at most `max_tokens` each, on whichever of `profiles` serves
    /// it: the most tokens and the highest cost any of them could come to. Without
    /// `max_tokens` an answer runs until the profile's context is full, capped at
    /// [`DEFAULT_RESERVED_COMPLETION_TOKENS`].
    pub fn worst_case<'a>(
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        choices: u64,
        profiles: impl IntoIterator<Item = &'a Profile>,
    ) -> Self {
        let per_choice = |p: &Profile| {
            max_tokens.unwrap_or_else(|| {
                u64::from(p.max_context_tokens)
                    .saturating_sub(prompt_tokens)
                    .min(DEFAULT_RESERVED_COMPLETION_TOKENS)
            })
        };
        let completion = |p: &Profile| per_choice(p).saturating_mul(choices.max(1));
        let mut worst: Option<Self> = None;
        for p in profiles {
            let completion = completion(p);
            let cost = prompt_tokens as f64 * p.cost_per_1m_input_tokens / 1e6
                + completion as f64 * p.cost_per_1m_output_tokens / 1e6;
            let this = Self {
                tokens: prompt_tokens.saturating_add(completion),
                spend: to_micros(cost),
            };
            worst = Some(match worst {
                Some(w) => Self {
                    tokens: w.tokens.max(this.tokens),
                    spend: w.spend.max(this.spend),
                },
                None => this,
            });
        }
        worst.unwrap_or_else(|| {
            let per_choice = max_tokens.unwrap_or(DEFAULT_RESERVED_COMPLETION_TOKENS);
            Self::tokens(prompt_tokens.saturating_add(per_choice.saturating_mul(choices.max(1))))
        })
    }

    /// The corrections (tokens, spend) that turn this reservation into what the request
    /// used: negative when it used less.
    pub fn settle(self, used_tokens: u64, used_spend: u64) -> (i64, i64) {
        let signed = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        (
            signed(used_tokens).saturating_sub(signed(self.tokens)),
            signed(used_spend).saturating_sub(signed(self.spend)),
        )
    }
}

// === impl Counters ===

impl Counters {
    /// These counters plus one admitted request of `tokens` tokens.
    pub fn plus_request(self, tokens: u64) -> Self {
        self.plus(Reservation::tokens(tokens))
    }

    /// These counters plus one admitted request holding `reserved`.
    pub fn plus(self, reserved: Reservation) -> Self {
        Self {
            requests: self.requests.saturating_add(1),
            tokens: self.tokens.saturating_add(reserved.tokens),
            spend_day: self.spend_day.saturating_add(reserved.spend),
            spend_month: self.spend_month.saturating_add(reserved.spend),
        }
    }
}

// === impl WindowedCounters ===

impl WindowedCounters {
    /// Zero counters in the windows of `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            windows: Windows::at(now_ms),
            counters: Counters::default(),
        }
    }

    /// Moves to the windows of `now_ms`, zeroing what counted in a window that is over.
    pub fn roll(&mut self, now_ms: u64) {
        let now = Windows::at(now_ms);
        let c = &mut self.counters;
        if now.minute != self.windows.minute {
            c.requests = 0;
            c.tokens = 0;
        }
        if now.day != self.windows.day {
            c.spend_day = 0;
        }
        if now.month != self.windows.month {
            c.spend_month = 0;
        }
        self.windows = now;
    }

    /// Counts requests, tokens (negative: a correction down) and spend in the windows of
    /// `now_ms`.
    pub fn charge(&mut self, now_ms: u64, requests: u64, tokens: i64, spend: u64) {
        self.roll(now_ms);
        let c = &mut self.counters;
        c.requests = c.requests.saturating_add(requests);
        c.tokens = c.tokens.saturating_add_signed(tokens);
        c.spend_day = c.spend_day.saturating_add(spend);
        c.spend_month = c.spend_month.saturating_add(spend);
    }

    /// Corrects what a request admitted at `admitted_ms` counted (a settlement or a
    /// refund), in the windows it counted in; a window that has ended since is left alone,
    /// and no counter goes below zero.
    pub fn correct(&mut self, admitted_ms: u64, requests: i64, tokens: i64, spend: i64) {
        let then = Windows::at(admitted_ms);
        let c = &mut self.counters;
        if then.minute == self.windows.minute {
            c.requests = c.requests.saturating_add_signed(requests);
            c.tokens = c.tokens.saturating_add_signed(tokens);
        }
        if then.day == self.windows.day {
            c.spend_day = c.spend_day.saturating_add_signed(spend);
        }
        if then.month == self.windows.month {
            c.spend_month = c.spend_month.saturating_add_signed(spend);
        }
    }

    /// The counters as of `now_ms`: zero in windows that have ended since.
    pub fn at(&self, now_ms: u64) -> Counters {
        let mut rolled = *self;
        rolled.roll(now_ms);
        rolled.counters
    }
}

// === impl Quota ===

impl Quota {
    /// No limit at all.
    pub const UNLIMITED: Quota = Quota {
        requests_per_minute: None,
        tokens_per_minute: None,
        budget_per_day: None,
        budget_per_month: None,
        soft_limit: 1.0,
    };

    /// What a request may hold of the token limit: its reservation, but never more than
    /// the whole limit, so a request larger than a minute's tokens still passes once the
    /// minute is empty instead of never (tokens served then stay within the limit plus
    /// one request's worst case).
    pub fn reservable(&self, reserved: Reservation) -> Reservation {
        Reservation {
            tokens: self
                .tokens_per_minute
                .map_or(reserved.tokens, |limit| reserved.tokens.min(limit)),
            ..reserved
        }
    }

    /// Whether any limit is set.
    pub fn is_limited(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_minute.is_some()
            || self.budget_per_day.is_some()
            || self.budget_per_month.is_some()
    }

    /// This replica's share of what is left of each limit, for when the shared counters are
    /// out of reach: the headroom above `seen` (the cluster's counters when last read)
    /// divided among `replicas`, at least one unit while any is left so a small limit is not
    /// refused everywhere.
    pub fn local_share(&self, seen: &Counters, replicas: u64) -> Quota {
        let replicas = replicas.max(1);
        let share = |limit: Option<u64>, used: u64| {
            limit.map(|limit| match limit.saturating_sub(used) {
                0 => 0,
                headroom => (headroom / replicas).max(1),
            })
        };
        Quota {
            requests_per_minute: share(self.requests_per_minute, seen.requests),
            tokens_per_minute: share(self.tokens_per_minute, seen.tokens),
            budget_per_day: share(self.budget_per_day, seen.spend_day),
            budget_per_month: share(self.budget_per_month, seen.spend_month),
            soft_limit: self.soft_limit,
        }
    }
}

impl From<&TenantLimits> for Quota {
    fn from(limits: &TenantLimits) -> Self {
        Self {
            requests_per_minute: limits.requests_per_minute,
            tokens_per_minute: limits.tokens_per_minute,
            budget_per_day: limits.budget_per_day.map(|b| to_micros(b).max(1)),
            budget_per_month: limits.budget_per_month.map(|b| to_micros(b).max(1)),
            soft_limit: limits.soft_limit,
        }
    }
}

/// An amount in millionths of the currency unit, rounded up (a cost is never undercounted);
/// negative or not a number: 0.
pub fn to_micros(amount: f64) -> u64 {
    let micros = (amount * 1e6).ceil();
    if micros >= 0.0 {
        // `as` saturates at u64::MAX for huge values.
        micros as u64
    } else {
        0
    }
}

/// Millionths of the currency unit as an amount.
pub fn from_micros(micros: u64) -> f64 {
    micros as f64 / 1e6
}

// === impl LimitKind ===

impl LimitKind {
    /// The OpenAI error code of a refusal: rates can be retried shortly, budgets not.
    pub fn code(self) -> &'static str {
        match self {
            LimitKind::Requests | LimitKind::Tokens => "rate_limit_exceeded",
            LimitKind::BudgetPerDay | LimitKind::BudgetPerMonth => "insufficient_quota",
        }
    }

    /// The limit's field name in the tenant document, also its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests_per_minute",
            LimitKind::Tokens => "tokens_per_minute",
            LimitKind::BudgetPerDay => "budget_per_day",
            LimitKind::BudgetPerMonth => "budget_per_month",
        }
    }

    /// When the window this limit counts in ends.
    pub fn window_end_ms(self, windows: Windows) -> u64 {
        match self {
            LimitKind::Requests | LimitKind::Tokens => windows.minute_end_ms(),
            LimitKind::BudgetPerDay => windows.day_end_ms(),
            LimitKind::BudgetPerMonth => windows.month_end_ms(),
        }
    }
}

/// The limit that refuses one more request of `tokens` tokens on top of `before`, if any.
/// Budgets refuse once spent or reserved (the request that crosses one is let through, so
/// spend stays within the budget plus one request's worst case); rates refuse a request
/// that would pass them. Longest waits first:
/// month, day, then the minute's requests and tokens. The Redis admission script makes the
/// same comparisons in the same order.
pub fn exceeded(quota: &Quota, before: &Counters, tokens: u64) -> Option<LimitKind> {
    let over = |limit: Option<u64>, used: u64| limit.is_some_and(|limit| used > limit);
    if quota
        .budget_per_month
        .is_some_and(|b| before.spend_month >= b)
    {
        Some(LimitKind::BudgetPerMonth)
    } else if quota.budget_per_day.is_some_and(|b| before.spend_day >= b) {
        Some(LimitKind::BudgetPerDay)
    } else if over(quota.requests_per_minute, before.requests.saturating_add(1)) {
        Some(LimitKind::Requests)
    } else if over(
        quota.tokens_per_minute,
        before.tokens.saturating_add(tokens),
    ) {
        Some(LimitKind::Tokens)
    } else {
        None
    }
}

/// Decides one request of an estimated `tokens` tokens, given what the tenant used before it
/// in the windows of `now_ms`.
pub fn admit(quota: &Quota, before: &Counters, tokens: u64, now_ms: u64) -> LimitDecision {
    admit_reserving(quota, before, Reservation::tokens(tokens), now_ms)
}

/// Decides one request holding `reserved` (tokens and worst-case spend), given what the
/// tenant used and reserved before it in the windows of `now_ms`.
pub fn admit_reserving(
    quota: &Quota,
    before: &Counters,
    reserved: Reservation,
    now_ms: u64,
) -> LimitDecision {
    let windows = Windows::at(now_ms);
    match exceeded(quota, before, reserved.tokens) {
        Some(limit) => {
            let wait_ms = limit.window_end_ms(windows).saturating_sub(now_ms);
            LimitDecision {
                outcome: Outcome::Refuse {
                    limit,
                    retry_after_s: wait_ms.div_ceil(1000).max(1),
                },
                headers: rate_headers(quota, before, windows, now_ms),
                used: used_share(quota, before),
            }
        }
        None => {
            let after = before.plus(reserved);
            let used = used_share(quota, &after);
            let outcome = if quota.soft_limit < 1.0 && used >= quota.soft_limit {
                Outcome::Downgrade
            } else {
                Outcome::Admit
            };
            LimitDecision {
                outcome,
                headers: rate_headers(quota, &after, windows, now_ms),
                used,
            }
        }
    }
}

/// Decides one request on a replica's share of the limits ([`Quota::local_share`]): as
/// [`admit_reserving`], except that a budget share refuses a request whose reservation does
/// not fit in what is left of it. Each replica letting one request cross its share would
/// overshoot the budget once per replica; strict shares keep the cluster within it.
pub fn admit_on_share(
    share: &Quota,
    before: &Counters,
    reserved: Reservation,
    now_ms: u64,
) -> LimitDecision {
    let windows = Windows::at(now_ms);
    let crosses = |budget: Option<u64>, spent: u64| {
        budget.is_some_and(|b| spent.saturating_add(reserved.spend) > b)
    };
    let limit = if crosses(share.budget_per_month, before.spend_month) {
        Some(LimitKind::BudgetPerMonth)
    } else if crosses(share.budget_per_day, before.spend_day) {
        Some(LimitKind::BudgetPerDay)
    } else {
        None
    };
    match limit {
        Some(limit) if reserved.spend > 0 => {
            let wait_ms = limit.window_end_ms(windows).saturating_sub(now_ms);
            LimitDecision {
                outcome: Outcome::Refuse {
                    limit,
                    retry_after_s: wait_ms.div_ceil(1000).max(1),
                },
                headers: rate_headers(share, before, windows, now_ms),
                used: used_share(share, before),
            }
        }
        _ => admit_reserving(share, before, reserved, now_ms),
    }
}

/// The largest share of any limit that `counters` use.
pub fn used_share(quota: &Quota, counters: &Counters) -> f64 {
    let share = |limit: Option<u64>, used: u64| match limit {
        Some(0) => 1.0,
        Some(limit) => used as f64 / limit as f64,
        None => 0.0,
    };
    [
        share(quota.requests_per_minute, counters.requests),
        share(quota.tokens_per_minute, counters.tokens),
        share(quota.budget_per_day, counters.spend_day),
        share(quota.budget_per_month, counters.spend_month),
    ]
    .into_iter()
    .fold(0.0, f64::max)
}

fn rate_headers(quota: &Quota, counters: &Counters, windows: Windows, now_ms: u64) -> RateHeaders {
    let reset_ms = windows.minute_end_ms().saturating_sub(now_ms);
    let state = |limit: Option<u64>, used: u64| {
        limit.map(|limit| RateState {
            limit,
            remaining: limit.saturating_sub(used),
            reset_ms,
        })
    };
    RateHeaders {
        requests: state(quota.requests_per_minute, counters.requests),
        tokens: state(quota.tokens_per_minute, counters.tokens),
    }
}

// === impl RateHeaders ===

impl RateHeaders {
    /// Header names and values, requests first; none for a limit the tenant does not have.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(6);
        for (state, names) in [
            (
                self.requests,
                [LIMIT_REQUESTS, REMAINING_REQUESTS, RESET_REQUESTS],
            ),
            (self.tokens, [LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS]),
        ] {
            if let Some(s) = state {
                out.push((names[0], s.limit.to_string()));
                out.push((names[1], s.remaining.to_string()));
                out.push((names[2], reset_value(s.reset_ms)));
            }
        }
        out
    }
}

/// A reset time as OpenAI writes it: `250ms`, `1s`, `59.5s`, `6m0s`, `1h2m3s`.
pub fn reset_value(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (hours, minutes) = (ms / 3_600_000, ms / 60_000 % 60);
    let (secs, millis) = (ms / 1000 % 60, ms % 1000);
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&format!("{hours}h"));
    }
    if hours > 0 || minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    if millis == 0 {
        out.push_str(&format!("{secs}s"));
    } else {
        let fraction = format!("{millis:03}");
        out.push_str(&format!("{secs}.{}s", fraction.trim_end_matches('0')));
    }
    out
}

#[cfg(test)]
mod tests;
