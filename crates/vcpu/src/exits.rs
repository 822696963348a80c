//! A vCPU's exits: decoding what `KVM_RUN` returned, serving Linux guests' port I/O from their
//! devices while the data is still in `kvm_run`, and deciding what each exit means.
//!
//! Exits handled: the doorbell port (a payload's one `out`), the devices' ports (Linux guests),
//! HLT, shutdown (triple fault), failed entry, internal errors, and accesses to ports or
//! guest-physical memory nothing handles, which the [`UnknownAccessPolicy`] either ignores
//! (reads return all ones) or turns into the vCPU's end. Nothing here panics on a guest's
//! behaviour: every outcome is a [`VcpuOutcome`].
//!
//! What ends a Linux guest cleanly: a write of `SLP_EN` with `SLP_TYP` = S5 to the FADT's sleep
//! control register (power-off), the FADT reset register, 0xfe to the i8042 command port,
//! a reset through port 0xcf9, or `KVM_EXIT_SHUTDOWN` (a triple fault resets a PC): the last
//! four are reboots ([`RebootVia`]). vmhost does not restart the guest: a reboot ends the VM.
//! A pvpanic "panicked" write ends it as a guest failure ([`VcpuOutcome::Panicked`], exit 4).

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use kvm_bindings::KVM_INTERNAL_ERROR_EMULATION;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress};
use vmhost_devices::bus::Access;
use vmhost_memory::GuestMemoryMmap;

use crate::devices::legacy::{PortAction, RebootVia};
use crate::devices::LinuxDevices;
use crate::payload::mailbox::{Doorbell, Mailbox, DOORBELL_PORT};
use crate::report::VcpuOutcome;
use crate::vcpu::{Event, GuestCtx, VcpuContext};

/// A KVM exit with its data copied out of `kvm_run`.
pub(crate) enum Exit {
    PortOut {
        port: u16,
        first: u8,
        size: usize,
    },
    PortIn {
        port: u16,
        size: usize,
    },
    Mmio {
        gpa: u64,
        write: bool,
        size: usize,
    },
    /// A device served the access.
    Handled,
    /// A device write ended the guest (power-off or reboot).
    GuestEnd(VcpuOutcome),
    Hlt,
    Shutdown,
    FailEntry(u64),
    InternalError,
    Interrupted,
    Other(String),
}

/// Runs the vCPU once and decodes the exit; port I/O and MMIO that `devices` serve is done
/// here. An MMIO access to a device that stays busy (hung storage under its I/O thread) is
/// abandoned once `stopping` says the VM stops: the exit is then [`Exit::Interrupted`], and the
/// vCPU, which never re-enters the guest, sees the stop at the top of its loop.
pub(crate) fn next_exit(
    fd: &mut VcpuFd,
    devices: Option<&LinuxDevices>,
    stopping: &dyn Fn() -> bool,
) -> Result<Exit, kvm_ioctls::Error> {
    Ok(match fd.run()? {
        VcpuExit::IoOut(port, data) => match devices.map(|d| d.pio_write(port, data)) {
            Some(PortAction::Handled) => Exit::Handled,
            Some(PortAction::PowerOff) => Exit::GuestEnd(VcpuOutcome::PoweredOff),
            Some(PortAction::Reboot(how)) => Exit::GuestEnd(VcpuOutcome::Rebooted { how }),
            Some(PortAction::Panic) => Exit::GuestEnd(VcpuOutcome::Panicked),
            Some(PortAction::Unknown) | None => Exit::PortOut {
                port,
                first: data.first().copied().unwrap_or(0),
                size: data.len(),
            },
        },
        VcpuExit::IoIn(port, data) => {
            if devices.is_some_and(|d| d.pio_read(port, data)) {
                Exit::Handled
            } else {
                data.fill(0xff);
                Exit::PortIn {
                    port,
                    size: data.len(),
                }
            }
        }
        VcpuExit::MmioRead(gpa, data) => {
            match devices.map_or(Access::NotMine, |d| d.mmio_read(gpa, data, stopping)) {
                Access::Done => Exit::Handled,
                Access::GaveUp => Exit::Interrupted,
                Access::NotMine => {
                    data.fill(0xff);
                    Exit::Mmio {
                        gpa,
                        write: false,
                        size: data.len(),
                    }
                }
            }
        }
        VcpuExit::MmioWrite(gpa, data) => {
            match devices.map_or(Access::NotMine, |d| d.mmio_write(gpa, data, stopping)) {
                Access::Done => Exit::Handled,
                Access::GaveUp => Exit::Interrupted,
                Access::NotMine => Exit::Mmio {
                    gpa,
                    write: true,
                    size: data.len(),
                },
            }
        }
        VcpuExit::Hlt => Exit::Hlt,
        VcpuExit::Shutdown => Exit::Shutdown,
        VcpuExit::FailEntry(reason, _cpu) => Exit::FailEntry(reason),
        VcpuExit::InternalError => Exit::InternalError,
        VcpuExit::Intr => Exit::Interrupted,
        // A split irqchip's level-triggered vector was acknowledged: the I/O APIC's sources
        // are edges (docs/devices.md, "Split irqchip"), so no line is still asserted.
        VcpuExit::IoapicEoi(_) => Exit::Handled,
        other => Exit::Other(format!("{other:?}")),
    })
}

/// What the run loop does after an exit.
pub(crate) enum Step {
    /// Re-enter the guest.
    Continue,
    /// The vCPU is done.
    End(VcpuOutcome),
    /// An access nothing handles: up to the policy.
    Unknown(VcpuOutcome),
}

/// What `exit` means for vCPU `vcpu`.
pub(crate) fn handle_exit(
    exit: Exit,
    vcpu: usize,
    ctx: &VcpuContext,
    fd: &mut VcpuFd,
    ie: *const AtomicU8,
) -> Step {
    match exit {
        Exit::PortOut {
            port: DOORBELL_PORT,
            first,
            size: 1,
        } if matches!(ctx.guest, GuestCtx::Payload { .. }) => doorbell(first, vcpu, ctx),
        Exit::PortOut { port, size, .. } => Step::Unknown(VcpuOutcome::UnknownPort {
            port,
            write: true,
            size,
        }),
        Exit::PortIn { port, size } => Step::Unknown(VcpuOutcome::UnknownPort {
            port,
            write: false,
            size,
        }),
        Exit::Mmio { gpa, write, size } => {
            Step::Unknown(VcpuOutcome::UnknownMmio { gpa, write, size })
        }
        Exit::Handled => Step::Continue,
        Exit::GuestEnd(outcome) => {
            tracing::info!(vcpu, %outcome, "the guest ends the VM");
            Step::End(outcome)
        }
        Exit::Hlt => Step::End(VcpuOutcome::Halted),
        Exit::Shutdown => Step::End(shutdown_outcome(vcpu, ctx, fd)),
        Exit::FailEntry(reason) => {
            tracing::error!(
                vcpu,
                reason = format_args!("{reason:#x}"),
                "vCPU entry failed"
            );
            Step::End(VcpuOutcome::EntryFailed { reason })
        }
        Exit::InternalError => {
            let what = internal_error(fd, ctx);
            tracing::error!(vcpu, %what, "vCPU stopped");
            Step::End(VcpuOutcome::Unexpected { what })
        }
        Exit::Interrupted => {
            // A kick: the stop or pause it announces is seen at the top of the loop. Clearing
            // it here is safe against a racing kick, whose sender sets its flag before it
            // signals (and this thread's handler sets `immediate_exit`).
            // SAFETY: `ie` points into this vCPU's kvm_run mapping, live while `fd` is.
            unsafe { (*ie).store(0, Ordering::SeqCst) };
            Step::Continue
        }
        Exit::Other(what) => {
            tracing::error!(vcpu, exit = %what, "unexpected vCPU exit");
            Step::End(VcpuOutcome::Unexpected { what })
        }
    }
}

fn doorbell(code: u8, vcpu: usize, ctx: &VcpuContext) -> Step {
    match Doorbell::from_byte(code) {
        Some(Doorbell::Ready) => {
            ctx.control.mark_ready();
            let _ = ctx.events.send(Event::Ready {
                vcpu,
                at: Instant::now(),
            });
            Step::Continue
        }
        Some(Doorbell::Done) => Step::End(VcpuOutcome::Done),
        Some(Doorbell::Fault) => Step::End(fault_outcome(vcpu, ctx)),
        None => Step::Unknown(VcpuOutcome::UnknownPort {
            port: DOORBELL_PORT,
            write: true,
            size: 1,
        }),
    }
}

fn fault_outcome(vcpu: usize, ctx: &VcpuContext) -> VcpuOutcome {
    let GuestCtx::Payload { boot, boot_mem } = &ctx.guest else {
        return VcpuOutcome::Unexpected {
            what: "fault doorbell from a guest without mailboxes".into(),
        };
    };
    let gpa = boot.mailbox(vcpu);
    match boot_mem.read_obj::<Mailbox>(GuestAddress(gpa)) {
        Ok(m) => {
            let f = m.fault;
            let vector = u8::try_from(f.vector).unwrap_or(u8::MAX);
            let ring = u8::try_from(f.cs & 3).unwrap_or(0);
            tracing::error!(
                vcpu,
                vector,
                error_code = format_args!("{:#x}", f.error_code),
                rip = format_args!("{:#x}", f.rip),
                cr2 = format_args!("{:#x}", f.cr2),
                rflags = format_args!("{:#x}", f.rflags),
                ring,
                "guest exception"
            );
            VcpuOutcome::Exception {
                vector,
                error_code: f.error_code,
                rip: f.rip,
                ring,
                cr2: f.cr2,
            }
        }
        Err(e) => VcpuOutcome::Unexpected {
            what: format!("fault doorbell, but the mailbox at {gpa:#x} is unreadable: {e}"),
        },
    }
}

/// A triple fault: a payload's failure, a Linux guest's reboot (that is what it does to a PC).
fn shutdown_outcome(vcpu: usize, ctx: &VcpuContext, fd: &VcpuFd) -> VcpuOutcome {
    let vector = fd
        .get_vcpu_events()
        .ok()
        .filter(|ev| {
            ev.exception.injected != 0 || ev.exception.pending != 0 || ev.exception.nr != 0
        })
        .map(|ev| ev.exception.nr);
    let regs = fd.get_regs().ok();
    let rip = regs.map_or(0, |r| r.rip);
    if let GuestCtx::Linux { .. } = ctx.guest {
        tracing::info!(
            vcpu,
            ?vector,
            rip = format_args!("{rip:#x}"),
            "guest triple-faulted: a reset, which ends the VM"
        );
        return VcpuOutcome::Rebooted {
            how: RebootVia::TripleFault { vector, rip },
        };
    }
    let payload_status = payload_status(vcpu, ctx);
    // The reset state (RIP 0xfff0, RFLAGS 0x2); KVM_GET_SREGS is not in the vCPU thread's
    // seccomp filter, and these two suffice: no payload runs code at 0xfff0.
    let reset = regs.is_some_and(|r| r.rip == 0xfff0 && r.rflags == 0x2);
    tracing::error!(
        vcpu,
        ?vector,
        rip = format_args!("{rip:#x}"),
        ?payload_status,
        registers_reset = reset,
        "guest shut down (triple fault){}",
        if reset {
            ": KVM reset the vCPU (AMD), so RIP is not where it faulted"
        } else {
            ""
        }
    );
    VcpuOutcome::Shutdown {
        vector,
        rip,
        payload_status,
    }
}

/// The progress word of vCPU `vcpu`'s payload mailbox, if the mailbox still holds the VMM's
/// magic.
fn payload_status(vcpu: usize, ctx: &VcpuContext) -> Option<u64> {
    let GuestCtx::Payload { boot, boot_mem } = &ctx.guest else {
        return None;
    };
    let gpa = boot.mailbox(vcpu);
    match boot_mem.read_obj::<Mailbox>(GuestAddress(gpa)) {
        Ok(m) if m.magic == crate::payload::mailbox::MAGIC => Some(m.status),
        Ok(_) => {
            tracing::error!(
                vcpu,
                gpa = format_args!("{gpa:#x}"),
                "payload mailbox overwritten"
            );
            None
        }
        Err(e) => {
            tracing::error!(vcpu, gpa = format_args!("{gpa:#x}"), %e, "payload mailbox unreadable");
            None
        }
    }
}

/// Describes a `KVM_EXIT_INTERNAL_ERROR`: suberror, RIP, and for an emulation failure the
/// instruction bytes at RIP (read through the guest's page tables when it has guest RAM).
fn internal_error(fd: &mut VcpuFd, ctx: &VcpuContext) -> String {
    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the union member
    // KVM filled in.
    let suberror = unsafe { fd.get_kvm_run().__bindgen_anon_1.internal.suberror };
    let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
    let mut what = format!("KVM_EXIT_INTERNAL_ERROR suberror {suberror} at RIP {rip:#x}");
    if suberror == KVM_INTERNAL_ERROR_EMULATION {
        what.push_str(" (instruction emulation failed)");
    }
    if let (GuestCtx::Linux { ram, .. }, Ok(t)) = (&ctx.guest, fd.translate_gva(rip)) {
        if t.valid != 0 {
            let mut bytes = [0u8; 15];
            if read_guest(ram, t.physical_address, &mut bytes) {
                let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
                what.push_str(&format!(
                    ", GPA {:#x}, bytes {}",
                    t.physical_address,
                    hex.join(" ")
                ));
            }
        }
    }
    what
}

fn read_guest(ram: &GuestMemoryMmap, gpa: u64, buf: &mut [u8]) -> bool {
    ram.read_slice(buf, GuestAddress(gpa)).is_ok()
}
