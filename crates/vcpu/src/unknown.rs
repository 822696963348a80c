//! Logging a vCPU's accesses to ports and guest-physical memory nothing handles, with bounded
//! memory and a bounded log rate whatever the guest does.
//!
//! Each vCPU thread owns an [`UnknownLog`] (no lock shared between vCPUs). Under the `Ignore`
//! policy an address is logged the first time it is seen; at most [`MAX_REMEMBERED`] addresses
//! (ports, or 4 KiB pages of MMIO) are remembered, after which new ones are logged subject to the
//! rate limit only. Across all of them at most [`LOG_BURST`] warnings are written per
//! [`LOG_WINDOW`]; the rest are counted, and the count is logged when the next window opens.
//! Under `Stop` the access ends the vCPU and is always logged once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::report::VcpuOutcome;
use crate::vcpu::UnknownAccessPolicy;

/// Distinct unknown ports or MMIO pages one vCPU remembers as already logged.
pub const MAX_REMEMBERED: usize = 256;
/// Warnings one vCPU writes per [`LOG_WINDOW`] at most.
pub const LOG_BURST: u32 = 10;
/// The rate limit's window.
pub const LOG_WINDOW: Duration = Duration::from_secs(1);

/// One vCPU's record of unknown accesses already logged, and its log budget.
#[derive(Debug, Default)]
pub struct UnknownLog {
    seen: HashSet<u64>,
    window_start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl UnknownLog {
    /// Addresses remembered now (at most [`MAX_REMEMBERED`]).
    #[cfg(test)]
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }

    /// Logs `access` by vCPU `vcpu` if the policy, the remembered set and the rate limit allow;
    /// returns true when it wrote a warning.
    pub(crate) fn note(
        &mut self,
        vcpu: usize,
        access: &VcpuOutcome,
        policy: UnknownAccessPolicy,
        now: Instant,
    ) -> bool {
        let key = match *access {
            VcpuOutcome::UnknownPort { port, .. } => u64::from(port),
            VcpuOutcome::UnknownMmio { gpa, .. } => (1 << 63) | (gpa >> 12),
            _ => return false,
        };
        if policy == UnknownAccessPolicy::Ignore {
            if self.seen.contains(&key) {
                return false;
            }
            if self.seen.len() < MAX_REMEMBERED {
                self.seen.insert(key);
            }
            if !self.take_budget(vcpu, now) {
                return false;
            }
        }
        warn(vcpu, access, policy);
        true
    }

    /// True when one more warning fits this window; opening a new window reports what the
    /// last one suppressed.
    fn take_budget(&mut self, vcpu: usize, now: Instant) -> bool {
        let fresh = self
            .window_start
            .is_none_or(|s| now.saturating_duration_since(s) >= LOG_WINDOW);
        if fresh {
            if self.suppressed > 0 {
                tracing::warn!(
                    vcpu,
                    suppressed = self.suppressed,
                    "unknown accesses not logged (rate limit)"
                );
            }
            self.window_start = Some(now);
            self.logged = 0;
            self.suppressed = 0;
        }
        if self.logged < LOG_BURST {
            self.logged += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}

fn warn(vcpu: usize, access: &VcpuOutcome, policy: UnknownAccessPolicy) {
    match *access {
        VcpuOutcome::UnknownPort { port, write, size } => tracing::warn!(
            vcpu,
            port = format_args!("{port:#x}"),
            write,
            size,
            ?policy,
            "guest accessed an unknown I/O port"
        ),
        VcpuOutcome::UnknownMmio { gpa, write, size } => tracing::warn!(
            vcpu,
            gpa = format_args!("{gpa:#x}"),
            write,
            size,
            ?policy,
            "guest accessed unmapped guest-physical memory"
        ),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mmio(gpa: u64) -> VcpuOutcome {
        VcpuOutcome::UnknownMmio {
            gpa,
            write: true,
            size: 4,
        }
    }

    #[test]
    fn a_guest_sweeping_memory_neither_grows_the_set_nor_floods_the_log() {
        let mut log = UnknownLog::default();
        let t0 = Instant::now();
        let pages = 1_000_000u64;
        let logged = (0..pages)
            .filter(|&p| log.note(0, &mmio(p << 12), UnknownAccessPolicy::Ignore, t0))
            .count();
        assert!(log.remembered() <= MAX_REMEMBERED, "{}", log.remembered());
        assert_eq!(logged, LOG_BURST as usize, "one window's budget");
        // The next window logs again, within its budget.
        let t1 = t0 + LOG_WINDOW;
        let logged = (pages..pages + 100)
            .filter(|&p| log.note(0, &mmio(p << 12), UnknownAccessPolicy::Ignore, t1))
            .count();
        assert_eq!(logged, LOG_BURST as usize);
    }

    #[test]
    fn a_known_address_is_logged_once_and_the_stop_policy_always_logs() {
        let mut log = UnknownLog::default();
        let t = Instant::now();
        let port = VcpuOutcome::UnknownPort {
            port: 0x80,
            write: true,
            size: 1,
        };
        assert!(log.note(1, &port, UnknownAccessPolicy::Ignore, t));
        assert!(!log.note(1, &port, UnknownAccessPolicy::Ignore, t));
        assert!(log.note(1, &port, UnknownAccessPolicy::Stop, t));
        assert!(!log.note(1, &VcpuOutcome::Done, UnknownAccessPolicy::Ignore, t));
    }
}
