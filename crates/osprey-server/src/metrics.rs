//! Counters for `GET /metrics` (Prometheus text format).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    pub requests: Mutex<BTreeMap<u16, u64>>,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cancelled: AtomicU64,
    pub queue_depth: AtomicUsize,
    timings: Mutex<Timings>,
}

#[derive(Default)]
struct Timings {
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    ttft_sum: f64,
    ttft_count: u64,
}

impl Metrics {
    pub fn record_status(&self, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry(status).or_insert(0) += 1;
        }
    }
    pub fn record_prefill(&self, computed: usize, cached: usize, seconds: f64) {
        self.prompt_tokens
            .fetch_add((computed + cached) as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        if computed > 0 && seconds > 0.0 {
            if let Ok(mut t) = self.timings.lock() {
                t.prefill_tokens_per_s = computed as f64 / seconds;
            }
        }
    }
    pub fn record_decode(&self, tokens: usize, seconds: f64) {
        self.generated_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        if tokens > 1 && seconds > 0.0 {
            if let Ok(mut t) = self.timings.lock() {
                t.decode_tokens_per_s = tokens as f64 / seconds;
            }
        }
    }
    pub fn record_ttft(&self, seconds: f64) {
        if let Ok(mut t) = self.timings.lock() {
            t.ttft_sum += seconds;
            t.ttft_count += 1;
        }
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# HELP osprey_requests_total HTTP requests by status code.\n# TYPE osprey_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for (code, n) in m.iter() {
                let _ = writeln!(s, "osprey_requests_total{{status=\"{code}\"}} {n}");
            }
        }
        let counters = [
            (
                "osprey_prompt_tokens_total",
                "Prompt tokens received.",
                &self.prompt_tokens,
            ),
            (
                "osprey_cached_prompt_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &self.cached_tokens,
            ),
            (
                "osprey_generated_tokens_total",
                "Tokens generated.",
                &self.generated_tokens,
            ),
            (
                "osprey_prefix_cache_hits_total",
                "Requests that resumed from a cached state.",
                &self.cache_hits,
            ),
            (
                "osprey_prefix_cache_misses_total",
                "Requests that started from an empty state.",
                &self.cache_misses,
            ),
            (
                "osprey_cancelled_total",
                "Generations stopped because the client went away.",
                &self.cancelled,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            s,
            "# HELP osprey_queue_depth Requests waiting for the engine.\n# TYPE osprey_queue_depth gauge\nosprey_queue_depth {}",
            self.queue_depth.load(Ordering::Relaxed)
        );
        if let Ok(t) = self.timings.lock() {
            let _ = writeln!(s, "# HELP osprey_prefill_tokens_per_second Prefill throughput of the last request.\n# TYPE osprey_prefill_tokens_per_second gauge\nosprey_prefill_tokens_per_second {:.3}", t.prefill_tokens_per_s);
            let _ = writeln!(s, "# HELP osprey_decode_tokens_per_second Decode throughput of the last request.\n# TYPE osprey_decode_tokens_per_second gauge\nosprey_decode_tokens_per_second {:.3}", t.decode_tokens_per_s);
            let _ = writeln!(s, "# HELP osprey_time_to_first_token_seconds Time from request to first token.\n# TYPE osprey_time_to_first_token_seconds summary\nosprey_time_to_first_token_seconds_sum {:.6}\nosprey_time_to_first_token_seconds_count {}", t.ttft_sum, t.ttft_count);
        }
        s
    }
}
