//! Preparing a Linux guest (`[boot] kernel = ...`): ACPI tables built from the plan and
//! written at [`vmhost_boot::ACPI_START`], the kernel, initramfs and command line loaded by
//! [`vmhost_boot::load_linux`], all checked before KVM is opened; then the KVM VM with the
//! in-kernel irqchip and PIT, RAM memslots, COM1 with its irqfd on GSI 4, the plan's virtio
//! devices ([`crate::virtio`]), and per-vCPU CPUID.
//!
//! The vCPU whose APIC ID is 0 (KVM's boot processor) starts at the kernel's entry with
//! [`vmhost_boot::LinuxBoot::cpu_state`] (PVH for Debian's vmlinux); every other vCPU stays in
//! KVM's wait-for-INIT/SIPI state, and Linux brings it up. See [`crate::exits`] for what
//! ends the guest.

use std::path::Path;
use std::sync::Arc;

use kvm_bindings::CpuId;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vmhost_boot::{build_acpi, load_linux, LinuxBoot, ACPI_START};
use vmhost_plan::Plan;

use crate::devices::serial::{SerialConsole, COM1_GSI};
use crate::devices::LinuxDevices;
use crate::persist::DevicesState;
use crate::setup::{create_irqchip, open_vm, register_memslots, vcpu_cpuids, vcpu_cpus, vcpu_fifo};
use crate::vcpu::{VcpuConfig, VcpuError, VcpuStart};
use crate::vm::{kvm_err, Guest, GuestRam, Prepared, VmError, VmOptions};

/// What `[boot]` names for a Linux guest.
pub(crate) struct KernelSpec<'a> {
    pub kernel: &'a Path,
    pub initrd: Option<&'a Path>,
    pub cmdline: &'a str,
}

/// Loads the kernel into `ram` and prepares the VM around it.
pub(crate) fn prepare_linux(
    plan: &Plan,
    ram: &dyn GuestRam,
    options: &VmOptions,
    spec: &KernelSpec<'_>,
) -> Result<Prepared, VmError> {
    let vm = || plan.name.clone();
    let layout = ram.guest_layout();
    let acpi = build_acpi(plan, layout, ACPI_START)
        .map_err(|source| VmError::Acpi { vm: vm(), source })?;
    // The DSDT announces the virtio devices, or (`boot.virtio_announce = "cmdline"`) the
    // command line does: never both.
    let cmdline = match plan.virtio_cmdline() {
        extra if extra.is_empty() => spec.cmdline.to_string(),
        extra => format!("{} {extra}", spec.cmdline),
    };
    let boot = load_linux(
        ram.guest_memory(),
        layout,
        spec.kernel,
        spec.initrd,
        &cmdline,
        &acpi,
    )
    .map_err(|source| VmError::Kernel { vm: vm(), source })?;
    tracing::info!(
        kernel = %spec.kernel.display(),
        mode = ?boot.mode,
        entry = format_args!("{:#x}", boot.entry),
        footprint = format_args!("{:#x}..{:#x}", boot.kernel.start, boot.kernel.end),
        "kernel loaded"
    );
    let bsp = plan
        .vcpus
        .iter()
        .position(|v| v.apic_id == 0)
        .ok_or_else(|| VmError::NoBootVcpu { vm: vm() })?;

    let (kvm, fd) = open_vm(plan)?;
    register_memslots(&fd, ram.guest_memory(), None)?;
    create_irqchip(&fd)?;
    let serial = SerialConsole::new(options.serial_out.clone()).map_err(VmError::Serial)?;
    fd.register_irqfd(serial.irq_fd(), COM1_GSI)
        .map_err(kvm_err("KVM_IRQFD"))?;
    let mut devices = LinuxDevices::new(serial);
    if !plan.devices.is_empty() {
        let dir = options
            .device_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir);
        let virtio =
            crate::virtio::attach(&fd, &plan.devices, &plan.name, ram.guest_memory(), &dir)
                .map_err(|source| VmError::Virtio {
                    vm: vm(),
                    source: Box::new(source),
                })?;
        for line in virtio.describe() {
            tracing::info!("{line}");
        }
        devices = devices.with_virtio(virtio);
    }
    let cpuids = vcpu_cpuids(&kvm, plan, options.mask_for_nested_emulation)?;
    let configs = plan
        .vcpus
        .iter()
        .zip(cpuids)
        .enumerate()
        .map(|(i, (v, cpuid))| VcpuConfig {
            index: i,
            kvm_id: v.apic_id,
            cpus: vcpu_cpus(plan, v),
            fifo_priority: vcpu_fifo(plan, v),
            cpuid,
            start: if i == bsp {
                VcpuStart::LinuxBoot(Box::new(boot.cpu_state()))
            } else {
                VcpuStart::LinuxWaitForSipi
            },
            created: None,
        })
        .collect();
    Ok(Prepared {
        kvm,
        fd,
        guest: Guest::Linux {
            boot: Some(Box::new(boot)),
            devices: Arc::new(devices),
        },
        configs,
    })
}

/// The part of a restored Linux guest's VM that its saved state does not change: the KVM VM,
/// the RAM memslots, the in-kernel irqchip and PIT, every vCPU's CPUID and, when built ahead,
/// the vCPUs themselves.
pub(crate) struct LinuxShell {
    kvm: Kvm,
    fd: VmFd,
    cpuids: Vec<CpuId>,
    /// The vCPUs created ahead ([`LinuxShell::create_vcpus`]), in the plan's order; empty when
    /// each vCPU thread creates its own.
    vcpus: Vec<VcpuFd>,
}

impl LinuxShell {
    /// Builds it over `ram` (`nested`: CPUID masked for an emulated ring 0).
    pub(crate) fn build(plan: &Plan, ram: &dyn GuestRam, nested: bool) -> Result<Self, VmError> {
        let (kvm, fd) = open_vm(plan)?;
        register_memslots(&fd, ram.guest_memory(), None)?;
        create_irqchip(&fd)?;
        let cpuids = vcpu_cpuids(&kvm, plan, nested)?;
        Ok(LinuxShell {
            kvm,
            fd,
            cpuids,
            vcpus: Vec::new(),
        })
    }

    /// Creates every vCPU now (`KVM_CREATE_VCPU`), each on a short-lived thread pinned to
    /// the PUs its vCPU thread will run on, so that KVM allocates the vCPU's structures on
    /// that node, as when the vCPU thread creates it. A migration target does this while the
    /// rounds arrive: its vCPU threads then only load the state while the guest is paused.
    pub(crate) fn create_vcpus(mut self, plan: &Plan) -> Result<Self, VmError> {
        let fd = &self.fd;
        let created: Vec<Result<VcpuFd, VmError>> = std::thread::scope(|scope| {
            let threads: Vec<_> = plan
                .vcpus
                .iter()
                .enumerate()
                .map(|(vcpu, v)| {
                    let cpus = vcpu_cpus(plan, v);
                    let thread = std::thread::Builder::new()
                        .name(format!("vmhost-new{vcpu}"))
                        .spawn_scoped(scope, move || create_vcpu_on(fd, vcpu, v.apic_id, &cpus))
                        .map_err(|source| VmError::SpawnVcpu { vcpu, source });
                    (vcpu, thread)
                })
                .collect();
            threads
                .into_iter()
                .map(|(vcpu, t)| t?.join().map_err(|_| VmError::VcpuPanicked { vcpu })?)
                .collect()
        });
        self.vcpus = created.into_iter().collect::<Result<_, _>>()?;
        Ok(self)
    }
}

/// Creates vCPU `vcpu` (KVM id `kvm_id`) on this thread, pinned to `cpus` first (none: left
/// as it is).
fn create_vcpu_on(fd: &VmFd, vcpu: usize, kvm_id: u32, cpus: &[u32]) -> Result<VcpuFd, VmError> {
    let id = u32::try_from(vcpu).unwrap_or(u32::MAX);
    let failed = |source| VmError::Vcpu { vcpu, source };
    if !cpus.is_empty() {
        crate::sys::pin_current_thread(cpus).map_err(|source| {
            failed(VcpuError::Pin {
                vcpu: id,
                cpus: cpus.to_vec(),
                source,
            })
        })?;
    }
    fd.create_vcpu(u64::from(kvm_id)).map_err(|source| {
        failed(VcpuError::Kvm {
            vcpu: id,
            op: "KVM_CREATE_VCPU",
            source,
        })
    })
}

/// Prepares a restored Linux guest: no kernel is loaded (`ram` holds the saved memory); the
/// KVM VM with its irqchip and PIT, the RAM memslots ([`LinuxShell`], built now unless
/// `shell` was built ahead over the same `ram`), and COM1, the legacy ports and the plan's
/// virtio devices rebuilt with their saved state ([`LinuxDevices::restore`], before any
/// device I/O thread starts). The caller gives the vCPUs their saved states.
pub(crate) fn prepare_restored_linux(
    plan: &Plan,
    ram: &dyn GuestRam,
    options: &VmOptions,
    saved: &DevicesState,
    shell: Option<LinuxShell>,
) -> Result<Prepared, VmError> {
    let LinuxShell {
        kvm,
        fd,
        cpuids,
        vcpus,
    } = match shell {
        Some(shell) => shell,
        None => LinuxShell::build(plan, ram, options.mask_for_nested_emulation)?,
    };
    let dir = options
        .device_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir);
    let serial_out = options.serial_out.clone();
    let devices = LinuxDevices::restore(&fd, plan, ram.guest_memory(), serial_out, &dir, saved)
        .map_err(|source| VmError::RestoreDevices {
            vm: plan.name.clone(),
            source: Box::new(source),
        })?;
    let mut created = vcpus.into_iter();
    let configs = plan
        .vcpus
        .iter()
        .zip(cpuids)
        .enumerate()
        .map(|(i, (v, cpuid))| VcpuConfig {
            index: i,
            kvm_id: v.apic_id,
            cpus: vcpu_cpus(plan, v),
            fifo_priority: vcpu_fifo(plan, v),
            cpuid,
            start: VcpuStart::LinuxWaitForSipi,
            created: created.next(),
        })
        .collect();
    Ok(Prepared {
        kvm,
        fd,
        guest: Guest::Linux {
            boot: None,
            devices: Arc::new(devices),
        },
        configs,
    })
}

/// The image format's name in reports.
pub(crate) fn image_name(boot: &LinuxBoot) -> &'static str {
    match boot.format {
        vmhost_boot::KernelFormat::Elf => "elf",
        vmhost_boot::KernelFormat::BzImage => "bz_image",
    }
}
