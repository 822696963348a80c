//! Taking a running VM's state out ([`VmHandle::capture`]) and building a VM that continues
//! from it ([`Vm::restore`]): the orchestration around the state types of [`crate::persist`].
//!
//! Capture, while the VM is paused (every vCPU parked at the top of its run loop after leaving
//! `KVM_RUN` through `immediate_exit`): a Linux guest's devices first (quiesced: requests in
//! flight complete, which may write RAM and raise interrupts), then each parked vCPU thread
//! saves its own vCPU's state ([`VcpuState::save`] with the CPUID the VMM set), then the
//! calling thread saves the VM's irqchip, PIT and kvmclock ([`VmState::save`], the clock last)
//! and a payload's per-vCPU boot-area blocks. Restore: the VM is built for the plan as
//! [`Vm::new`] builds it (irqchip, PIT, memslots; a payload's boot area with the saved blocks
//! written over it, or a Linux guest's devices rebuilt with their state and no kernel loaded),
//! the VM state is loaded, and each vCPU thread creates its vCPU and loads its state
//! ([`VcpuState::restore`]) before the start gate opens; [`Vm::run`] continues the guest.
//!
//! [`VcpuState::save`]: crate::persist::VcpuState::save
//! [`VcpuState::restore`]: crate::persist::VcpuState::restore

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvm_ioctls::VmFd;
use vm_memory::{Bytes, GuestAddress};
use vmhost_config::BootSpec;
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::Plan;

use crate::arch::boot::VCPU_BLOCK;
use crate::arch::BootLayout;
use crate::control::{lock, VmHandle, VmState as RunState, PAUSE_TIMEOUT};
use crate::devices::LinuxDevices;
use crate::linux::{prepare_restored_linux, LinuxShell};
use crate::payload::mailbox::Mailbox;
use crate::payload::PayloadKind;
use crate::persist::{DevicesState, PersistError, SavedPayload, SavedVm, VmState};
use crate::setup::prepare_payload;
use crate::vcpu::VcpuStart;
use crate::vm::{Guest, GuestRam, Prepared, Vm, VmError, VmOptions};

/// A vCPU block's size as a buffer length (16 KiB, asserted below: no truncation).
#[allow(clippy::cast_possible_truncation)]
const BLOCK_BYTES: usize = VCPU_BLOCK as usize;
const _: () = assert!(BLOCK_BYTES as u64 == VCPU_BLOCK);

/// Why a VM's state could not be captured. The VM is left as it was (paused).
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// Capture needs a paused VM ([`VmHandle::pause`] first).
    #[error("cannot capture a VM that is {state:?}: pause it first")]
    NotPaused {
        /// The state it was in.
        state: RunState,
    },
    /// A vCPU has ended (its payload finished or failed) or never started: its state is gone.
    #[error("vCPU {vcpu} has ended or never started: a VM is captured only with every vCPU live")]
    VcpuGone {
        /// The vCPU index.
        vcpu: usize,
    },
    /// A vCPU thread could not save its vCPU's state.
    #[error("vCPU {vcpu}: cannot save its state")]
    Vcpu {
        /// The vCPU index.
        vcpu: usize,
        /// The cause.
        #[source]
        source: PersistError,
    },
    /// Another capture of this VM is running.
    #[error("another capture of this VM is in progress")]
    InProgress,
    /// The parked vCPU threads did not all answer in time.
    #[error("the vCPUs did not save their state within {timeout:?}")]
    Timeout {
        /// How long it waited.
        timeout: Duration,
    },
    /// The VM's irqchip, PIT or clock could not be saved.
    #[error("cannot save the VM's irqchip, PIT or clock")]
    Vm(#[source] PersistError),
    /// A Linux guest's devices could not be quiesced or saved.
    #[error("cannot save the guest's devices")]
    Devices(#[source] vmhost_devices::PersistError),
    /// A payload that runs without the in-kernel irqchip and PIT (`halt`, `numa-bench`) has
    /// no VM state to capture.
    #[error(
        "the {kind:?} payload runs without the in-kernel irqchip, so it cannot be captured \
         (the idle and touch payloads can)"
    )]
    NoIrqchip {
        /// The payload.
        kind: PayloadKind,
    },
    /// A payload's boot-area block could not be read.
    #[error("vCPU {vcpu}: cannot read its boot-area block at GPA {gpa:#x}")]
    BootArea {
        /// The vCPU index.
        vcpu: usize,
        /// The block's GPA.
        gpa: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// What a capture reads besides the vCPUs: the VM fd, a payload's boot area or a Linux
/// guest's devices (weak: the `Vm` owns them).
#[derive(Clone)]
pub(crate) struct Source {
    vm: Weak<VmFd>,
    payload: Option<PayloadSource>,
    /// A Linux guest's devices, saved by a capture and resumed by [`VmHandle::resume`].
    linux: Option<Weak<LinuxDevices>>,
}

#[derive(Clone)]
struct PayloadSource {
    kind: PayloadKind,
    boot: Arc<BootLayout>,
    boot_mem: GuestMemoryMmap,
}

impl Source {
    pub(crate) fn new(fd: &Arc<VmFd>, guest: &Guest) -> Self {
        let payload = match guest {
            Guest::Payload {
                kind,
                boot,
                boot_mem,
                ..
            } => Some(PayloadSource {
                kind: *kind,
                boot: Arc::clone(boot),
                boot_mem: boot_mem.clone(),
            }),
            Guest::Linux { .. } => None,
        };
        let linux = match guest {
            Guest::Linux { devices, .. } => Some(Arc::downgrade(devices)),
            Guest::Payload { .. } => None,
        };
        Source {
            vm: Arc::downgrade(fd),
            payload,
            linux,
        }
    }
}

impl Source {
    /// Lets a Linux guest's device I/O threads, quiesced by a capture, run again.
    pub(crate) fn resume_devices(&self) {
        if let Some(d) = self.linux.as_ref().and_then(Weak::upgrade) {
            d.resume_io();
        }
    }
}

impl PayloadSource {
    fn save(&self) -> Result<SavedPayload, CaptureError> {
        let vcpu_blocks = (0..self.boot.vcpus)
            .map(|vcpu| {
                let gpa = self.boot.mailbox(vcpu);
                let mut block = vec![0u8; BLOCK_BYTES];
                self.boot_mem
                    .read_slice(&mut block, GuestAddress(gpa))
                    .map_err(|source| CaptureError::BootArea { vcpu, gpa, source })?;
                Ok(block)
            })
            .collect::<Result<_, _>>()?;
        Ok(SavedPayload {
            kind: self.kind,
            vcpu_blocks,
        })
    }
}

impl VmHandle {
    /// Captures the paused VM's state: every vCPU's (each saved on its own parked thread),
    /// then the VM's irqchip, PIT and kvmclock, then a payload's boot-area blocks. Guest RAM
    /// is not included. Refused unless the VM is paused with every vCPU live; the VM stays
    /// paused (resume or stop it afterwards). Do not resume it while a capture runs: a capture
    /// that sees the VM leave the paused state fails.
    pub fn capture(&self) -> Result<SavedVm, CaptureError> {
        let source = lock(&self.0.snapshot).clone();
        let state = self.state();
        let Some(source) = source.filter(|_| state == RunState::Paused) else {
            return Err(CaptureError::NotPaused { state });
        };
        if let Some(p) = source.payload.as_ref().filter(|p| !p.kind.needs_irqchip()) {
            return Err(CaptureError::NoIrqchip { kind: p.kind });
        }
        // Devices first: quiescing them completes in-flight requests, which may write guest
        // RAM and raise interrupts; the irqchip and LAPIC states are taken after that.
        let devices = source
            .linux
            .as_ref()
            .and_then(Weak::upgrade)
            .map(|d| d.save())
            .transpose()
            .map_err(CaptureError::Devices)?;
        let vcpus = self.0.save_vcpus(PAUSE_TIMEOUT)?;
        let fd = source.vm.upgrade().ok_or(CaptureError::NotPaused {
            state: RunState::Stopped,
        })?;
        let irqchip = match devices.as_ref().and_then(|d| d.ioapic.as_ref()) {
            Some(_) => vmhost_config::Irqchip::Split,
            None => vmhost_config::Irqchip::Kernel,
        };
        let vm = VmState::save(&fd, irqchip).map_err(CaptureError::Vm)?;
        let payload = source
            .payload
            .as_ref()
            .map(PayloadSource::save)
            .transpose()?;
        let state = self.state();
        if state != RunState::Paused {
            return Err(CaptureError::NotPaused { state });
        }
        Ok(SavedVm {
            vm,
            vcpus,
            payload,
            devices,
        })
    }
}

impl VmHandle {
    /// vCPU `vcpu`'s payload mailbox as it is now: a payload's progress (`idle`'s `ticks`,
    /// `touch`'s status), read without stopping the guest. `None` for a Linux guest or an index
    /// past the last vCPU.
    pub fn payload_mailbox(&self, vcpu: usize) -> Option<Mailbox> {
        let source = lock(&self.0.snapshot).clone()?;
        let p = source.payload?;
        if vcpu >= p.boot.vcpus {
            return None;
        }
        crate::payload::read_mailbox(&p.boot_mem, p.boot.mailbox(vcpu)).ok()
    }
}

impl Vm {
    /// Builds the VM of `plan` on `ram` (which holds the saved guest RAM) to continue from
    /// `saved` instead of booting: the same VM-level setup as [`Vm::new`] (irqchip, PIT,
    /// memslots, boot area), the payload's saved boot-area blocks written back, the VM state
    /// loaded; each vCPU thread then creates its vCPU and loads its state before the guest
    /// starts. [`Vm::run`] continues the guest.
    ///
    /// The plan must have the saved guest topology: as many vCPUs, with the same APIC IDs, and
    /// the same payload; a mismatch is [`VmError::RestoreMismatch`] naming both. Run
    /// [`crate::persist::check_target`] first. A Linux guest's devices are rebuilt from the plan
    /// with their saved state (run `vmhost_devices::persist::check_restorable` on it before
    /// guest RAM is loaded), then the irqchip is loaded and interrupts the devices had pending
    /// are raised again.
    ///
    /// ```
    /// use vmhost_memory::{GuestMemory, MemoryOptions};
    /// use vmhost_plan::{plan, PlanOptions};
    /// use vmhost_vcpu::{persist, RunStatus, Vm, VmOptions};
    ///
    /// if std::env::var("VMHOST_SKIP_KVM_TESTS").as_deref() == Ok("1") {
    ///     println!("SKIP doc example: VMHOST_SKIP_KVM_TESTS=1");
    ///     return;
    /// }
    /// let spec = vmhost_config::from_toml_str(
    ///     "name = \"moved\"\n[cpu]\ncores = 1\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"idle\"\n",
    ///     "moved.toml",
    /// )
    /// .unwrap()
    /// .spec;
    /// let host = vmhost_topology::discover().unwrap();
    /// let plan = plan(&spec, &host, &PlanOptions::default()).into_result().unwrap();
    /// let memory = || GuestMemory::new(&plan, &MemoryOptions::default()).unwrap();
    ///
    /// let mut vm = Vm::new(&plan, memory(), VmOptions::default()).unwrap();
    /// let (handle, stop) = (vm.handle(), vm.stop_handle());
    /// let running = std::thread::spawn(move || vm.run());
    /// while stop.ready_vcpus() < 1 {
    ///     std::thread::yield_now();
    /// }
    /// handle.pause().unwrap();
    /// let saved = handle.capture().unwrap();
    /// handle.stop();
    /// running.join().unwrap().unwrap();
    ///
    /// // (The idle payload keeps nothing in RAM; a real restore loads the saved RAM first.)
    /// persist::check_target(&saved).unwrap();
    /// let mut vm = Vm::restore(&plan, memory(), VmOptions::default(), saved).unwrap();
    /// vm.stop_handle().stop(); // ends the run as soon as its vCPUs are loaded
    /// assert_eq!(vm.run().unwrap().status, RunStatus::Stopped);
    /// ```
    pub fn restore(
        plan: &Plan,
        ram: impl GuestRam,
        options: VmOptions,
        saved: SavedVm,
    ) -> Result<Vm, VmError> {
        Self::restore_on(None, plan, ram, options, saved)
    }

    /// [`Vm::restore`] on a [`VmShell`] built ahead over the same `ram` (a migration target
    /// builds it while the pre-copy rounds arrive, so that only the state is loaded while the
    /// guest is paused). `None`, or a shell for a guest the state says is a built-in payload,
    /// builds the whole VM here. A shell built over other mappings than `ram`'s is
    /// [`VmError::RestoreMismatch`].
    pub fn restore_on(
        shell: Option<VmShell>,
        plan: &Plan,
        ram: impl GuestRam,
        options: VmOptions,
        saved: SavedVm,
    ) -> Result<Vm, VmError> {
        let t0 = Instant::now();
        check_topology(plan, &saved)?;
        let load_vm = |prepared: &Prepared| {
            saved
                .vm
                .restore(&prepared.fd, plan.irqchip())
                .map_err(|source| VmError::State { vcpu: None, source })
        };
        let mut prepared = match check_guest(plan, &options, &saved)? {
            SavedGuest::Payload(payload) => {
                let prepared = prepare_payload(plan, &ram, &options, payload.kind)?;
                if let Guest::Payload { boot, boot_mem, .. } = &prepared.guest {
                    write_blocks(plan, boot, boot_mem, payload)?;
                }
                load_vm(&prepared)?;
                prepared
            }
            SavedGuest::Linux(devices) => {
                let shell = shell.map(|s| s.take(plan, &ram)).transpose()?;
                // Devices (rebuilt with their state), then the irqchip, then the interrupts the
                // devices had pending are raised again, before any vCPU runs.
                let prepared = prepare_restored_linux(plan, &ram, &options, devices, shell)?;
                load_vm(&prepared)?;
                if let Guest::Linux { devices, .. } = &prepared.guest {
                    devices.resume_restored();
                }
                prepared
            }
        };
        for (cfg, state) in prepared.configs.iter_mut().zip(saved.vcpus) {
            cfg.start = VcpuStart::Restore(Box::new(state));
        }
        Vm::from_prepared(plan, prepared, ram, &options, t0)
    }
}

/// The part of a Linux guest's VM that its saved state does not change, built before the
/// state is known: the KVM VM with a memslot over each RAM region, the in-kernel irqchip and
/// PIT, and every vCPU's CPUID. [`Vm::restore_on`] builds the rest (devices, vCPU threads)
/// and loads the state. Dropping it closes the VM.
pub struct VmShell {
    linux: LinuxShell,
    /// Each RAM region's (GPA, length, host address) the memslots were made for.
    regions: Vec<(u64, u64, usize)>,
}

impl std::fmt::Debug for VmShell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmShell")
            .field("regions", &self.regions)
            .finish_non_exhaustive()
    }
}

/// Each RAM region's (GPA, length, host address).
fn ram_regions(ram: &dyn GuestRam) -> Vec<(u64, u64, usize)> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
    ram.guest_memory()
        .iter()
        .map(|r| {
            let host = r
                .get_host_address(MemoryRegionAddress(0))
                .map_or(0, |p| p as usize);
            (r.start_addr().0, r.len(), host)
        })
        .collect()
}

impl VmShell {
    /// Builds the shell of `plan`'s VM over `ram`, the guest RAM the VM will run on
    /// (`nested`: [`VmOptions::mask_for_nested_emulation`]). `None` for a plan that runs a
    /// built-in payload: its VM is built with its boot area, from the state.
    pub fn build(plan: &Plan, ram: &impl GuestRam, nested: bool) -> Result<Option<Self>, VmError> {
        if !matches!(plan.boot, BootSpec::Kernel { .. }) {
            return Ok(None);
        }
        Ok(Some(VmShell {
            linux: LinuxShell::build(plan, ram, nested)?,
            regions: ram_regions(ram),
        }))
    }

    /// The shell, checked to map exactly `ram`'s regions (the memslots point at them).
    fn take(self, plan: &Plan, ram: &dyn GuestRam) -> Result<LinuxShell, VmError> {
        let now = ram_regions(ram);
        if now != self.regions {
            return Err(mismatch(
                plan,
                "guest RAM under the VM built ahead",
                format!("{:x?}", self.regions),
                format!("{now:x?}"),
            ));
        }
        Ok(self.linux)
    }
}

/// What a saved VM runs, checked against the plan.
enum SavedGuest<'a> {
    Payload(&'a SavedPayload),
    Linux(&'a DevicesState),
}

fn mismatch(
    plan: &Plan,
    what: impl Into<String>,
    saved: impl ToString,
    planned: impl ToString,
) -> VmError {
    VmError::RestoreMismatch {
        vm: plan.name.clone(),
        what: what.into(),
        saved: saved.to_string(),
        planned: planned.to_string(),
    }
}

/// The saved vCPUs against the plan's: their number and each one's APIC ID.
fn check_topology(plan: &Plan, saved: &SavedVm) -> Result<(), VmError> {
    if saved.vcpus.len() != plan.vcpus.len() || plan.vcpus.is_empty() {
        return Err(mismatch(plan, "vCPUs", saved.vcpus.len(), plan.vcpus.len()));
    }
    let ids = saved
        .apic_ids()
        .map_err(|source| VmError::State { vcpu: None, source })?;
    for (v, id) in plan.vcpus.iter().zip(ids) {
        if v.apic_id != id {
            return Err(mismatch(
                plan,
                format!("vCPU {} APIC ID", v.vcpu),
                id,
                v.apic_id,
            ));
        }
    }
    Ok(())
}

/// The saved guest against the plan's: the same payload, or a Linux guest with its devices'
/// state for a plan that boots a kernel.
fn check_guest<'a>(
    plan: &Plan,
    options: &VmOptions,
    saved: &'a SavedVm,
) -> Result<SavedGuest<'a>, VmError> {
    let planned = match (&options.payload_override, &plan.boot) {
        (Some(kind), _) => Some(*kind),
        (None, BootSpec::Payload { payload }) => Some(crate::payload::kind_of(*payload)),
        (None, BootSpec::Kernel { .. }) => None,
    };
    let name = |k: Option<PayloadKind>| {
        k.map_or("a Linux kernel".to_owned(), |k| {
            format!("the {k:?} payload")
        })
    };
    let saved_kind = saved.payload.as_ref().map(|p| p.kind);
    if planned != saved_kind {
        return Err(mismatch(plan, "guest", name(saved_kind), name(planned)));
    }
    let Some(payload) = &saved.payload else {
        return saved
            .devices
            .as_ref()
            .map(SavedGuest::Linux)
            .ok_or_else(|| VmError::RestoreUnsupported {
                vm: plan.name.clone(),
                what: "a Linux guest saved without its devices' state".into(),
            });
    };
    if !payload.kind.needs_irqchip() {
        return Err(VmError::RestoreUnsupported {
            vm: plan.name.clone(),
            what: format!(
                "the {:?} payload: it runs without the in-kernel irqchip",
                payload.kind
            ),
        });
    }
    if payload.vcpu_blocks.len() != plan.vcpus.len() {
        return Err(mismatch(
            plan,
            "payload vCPU blocks",
            payload.vcpu_blocks.len(),
            plan.vcpus.len(),
        ));
    }
    Ok(SavedGuest::Payload(payload))
}

/// Writes the saved per-vCPU blocks (mailbox, stacks) over the freshly built ones.
fn write_blocks(
    plan: &Plan,
    boot: &BootLayout,
    boot_mem: &GuestMemoryMmap,
    payload: &SavedPayload,
) -> Result<(), VmError> {
    for (i, block) in payload.vcpu_blocks.iter().enumerate() {
        if block.len() as u64 != VCPU_BLOCK {
            return Err(mismatch(
                plan,
                format!("vCPU {i} boot-area block bytes"),
                block.len(),
                VCPU_BLOCK,
            ));
        }
        let gpa = boot.mailbox(i);
        boot_mem
            .write_slice(block, GuestAddress(gpa))
            .map_err(|source| VmError::Payload {
                vcpu: Some(i),
                source: crate::payload::PayloadError::Write { gpa, source },
            })?;
    }
    Ok(())
}
