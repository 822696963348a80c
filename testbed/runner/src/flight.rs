//! KVM's own account of the last moments of every vCPU: a flight recorder in a tracefs instance
//! of its own (`instances/vmhost-flight`), for the test suites (not the benchmarks, whose VM
//! exits it would slow).
//!
//! A Linux guest that triple-faults on this emulated host leaves nothing behind: no console
//! line, and KVM resets the vCPU (AMD), so its registers are gone (docs/testing.md, "Guest
//! triple faults"). The recorder keeps the host kernel's KVM events in an overwriting ring
//! buffer per CPU: every exit with its reason, RIP, exit information and the event it was
//! delivering (`kvm_exit`'s `intr_info`, SVM's EXITINTINFO), every exception KVM injected or
//! re-injected (`kvm_inj_exception`), every interrupt (`kvm_inj_virq`) and guest page fault KVM
//! handled (`kvm_page_fault`). When the runner stops on a guest's triple fault it prints the
//! last of them: what the emulated CPU and KVM did right before the reset.
//!
//! The events stay enabled for the whole suite: enabling one rewrites kernel text, which the
//! emulated host's CPUs are best spared while a VM runs (`static_keys.rs`).
//!
//! Off unless `VMHOST_TESTBED_FLIGHT=1` (testbed/run.sh passes it into the emulated host). With
//! it on in every run, the first fresh-clone CI run passed with no emulator fault, and the next
//! one retried four boots for the emulated host's own faults (its kernel's GS base broken after
//! a #VMEXIT, a jump to address 0 in the idle task, a machine that reset itself, an RCU stall).
//! The run after that, with it off, retried one boot for the same #VMEXIT fault (a stack
//! overrun in `error_entry` on a vCPU thread), so the recorder is not shown to cause them; it
//! stays off as a precaution: a tracepoint in KVM's exit path runs in the very code the
//! emulated CPU gets wrong (docs/testing.md, "Guest triple faults").

use crate::kvm_exits::Instance;

/// The recorder's tracefs instance (`instances/NAME`).
const INSTANCE: &str = "vmhost-flight";
/// What it records.
const EVENTS: &[&str] = &[
    "kvm/kvm_exit",
    "kvm/kvm_inj_exception",
    "kvm/kvm_inj_virq",
    "kvm/kvm_page_fault",
];
/// Ring buffer per CPU, in KiB: some thousands of events, the last seconds of a busy vCPU.
const BUFFER_KB: &str = "512";

/// Is the recorder asked for (`VMHOST_TESTBED_FLIGHT=1`)?
pub fn wanted() -> bool {
    std::env::var("VMHOST_TESTBED_FLIGHT").is_ok_and(|v| v == "1")
}

/// The running recorder; its instance is removed when dropped.
pub struct Flight {
    instance: Instance,
}

impl Flight {
    /// Creates the instance (mounting tracefs first if needed) and enables its events.
    pub fn start() -> Result<Flight, String> {
        let instance = Instance::create(INSTANCE, &[("buffer_size_kb", BUFFER_KB)], EVENTS)?;
        Ok(Flight { instance })
    }

    /// The last `n` events of vCPU threads (`vcpu<N>-<tid>`), oldest first. Recording stops
    /// for the read and goes on after it.
    pub fn last_of_vcpus(&self, n: usize) -> Result<Vec<String>, String> {
        self.instance.write("tracing_on", "0")?;
        let trace = crate::host::read(&self.instance.path("trace"));
        self.instance.write("tracing_on", "1")?;
        Ok(vcpu_lines(&trace?, n))
    }
}

/// The last `n` lines of a tracefs `trace` file whose task is a vCPU thread, trimmed.
fn vcpu_lines(trace: &str, n: usize) -> Vec<String> {
    let lines: Vec<&str> = trace
        .lines()
        .map(str::trim_start)
        .filter(|l| {
            l.strip_prefix("vcpu")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.trim_end().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::vcpu_lines;

    #[test]
    fn only_vcpu_threads_lines_are_kept_the_last_ones() {
        let trace = "# tracer: nop\n#\n\
            \x20          vcpu0-291     [000] d..2.   10.000001: kvm_exit: vcpu 0 reason npf rip 0x1\n\
            \x20   vmhost-emu-290     [001] .....   10.000002: kvm_page_fault: vcpu 0 rip 0x1\n\
            \x20          vcpu1-292     [001] d..2.   10.000003: kvm_exit: vcpu 1 reason hlt rip 0x2\n\
            \x20          vcpu0-291     [000] .....   10.000004: kvm_inj_exception: #PF (0x2)\n\
            \x20     vcpuless-1         [000] .....   10.000005: kvm_exit: not a vcpu\n";
        let got = vcpu_lines(trace, 2);
        assert_eq!(got.len(), 2);
        assert!(got[0].starts_with("vcpu1-292"), "{got:?}");
        assert!(got[1].ends_with("kvm_inj_exception: #PF (0x2)"), "{got:?}");
        assert_eq!(vcpu_lines(trace, 10).len(), 3);
    }
}
