//! How much of a held-out comparison is noise (`docs/routing.md` §1c): a paired bootstrap
//! over prompts of the outcome head's pooled held-out APGR against the prompt-length and
//! complexity baselines, and the spread of those figures over the seed that draws the folds.

use serde::Serialize;

use super::outcome::{OutcomeRecord, Verdicts};
use super::routing_eval::{cross_validate_with_scores, curve};
use super::Classifier;

/// One source's pooled held-out scores beside its baselines', record by record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeldOutScores {
    pub verdicts: Vec<Verdicts>,
    /// The outcome head's logits, each from a head that did not see the prompt.
    pub head: Vec<f64>,
    pub length: Vec<f64>,
    pub complexity: Vec<f64>,
}

/// APGR of the head less a baseline's: on the records as they are, and its 95% interval
/// over resamples of the prompts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Difference {
    pub observed: f64,
    /// The 2.5th and 97.5th percentiles over resamples.
    pub low: f64,
    pub high: f64,
    /// Share of resamples in which the head ranks better.
    pub above: f64,
}

/// The head against both baselines, on the same resamples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairedBootstrap {
    pub resamples: usize,
    pub length: Difference,
    pub complexity: Difference,
}

/// Resamples the prompts `resamples` times (with replacement, the same draw for the head
/// and both baselines) and measures the head's APGR less each baseline's. `None` without
/// records, or when the reference leads in too few resamples to measure a gap.
pub fn paired_bootstrap(
    scores: &HeldOutScores,
    resamples: usize,
    seed: u64,
) -> Option<PairedBootstrap> {
    let n = scores.verdicts.len();
    let observed = differences(scores, &(0..n).collect::<Vec<_>>())?;
    let mut rng = SplitMix(seed);
    let mut drawn: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut picks = vec![0; n];
    for _ in 0..resamples {
        for pick in &mut picks {
            *pick = (rng.next() % n as u64) as usize;
        }
        if let Some(d) = differences(scores, &picks) {
            drawn[0].push(d[0]);
            drawn[1].push(d[1]);
        }
    }
    if drawn[0].len() < resamples / 2 || drawn[0].is_empty() {
        return None;
    }
    let [length, complexity] = drawn;
    Some(PairedBootstrap {
        resamples,
        length: interval(observed[0], length),
        complexity: interval(observed[1], complexity),
    })
}

/// The head's APGR less length's and less complexity's over the records at `picks`.
fn differences(scores: &HeldOutScores, picks: &[usize]) -> Option<[f64; 2]> {
    if picks.is_empty() {
        return None;
    }
    let verdicts: Vec<Verdicts> = picks.iter().map(|&i| scores.verdicts[i]).collect();
    let apgr = |of: &[f64]| {
        let drawn: Vec<f64> = picks.iter().map(|&i| of[i]).collect();
        curve(&drawn, &verdicts).apgr
    };
    let head = apgr(&scores.head)?;
    Some([
        head - apgr(&scores.length)?,
        head - apgr(&scores.complexity)?,
    ])
}

fn interval(observed: f64, mut drawn: Vec<f64>) -> Difference {
    drawn.sort_by(f64::total_cmp);
    let above = drawn.iter().filter(|&&d| d > 0.0).count() as f64 / drawn.len() as f64;
    Difference {
        observed,
        low: percentile(&drawn, 0.025),
        high: percentile(&drawn, 0.975),
        above,
    }
}

/// The `q` quantile of sorted values, interpolated linearly (as numpy's default).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let h = (sorted.len() - 1) as f64 * q;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (h - lo as f64)
}

/// A small deterministic generator (SplitMix64): the same seed draws the same resamples on
/// every platform.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// One source's pooled held-out APGR under each fold seed, beside its baselines (which no
/// fold changes).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeedSpread {
    pub source: String,
    /// `(seed, pooled held-out APGR)`.
    pub pooled: Vec<(u64, Option<f64>)>,
    pub length: Option<f64>,
    pub complexity: Option<f64>,
}

/// The held-out figures of every source held out by folds of prompts, once per seed in
/// `seeds` (sources held out by category do not depend on the seed and are left out).
pub fn seed_spread(
    records: &[OutcomeRecord],
    window: usize,
    seeds: &[u64],
    model: &Classifier,
) -> Vec<SeedSpread> {
    let mut spread: Vec<SeedSpread> = Vec::new();
    for &seed in seeds {
        let (cv, _) = cross_validate_with_scores(records, window, seed, model);
        for s in cv.sources.iter().filter(|s| s.by != "category") {
            let at = match spread.iter().position(|x| x.source == s.source) {
                Some(at) => at,
                None => {
                    spread.push(SeedSpread {
                        source: s.source.clone(),
                        pooled: Vec::new(),
                        length: s.length.apgr,
                        complexity: s.complexity.as_ref().and_then(|c| c.apgr),
                    });
                    spread.len() - 1
                }
            };
            spread[at].pooled.push((seed, s.pooled.apgr));
        }
    }
    spread
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:+.3} (95% {:+.3} to {:+.3}; head ahead in {:.0}% of resamples)",
            self.observed,
            self.low,
            self.high,
            100.0 * self.above
        )
    }
}

impl std::fmt::Display for SeedSpread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let values: Vec<f64> = self.pooled.iter().filter_map(|(_, a)| *a).collect();
        let listed: Vec<String> = self
            .pooled
            .iter()
            .map(|(seed, a)| format!("{seed}: {}", a.map_or("-".into(), |a| format!("{a:.3}"))))
            .collect();
        writeln!(f, "{} (pooled held-out APGR by fold seed):", self.source)?;
        writeln!(f, "  {}", listed.join(", "))?;
        if values.is_empty() {
            return Ok(());
        }
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let (low, high) = values
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &v| {
                (l.min(v), h.max(v))
            });
        writeln!(f, "  mean {mean:.3}, range {low:.3}–{high:.3}")?;
        for (name, baseline) in [
            ("prompt length", self.length),
            ("complexity", self.complexity),
        ] {
            if let Some(b) = baseline {
                let above = values.iter().filter(|&&v| v > b).count();
                writeln!(
                    f,
                    "  less {name} ({b:.3}): mean {:+.3}, range {:+.3} to {:+.3}; above it under {above} of {} seeds",
                    mean - b,
                    low - b,
                    high - b,
                    values.len()
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graded(cheap: f32, reference: f32) -> Verdicts {
        Verdicts::Graded { cheap, reference }
    }

    /// Half the prompts lose five points on the cheap model, half none: a head that knows
    /// which beats a baseline that ranks backwards in every resample, and one that ranks
    /// the same as the head differs from it by exactly nothing.
    #[test]
    fn a_paired_bootstrap_separates_a_real_lead_from_none() {
        let n = 200;
        let verdicts: Vec<Verdicts> = (0..n)
            .map(|i| match i % 2 {
                0 => graded(4.0, 9.0),
                _ => graded(9.0, 9.0),
            })
            .collect();
        let knows: Vec<f64> = (0..n).map(|i| f64::from(u8::from(i % 2 == 0))).collect();
        let backwards: Vec<f64> = knows.iter().map(|k| 1.0 - k).collect();
        let scores = HeldOutScores {
            verdicts,
            head: knows.clone(),
            length: backwards,
            complexity: knows,
        };
        let b = paired_bootstrap(&scores, 300, 7).unwrap();
        assert!(b.length.low > 0.3, "{:?}", b.length);
        assert_eq!(b.length.above, 1.0);
        assert_eq!(b.complexity.observed, 0.0);
        assert_eq!((b.complexity.low, b.complexity.high), (0.0, 0.0));
        assert_eq!(b.complexity.above, 0.0);
        // The same seed draws the same resamples.
        assert_eq!(paired_bootstrap(&scores, 300, 7), Some(b));
    }

    /// Without a gap between the two models there is nothing to recover and no interval.
    #[test]
    fn no_gap_no_interval() {
        let scores = HeldOutScores {
            verdicts: vec![graded(8.0, 8.0); 10],
            head: (0..10).map(f64::from).collect(),
            length: vec![1.0; 10],
            complexity: vec![1.0; 10],
        };
        assert_eq!(paired_bootstrap(&scores, 50, 1), None);
        assert_eq!(paired_bootstrap(&HeldOutScores::default(), 50, 1), None);
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let sorted = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&sorted, 0.0), 0.0);
        assert_eq!(percentile(&sorted, 0.5), 2.0);
        assert_eq!(percentile(&sorted, 0.975), 3.9);
    }
}
