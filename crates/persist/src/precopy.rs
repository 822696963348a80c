//! When live migration's pre-copy stops: after each round, the bytes left dirty and the
//! bandwidth the round measured give an estimated downtime (the time the final round, run
//! with the guest paused, would take); below `--max-downtime` the source pauses for the final
//! round, past `--timeout` it gives up and the guest stays on the source (docs/migration.md,
//! "When pre-copy does not converge").
//!
//! `--max-downtime` is the longest pause accepted, not the one aimed at: under it, pre-copy
//! still goes on while another round pays, that is while the round just sent left at most half
//! as many bytes dirty as it sent (so the next one should leave fewer still), the estimate is
//! above a tenth of the limit, and at most [`EXTRA_ROUNDS`] rounds were added so (within
//! `--timeout`). A guest writing 16 MiB/s over a link of a few tens of MB/s then pauses for a
//! fraction of a MiB instead of several.
//!
//! Pure arithmetic on what the caller measured: no clock, no I/O, no KVM.

use std::time::Duration;

/// `--max-downtime`'s default, as QEMU's and Cloud Hypervisor's.
pub const DEFAULT_MAX_DOWNTIME: Duration = Duration::from_millis(300);

/// The most rounds pre-copy adds once the estimate is under `--max-downtime`.
pub const EXTRA_ROUNDS: u32 = 3;

/// The limits of one migration's pre-copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrecopyLimits {
    /// The longest pause accepted for the final round (`--max-downtime`).
    pub max_downtime: Duration,
    /// How long pre-copy may go on before the migration is cancelled (`--timeout`).
    pub timeout: Duration,
}

/// What one pre-copy round did, as the sender measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundStats {
    /// Bytes of guest memory sent in the round.
    pub bytes_sent: u64,
    /// How long sending them took.
    pub elapsed: Duration,
    /// Bytes dirty when the round ended (the next round's, or the final round's, work): the
    /// dirty bitmaps' `dirty_bytes`, summed over the cells.
    pub dirty_bytes: u64,
}

/// What to do after a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Send another round with the guest running.
    Continue {
        /// The downtime a final round now would cost (`None`: no bandwidth measured yet).
        estimated_downtime: Option<Duration>,
    },
    /// Pause the guest and send the last dirty pages and the state.
    FinalRound {
        /// The downtime expected.
        estimated_downtime: Duration,
    },
    /// Cancel: pre-copy did not get under the limit within the timeout. The guest stays on
    /// the source.
    GiveUp {
        /// The downtime a final round would have cost (`None`: no bandwidth measured).
        estimated_downtime: Option<Duration>,
        /// The rounds sent.
        rounds: u32,
    },
}

/// The running estimate over one migration's rounds.
#[derive(Debug, Clone)]
pub struct Convergence {
    limits: PrecopyLimits,
    rounds: u32,
    total: Duration,
    /// Bytes per second of the last round that sent anything measurable.
    bandwidth: Option<f64>,
    /// Rounds added with the estimate already under the limit.
    extra: u32,
}

impl Convergence {
    /// A fresh estimate under `limits`.
    pub fn new(limits: PrecopyLimits) -> Self {
        Convergence {
            limits,
            rounds: 0,
            total: Duration::ZERO,
            bandwidth: None,
            extra: 0,
        }
    }

    /// Rounds recorded so far.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// Pre-copy time so far (the rounds' elapsed times, summed).
    pub fn elapsed(&self) -> Duration {
        self.total
    }

    /// The measured send bandwidth in bytes per second (the last round's).
    pub fn bandwidth(&self) -> Option<f64> {
        self.bandwidth
    }

    /// Records a round and decides what comes next: the final round when the bytes left
    /// would be sent within `max_downtime` at the measured bandwidth (at once when nothing is
    /// dirty) and another round would not pay (see the module docs), giving up once the
    /// rounds have taken `timeout` or more, else another round.
    pub fn record(&mut self, round: RoundStats) -> Decision {
        self.rounds = self.rounds.saturating_add(1);
        self.total = self.total.saturating_add(round.elapsed);
        let secs = round.elapsed.as_secs_f64();
        if round.bytes_sent > 0 && secs > 0.0 {
            self.bandwidth = Some(round.bytes_sent as f64 / secs);
        }
        let estimate = self.estimate(round.dirty_bytes);
        match estimate {
            Some(d) if d <= self.limits.max_downtime => {
                if self.another_round_pays(&round, d) {
                    self.extra += 1;
                    return Decision::Continue {
                        estimated_downtime: estimate,
                    };
                }
                return Decision::FinalRound {
                    estimated_downtime: d,
                };
            }
            _ => {}
        }
        if self.total >= self.limits.timeout {
            return Decision::GiveUp {
                estimated_downtime: estimate,
                rounds: self.rounds,
            };
        }
        Decision::Continue {
            estimated_downtime: estimate,
        }
    }

    /// Whether a round with the estimate `estimate` already under the limit is worth another:
    /// the round halved what it had to send, the estimate is above a tenth of the limit, and
    /// the extra rounds and the timeout allow one more.
    fn another_round_pays(&self, round: &RoundStats, estimate: Duration) -> bool {
        let halved = round.dirty_bytes <= round.bytes_sent / 2;
        halved
            && estimate > self.limits.max_downtime / 10
            && self.extra < EXTRA_ROUNDS
            && self.total < self.limits.timeout
    }

    /// How long sending `dirty_bytes` would take at the measured bandwidth (zero bytes take
    /// no time; `None` with no bandwidth measured).
    pub fn estimate(&self, dirty_bytes: u64) -> Option<Duration> {
        if dirty_bytes == 0 {
            return Some(Duration::ZERO);
        }
        let bw = self.bandwidth.filter(|b| b.is_finite() && *b > 0.0)?;
        Duration::try_from_secs_f64(dirty_bytes as f64 / bw).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn limits(timeout_s: u64) -> PrecopyLimits {
        PrecopyLimits {
            max_downtime: DEFAULT_MAX_DOWNTIME,
            timeout: Duration::from_secs(timeout_s),
        }
    }

    fn round(sent_mib: u64, ms: u64, dirty_mib: u64) -> RoundStats {
        RoundStats {
            bytes_sent: sent_mib * MIB,
            elapsed: Duration::from_millis(ms),
            dirty_bytes: dirty_mib * MIB,
        }
    }

    #[test]
    fn shrinking_dirty_set_converges_to_a_final_round() {
        // 1 GiB/s: 1 GiB first, then 400 MiB dirty (400 ms: too long), then 300 MiB (under
        // the limit, and not half of the 400 sent: another round would not pay).
        let mut c = Convergence::new(limits(60));
        let d = c.record(round(1024, 1000, 400));
        let Decision::Continue {
            estimated_downtime: Some(e),
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(e.as_millis(), 390, "400 MiB at 1 GiB/s");
        let d = c.record(round(400, 390, 280));
        let Decision::FinalRound { estimated_downtime } = d else {
            panic!("{d:?}")
        };
        assert!(estimated_downtime <= DEFAULT_MAX_DOWNTIME);
        assert_eq!((c.rounds(), c.elapsed().as_millis()), (2, 1390));
    }

    /// Under the limit, rounds go on while each leaves at most half of what it sent dirty,
    /// down to a tenth of the limit: the pause is for 2 MiB, not 18.
    #[test]
    fn under_the_limit_rounds_go_on_while_they_halve_the_dirty_set() {
        // 60 MiB/s (the emulated host's sealed stream); the guest dirties a third of each
        // round's bytes again meanwhile.
        let mut c = Convergence::new(limits(60));
        let expect = [
            (64, 1067, 20, "continue: 333 ms estimated"),
            (
                20,
                333,
                7,
                "continue: 117 ms, under the limit, and 20 -> 7 halves",
            ),
            (
                7,
                117,
                2,
                "continue: 33 ms, above a tenth of the limit (30 ms)",
            ),
        ];
        for (sent, ms, dirty, why) in expect {
            let d = c.record(round(sent, ms, dirty));
            assert!(matches!(d, Decision::Continue { .. }), "{why}: {d:?}");
        }
        let d = c.record(round(2, 33, 1));
        let Decision::FinalRound { estimated_downtime } = d else {
            panic!("{d:?}")
        };
        assert!(
            estimated_downtime < DEFAULT_MAX_DOWNTIME / 10,
            "{estimated_downtime:?}"
        );
    }

    /// The added rounds stop at [`EXTRA_ROUNDS`], and at the timeout: a final round then,
    /// not a give-up, since the estimate is under the limit.
    #[test]
    fn added_rounds_are_bounded() {
        let mut c = Convergence::new(limits(60));
        // 1 GiB/s, every round halves and stays at 200 ms estimated.
        for i in 0..EXTRA_ROUNDS {
            let d = c.record(round(400, 400, 200));
            assert!(matches!(d, Decision::Continue { .. }), "round {i}: {d:?}");
        }
        let d = c.record(round(400, 400, 200));
        assert!(matches!(d, Decision::FinalRound { .. }), "{d:?}");

        // 400 MiB/s: 100 MiB is 250 ms, under the limit; the round took the whole 1 s.
        let mut c = Convergence::new(limits(1));
        let d = c.record(round(400, 1000, 100));
        assert!(matches!(d, Decision::FinalRound { .. }), "{d:?}");
    }

    #[test]
    fn a_guest_dirtying_faster_than_the_link_gives_up_at_the_timeout_not_before() {
        // 100 MiB/s link, the guest keeps 500 MiB dirty: 5 s estimated, never under 300 ms.
        let mut c = Convergence::new(limits(10));
        for i in 1..=9 {
            let d = c.record(round(100, 1000, 500));
            assert!(matches!(d, Decision::Continue { .. }), "round {i}: {d:?}");
        }
        let d = c.record(round(100, 1000, 500));
        let Decision::GiveUp {
            estimated_downtime: Some(e),
            rounds: 10,
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(e, Duration::from_secs(5));
    }

    #[test]
    fn nothing_dirty_is_a_final_round_at_once() {
        let mut c = Convergence::new(limits(1));
        let d = c.record(round(0, 0, 0));
        assert_eq!(
            d,
            Decision::FinalRound {
                estimated_downtime: Duration::ZERO
            }
        );
    }

    #[test]
    fn without_a_measured_bandwidth_there_is_no_estimate() {
        let mut c = Convergence::new(limits(5));
        // Nothing sent, or sent in no measurable time: the estimate stays unknown.
        let d = c.record(round(0, 10, 64));
        assert_eq!(
            d,
            Decision::Continue {
                estimated_downtime: None
            }
        );
        let d = c.record(round(64, 0, 64));
        assert_eq!(c.bandwidth(), None);
        assert!(matches!(
            d,
            Decision::Continue {
                estimated_downtime: None
            }
        ));
        // The bandwidth of an earlier round carries over to a round that measured none.
        c.record(round(1024, 1000, 64));
        let d = c.record(round(0, 0, 64));
        assert!(matches!(d, Decision::FinalRound { .. }), "{d:?}");
    }

    #[test]
    fn extreme_inputs_do_not_overflow() {
        let mut c = Convergence::new(PrecopyLimits {
            max_downtime: Duration::ZERO,
            timeout: Duration::MAX,
        });
        c.record(RoundStats {
            bytes_sent: 1,
            elapsed: Duration::MAX,
            dirty_bytes: u64::MAX,
        });
        let d = c.record(RoundStats {
            bytes_sent: u64::MAX,
            elapsed: Duration::MAX,
            dirty_bytes: u64::MAX,
        });
        assert!(matches!(d, Decision::GiveUp { .. }), "{d:?}");
        assert_eq!(c.elapsed(), Duration::MAX);
    }
}
