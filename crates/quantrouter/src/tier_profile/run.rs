//! One measurement run: streamed requests at each concurrency level, then the eval set on
//! the tier (and the baseline), within a request budget and a deadline.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{IsTerminal, Write as _};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::client::{Endpoint, RequestError, TierClient};
use super::eval::EvalItem;
use super::stats::{LevelReport, StreamSample};

/// What to run, decided before the first request.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    /// `(concurrency, requests)` per level.
    pub levels: Vec<(usize, usize)>,
    /// Eval items to run (each costs one request, two with a baseline).
    pub eval_items: usize,
}

/// Settings of one run.
#[derive(Debug)]
pub struct RunSettings<'a> {
    pub tier: &'a Endpoint,
    pub baseline: Option<&'a Endpoint>,
    pub budget: Budget,
    /// Prompts of the latency requests, used in turn.
    pub prompts: &'a [String],
    pub items: &'a [&'a EvalItem],
    pub eval_concurrency: usize,
    pub max_tokens: u32,
    pub request_timeout: Duration,
    pub deadline: Instant,
}

/// Everything a run measured.
#[derive(Debug, Default)]
pub struct RunOutcome {
    pub levels: Vec<LevelReport>,
    /// `outcomes[i]` answers `items[i]`; `None` when the run ended first.
    pub outcomes: Vec<Option<ItemOutcome>>,
    /// Requests sent, to the tier and the baseline.
    pub requests: usize,
    /// The deadline cut the run short.
    pub timed_out: bool,
}

/// The answers to one eval item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutcome {
    pub tier: Result<String, RequestError>,
    /// `None` without a baseline.
    pub baseline: Option<Result<String, RequestError>>,
}

/// A progress line on stderr, shown only when stderr is a terminal.
#[derive(Debug)]
struct Progress {
    enabled: bool,
    label: String,
    total: usize,
    done: AtomicUsize,
}

/// Subjects of the latency prompts: open questions, so answers run to `max_tokens` and
/// decoding is timed over many tokens.
const LATENCY_TOPICS: [&str; 12] = [
    "how a refrigerator keeps food cold",
    "why the sky is blue",
    "how vaccines train the immune system",
    "how a bill becomes law in a parliament",
    "how compilers turn source code into machine code",
    "why bread rises",
    "how tides work",
    "how a bicycle stays upright",
    "how public-key cryptography works",
    "why leaves change colour in autumn",
    "how a jet engine produces thrust",
    "how coral reefs form",
];

/// `n` latency prompts, each unique within the run and across runs (`nonce`), starting with
/// what makes them unique: a server's prefix cache must not make later requests look fast.
pub fn latency_prompts(n: usize, nonce: u32) -> Vec<String> {
    (0..n)
        .map(|i| {
            let topic = LATENCY_TOPICS[i % LATENCY_TOPICS.len()];
            format!("Request {nonce:08x}-{i}. In a few paragraphs, explain {topic}.")
        })
        .collect()
}

/// Requests per level without `--requests-per-level`: four per concurrent stream so every
/// stream runs several requests in a row, and at least eight so p90 rests on a few samples.
pub fn default_requests(concurrency: usize) -> usize {
    (4 * concurrency).max(8)
}

/// Spends `max_requests` on the latency levels first, in order, then on eval items.
pub fn allocate(
    concurrency: &[usize],
    per_level: Option<usize>,
    items: usize,
    with_baseline: bool,
    max_requests: usize,
) -> Budget {
    let mut left = max_requests;
    let mut levels = Vec::new();
    for &c in concurrency {
        let wanted = per_level.unwrap_or_else(|| default_requests(c));
        let n = wanted.min(left);
        if n == 0 {
            break;
        }
        left -= n;
        levels.push((c, n));
    }
    let per_item = if with_baseline { 2 } else { 1 };
    Budget {
        levels,
        eval_items: items.min(left / per_item),
    }
}

/// Runs the latency levels and then the eval items.
pub async fn run(client: &TierClient, settings: &RunSettings<'_>) -> RunOutcome {
    let mut outcome = RunOutcome::default();
    for &(concurrency, requests) in &settings.budget.levels {
        let (level, started, cut_off) =
            measure_level(client, settings, concurrency, requests).await;
        outcome.requests += started;
        outcome.timed_out |= cut_off;
        outcome.levels.push(level);
    }
    let items = &settings.items[..settings.budget.eval_items.min(settings.items.len())];
    let progress = Progress::new("eval set".to_owned(), items.len());
    let results = pool(
        items.len(),
        settings.eval_concurrency,
        settings.deadline,
        &progress,
        |i| settings.answer(client, &items[i].prompt),
    )
    .await;
    progress.finish();
    let per_item = if settings.baseline.is_some() { 2 } else { 1 };
    outcome.requests += results.started * per_item;
    outcome.timed_out |= results.cut_off;
    outcome.outcomes = results.values;
    outcome
}

/// `requests` streamed requests, `concurrency` at a time: the level's report, the requests
/// started, and whether the deadline cut it short.
async fn measure_level(
    client: &TierClient,
    settings: &RunSettings<'_>,
    concurrency: usize,
    requests: usize,
) -> (LevelReport, usize, bool) {
    let progress = Progress::new(format!("latency at concurrency {concurrency}"), requests);
    let started = Instant::now();
    let results = pool(requests, concurrency, settings.deadline, &progress, |i| {
        let prompt = &settings.prompts[i % settings.prompts.len()];
        let until = settings.until();
        async move {
            let result = client
                .stream(settings.tier, prompt, settings.max_tokens, until)
                .await;
            settings.unless_cut_off(result)
        }
    })
    .await;
    progress.finish();
    let wall = started.elapsed();
    let mut samples: Vec<StreamSample> = Vec::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for result in results.values.iter().flatten() {
        match result {
            Ok(sample) => samples.push(*sample),
            Err(error) => *errors.entry(error.kind()).or_default() += 1,
        }
    }
    let level = LevelReport::new(concurrency, &samples, errors, wall);
    (level, results.started, results.cut_off)
}

// === impl RunSettings ===

impl RunSettings<'_> {
    /// When a request starting now must give up.
    fn until(&self) -> Instant {
        (Instant::now() + self.request_timeout).min(self.deadline)
    }

    /// A request the run's deadline stopped is not the endpoint's failure: no result.
    fn unless_cut_off<T>(
        &self,
        result: Result<T, RequestError>,
    ) -> Option<Result<T, RequestError>> {
        match result {
            Err(RequestError::Timeout) if Instant::now() >= self.deadline => None,
            other => Some(other),
        }
    }

    /// One eval item on the tier and, at the same time, on the baseline.
    async fn answer(&self, client: &TierClient, prompt: &str) -> Option<ItemOutcome> {
        let until = self.until();
        let tier = client.answer(self.tier, prompt, self.max_tokens, until);
        let baseline = async {
            match self.baseline {
                Some(endpoint) => Some(
                    client
                        .answer(endpoint, prompt, self.max_tokens, until)
                        .await,
                ),
                None => None,
            }
        };
        let (tier, baseline) = tokio::join!(tier, baseline);
        let tier = self.unless_cut_off(tier)?;
        let baseline = match baseline {
            Some(result) => Some(self.unless_cut_off(result)?),
            None => None,
        };
        Some(ItemOutcome { tier, baseline })
    }
}

/// Results of a pool: one slot per task.
struct PoolResults<T> {
    values: Vec<Option<T>>,
    started: usize,
    /// Some task did not start, or did not finish, because of the deadline.
    cut_off: bool,
}

/// Runs `task(0..n)` with at most `concurrency` at once and starts none after `deadline`.
/// A task returns `None` when the deadline cut it off.
async fn pool<T, F, Fut>(
    n: usize,
    concurrency: usize,
    deadline: Instant,
    progress: &Progress,
    task: F,
) -> PoolResults<T>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let next = AtomicUsize::new(0);
    let started = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
    let worker = || async {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n || Instant::now() >= deadline {
                break;
            }
            started.fetch_add(1, Ordering::Relaxed);
            let value = task(i).await;
            if let Some(slot) = slots.lock().unwrap_or_else(|e| e.into_inner()).get_mut(i) {
                *slot = value;
            }
            progress.tick();
        }
    };
    futures_util::future::join_all((0..concurrency.clamp(1, n.max(1))).map(|_| worker())).await;
    let values = slots.into_inner().unwrap_or_else(|e| e.into_inner());
    let done = values.iter().filter(|v| v.is_some()).count();
    PoolResults {
        cut_off: done < n,
        started: started.into_inner(),
        values,
    }
}

// === impl Progress ===

impl Progress {
    fn new(label: String, total: usize) -> Self {
        let progress = Self {
            enabled: std::io::stderr().is_terminal() && total > 0,
            label,
            total,
            done: AtomicUsize::new(0),
        };
        progress.draw(0);
        progress
    }

    fn tick(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        self.draw(done);
    }

    fn draw(&self, done: usize) {
        if self.enabled {
            let mut stderr = std::io::stderr().lock();
            let _ = write!(stderr, "\r\x1b[2K{}: {done}/{}", self.label, self.total);
            let _ = stderr.flush();
        }
    }

    fn finish(&self) {
        if self.enabled {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_prompts_are_unique_and_differ_between_runs() {
        let a = latency_prompts(30, 1);
        let unique: std::collections::HashSet<&String> = a.iter().collect();
        assert_eq!(unique.len(), 30);
        assert!(latency_prompts(30, 2).iter().all(|p| !unique.contains(p)));
    }

    #[test]
    fn latency_levels_come_first_and_the_eval_set_gets_the_rest() {
        let budget = allocate(&[1, 4, 16], None, 310, true, 1000);
        assert_eq!(budget.levels, [(1, 8), (4, 16), (16, 64)]);
        assert_eq!(budget.eval_items, 310);
        let tight = allocate(&[1, 4, 16], None, 310, true, 100);
        assert_eq!(tight.levels, [(1, 8), (4, 16), (16, 64)]);
        assert_eq!(tight.eval_items, 6);
        let tiny = allocate(&[1, 4], Some(5), 310, false, 7);
        assert_eq!(tiny.levels, [(1, 5), (4, 2)]);
        assert_eq!(tiny.eval_items, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_pool_bounds_concurrency_and_starts_nothing_after_the_deadline() {
        let running = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        let progress = Progress::new("test".into(), 10);
        let deadline = Instant::now() + Duration::from_millis(350);
        let results = pool(10, 3, deadline, &progress, |i| {
            let (running, peak) = (&running, &peak);
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Some(i)
            }
        })
        .await;
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        // Rounds start at 0, 100, 200 and 300 ms; none at 400 ms.
        assert_eq!(results.started, 10);
        assert!(!results.cut_off);
        let deadline = Instant::now() + Duration::from_millis(150);
        let results = pool(10, 3, deadline, &progress, |i| async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Some(i)
        })
        .await;
        assert_eq!(results.started, 6);
        assert!(results.cut_off);
        assert_eq!(results.values.iter().flatten().count(), 6);
    }
}
