//! The VM: `/dev/kvm`, the VM file descriptor, memslots for guest RAM and the boot area, the
//! in-kernel interrupt controller and PIT when the guest needs them, per-vCPU CPUID and
//! mailboxes; and [`Vm::run`], which hands everything to the emulator thread.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmhost_config::BootSpec;
use vmhost_memory::GuestLayout;
use vmhost_plan::Plan;

use crate::arch::boot::CODE_BYTES;
use crate::arch::cpuid::{self, CpuidInputs};
use crate::arch::{BootError, BootLayout, CpuidError};
use crate::control::{Control, StopHandle};
use crate::emulator::{self, EmulatorInput, VcpuMeta};
use crate::payload::bench::{self, BenchOptions};
use crate::payload::{self, program, MailboxInputs, PayloadError, PayloadKind};
use crate::report::RunReport;
use crate::vcpu::{UnknownAccessPolicy, VcpuConfig, VcpuContext, VcpuError};

/// Where KVM's real-mode TSS goes on Intel (three pages, inside the MMIO hole).
const TSS_ADDR: usize = 0xfffb_d000;
/// Seed of the benchmark's chain shuffle (fixed: runs are comparable).
const BENCH_SEED: u64 = 0x766d_686f_7374;
/// The boot area must end below the IOAPIC.
const BOOT_LIMIT: u64 = 0xfec0_0000;

/// Guest RAM a VM runs on: the mapping and its guest-physical layout.
///
/// Implemented by [`vmhost_memory::GuestMemory`] (the normal case) and by a
/// `(GuestMemoryMmap, GuestLayout)` pair.
pub trait GuestRam: Send + 'static {
    /// The RAM regions, one memslot each.
    fn guest_memory(&self) -> &GuestMemoryMmap;
    /// Where each cell's RAM sits.
    fn guest_layout(&self) -> &GuestLayout;
}

impl GuestRam for vmhost_memory::GuestMemory {
    fn guest_memory(&self) -> &GuestMemoryMmap {
        self.memory()
    }
    fn guest_layout(&self) -> &GuestLayout {
        self.layout()
    }
}

impl GuestRam for (GuestMemoryMmap, GuestLayout) {
    fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.0
    }
    fn guest_layout(&self) -> &GuestLayout {
        &self.1
    }
}

/// Settings of a VM that are not in the plan.
#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    /// What to do on an access to an unknown port or unmapped guest-physical memory.
    pub unknown_access: UnknownAccessPolicy,
    /// numa-bench sizes.
    pub bench: BenchOptions,
    /// Run this payload instead of the plan's (test payloads).
    #[doc(hidden)]
    pub payload_override: Option<PayloadKind>,
    /// Called on the emulator thread once every vCPU thread is pinned and configured, just
    /// before the guest starts, with the thread placement read back from `/proc`.
    pub on_start: Option<StartHook>,
}

/// The function a [`StartHook`] calls.
pub type StartFn = dyn Fn(&[crate::ThreadPlacement]) + Send + Sync;

/// A callback run when the VM starts (see [`VmOptions::on_start`]).
#[derive(Clone)]
pub struct StartHook(pub Arc<StartFn>);

impl std::fmt::Debug for StartHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StartHook(..)")
    }
}

/// Why a VM cannot be created or run.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The plan boots a kernel; this crate runs built-in payloads only.
    #[error("VM {vm}: booting a kernel is not supported by vmhost-vcpu (use a built-in payload)")]
    UnsupportedBoot {
        /// VM name.
        vm: String,
    },
    /// The plan has no vCPUs.
    #[error("VM {vm}: the plan has no vCPUs")]
    NoVcpus {
        /// VM name.
        vm: String,
    },
    /// `/dev/kvm` could not be opened.
    #[error("cannot open /dev/kvm")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// KVM lacks a capability this crate needs.
    #[error("KVM lacks {cap}")]
    MissingCap {
        /// The capability.
        cap: &'static str,
    },
    /// A VM-level KVM ioctl failed.
    #[error("{op} failed")]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// An APIC ID exceeds what KVM accepts as a vcpu id.
    #[error("vCPU {vcpu}: APIC ID {apic_id} exceeds KVM's largest vcpu id {max}")]
    VcpuId {
        /// vCPU index.
        vcpu: u32,
        /// Its APIC ID.
        apic_id: u32,
        /// KVM's limit.
        max: usize,
    },
    /// A memslot could not be registered.
    #[error("cannot register memslot {slot} (GPA {gpa:#x}, {size:#x} bytes)")]
    Memslot {
        /// Slot number.
        slot: u32,
        /// Guest-physical start.
        gpa: u64,
        /// Size.
        size: u64,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The MMIO hole has no room for the boot area.
    #[error("the MMIO hole {hole:x?} leaves no room for the boot area")]
    NoHole {
        /// The hole.
        hole: Range<u64>,
    },
    /// The boot area could not be built.
    #[error("cannot build the boot area")]
    Boot(#[source] BootError),
    /// A vCPU's CPUID could not be built.
    #[error("cannot build the CPUID")]
    Cpuid(#[source] CpuidError),
    /// A payload could not be prepared or read back.
    #[error("payload{}", .vcpu.map(|v| format!(" of vCPU {v}")).unwrap_or_default())]
    Payload {
        /// The vCPU, when one is concerned.
        vcpu: Option<usize>,
        /// The cause.
        #[source]
        source: PayloadError,
    },
    /// The VM was already run.
    #[error("the VM has already run")]
    AlreadyRun,
    /// A thread could not be started.
    #[error("cannot start the emulator thread")]
    SpawnEmulator(#[source] std::io::Error),
    /// A vCPU thread could not be started.
    #[error("cannot start the thread of vCPU {vcpu}")]
    SpawnVcpu {
        /// vCPU index.
        vcpu: usize,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The emulator thread could not be pinned.
    #[error("cannot pin the emulator thread to PUs {cpus:?}")]
    PinEmulator {
        /// The PUs.
        cpus: Vec<u32>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A vCPU could not be set up.
    #[error("vCPU {vcpu} setup failed")]
    Vcpu {
        /// vCPU index.
        vcpu: usize,
        /// The cause.
        #[source]
        source: VcpuError,
    },
    /// A vCPU thread panicked (a bug).
    #[error("the thread of vCPU {vcpu} panicked")]
    VcpuPanicked {
        /// vCPU index (`usize::MAX`: unknown).
        vcpu: usize,
    },
    /// The emulator thread panicked (a bug).
    #[error("the emulator thread panicked")]
    EmulatorPanicked,
}

fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// A KVM VM ready to run a plan's payload.
pub struct Vm {
    // Field order is drop order: the VM fd closes before the memory it maps goes away.
    fd: Arc<VmFd>,
    _kvm: Kvm,
    name: String,
    kind: PayloadKind,
    boot: Arc<BootLayout>,
    boot_mem: GuestMemoryMmap,
    configs: Option<Vec<VcpuConfig>>,
    meta: Vec<VcpuMeta>,
    bench_cells: Vec<u32>,
    emulator_cpus: Vec<u32>,
    control: Arc<Control>,
    policy: UnknownAccessPolicy,
    on_start: Option<StartHook>,
    setup_seconds: f64,
    ram: Box<dyn GuestRam>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("name", &self.name)
            .field("payload", &self.kind)
            .field("vcpus", &self.meta.len())
            .finish()
    }
}

impl Vm {
    /// Creates the VM of `plan` on `ram`: KVM VM, memslots, irqchip/PIT when the payload needs
    /// them, boot area, payload code and parameters, per-vCPU CPUID. No thread starts yet.
    pub fn new(plan: &Plan, ram: impl GuestRam, options: VmOptions) -> Result<Vm, VmError> {
        let t0 = Instant::now();
        let kind = payload_kind(plan, &options)?;
        let (kvm, fd) = open_vm(plan, kind)?;
        let layout = ram.guest_layout();
        let (boot, boot_mem, program) = build_boot_area(layout, plan.vcpus.len(), kind)?;
        register_memslots(&fd, ram.guest_memory(), &boot_mem)?;
        let (chains, bench_cells) = if kind == PayloadKind::NumaBench {
            let chains = bench::prepare(
                ram.guest_memory(),
                layout,
                &options.bench,
                BENCH_SEED,
                plan.vcpus.len(),
            )
            .map_err(|source| VmError::Payload { vcpu: None, source })?;
            let mut cells: Vec<u32> = layout.regions.iter().map(|r| r.cell).collect();
            cells.dedup();
            (chains, cells)
        } else {
            (Vec::new(), Vec::new())
        };
        let inputs = MailboxInputs {
            plan,
            layout,
            boot: &boot,
            user_entry: program.user_entry,
            bench: &chains,
        };
        let configs = vcpu_configs(
            &kvm,
            plan,
            &inputs,
            &boot_mem,
            program.entry,
            kind.needs_irqchip(),
        )?;
        let meta = plan
            .vcpus
            .iter()
            .map(|v| VcpuMeta {
                vcpu: v.vcpu,
                apic_id: v.apic_id,
                host_cpu: v.host_cpu,
                guest_cell: v.guest_cell,
            })
            .collect();
        Ok(Vm {
            fd: Arc::new(fd),
            _kvm: kvm,
            name: plan.name.clone(),
            kind,
            boot: Arc::new(boot),
            boot_mem,
            configs: Some(configs),
            meta,
            bench_cells,
            emulator_cpus: plan.emulator.host_cpus.clone(),
            control: Arc::new(Control::new(plan.vcpus.len())),
            policy: options.unknown_access,
            on_start: options.on_start.clone(),
            setup_seconds: t0.elapsed().as_secs_f64(),
            ram: Box::new(ram),
        })
    }

    /// A handle that stops the VM from another thread (SIGINT/SIGTERM handling).
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.control))
    }

    /// The payload this VM runs.
    pub fn payload(&self) -> PayloadKind {
        self.kind
    }

    /// The guest RAM (for checks after the run).
    pub fn ram(&self) -> &dyn GuestRam {
        self.ram.as_ref()
    }

    /// The VMM-owned boot area (page tables, descriptor tables, code, mailboxes): reserved
    /// guest-physical space in the MMIO hole, never RAM.
    pub fn boot_area(&self) -> Range<u64> {
        self.boot.range()
    }

    /// Runs the payload to its end: starts the `vmhost-emu` thread, which starts one pinned
    /// `vcpu<N>` thread per vCPU, and returns when every thread has been joined. Guest failures
    /// are in the report ([`crate::RunStatus::GuestFailed`]), not errors. A VM runs once.
    pub fn run(&mut self) -> Result<RunReport, VmError> {
        let configs = self.configs.take().ok_or(VmError::AlreadyRun)?;
        let run_start = Instant::now();
        let (events, rx, gate) = emulator::channel();
        let input = EmulatorInput {
            vm_name: self.name.clone(),
            kind: self.kind,
            emulator_cpus: self.emulator_cpus.clone(),
            configs,
            meta: self.meta.clone(),
            bench_cells: self.bench_cells.clone(),
            ctx: VcpuContext {
                vm: Arc::clone(&self.fd),
                boot: Arc::clone(&self.boot),
                boot_mem: self.boot_mem.clone(),
                control: Arc::clone(&self.control),
                gate,
                events,
                policy: self.policy,
            },
            run_start,
            vm_setup_seconds: self.setup_seconds,
            on_start: self.on_start.clone(),
        };
        let emu = std::thread::Builder::new()
            .name("vmhost-emu".into())
            .spawn(move || emulator::run(input, rx))
            .map_err(VmError::SpawnEmulator)?;
        emu.join().map_err(|_| VmError::EmulatorPanicked)?
    }
}

fn payload_kind(plan: &Plan, options: &VmOptions) -> Result<PayloadKind, VmError> {
    if plan.vcpus.is_empty() {
        return Err(VmError::NoVcpus {
            vm: plan.name.clone(),
        });
    }
    match (&options.payload_override, &plan.boot) {
        (Some(k), _) => Ok(*k),
        (None, BootSpec::Payload { payload }) => Ok(PayloadKind::from(*payload)),
        (None, BootSpec::Kernel { .. }) => Err(VmError::UnsupportedBoot {
            vm: plan.name.clone(),
        }),
    }
}

/// Opens KVM and creates the VM, with the in-kernel irqchip and PIT when `kind` needs them.
fn open_vm(plan: &Plan, kind: PayloadKind) -> Result<(Kvm, VmFd), VmError> {
    let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
    if !kvm.check_extension(Cap::ImmediateExit) {
        return Err(VmError::MissingCap {
            cap: "KVM_CAP_IMMEDIATE_EXIT",
        });
    }
    let max = kvm.get_max_vcpu_id();
    if let Some(v) = plan
        .vcpus
        .iter()
        .find(|v| usize::try_from(v.apic_id).map_or(true, |id| id >= max))
    {
        return Err(VmError::VcpuId {
            vcpu: v.vcpu,
            apic_id: v.apic_id,
            max,
        });
    }
    let fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    if kvm.check_extension(Cap::SetTssAddr) {
        fd.set_tss_address(TSS_ADDR)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
    }
    if kind.needs_irqchip() {
        fd.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;
    }
    Ok((kvm, fd))
}

/// Lays out and fills the boot area in the MMIO hole: tables, code, mailboxes come later.
fn build_boot_area(
    layout: &GuestLayout,
    vcpus: usize,
    kind: PayloadKind,
) -> Result<(BootLayout, GuestMemoryMmap, program::Program), VmError> {
    let hole = layout.mmio_hole();
    if hole.end <= hole.start || hole.start >= BOOT_LIMIT {
        return Err(VmError::NoHole { hole });
    }
    // Identity-map RAM and the whole hole (boot area included): guest MMIO accesses then reach
    // the VMM as MMIO exits instead of page faults.
    let mut mapped: Vec<Range<u64>> = layout.regions.iter().map(|r| r.gpa_range()).collect();
    mapped.push(hole.clone());
    let boot = BootLayout::new(hole.start, BOOT_LIMIT.min(hole.end), vcpus, &mapped)
        .map_err(VmError::Boot)?;
    if boot.range().contains(&program::UNMAPPED_GPA) {
        return Err(VmError::NoHole { hole });
    }
    let program = program::assemble(kind, boot.code).map_err(|source| VmError::Payload {
        vcpu: None,
        source: PayloadError::Assemble { kind, source },
    })?;
    if program.code.len() as u64 > CODE_BYTES {
        let source = PayloadError::CodeTooLarge {
            kind,
            bytes: program.code.len(),
            max: CODE_BYTES,
        };
        return Err(VmError::Payload { vcpu: None, source });
    }
    let boot_mem = boot.build(&program.handlers).map_err(VmError::Boot)?;
    boot_mem
        .write_slice(&program.code, GuestAddress(boot.code))
        .map_err(|source| {
            VmError::Boot(BootError::Write {
                gpa: boot.code,
                source,
            })
        })?;
    Ok((boot, boot_mem, program))
}

/// One memslot per RAM region, then one for the boot area.
fn register_memslots(
    fd: &VmFd,
    ram: &GuestMemoryMmap,
    boot_mem: &GuestMemoryMmap,
) -> Result<(), VmError> {
    for (slot, region) in (0u32..).zip(ram.iter().chain(boot_mem.iter())) {
        let gpa = region.start_addr().0;
        let size = region.len();
        let err = |source| VmError::Memslot {
            slot,
            gpa,
            size,
            source,
        };
        let host = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .map_err(|_| err(kvm_ioctls::Error::new(libc::EFAULT)))?;
        let mem = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: host as u64,
        };
        // SAFETY: `host..host + size` is a live mapping owned by a GuestMemoryMmap that the Vm
        // keeps (in `ram` or `boot_mem`) until after the VM fd, declared first, is closed; the
        // slots do not overlap because the RAM regions and the boot area are disjoint.
        unsafe { fd.set_user_memory_region(mem) }.map_err(err)?;
    }
    Ok(())
}

fn vcpu_configs(
    kvm: &Kvm,
    plan: &Plan,
    inputs: &MailboxInputs<'_>,
    boot_mem: &GuestMemoryMmap,
    entry: u64,
    irqchip: bool,
) -> Result<Vec<VcpuConfig>, VmError> {
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    let dedicated = plan.vcpus.iter().all(|v| v.host_cpu.is_some());
    let mut configs = Vec::with_capacity(plan.vcpus.len());
    for (i, v) in plan.vcpus.iter().enumerate() {
        let cpuid = cpuid::vcpu_cpuid(
            &supported,
            &CpuidInputs {
                topology: plan.guest_topology,
                vcpu: v,
                dedicated,
            },
            &cpuid::host_cpuid,
        )
        .map_err(VmError::Cpuid)?;
        let mut m = payload::initial_mailbox(inputs, i).map_err(|source| VmError::Payload {
            vcpu: Some(i),
            source,
        })?;
        payload::set_cpuid_requests(&mut m, &cpuid::reported_leaves(&cpuid));
        payload::write_mailbox(boot_mem, &m).map_err(|source| VmError::Payload {
            vcpu: Some(i),
            source,
        })?;
        configs.push(VcpuConfig {
            index: i,
            kvm_id: v.apic_id,
            cpus: v
                .host_cpu
                .map_or_else(|| plan.floating_cpus.clone(), |c| vec![c]),
            cpuid,
            entry,
            make_runnable: irqchip,
        });
    }
    Ok(configs)
}
