//! A circuit breaker per endpoint: closed → open on consecutive failures or a failure rate
//! (with a minimum volume) → half-open after a growing open time → closed after enough good
//! probes, or open again (for longer) after a bad one. Pure: the caller passes the time and
//! reports outcomes.

use std::time::Duration;

use tokio::time::Instant;

use super::window::Window;

/// Breaker settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the circuit: a crashed pod fails every request, and
    /// five in a row is not bad luck.
    pub consecutive_failures: u32,
    /// Failure share over `window` that opens the circuit: a pod failing half its requests
    /// is worse than routing them elsewhere.
    pub failure_rate: f64,
    /// Requests in the window before the rate counts, so two failures out of three do not
    /// open a circuit.
    pub min_volume: u32,
    pub window: Duration,
    /// First open time: about a pod restart's readiness delay.
    pub open_base: Duration,
    /// Longest open time: a pod that keeps failing is still retried every minute.
    pub open_cap: Duration,
    /// Probes let through while half-open, and the successes needed to close.
    pub half_open_probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            failure_rate: 0.5,
            min_volume: 20,
            window: Duration::from_secs(10),
            open_base: Duration::from_secs(5),
            open_cap: Duration::from_secs(60),
            half_open_probes: 2,
        }
    }
}

/// The state exported as a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    Closed,
    HalfOpen,
    Open,
}

/// Whether a request may go to the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// Yes, as one of the half-open probes; report its outcome with `probe = true`.
    Probe,
    No,
}

#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    state: State,
    consecutive: u32,
    window: Window,
    /// Times opened since the circuit was last closed; sets the next open time.
    trips: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { issued: u32, succeeded: u32 },
}

// === impl CircuitState ===

impl CircuitState {
    /// The `quantrouter_circuit_state` value: ordered by severity, so `max` over a tier's
    /// endpoints is its worst circuit.
    pub fn gauge_value(self) -> u8 {
        match self {
            Self::Closed => 0,
            Self::HalfOpen => 1,
            Self::Open => 2,
        }
    }
}

// === impl Breaker ===

impl Breaker {
    pub fn new(config: BreakerConfig, now: Instant) -> Self {
        Self {
            config,
            state: State::Closed,
            consecutive: 0,
            window: Window::new(config.window, now),
            trips: 0,
        }
    }

    /// The state as of `now` (an open circuit whose time is up reads half-open).
    pub fn state(&self, now: Instant) -> CircuitState {
        match self.state {
            State::Closed => CircuitState::Closed,
            State::Open { until } if now < until => CircuitState::Open,
            State::Open { .. } | State::HalfOpen { .. } => CircuitState::HalfOpen,
        }
    }

    /// When an open circuit turns half-open; `None` unless open.
    pub fn open_until(&self) -> Option<Instant> {
        match self.state {
            State::Open { until } => Some(until),
            State::Closed | State::HalfOpen { .. } => None,
        }
    }

    /// Would [`Breaker::admit`] say yes? (Does not take a probe slot.)
    pub fn would_admit(&self, now: Instant) -> bool {
        match self.state {
            State::Closed => true,
            State::Open { until } => now >= until,
            State::HalfOpen { issued, .. } => issued < self.config.half_open_probes,
        }
    }

    /// Asks to send a request now.
    pub fn admit(&mut self, now: Instant) -> Admit {
        if let State::Open { until } = self.state {
            if now < until {
                return Admit::No;
            }
            self.state = State::HalfOpen {
                issued: 0,
                succeeded: 0,
            };
        }
        match &mut self.state {
            State::Closed => Admit::Yes,
            State::HalfOpen { issued, .. } if *issued < self.config.half_open_probes => {
                *issued += 1;
                Admit::Probe
            }
            State::HalfOpen { .. } | State::Open { .. } => Admit::No,
        }
    }

    pub fn on_success(&mut self, now: Instant, probe: bool) {
        self.consecutive = 0;
        match &mut self.state {
            State::HalfOpen { succeeded, .. } if probe => {
                *succeeded += 1;
                if *succeeded >= self.config.half_open_probes {
                    self.close();
                }
            }
            State::Closed => self.window.record(now, false),
            _ => {}
        }
    }

    pub fn on_failure(&mut self, now: Instant, probe: bool) {
        match self.state {
            State::HalfOpen { .. } if probe => self.open(now),
            State::Closed => {
                self.consecutive += 1;
                self.window.record(now, true);
                let counts = self.window.counts(now);
                let rate_tripped = counts.total >= self.config.min_volume
                    && f64::from(counts.marked)
                        >= self.config.failure_rate * f64::from(counts.total);
                if self.consecutive >= self.config.consecutive_failures || rate_tripped {
                    self.open(now);
                }
            }
            // Late outcomes of requests admitted before the circuit opened change nothing.
            _ => {}
        }
    }

    /// A probe ended without an outcome (the client went away first): its slot is free again.
    pub fn abandon_probe(&mut self) {
        if let State::HalfOpen { issued, .. } = &mut self.state {
            *issued = issued.saturating_sub(1);
        }
    }

    fn open(&mut self, now: Instant) {
        let factor = 1u32.checked_shl(self.trips.min(16)).unwrap_or(u32::MAX);
        let open_for = self
            .config
            .open_base
            .saturating_mul(factor)
            .min(self.config.open_cap);
        self.trips = self.trips.saturating_add(1);
        self.state = State::Open {
            until: now + open_for,
        };
    }

    fn close(&mut self) {
        self.state = State::Closed;
        self.consecutive = 0;
        self.trips = 0;
        self.window.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> BreakerConfig {
        BreakerConfig {
            consecutive_failures: 3,
            failure_rate: 0.5,
            min_volume: 10,
            window: Duration::from_secs(10),
            open_base: Duration::from_secs(1),
            open_cap: Duration::from_secs(4),
            half_open_probes: 2,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn consecutive_failures_open_then_probes_close() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config(), t0);
        b.on_failure(t0, false);
        b.on_failure(t0, false);
        b.on_success(t0, false);
        b.on_failure(t0, false);
        b.on_failure(t0, false);
        assert_eq!(
            b.state(t0),
            CircuitState::Closed,
            "a success resets the streak"
        );
        b.on_failure(t0, false);
        assert_eq!(b.state(t0), CircuitState::Open);
        assert_eq!(b.admit(t0), Admit::No);

        tokio::time::advance(Duration::from_secs(1)).await;
        let t1 = Instant::now();
        assert_eq!(b.state(t1), CircuitState::HalfOpen);
        assert_eq!(b.admit(t1), Admit::Probe);
        assert_eq!(b.admit(t1), Admit::Probe);
        assert_eq!(
            b.admit(t1),
            Admit::No,
            "only the configured probes go through"
        );
        b.on_success(t1, true);
        assert_eq!(b.state(t1), CircuitState::HalfOpen);
        b.on_success(t1, true);
        assert_eq!(b.state(t1), CircuitState::Closed);
        assert_eq!(b.admit(t1), Admit::Yes);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_reopens_for_longer_up_to_the_cap() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config(), t0);
        for _ in 0..3 {
            b.on_failure(t0, false);
        }
        let mut open_for = Vec::new();
        let mut now = t0;
        for _ in 0..4 {
            let opened = now;
            while b.admit(now) == Admit::No {
                now += Duration::from_millis(100);
            }
            open_for.push((now - opened).as_millis());
            b.on_failure(now, true);
        }
        assert_eq!(open_for, [1000, 2000, 4000, 4000]);
    }

    #[tokio::test(start_paused = true)]
    async fn failure_rate_needs_the_minimum_volume() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config(), t0);
        // Alternating outcomes never make 3 in a row, so only the rate can trip.
        for i in 0..9 {
            if i % 2 == 0 {
                b.on_failure(t0, false);
            } else {
                b.on_success(t0, false);
            }
        }
        assert_eq!(
            b.state(t0),
            CircuitState::Closed,
            "5/9 failed but volume < 10"
        );
        b.on_success(t0, false);
        b.on_failure(t0, false);
        assert_eq!(
            b.state(t0),
            CircuitState::Open,
            "6/11 ≥ 50% with volume ≥ 10"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn old_failures_leave_the_window() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config(), t0);
        for i in 0..10 {
            if i % 2 == 0 {
                b.on_failure(t0, false);
            } else {
                b.on_success(t0, false);
            }
        }
        let later = t0 + Duration::from_secs(11);
        b.on_failure(later, false);
        assert_eq!(
            b.state(later),
            CircuitState::Closed,
            "the earlier ten aged out"
        );
    }
}
