//! When a VMM's guest first ran: the emulated host kernel's first `kvm_exit` event after a
//! spawn, on `CLOCK_MONOTONIC`, for the boot benchmarks' split of spawn → `/init` into the
//! VMM's own start (spawn → the guest's first exit) and the guest's (docs/benchmarks.md).
//!
//! A tracefs instance of its own (`instances/vmhost-first-exit`) records `kvm/kvm_exit` with
//! `trace_clock` `mono` (the clock the runner's spawn time is read on) into a small ring buffer
//! that does **not** overwrite: once a CPU's buffer is full, later events are dropped, so the
//! first ones of a run are always kept, and a full buffer costs no more than a dropped event.
//! Each run clears it first. The event stays enabled for the whole benchmark (enabling one
//! rewrites kernel text, which the emulated host's CPUs are best spared while a VM runs).

use crate::kvm_exits::Instance;

/// Ring buffer per CPU, KiB: a few hundred events, more than the first one needs.
const BUFFER_KB: &str = "16";

/// The running recorder; its instance is removed when dropped.
pub struct FirstExit {
    instance: Instance,
}

impl FirstExit {
    /// Creates the instance (mounting tracefs if needed) and starts recording.
    pub fn start() -> Result<FirstExit, String> {
        let settings = [
            ("trace_clock", "mono"),
            ("options/overwrite", "0"),
            ("buffer_size_kb", BUFFER_KB),
        ];
        let instance = Instance::create("vmhost-first-exit", &settings, &["kvm/kvm_exit"])?;
        Ok(FirstExit { instance })
    }

    /// Forgets every event recorded so far (truncating `trace` clears the buffers).
    pub fn clear(&self) -> Result<(), String> {
        let path = self.instance.path("trace");
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .map(drop)
            .map_err(|e| format!("clear {path}: {e}"))
    }

    /// `CLOCK_MONOTONIC` of the first `kvm_exit` since the last [`FirstExit::clear`], ns.
    pub fn first_ns(&self) -> Result<u64, String> {
        let trace = crate::host::read(&self.instance.path("trace"))?;
        first_event_ns(&trace).ok_or_else(|| "no kvm_exit event recorded".to_string())
    }
}

/// The smallest `SECONDS.MICROS:` timestamp of the `kvm_exit` lines of a `trace` file, ns
/// (the file merges the CPUs' buffers in time order, but the minimum does not rely on it).
fn first_event_ns(trace: &str) -> Option<u64> {
    trace
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, _) = l.split_once(": kvm_exit:")?;
            let ts = head.split_whitespace().last()?;
            let (s, us) = ts.split_once('.')?;
            let s: u64 = s.parse().ok()?;
            let frac: String = us.chars().chain("000000000".chars()).take(9).collect();
            Some(s * 1_000_000_000 + frac.parse::<u64>().ok()?)
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::first_event_ns;

    #[test]
    fn the_earliest_kvm_exit_line_counts() {
        let trace = "# tracer: nop\n#\n\
            \x20          vcpu0-291     [001] d..2.   12.000300: kvm_exit: vcpu 0 reason io rip 0x1\n\
            \x20          vcpu1-292     [000] d..2.   11.500001: kvm_exit: vcpu 1 reason hlt rip 0x2\n\
            \x20    other-1             [000] .....    9.000000: kvm_entry: vcpu 0\n";
        assert_eq!(first_event_ns(trace), Some(11_500_001_000));
        assert_eq!(first_event_ns("# tracer: nop\n"), None);
    }
}
