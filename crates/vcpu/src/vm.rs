//! The VM: what it boots (a built-in payload or a Linux kernel), its KVM file descriptors, guest
//! RAM and devices, and [`Vm::run`], which hands everything to the emulator thread. Building it
//! is in the `setup` (payloads) and `linux` (kernels) modules; every input is checked
//! there, before any thread starts.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvm_ioctls::{Kvm, VmFd};
use vmhost_boot::LinuxBoot;
use vmhost_config::BootSpec;
use vmhost_memory::GuestLayout;
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::Plan;

use crate::arch::{BootError, BootLayout, CpuidError};
use crate::control::{Control, StopHandle, VmHandle};
use crate::devices::console::{ConsoleInput, ConsoleReader};
use crate::devices::serial::SerialOut;
use crate::devices::LinuxDevices;
use crate::dirty::DirtyLog;
use crate::emulator::{self, EmulatorInput, RunGuest, VcpuMeta};
use crate::linux::{image_name, prepare_linux, KernelSpec};
use crate::payload::bench::BenchOptions;
use crate::payload::{PayloadError, PayloadKind};
use crate::persist::{PersistError, VcpuStateLayout};
use crate::report::RunReport;
use crate::setup::prepare_payload;
use crate::snapshot::Source;
use crate::vcpu::{GuestCtx, UnknownAccessPolicy, VcpuConfig, VcpuContext, VcpuError};

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
    /// What to do on an access to an unknown port or unmapped guest-physical memory (default
    /// `Auto`: stop for payloads, ignore and log once per port for Linux guests).
    pub unknown_access: UnknownAccessPolicy,
    /// Clear the CPUID features an emulated ring 0 cannot run (`cx16`, XSAVE, AVX, ...; see
    /// [`crate::arch::mask_for_nested_emulation`]): for kernels on a nested host whose KVM
    /// emulates guest ring 0 instruction by instruction. Off by default.
    pub mask_for_nested_emulation: bool,
    /// Where a Linux guest's serial output goes (`None`: this process's stdout).
    pub serial_out: Option<SerialOut>,
    /// Where a Linux guest's serial input comes from (default: stdin when it is a terminal
    /// and the output goes to stdout).
    pub console_input: ConsoleInput,
    /// numa-bench sizes.
    pub bench: BenchOptions,
    /// Run this payload instead of the plan's (test payloads).
    #[doc(hidden)]
    pub payload_override: Option<PayloadKind>,
    /// Called on the emulator thread once every vCPU thread is pinned and configured, just
    /// before the guest starts, with the thread placement read back from `/proc`.
    pub on_start: Option<StartHook>,
    /// Where a Linux guest's scratch images go (empty disks, cloud-init seeds; removed at
    /// stop). Default: the system's temporary directory.
    pub device_dir: Option<std::path::PathBuf>,
    /// Install the VMM thread's syscall filter ([`vmhost_seccomp::ThreadKind::Vmm`]) on the
    /// thread that calls [`Vm::run`], once the emulator thread has installed its own (every
    /// vCPU thread has by then): what the calling thread does from then on is wait, tear the VM
    /// down and report. Off by default (a library caller's thread is its own); the `vmhost`
    /// binary sets it.
    pub filter_calling_thread: bool,
    /// The handle the VM is to answer through, made before it is built
    /// ([`VmHandle::unbuilt`]): a control API served while guest memory is still being
    /// filled sees the VM as `Created` and, once built, controls it. Its vCPU count must be
    /// the plan's. `None`: the VM makes its own.
    pub handle: Option<crate::control::VmHandle>,
    /// Work for the thread that calls [`Vm::run`] once the guest runs: what must happen but
    /// need not hold the guest back (a migration target's ledger hand-over and report). Run
    /// before that thread's own filter ([`VmOptions::filter_calling_thread`]), also when the
    /// run ended before the guest started (its argument is then false).
    pub after_start: Option<AfterStart>,
}

/// The work of [`VmOptions::after_start`], set up to the moment [`Vm::run`] takes it: the
/// caller may fill it after the VM is built.
#[derive(Clone, Default)]
pub struct AfterStart(Arc<Mutex<Option<Box<AfterStartFn>>>>);

/// What [`AfterStart`] runs: its argument tells whether the guest started.
pub type AfterStartFn = dyn FnOnce(bool) + Send;

impl AfterStart {
    /// Sets the work (replacing any set before).
    pub fn set(&self, work: Box<AfterStartFn>) {
        *crate::control::lock(&self.0) = Some(work);
    }

    /// Runs the work set, if any, once.
    fn run(&self, started: bool) {
        let work = crate::control::lock(&self.0).take();
        if let Some(work) = work {
            work(started);
        }
    }
}

impl std::fmt::Debug for AfterStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterStart(..)")
    }
}

/// The function a [`StartHook`] calls: the threads' placement read back from `/proc`, and
/// when each step of the start ended.
pub type StartFn = dyn Fn(&[crate::ThreadPlacement], &StartSteps) + Send + Sync;

/// When the emulator thread ended each step of a VM's start, before the guest's release (what
/// a migration target's pause is made of).
#[derive(Debug, Clone, Copy)]
pub struct StartSteps {
    /// The emulator thread runs, pinned.
    pub emulator: std::time::Instant,
    /// Every vCPU thread is spawned.
    pub spawned: std::time::Instant,
    /// Every vCPU thread is pinned and the threads' placement is read back (while the vCPUs
    /// are created and given their state).
    pub placed: std::time::Instant,
    /// Every vCPU is created, given its state (booted or restored) and filtered; the
    /// restored interrupts are raised again.
    pub set_up: std::time::Instant,
}

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
    /// The ACPI tables cannot be built from the plan.
    #[error("VM {vm}: cannot build the guest's ACPI tables")]
    Acpi {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: vmhost_boot::AcpiError,
    },
    /// The kernel, initramfs or command line is unusable, or does not fit guest RAM.
    #[error("VM {vm}: cannot load the guest kernel")]
    Kernel {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: vmhost_boot::BootError,
    },
    /// No vCPU has APIC ID 0, KVM's boot processor.
    #[error("VM {vm}: no vCPU has APIC ID 0 to boot the kernel on")]
    NoBootVcpu {
        /// VM name.
        vm: String,
    },
    /// The serial port's interrupt eventfd could not be created.
    #[error("cannot create the serial port's interrupt eventfd")]
    Serial(#[source] std::io::Error),
    /// The user-space I/O APIC of a split irqchip could not be set up.
    #[error("VM {vm}: the I/O APIC (boot.irqchip = \"split\")")]
    Ioapic {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: crate::devices::ioapic::IoapicError,
    },
    /// The console input thread could not be started.
    #[error("cannot start the console input thread")]
    ConsoleInput(#[source] std::io::Error),
    /// The plan has no vCPUs.
    #[error("VM {vm}: the plan has no vCPUs")]
    NoVcpus {
        /// VM name.
        vm: String,
    },
    /// [`VmOptions::handle`] was made for another number of vCPUs than the plan has.
    #[error("VM {vm}: the handle made before the VM has {handle} vCPUs, the plan {plan}")]
    HandleMismatch {
        /// VM name.
        vm: String,
        /// The handle's vCPUs.
        handle: usize,
        /// The plan's vCPUs.
        plan: usize,
    },
    /// The virtio devices could not be attached.
    #[error("VM {vm}: cannot attach the virtio devices")]
    Virtio {
        /// VM name.
        vm: String,
        /// The cause (boxed: it is large and rare).
        #[source]
        source: Box<crate::virtio::VirtioError>,
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
    /// Probing, reading or loading saved KVM state failed.
    #[error("{}the saved state cannot be loaded", .vcpu.map(|v| format!("vCPU {v}: ")).unwrap_or_default())]
    State {
        /// The vCPU, when one is concerned.
        vcpu: Option<usize>,
        /// The cause.
        #[source]
        source: PersistError,
    },
    /// A saved VM does not fit the plan it is restored with: another guest topology or guest.
    #[error(
        "VM {vm}: {what}: the saved VM has {saved}, the plan {planned}; restore with the spec \
         the snapshot was taken with"
    )]
    RestoreMismatch {
        /// VM name.
        vm: String,
        /// What differs (e.g. "vCPUs", "vCPU 1 APIC ID", "guest").
        what: String,
        /// The saved value.
        saved: String,
        /// The plan's value.
        planned: String,
    },
    /// A restored Linux guest's devices could not be rebuilt with their saved state.
    #[error("VM {vm}: cannot restore the devices")]
    RestoreDevices {
        /// VM name.
        vm: String,
        /// The cause (boxed: it is large and rare).
        #[source]
        source: Box<crate::devices::RestoreError>,
    },
    /// This kind of guest cannot be restored yet.
    #[error("VM {vm}: cannot restore {what}")]
    RestoreUnsupported {
        /// VM name.
        vm: String,
        /// What and why.
        what: String,
    },
}

pub(crate) fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// What a VM boots, with what its vCPU threads need of it.
pub(crate) enum Guest {
    /// A built-in payload on the boot area.
    Payload {
        kind: PayloadKind,
        boot: Arc<BootLayout>,
        boot_mem: GuestMemoryMmap,
        /// Guest cells in benchmark order.
        bench_cells: Vec<u32>,
    },
    /// A Linux kernel and its devices.
    Linux {
        /// Where the kernel was loaded; `None` for a restored guest (no kernel was loaded).
        boot: Option<Box<LinuxBoot>>,
        devices: Arc<LinuxDevices>,
    },
}

/// A VM built but not yet wrapped: what [`crate::setup`] and [`crate::linux`] return.
pub(crate) struct Prepared {
    pub kvm: Kvm,
    pub fd: VmFd,
    pub guest: Guest,
    pub configs: Vec<VcpuConfig>,
}

/// A KVM VM ready to run a plan's payload or kernel.
pub struct Vm {
    // Field order is drop order: the VM fd closes before the memory it maps goes away.
    fd: Arc<VmFd>,
    _kvm: Kvm,
    /// The dirty page log; it holds a clone of the RAM, so the `Vm` owns it.
    _dirty: Arc<DirtyLog>,
    name: String,
    guest: Guest,
    configs: Option<Vec<VcpuConfig>>,
    meta: Vec<VcpuMeta>,
    emulator_cpus: Vec<u32>,
    control: Arc<Control>,
    layout: Arc<VcpuStateLayout>,
    policy: UnknownAccessPolicy,
    on_start: Option<StartHook>,
    filter_calling_thread: bool,
    after_start: Option<AfterStart>,
    console_input: ConsoleInput,
    setup_seconds: f64,
    ram: Box<dyn GuestRam>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("name", &self.name)
            .field("payload", &self.payload())
            .field("vcpus", &self.meta.len())
            .finish()
    }
}

impl Vm {
    /// Creates the VM of `plan` on `ram`. For a built-in payload: KVM VM, memslots,
    /// irqchip/PIT when the payload needs them, boot area, payload code and parameters,
    /// per-vCPU CPUID. For a kernel (`plan.boot` is [`BootSpec::Kernel`]): ACPI tables, kernel,
    /// initramfs and command line in guest RAM (bad input fails here, before KVM is opened),
    /// then KVM VM, irqchip and PIT, memslots, COM1 and per-vCPU CPUID. No thread starts yet.
    pub fn new(plan: &Plan, ram: impl GuestRam, options: VmOptions) -> Result<Vm, VmError> {
        let t0 = Instant::now();
        if plan.vcpus.is_empty() {
            return Err(VmError::NoVcpus {
                vm: plan.name.clone(),
            });
        }
        let prepared = match (&options.payload_override, &plan.boot) {
            (
                None,
                BootSpec::Kernel {
                    kernel,
                    initrd,
                    cmdline,
                    ..
                },
            ) => {
                let spec = KernelSpec {
                    kernel,
                    initrd: initrd.as_deref(),
                    cmdline,
                };
                prepare_linux(plan, &ram, &options, &spec)?
            }
            (Some(kind), _) => prepare_payload(plan, &ram, &options, *kind)?,
            (None, BootSpec::Payload { payload }) => {
                prepare_payload(plan, &ram, &options, crate::payload::kind_of(*payload))?
            }
        };
        Vm::from_prepared(plan, prepared, ram, &options, t0)
    }

    /// Wraps a prepared VM (from [`Vm::new`] or [`Vm::restore`]): probes what its vCPUs save,
    /// records what a capture reads, and keeps `ram` alive as long as the VM.
    pub(crate) fn from_prepared(
        plan: &Plan,
        prepared: Prepared,
        ram: impl GuestRam,
        options: &VmOptions,
        t0: Instant,
    ) -> Result<Vm, VmError> {
        let linux = matches!(prepared.guest, Guest::Linux { .. });
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
        let console_input = match options.serial_out {
            Some(_) => ConsoleInput::None,
            None => options.console_input,
        };
        let layout = VcpuStateLayout::probe(&prepared.kvm, &prepared.fd)
            .map_err(|source| VmError::State { vcpu: None, source })?;
        let fd = Arc::new(prepared.fd);
        let control = match &options.handle {
            Some(h) if h.0.vcpus() == plan.vcpus.len() => Arc::clone(&h.0),
            Some(h) => {
                return Err(VmError::HandleMismatch {
                    vm: plan.name.clone(),
                    handle: h.0.vcpus(),
                    plan: plan.vcpus.len(),
                })
            }
            None => Arc::new(Control::new(plan.vcpus.len())),
        };
        if linux {
            control.set_power_button(&fd);
        }
        *crate::control::lock(&control.snapshot) = Some(Source::new(&fd, &prepared.guest));
        let dirty = crate::dirty::attach(plan, &fd, &ram, linux, &control);
        Ok(Vm {
            fd,
            _kvm: prepared.kvm,
            _dirty: dirty,
            name: plan.name.clone(),
            guest: prepared.guest,
            configs: Some(prepared.configs),
            meta,
            emulator_cpus: plan.emulator.host_cpus.clone(),
            control,
            layout: Arc::new(layout),
            policy: options.unknown_access.resolve(linux),
            on_start: options.on_start.clone(),
            filter_calling_thread: options.filter_calling_thread,
            after_start: options.after_start.clone(),
            console_input,
            setup_seconds: t0.elapsed().as_secs_f64(),
            ram: Box::new(ram),
        })
    }

    /// A handle that stops the VM from another thread (SIGINT/SIGTERM handling).
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.control))
    }

    /// A handle that stops, pauses and resumes the VM and reports its state and vCPU threads
    /// from another thread while [`Vm::run`] blocks.
    pub fn handle(&self) -> VmHandle {
        VmHandle(Arc::clone(&self.control))
    }

    /// The payload this VM runs (`None`: a Linux kernel).
    pub fn payload(&self) -> Option<PayloadKind> {
        match &self.guest {
            Guest::Payload { kind, .. } => Some(*kind),
            Guest::Linux { .. } => None,
        }
    }

    /// Where the kernel, initramfs and boot parameters were loaded (`None`: a payload, or a
    /// restored guest).
    pub fn linux_boot(&self) -> Option<&LinuxBoot> {
        match &self.guest {
            Guest::Linux { boot, .. } => boot.as_deref(),
            Guest::Payload { .. } => None,
        }
    }

    /// The unknown-access policy in force (`Auto` resolved).
    pub fn unknown_access(&self) -> UnknownAccessPolicy {
        self.policy
    }

    /// The guest RAM (for checks after the run).
    pub fn ram(&self) -> &dyn GuestRam {
        self.ram.as_ref()
    }

    /// A payload's VMM-owned boot area (page tables, descriptor tables, code, mailboxes):
    /// reserved guest-physical space in the MMIO hole, never RAM. `None` for a Linux guest.
    pub fn boot_area(&self) -> Option<Range<u64>> {
        match &self.guest {
            Guest::Payload { boot, .. } => Some(boot.range()),
            Guest::Linux { .. } => None,
        }
    }

    /// Runs the guest to its end: starts the `vmhost-emu` thread, which starts one pinned
    /// `vcpu<N>` thread per vCPU, and returns when every thread has been joined. Guest failures
    /// are in the report ([`crate::RunStatus::GuestFailed`]), not errors; so are a Linux
    /// guest's power-off and reboot. A VM runs once.
    pub fn run(&mut self) -> Result<RunReport, VmError> {
        let configs = self.configs.take().ok_or(VmError::AlreadyRun)?;
        let run_start = Instant::now();
        let (events, rx, gate) = emulator::channel();
        let (guest, ctx_guest, devices) = self.run_guest();
        let (filtered, emulator_filtered) = std::sync::mpsc::channel();
        let input = EmulatorInput {
            vm_name: self.name.clone(),
            guest,
            emulator_cpus: self.emulator_cpus.clone(),
            configs,
            meta: self.meta.clone(),
            ctx: VcpuContext {
                vm: Arc::clone(&self.fd),
                guest: ctx_guest,
                control: Arc::clone(&self.control),
                gate,
                events,
                policy: self.policy,
                layout: Arc::clone(&self.layout),
            },
            run_start,
            vm_setup_seconds: self.setup_seconds,
            on_start: self.on_start.clone(),
            filtered,
        };
        let console = match &devices {
            Some(d) => ConsoleReader::start(self.console_input, d.serial())
                .map_err(VmError::ConsoleInput)?,
            None => None,
        };
        let emu = std::thread::Builder::new()
            .name("vmhost-emu".into())
            .spawn(move || emulator::run(input, rx));
        if emu.is_ok() && (self.filter_calling_thread || self.after_start.is_some()) {
            // The emulator thread sends once the gate is open and its filter installed; the
            // sender is dropped unsent when the run ends before.
            let started = emulator_filtered.recv().is_ok();
            if let Some(work) = self.after_start.take() {
                work.run(started);
            }
            // After the emulator and vCPU threads have their own filters: a thread starts with
            // its creator's filter, and theirs would otherwise hold this one too.
            if self.filter_calling_thread {
                vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Vmm);
            }
        }
        let result = match emu {
            Ok(t) => t.join().map_err(|_| VmError::EmulatorPanicked),
            Err(e) => Err(VmError::SpawnEmulator(e)),
        };
        if let Some(c) = console {
            c.finish();
        }
        if let Some(d) = &devices {
            flush_serial(d);
        }
        self.control.mark_ended();
        result?
    }

    /// What the emulator thread and the vCPU threads need of the guest.
    fn run_guest(&self) -> (RunGuest, GuestCtx, Option<Arc<LinuxDevices>>) {
        match &self.guest {
            Guest::Payload {
                kind,
                boot,
                boot_mem,
                bench_cells,
            } => (
                RunGuest::Payload {
                    kind: *kind,
                    bench_cells: bench_cells.clone(),
                },
                GuestCtx::Payload {
                    boot: Arc::clone(boot),
                    boot_mem: boot_mem.clone(),
                },
                None,
            ),
            Guest::Linux { boot, devices } => (
                RunGuest::Linux {
                    entry: boot
                        .as_ref()
                        .map_or(crate::report::LinuxEntry::Restored, |b| b.mode.into()),
                    image: boot.as_deref().map_or("restored", image_name).to_string(),
                    serial: devices.serial().stats(),
                    marks: Arc::clone(devices.marks()),
                },
                GuestCtx::Linux {
                    devices: Arc::clone(devices),
                    ram: self.ram.guest_memory().clone(),
                },
                Some(Arc::clone(devices)),
            ),
        }
    }
}

/// Lets the guest's last serial output reach the writer (bounded: a writer nobody reads does
/// not hold up the end of the run) and reports bytes that were dropped.
fn flush_serial(devices: &LinuxDevices) {
    let serial = devices.serial();
    if !serial.sync_output(crate::devices::serial::FLUSH_TIMEOUT) {
        tracing::warn!("the serial output is not being read; its last bytes may be lost");
    }
    let dropped = serial.stats().dropped();
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "serial output bytes dropped: nobody read them in time"
        );
    }
}
