//! A log budget for warnings a guest can cause: at most `burst` lines per window, the rest
//! counted and reported once when the next window opens.
//!
//! One budget belongs to one source (a vCPU's unknown-access log, a virtio transport), so a
//! guest that misbehaves on one device cannot spend another's budget, and each source's
//! output is bounded whatever the guest does. No lock: the owner holds it.

use std::time::{Duration, Instant};

/// One source's log budget.
#[derive(Debug, Clone)]
pub struct LogBudget {
    burst: u32,
    window: Duration,
    window_start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

/// What [`LogBudget::take`] allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Take {
    /// One more line may be written now.
    pub allowed: bool,
    /// Lines the window that just closed refused (report them before the new line); 0 when
    /// no window closed or nothing was refused.
    pub suppressed_before: u64,
}

impl LogBudget {
    /// At most `burst` lines per `window`.
    pub const fn new(burst: u32, window: Duration) -> Self {
        LogBudget {
            burst,
            window,
            window_start: None,
            logged: 0,
            suppressed: 0,
        }
    }

    /// Asks for one line at `now`; a refused line is counted.
    pub fn take(&mut self, now: Instant) -> Take {
        let fresh = self
            .window_start
            .is_none_or(|s| now.saturating_duration_since(s) >= self.window);
        let mut suppressed_before = 0;
        if fresh {
            suppressed_before = self.suppressed;
            self.window_start = Some(now);
            self.logged = 0;
            self.suppressed = 0;
        }
        let allowed = self.logged < self.burst;
        if allowed {
            self.logged += 1;
        } else {
            self.suppressed += 1;
        }
        Take {
            allowed,
            suppressed_before,
        }
    }

    /// Lines the current window refused so far (not yet reported by [`LogBudget::take`]):
    /// for the owner's last word when it goes away.
    pub fn unreported(&self) -> u64 {
        self.suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_allows_its_burst_and_the_next_reports_what_was_refused() {
        let mut b = LogBudget::new(3, Duration::from_secs(1));
        let t0 = Instant::now();
        let allowed = (0..100).filter(|_| b.take(t0).allowed).count();
        assert_eq!(allowed, 3);
        let next = b.take(t0 + Duration::from_secs(1));
        assert_eq!(
            next,
            Take {
                allowed: true,
                suppressed_before: 97
            }
        );
        // Still inside the new window: nothing more to report.
        assert_eq!(b.take(t0 + Duration::from_secs(1)).suppressed_before, 0);
        let refused = (0..5)
            .filter(|_| !b.take(t0 + Duration::from_secs(1)).allowed)
            .count();
        assert_eq!(refused, 4);
        assert_eq!(b.unreported(), 4);
    }
}
