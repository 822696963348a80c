//! Start-up timeline on `CLOCK_MONOTONIC`, comparable across processes (a benchmark that
//! spawns vmhost reads the same clock before the spawn), and [`StepClock`]: where a stretch
//! of a restore's or a migration target's work went, step by step, for one stderr line
//! (`vmhost: receive: ready for the rounds …`, `… the guest runs again …`, `vmhost: restore:
//! memory ready …`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

/// Nanoseconds on `CLOCK_MONOTONIC`.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call, and
    // CLOCK_MONOTONIC is always available on Linux.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if ret != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

static MAIN_NS: AtomicU64 = AtomicU64::new(0);

/// Records the moment `main` was entered.
pub fn mark_main() {
    MAIN_NS.store(now_ns(), Ordering::Relaxed);
}

/// When each start-up step ended (`CLOCK_MONOTONIC` ns; 0 when not reached).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timeline {
    /// `main` entered.
    pub main_ns: u64,
    /// The spec loaded and its boot inputs (kernel, initrd headers) checked.
    pub spec_loaded_ns: u64,
    /// The host's topology discovered (hwloc) and its hugepage pools read.
    pub host_discovered_ns: u64,
    /// Admitted through the host ledger (spec parsed, host discovered, plan made).
    pub admitted_ns: u64,
    /// Guest memory allocated, bound and prefaulted.
    pub memory_ready_ns: u64,
    /// KVM VM and vCPU state created.
    pub vm_created_ns: u64,
    /// Every vCPU thread pinned and its vCPU configured: the guest is released now.
    pub vcpus_runnable_ns: u64,
}

impl Timeline {
    /// A timeline whose `main_ns` is the recorded `main` entry.
    pub fn start() -> Self {
        Timeline {
            main_ns: MAIN_NS.load(Ordering::Relaxed),
            ..Default::default()
        }
    }
}

/// The marks of one stretch of a target's work, from the moment it began.
#[derive(Debug)]
pub struct StepClock {
    marks: Mutex<Vec<(&'static str, Instant)>>,
}

impl StepClock {
    /// Starts the clock now.
    pub fn start() -> StepClock {
        StepClock {
            marks: Mutex::new(vec![("start", Instant::now())]),
        }
    }

    /// Marks the end of `step`.
    pub fn mark(&self, step: &'static str) {
        self.mark_at(step, Instant::now());
    }

    /// Marks the end of `step` at `at` (a step timed by another thread).
    pub fn mark_at(&self, step: &'static str, at: Instant) {
        if let Ok(mut m) = self.marks.lock() {
            m.push((step, at));
        }
    }

    /// The time from the start to the last mark (ms) and each step's share ("step a ms, …").
    pub fn steps(&self) -> (f64, String) {
        let Ok(marks) = self.marks.lock() else {
            return (0.0, String::new());
        };
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
        let steps: Vec<String> = marks
            .windows(2)
            .map(|w| format!("{} {:.1} ms", w[1].0, ms(w[0].1, w[1].1)))
            .collect();
        let total = match (marks.first(), marks.last()) {
            (Some(a), Some(b)) => ms(a.1, b.1),
            _ => 0.0,
        };
        (total, steps.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::StepClock;

    #[test]
    fn the_steps_are_named_in_order_and_add_up_to_the_whole() {
        let c = StepClock::start();
        c.mark("VM built");
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.mark_at("vCPUs", std::time::Instant::now());
        let (total, steps) = c.steps();
        assert!(
            steps.starts_with("VM built ") && steps.contains(" ms, vCPUs "),
            "{steps}"
        );
        let parts: f64 = steps
            .split(", ")
            .map(|p| p.rsplit(' ').nth(1).unwrap().parse::<f64>().unwrap())
            .sum();
        assert!(
            total >= 2.0 && (parts - total).abs() < 0.2,
            "{total} vs {steps}"
        );
    }
}
