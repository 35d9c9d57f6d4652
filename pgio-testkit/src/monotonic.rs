//! Counters that step back: scrapes a daemon back to back on a thread of its own and compares
//! every counter and histogram sample (`_total`, `_bucket`, `_count`, `_sum` of a family
//! declared `counter` or `histogram`) with the same series' value in the scrape before.
//! Prometheus reads any decrease as a counter reset, so `rate()` shows a spike that never
//! happened. A series missing from a scrape has ended (Prometheus marks it stale); if the same
//! labels come back they may start over.
use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};

use crate::metrics::{Metrics, Sample, scrape};

/// One sample lower than the same series' value in an earlier scrape.
#[derive(Clone, Debug, PartialEq)]
pub struct StepBack {
    /// `name{label="value",…}`.
    pub series: String,
    pub before: f64,
    pub after: f64,
    /// The scrape (from 1) that saw the lower value.
    pub scrape: usize,
}

#[derive(Clone, Debug, Default)]
pub struct WatchReport {
    pub scrapes: usize,
    pub steps_back: Vec<StepBack>,
    /// Series (any type) that appeared twice in one scrape, with the scrape: an invalid
    /// exposition, and two counters Prometheus cannot tell apart.
    pub duplicates: Vec<(String, usize)>,
}

impl WatchReport {
    /// Whether every scrape held each series once and no counter stepped back.
    pub fn clean(&self) -> bool {
        self.steps_back.is_empty() && self.duplicates.is_empty()
    }

    /// The first `n` duplicates and steps back, one a line, for failure messages.
    pub fn describe(&self, n: usize) -> String {
        self.duplicates
            .iter()
            .map(|(series, scrape)| format!("scrape {scrape}: {series} twice"))
            .chain(self.steps_back.iter().map(|s| {
                format!(
                    "scrape {}: {} {} -> {}",
                    s.scrape, s.series, s.before, s.after
                )
            }))
            .take(n)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Compares successive scrapes; kept apart from the thread so that it can be used on scrapes
/// taken by the test itself too.
#[derive(Default)]
pub struct Monotonic {
    last: HashMap<String, f64>,
    pub report: WatchReport,
}

impl Monotonic {
    /// A series compares with the scrape just before only: one that was missing from it
    /// (retired, then made again) starts over, as Prometheus' staleness handling has it.
    pub fn observe(&mut self, m: &Metrics) {
        self.report.scrapes += 1;
        let mut seen = std::collections::HashSet::new();
        for s in m.all() {
            let series = series_name(s);
            if !seen.insert(series.clone()) {
                self.report.duplicates.push((series, self.report.scrapes));
            }
        }
        let mut now = HashMap::new();
        for s in m.all().iter().filter(|s| is_counter_sample(m, s)) {
            let series = series_name(s);
            if let Some(&before) = self.last.get(&series)
                && s.value < before
            {
                self.report.steps_back.push(StepBack {
                    series: series.clone(),
                    before,
                    after: s.value,
                    scrape: self.report.scrapes,
                });
            }
            now.insert(series, s.value);
        }
        self.last = now;
    }
}

fn is_counter_sample(m: &Metrics, s: &Sample) -> bool {
    let family = |suffix: &str| s.name.strip_suffix(suffix);
    let typed = |f: &str, ty: &str| m.metric_type(f) == Some(ty);
    if let Some(f) = family("_total") {
        return typed(f, "counter") || typed(&s.name, "counter");
    }
    ["_bucket", "_count", "_sum"]
        .iter()
        .filter_map(|suffix| family(suffix))
        .any(|f| typed(f, "histogram"))
}

fn series_name(s: &Sample) -> String {
    let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    format!("{}{{{}}}", s.name, labels.join(","))
}

/// Scrapes `url` back to back (with `pause` between) until `finish`.
pub struct MonotonicWatch {
    stop: Arc<AtomicBool>,
    /// Scrapes to reach before stopping (`finish_after`).
    at_least: Arc<AtomicUsize>,
    thread: Option<JoinHandle<Result<WatchReport>>>,
}

impl MonotonicWatch {
    pub fn start(url: &str, pause: Duration) -> MonotonicWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let at_least = Arc::new(AtomicUsize::new(0));
        let url = url.to_owned();
        let (flag, min) = (stop.clone(), at_least.clone());
        let thread = std::thread::spawn(move || {
            let mut check = Monotonic::default();
            // SeqCst: `finish_after`'s count is seen with the stop it precedes.
            while !flag.load(Ordering::SeqCst) || check.report.scrapes < min.load(Ordering::SeqCst)
            {
                let m = scrape(&url).with_context(|| format!("scrape {}", check.report.scrapes))?;
                check.observe(&m);
                std::thread::sleep(pause);
            }
            Ok(check.report)
        });
        MonotonicWatch {
            stop,
            at_least,
            thread: Some(thread),
        }
    }

    /// `finish`, once at least `n` scrapes were checked (on a loaded machine a scrape takes
    /// longer, and the events watched may be over before `n`).
    pub fn finish_after(self, n: usize) -> Result<WatchReport> {
        self.at_least.store(n, Ordering::SeqCst);
        self.finish()
    }

    pub fn finish(mut self) -> Result<WatchReport> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .context("finished twice")?
            .join()
            .map_err(|_| anyhow::anyhow!("the scraping thread panicked"))?
    }
}

impl Drop for MonotonicWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lower_counter_or_bucket_is_a_step_back_a_lower_gauge_is_not() {
        let text = |c: u32, b: u32, g: u32| {
            format!(
                "# TYPE x counter\nx_total{{a=\"1\"}} {c}\n# TYPE h histogram\n\
                 h_bucket{{le=\"+Inf\"}} {b}\nh_count {b}\nh_sum 1.5\n# TYPE g gauge\ng {g}\n"
            )
        };
        let mut m = Monotonic::default();
        for (c, b, g) in [(5, 7, 9), (5, 8, 1), (4, 8, 9), (6, 6, 9)] {
            m.observe(&Metrics::parse(&text(c, b, g)).expect("parse"));
        }
        let got: Vec<(String, f64, f64, usize)> = m
            .report
            .steps_back
            .iter()
            .map(|s| (s.series.clone(), s.before, s.after, s.scrape))
            .collect();
        assert_eq!(
            got,
            vec![
                ("x_total{a=\"1\"}".to_owned(), 5.0, 4.0, 3),
                ("h_bucket{le=\"+Inf\"}".to_owned(), 8.0, 6.0, 4),
                ("h_count{}".to_owned(), 8.0, 6.0, 4),
            ]
        );
        assert_eq!(m.report.scrapes, 4);
        assert!(m.report.duplicates.is_empty());
        // Gone for a scrape, then back from 0: a new series, not a step back.
        m.observe(&Metrics::parse("# TYPE x counter\n").expect("parse"));
        m.observe(&Metrics::parse("# TYPE x counter\nx_total{a=\"1\"} 1\n").expect("parse"));
        assert_eq!(m.report.steps_back.len(), 3);
        m.observe(&Metrics::parse("# TYPE g gauge\ng{a=\"1\"} 1\ng{a=\"1\"} 2\n").expect("parse"));
        assert_eq!(m.report.duplicates, vec![("g{a=\"1\"}".to_owned(), 7)]);
        assert!(!m.report.clean());
    }
}
