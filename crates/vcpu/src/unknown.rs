//! Logging a vCPU's accesses to ports and guest-physical memory nothing handles, with bounded
//! memory and a bounded log rate whatever the guest does.
//!
//! Each vCPU thread owns an [`UnknownLog`] (no lock shared between vCPUs). Under the `Ignore`
//! policy an address is logged the first time it is seen; at most [`MAX_REMEMBERED`] addresses
//! (ports, or 4 KiB pages of MMIO) are remembered, after which new ones are logged subject to the
//! rate limit only. Across all of them at most [`LOG_BURST`] warnings are written per
//! [`LOG_WINDOW`]; the rest are counted, and the count is logged when the next window opens.
//! Under `Stop` the access ends the vCPU and is always logged once.
//!
//! The budget is the devices' [`LogBudget`] (the virtio transports bound their guest-caused
//! warnings with the same mechanism). Ports every stock PC kernel probes while it boots
//! ([`ROUTINE_PROBE_PORTS`]) are a routine guest action, not a fault: under `Ignore` they are
//! logged at debug level and spend no budget.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use vmhost_devices::LogBudget;

use crate::report::VcpuOutcome;
use crate::vcpu::UnknownAccessPolicy;

/// Distinct unknown ports or MMIO pages one vCPU remembers as already logged.
pub const MAX_REMEMBERED: usize = 256;
/// Warnings one vCPU writes per [`LOG_WINDOW`] at most.
pub const LOG_BURST: u32 = 10;
/// The rate limit's window.
pub const LOG_WINDOW: Duration = Duration::from_secs(1);
/// Ports a stock kernel probes on every boot, with nothing there on vmhost's machine: the
/// Super I/O configuration ports (index/data at 0x2e/0x2f and 0x4e/0x4f), which Debian's
/// kernel reads while looking for a watchdog or hardware monitor chip. (The other legacy
/// ports it pokes are handled: `devices::legacy`.)
pub const ROUTINE_PROBE_PORTS: [u16; 4] = [0x2e, 0x2f, 0x4e, 0x4f];

/// One vCPU's record of unknown accesses already logged, and its log budget.
#[derive(Debug)]
pub struct UnknownLog {
    seen: HashSet<u64>,
    budget: LogBudget,
}

impl Default for UnknownLog {
    fn default() -> Self {
        UnknownLog {
            seen: HashSet::new(),
            budget: LogBudget::new(LOG_BURST, LOG_WINDOW),
        }
    }
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
            if let VcpuOutcome::UnknownPort { port, write, size } = *access {
                if ROUTINE_PROBE_PORTS.contains(&port) {
                    tracing::debug!(
                        vcpu,
                        port = format_args!("{port:#x}"),
                        write,
                        size,
                        "guest probed an absent Super I/O port"
                    );
                    return false;
                }
            }
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
        let take = self.budget.take(now);
        if take.suppressed_before > 0 {
            tracing::warn!(
                vcpu,
                suppressed = take.suppressed_before,
                "unknown accesses not logged (rate limit)"
            );
        }
        take.allowed
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

    #[test]
    fn the_super_io_probe_of_every_boot_is_not_a_warning() {
        let mut log = UnknownLog::default();
        let t = Instant::now();
        let probe = |port| VcpuOutcome::UnknownPort {
            port,
            write: false,
            size: 1,
        };
        for port in ROUTINE_PROBE_PORTS {
            assert!(!log.note(0, &probe(port), UnknownAccessPolicy::Ignore, t));
        }
        // They spent nothing: a real unknown port right after is still warned about, and
        // under `Stop` a probe ends the vCPU with its warning as before.
        assert!(log.note(0, &probe(0x3f0), UnknownAccessPolicy::Ignore, t));
        assert!(log.note(0, &probe(0x2e), UnknownAccessPolicy::Stop, t));
        assert_eq!(log.remembered(), 1);
    }
}
