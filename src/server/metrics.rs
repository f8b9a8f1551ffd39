//! The server's Prometheus metrics: counters, gauges and histograms kept with atomics and
//! rendered in the text exposition format (version 0.0.4) at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// A histogram with fixed upper bounds (seconds); counts are per bucket, summed on render.
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    /// Sum of observations in microseconds.
    sum_us: AtomicU64,
    count: AtomicU64,
}

/// Bounds of time-to-first-token and request latencies (seconds).
const LATENCY: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Bounds of the time between two tokens of a sequence (seconds).
const INTER_TOKEN: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum_us: AtomicU64::new(0), count: AtomicU64::new(0) }
    }

    pub fn observe(&self, seconds: f64) {
        let s = if seconds.is_finite() { seconds.max(0.0) } else { 0.0 };
        if let Some(i) = self.bounds.iter().position(|&b| s <= b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_us.fetch_add((s * 1e6) as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            acc += c.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// Every metric the server exports.
pub struct Metrics {
    /// HTTP requests by (path, status code).
    http: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens whose keys and values were already cached (a reused prefix).
    pub cached_prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Finished generations by reason (stop, length, cancelled, error).
    finished: Mutex<BTreeMap<&'static str, u64>>,
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    /// Positions held by running sequences, and the positions of all slots' caches.
    pub kv_used: AtomicU64,
    pub kv_total: AtomicU64,
    pub steps: AtomicU64,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            http: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            finished: Mutex::default(),
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_used: AtomicU64::new(0),
            kv_total: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY),
            inter_token: Histogram::new(INTER_TOKEN),
            e2e: Histogram::new(LATENCY),
            queue_time: Histogram::new(LATENCY),
        }
    }
}

impl Metrics {
    pub fn http_request(&self, path: &str, code: u16) {
        // only the API's paths are labels; anything else is one label (no unbounded series)
        let path = if super::KNOWN_PATHS.contains(&path) { path } else { "other" };
        if let Ok(mut m) = self.http.lock() {
            *m.entry((path.to_string(), code)).or_default() += 1;
        }
    }

    pub fn finished(&self, reason: &'static str) {
        if let Ok(mut m) = self.finished.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    /// The Prometheus text of every metric.
    pub fn render(&self, model: &str) -> String {
        let mut o = String::new();
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |o: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(o, "# HELP markbase_model_info The model this server runs.\n# TYPE markbase_model_info gauge");
        let _ = writeln!(o, "markbase_model_info{{model=\"{}\"}} 1", model.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', " "));
        let _ = writeln!(o, "# HELP markbase_http_requests_total HTTP requests by path and status code.\n# TYPE markbase_http_requests_total counter");
        if let Ok(m) = self.http.lock() {
            for ((path, code), n) in m.iter() {
                let _ = writeln!(o, "markbase_http_requests_total{{path=\"{path}\",code=\"{code}\"}} {n}");
            }
        }
        let _ = writeln!(o, "# HELP markbase_requests_finished_total Generations finished, by reason.\n# TYPE markbase_requests_finished_total counter");
        if let Ok(m) = self.finished.lock() {
            for (reason, n) in m.iter() {
                let _ = writeln!(o, "markbase_requests_finished_total{{reason=\"{reason}\"}} {n}");
            }
        }
        counter(&mut o, "markbase_prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens.load(Relaxed));
        counter(&mut o, "markbase_prompt_tokens_cached_total", "Prompt tokens reused from a cached prefix.", self.cached_prompt_tokens.load(Relaxed));
        counter(&mut o, "markbase_generation_tokens_total", "Generated tokens.", self.generated_tokens.load(Relaxed));
        counter(&mut o, "markbase_steps_total", "Scheduler steps run.", self.steps.load(Relaxed));
        gauge(&mut o, "markbase_num_requests_waiting", "Requests waiting for a sequence slot.", self.waiting.load(Relaxed) as f64);
        gauge(&mut o, "markbase_num_requests_running", "Sequences being generated.", self.running.load(Relaxed) as f64);
        let total = self.kv_total.load(Relaxed);
        let usage = if total == 0 { 0.0 } else { self.kv_used.load(Relaxed) as f64 / total as f64 };
        gauge(&mut o, "markbase_kv_cache_usage_ratio", "Fraction of the KV-cache positions of all slots held by running sequences.", usage);
        self.ttft.render(&mut o, "markbase_time_to_first_token_seconds", "Time from a request's arrival to its first token.");
        self.inter_token.render(&mut o, "markbase_inter_token_latency_seconds", "Time between two consecutive tokens of a sequence.");
        self.e2e.render(&mut o, "markbase_request_duration_seconds", "Time from a request's arrival to its last token.");
        self.queue_time.render(&mut o, "markbase_request_queue_seconds", "Time a request waited for a sequence slot.");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let m = Metrics::default();
        m.ttft.observe(0.003);
        m.ttft.observe(0.2);
        m.ttft.observe(100.0);
        let t = m.render("m");
        assert!(t.contains("markbase_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"), "{t}");
        assert!(t.contains("markbase_time_to_first_token_seconds_bucket{le=\"0.25\"} 2\n"), "{t}");
        assert!(t.contains("markbase_time_to_first_token_seconds_bucket{le=\"60\"} 2\n"), "{t}");
        assert!(t.contains("markbase_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"), "{t}");
        assert!(t.contains("markbase_time_to_first_token_seconds_count 3\n"), "{t}");
    }
}
