//! What a run produced: the VM's status, each vCPU's outcome, the CPUID it saw, what its
//! payload measured, and where the threads ran.

use std::fmt::Write as _;

use serde::Serialize;

use crate::arch::CpuidResult;
use crate::devices::debugport::BootMark;
use crate::devices::legacy::RebootVia;
use crate::payload::{PayloadKind, PayloadResult};
use crate::placement::{render_placements, ThreadPlacement};

/// How the run ended, for the binary's exit status ([`RunReport::exit_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Every vCPU finished its payload.
    Completed,
    /// Stopped on request before finishing (SIGINT/SIGTERM; the normal end of `idle`).
    Stopped,
    /// A vCPU failed: a payload's triple fault, guest exception, unknown access under the
    /// `stop` policy, failed entry or an unexpected exit.
    GuestFailed,
    /// A Linux guest powered off (ACPI S5 through the FADT's sleep control register).
    PoweredOff,
    /// A Linux guest rebooted (reset register, keyboard controller, port 0xcf9 or triple
    /// fault); vmhost ends the VM rather than restart it.
    Rebooted,
}

/// How one vCPU ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VcpuOutcome {
    /// The payload rang the doorbell with Done.
    Done,
    /// The guest executed HLT (no in-kernel irqchip: the halt payload's end).
    Halted,
    /// Kicked out of `KVM_RUN` by a stop.
    Stopped,
    /// Never ran (the run was aborted during setup).
    NotStarted,
    /// `KVM_EXIT_SHUTDOWN`: a triple fault, with the exception KVM last recorded.
    Shutdown {
        /// Exception vector from `KVM_GET_VCPU_EVENTS`, if one was recorded.
        vector: Option<u8>,
        /// Guest RIP. On AMD, KVM resets the vCPU on a shutdown intercept, so this is then the
        /// reset vector (0xfff0), not where the guest faulted.
        rip: u64,
        /// How far the built-in payload got, from its mailbox (see
        /// [`crate::payload::mailbox::status`]: 0 still in the ring-0 prologue, 1 prologue
        /// done, 2 in ring 3); `None` when the mailbox no longer holds the VMM's magic (guest
        /// memory was overwritten) or the guest is not a payload.
        payload_status: Option<u64>,
    },
    /// An exception reached the guest's IDT.
    Exception {
        /// Vector.
        vector: u8,
        /// Error code.
        error_code: u64,
        /// Faulting RIP.
        rip: u64,
        /// Ring the fault happened in (CS RPL).
        ring: u8,
        /// CR2 (faulting address of a page fault).
        cr2: u64,
    },
    /// An access to an I/O port nothing handles (`stop` policy).
    UnknownPort {
        /// Port.
        port: u16,
        /// Write (out) or read (in).
        write: bool,
        /// Access size in bytes.
        size: usize,
    },
    /// An access to guest-physical memory no memslot backs (`stop` policy).
    UnknownMmio {
        /// Guest-physical address.
        gpa: u64,
        /// Write or read.
        write: bool,
        /// Access size in bytes.
        size: usize,
    },
    /// A Linux guest powered off.
    PoweredOff,
    /// A Linux guest's kernel panicked (it wrote "panicked" to the pvpanic device).
    Panicked,
    /// A Linux guest rebooted (see [`RebootVia`]).
    Rebooted {
        /// How it asked.
        how: RebootVia,
    },
    /// `KVM_EXIT_FAIL_ENTRY`.
    EntryFailed {
        /// Hardware entry failure reason.
        reason: u64,
    },
    /// `KVM_RUN` failed or exited in a way this VMM does not handle.
    Unexpected {
        /// What happened.
        what: String,
    },
}

impl std::fmt::Display for VcpuOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = |write: bool| if write { "write" } else { "read" };
        match self {
            VcpuOutcome::Done => f.write_str("done"),
            VcpuOutcome::Halted => f.write_str("halted"),
            VcpuOutcome::Stopped => f.write_str("stopped"),
            VcpuOutcome::NotStarted => f.write_str("not started"),
            VcpuOutcome::Shutdown {
                vector,
                rip,
                payload_status,
            } => {
                match vector {
                    Some(v) => write!(f, "triple fault (last exception {v}) at RIP {rip:#x}")?,
                    None => write!(f, "shutdown at RIP {rip:#x}")?,
                }
                match payload_status {
                    Some(0) => f.write_str(", payload in its ring-0 prologue"),
                    Some(1) => f.write_str(", payload past its ring-0 prologue"),
                    Some(2) => f.write_str(", payload in ring 3"),
                    Some(s) => write!(f, ", payload status {s}"),
                    None => Ok(()),
                }
            }
            VcpuOutcome::Exception { vector, error_code, rip, ring, cr2 } => write!(
                f,
                "exception {vector} (error code {error_code:#x}) in ring {ring} at RIP {rip:#x}, CR2 {cr2:#x}"
            ),
            VcpuOutcome::UnknownPort { port, write, size } => {
                write!(f, "{}-byte {} of unknown port {port:#x}", size, dir(*write))
            }
            VcpuOutcome::UnknownMmio { gpa, write, size } => {
                write!(f, "{}-byte {} of unmapped GPA {gpa:#x}", size, dir(*write))
            }
            VcpuOutcome::PoweredOff => f.write_str("powered off"),
            VcpuOutcome::Panicked => f.write_str("guest kernel panic (pvpanic)"),
            VcpuOutcome::Rebooted { how } => match how {
                RebootVia::KeyboardController => f.write_str("rebooted (keyboard controller)"),
                RebootVia::AcpiResetRegister => f.write_str("rebooted (ACPI reset register)"),
                RebootVia::ResetControl => f.write_str("rebooted (port 0xcf9)"),
                RebootVia::TripleFault { vector, rip } => write!(
                    f,
                    "rebooted (triple fault, last exception {vector:?}, RIP {rip:#x})"
                ),
            },
            VcpuOutcome::EntryFailed { reason } => write!(f, "entry failed (reason {reason:#x})"),
            VcpuOutcome::Unexpected { what } => write!(f, "unexpected: {what}"),
        }
    }
}

impl VcpuOutcome {
    /// True for outcomes that make the run [`RunStatus::GuestFailed`].
    pub fn is_failure(&self) -> bool {
        !matches!(
            self,
            VcpuOutcome::Done
                | VcpuOutcome::Halted
                | VcpuOutcome::Stopped
                | VcpuOutcome::NotStarted
                | VcpuOutcome::PoweredOff
                | VcpuOutcome::Rebooted { .. }
        )
    }

    /// True when the guest itself ended the whole VM (power-off or reboot).
    pub fn ends_vm(&self) -> bool {
        matches!(self, VcpuOutcome::PoweredOff | VcpuOutcome::Rebooted { .. })
    }
}

/// One vCPU's part of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VcpuReport {
    /// vCPU index.
    pub vcpu: u32,
    /// APIC ID (= KVM vcpu id).
    pub apic_id: u32,
    /// Host PU it was pinned to (`None`: floating).
    pub host_cpu: Option<u32>,
    /// Guest cell.
    pub guest_cell: u32,
    /// How it ended.
    pub outcome: VcpuOutcome,
    /// The CPUID leaves the guest read in ring 0.
    pub cpuid: Vec<CpuidResult>,
    /// What its payload measured.
    pub result: PayloadResult,
    /// Exits handled (`KVM_RUN` returns).
    pub exits: u64,
    /// Unknown accesses ignored under the `ignore` policy.
    pub ignored_accesses: u64,
    /// Seconds from the start of the run to its first doorbell (`None`: it rang none).
    pub first_doorbell_seconds: Option<f64>,
    /// Seconds from the start of the run to its end.
    pub seconds: f64,
}

/// How a Linux guest was entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinuxEntry {
    /// PVH: 32-bit protected mode (a vmlinux with the Xen PVH note).
    Pvh,
    /// The Linux 64-bit boot protocol.
    Linux64,
    /// None: the guest continued from a saved state (`Vm::restore`).
    Restored,
}

impl From<vmhost_boot::BootMode> for LinuxEntry {
    fn from(m: vmhost_boot::BootMode) -> Self {
        match m {
            vmhost_boot::BootMode::Pvh => LinuxEntry::Pvh,
            vmhost_boot::BootMode::Linux64 => LinuxEntry::Linux64,
        }
    }
}

/// What the VM booted.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BootReport {
    /// A built-in payload.
    Payload {
        /// Which.
        payload: PayloadKind,
    },
    /// A Linux kernel.
    Linux {
        /// Entry protocol.
        entry: LinuxEntry,
        /// Image format: `elf` (vmlinux) or `bz_image`.
        image: String,
        /// Seconds from the start of the run to the guest's first serial byte (`None`: it
        /// wrote none).
        first_serial_byte_seconds: Option<f64>,
        /// Bytes the guest wrote to its serial port.
        serial_bytes: u64,
        /// The first boot marker of each phase the guest wrote to the debug port 0x80
        /// (`/init` writes 0x60: user space reached).
        markers: Vec<BootMark>,
        /// Seconds from the start of the run to the user-space marker (`None`: none written).
        userspace_seconds: Option<f64>,
    },
}

impl BootReport {
    /// One line: the payload, or the kernel's image, entry and serial console numbers.
    pub fn describe(&self) -> String {
        match self {
            BootReport::Payload { payload } => format!("payload {payload:?}"),
            BootReport::Linux {
                entry,
                image,
                first_serial_byte_seconds,
                serial_bytes,
                userspace_seconds,
                ..
            } => {
                let at =
                    |t: &Option<f64>| t.map_or_else(|| "never".into(), |t| format!("at {t:.3} s"));
                format!(
                    "Linux {image} via {entry:?}, first serial byte {}, {serial_bytes} serial bytes, user space {}",
                    at(first_serial_byte_seconds),
                    at(userspace_seconds)
                )
            }
        }
    }
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// VM name.
    pub vm: String,
    /// Payload run (`None`: a Linux guest).
    pub payload: Option<PayloadKind>,
    /// What was booted: the payload, or the kernel's entry and its time to the first serial
    /// byte.
    pub boot: BootReport,
    /// How it ended.
    pub status: RunStatus,
    /// Per vCPU, by index.
    pub vcpus: Vec<VcpuReport>,
    /// Every thread of the process, read from `/proc` when all vCPU threads were set up and
    /// pinned, just before they started running.
    pub placements: Vec<ThreadPlacement>,
    /// Guest TSC rate (KVM_GET_TSC_KHZ).
    pub tsc_khz: u32,
    /// `Vm::new`: KVM setup, memslots, boot area, CPUID, payload preparation.
    pub vm_setup_seconds: f64,
    /// From `Vm::run` until every vCPU thread was pinned, created and configured.
    pub vcpu_setup_seconds: f64,
    /// From the start of the run until every vCPU had rung its first doorbell or ended
    /// (payloads), or until the guest's first serial byte (Linux guests; the run's length
    /// when it wrote none).
    pub startup_seconds: f64,
    /// From the start of the run until every vCPU ended.
    pub run_seconds: f64,
}

impl RunReport {
    /// The exit status the binary should use: 0 completed, or a Linux guest powered off or
    /// rebooted (and `idle` stopped on request, which is how it ends), 130 stopped before
    /// finishing, 4 guest failure. (The binary uses 1 for VMM errors, 2 for an invalid spec and
    /// 3 for a VM that does not fit.)
    pub fn exit_code(&self) -> i32 {
        match self.status {
            RunStatus::Completed | RunStatus::PoweredOff | RunStatus::Rebooted => 0,
            RunStatus::Stopped if self.payload == Some(PayloadKind::Idle) => 0,
            RunStatus::Stopped => 130,
            RunStatus::GuestFailed => 4,
        }
    }

    /// The failed vCPUs and how they failed.
    pub fn failures(&self) -> impl Iterator<Item = (u32, &VcpuOutcome)> {
        self.vcpus
            .iter()
            .filter(|v| v.outcome.is_failure())
            .map(|v| (v.vcpu, &v.outcome))
    }

    /// A human-readable summary: timings, per-vCPU outcome and results, thread placement.
    pub fn render_text(&self) -> String {
        let mut s = String::new();
        let boot = self.boot.describe();
        let _ = writeln!(
            s,
            "VM {}: {}, {:?} (exit code {})\n  setup {:.3} ms, vCPU threads {:.3} ms, start-up {:.3} ms, run {:.3} ms, TSC {} kHz",
            self.vm,
            boot,
            self.status,
            self.exit_code(),
            self.vm_setup_seconds * 1e3,
            self.vcpu_setup_seconds * 1e3,
            self.startup_seconds * 1e3,
            self.run_seconds * 1e3,
            self.tsc_khz
        );
        for v in &self.vcpus {
            let pu = v
                .host_cpu
                .map_or_else(|| "float".to_string(), |c| c.to_string());
            let _ = writeln!(
                s,
                "  vcpu{} apic {} pu {} cell {}: {}, {} exits",
                v.vcpu, v.apic_id, pu, v.guest_cell, v.outcome, v.exits
            );
            if let Some(d) = crate::arch::decode_topology(&v.cpuid) {
                let _ = writeln!(
                    s,
                    "    guest CPUID (ring 0): APIC {} = package {} core {} thread {}; {} threads/core, \
                     {} logical/package; realtime hint {}",
                    d.apic_id,
                    d.package,
                    d.core,
                    d.thread,
                    d.threads_per_core,
                    d.logical_per_package,
                    if d.realtime_hint { "on" } else { "off" }
                );
            }
            match &v.result {
                PayloadResult::None => {}
                PayloadResult::Touch(t) => {
                    let _ = writeln!(
                        s,
                        "    touch cell {}: {} MiB in {:.4} s = {:.2} GB/s",
                        t.cell,
                        t.bytes >> 20,
                        t.seconds,
                        t.gb_per_s
                    );
                }
                PayloadResult::NumaBench(cells) => {
                    for c in cells {
                        let _ = writeln!(
                            s,
                            "    cell {}: chase {:.1} ns/load ({} loads over {} MiB), stream {:.2} GB/s",
                            c.cell,
                            c.chase_ns,
                            c.chase_loads,
                            c.working_set_bytes >> 20,
                            c.stream_gb_per_s
                        );
                    }
                }
            }
        }
        s.push_str(&render_placements(&self.placements));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(status: RunStatus, payload: PayloadKind) -> RunReport {
        RunReport {
            vm: "t".into(),
            payload: Some(payload),
            boot: BootReport::Payload { payload },
            status,
            vcpus: vec![VcpuReport {
                vcpu: 0,
                apic_id: 0,
                host_cpu: Some(1),
                guest_cell: 0,
                outcome: VcpuOutcome::UnknownPort {
                    port: 0x5a5a,
                    write: true,
                    size: 1,
                },
                cpuid: vec![],
                result: PayloadResult::None,
                exits: 2,
                ignored_accesses: 0,
                first_doorbell_seconds: None,
                seconds: 0.0,
            }],
            placements: vec![],
            tsc_khz: 1,
            vm_setup_seconds: 0.0,
            vcpu_setup_seconds: 0.0,
            startup_seconds: 0.0,
            run_seconds: 0.0,
        }
    }

    #[test]
    fn exit_codes_follow_the_outcome() {
        assert_eq!(
            report(RunStatus::Completed, PayloadKind::Touch).exit_code(),
            0
        );
        assert_eq!(report(RunStatus::Stopped, PayloadKind::Idle).exit_code(), 0);
        assert_eq!(
            report(RunStatus::Stopped, PayloadKind::Touch).exit_code(),
            130
        );
        let r = report(RunStatus::GuestFailed, PayloadKind::Halt);
        assert_eq!(r.exit_code(), 4);
        assert_eq!(r.failures().count(), 1);
        assert!(
            r.render_text()
                .contains("1-byte write of unknown port 0x5a5a"),
            "{}",
            r.render_text()
        );
    }

    #[test]
    fn a_linux_guest_that_powers_off_or_reboots_exits_0() {
        let mut r = report(RunStatus::PoweredOff, PayloadKind::Halt);
        r.payload = None;
        r.boot = BootReport::Linux {
            entry: LinuxEntry::Pvh,
            image: "elf".into(),
            first_serial_byte_seconds: Some(35.25),
            serial_bytes: 1000,
            markers: Vec::new(),
            userspace_seconds: Some(41.5),
        };
        r.vcpus[0].outcome = VcpuOutcome::PoweredOff;
        assert_eq!(r.exit_code(), 0);
        assert_eq!(r.failures().count(), 0);
        let text = r.render_text();
        assert!(
            text.contains("Linux elf via Pvh, first serial byte at 35.250 s")
                && text.contains("user space at 41.500 s"),
            "{text}"
        );
        r.status = RunStatus::Rebooted;
        r.vcpus[0].outcome = VcpuOutcome::Rebooted {
            how: RebootVia::TripleFault {
                vector: Some(13),
                rip: 0x1000,
            },
        };
        assert_eq!(r.exit_code(), 0);
        assert!(r.vcpus[0].outcome.ends_vm() && !r.vcpus[0].outcome.is_failure());
        r.status = RunStatus::Stopped;
        assert_eq!(r.exit_code(), 130, "a Linux guest stopped from outside");
    }

    /// The README once promised exit 4 for every triple fault while a Linux guest's exits 0:
    /// the documented rule and the behaviour are checked together.
    #[test]
    fn the_readme_states_the_triple_fault_rule_the_code_follows() {
        let readme = include_str!("../../../README.md").replace('\n', " ");
        assert!(
            readme.contains("A Linux guest's triple fault exits 0, not 4"),
            "README must say a Linux guest's triple fault exits 0"
        );
        assert!(
            readme.contains("4 guest failure (a built-in payload's fault or triple fault;"),
            "README must say a payload's triple fault is exit 4"
        );
        let mut payload = report(RunStatus::GuestFailed, PayloadKind::Touch);
        payload.vcpus[0].outcome = VcpuOutcome::Shutdown {
            vector: Some(8),
            rip: 0,
            payload_status: Some(2),
        };
        assert_eq!(
            payload.vcpus[0].outcome.to_string(),
            "triple fault (last exception 8) at RIP 0x0, payload in ring 3"
        );
        assert!(payload.vcpus[0].outcome.is_failure());
        assert_eq!(payload.exit_code(), 4);
        let mut linux = report(RunStatus::Rebooted, PayloadKind::Halt);
        linux.payload = None;
        linux.vcpus[0].outcome = VcpuOutcome::Rebooted {
            how: RebootVia::TripleFault {
                vector: Some(13),
                rip: 0,
            },
        };
        assert_eq!(linux.exit_code(), 0);
    }

    #[test]
    fn a_guest_kernel_panic_is_a_guest_failure_exit_4() {
        let mut r = report(RunStatus::GuestFailed, PayloadKind::Halt);
        r.payload = None;
        r.vcpus[0].outcome = VcpuOutcome::Panicked;
        assert!(r.vcpus[0].outcome.is_failure() && !r.vcpus[0].outcome.ends_vm());
        assert_eq!(r.exit_code(), 4);
        assert!(r.render_text().contains("guest kernel panic (pvpanic)"));
    }
}
