//! Preparing a Linux guest (`[boot] kernel = ...`): ACPI tables built from the plan and
//! written at [`vmhost_boot::ACPI_START`], the kernel, initramfs and command line loaded by
//! [`vmhost_boot::load_linux`], all checked before KVM is opened; then the KVM VM with the
//! in-kernel irqchip and PIT (or a split irqchip: KVM's LAPICs and vmhost's I/O APIC), RAM
//! memslots, COM1 with its irqfd on GSI 4, the plan's virtio
//! devices ([`crate::virtio`]), and per-vCPU CPUID.
//!
//! The vCPU whose APIC ID is 0 (KVM's boot processor) starts at the kernel's entry with
//! [`vmhost_boot::LinuxBoot::cpu_state`] (PVH for Debian's vmlinux); every other vCPU stays in
//! KVM's wait-for-INIT/SIPI state, and Linux brings it up. See [`crate::exits`] for what
//! ends the guest.

use std::path::Path;
use std::sync::Arc;

use kvm_bindings::CpuId;
use kvm_ioctls::{Kvm, VmFd};
use vmhost_boot::{build_acpi, load_linux, LinuxBoot, ACPI_START};
use vmhost_plan::Plan;

use crate::devices::ioapic::UserIoapic;
use crate::devices::serial::{SerialConsole, COM1_GSI};
use crate::devices::LinuxDevices;
use crate::persist::DevicesState;
use crate::setup::{create_irqchip, open_vm, register_memslots, vcpu_cpuids, vcpu_cpus, vcpu_fifo};
use crate::vcpu::{VcpuConfig, VcpuStart};
use crate::vm::{kvm_err, Guest, GuestRam, Prepared, VmError, VmOptions};
use vmhost_config::Irqchip;

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
    create_irqchip(&fd, plan.irqchip())?;
    let devices = linux_devices(&fd, plan, ram, options)?;
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

/// A fresh Linux guest's devices on `fd`: COM1 with its irqfd on GSI 4, the user-space I/O
/// APIC of a split irqchip, and the plan's virtio devices.
fn linux_devices(
    fd: &VmFd,
    plan: &Plan,
    ram: &dyn GuestRam,
    options: &VmOptions,
) -> Result<LinuxDevices, VmError> {
    let vm = || plan.name.clone();
    let serial = SerialConsole::new(options.serial_out.clone()).map_err(VmError::Serial)?;
    fd.register_irqfd(serial.irq_fd(), COM1_GSI)
        .map_err(kvm_err("KVM_IRQFD"))?;
    let mut devices = LinuxDevices::new(serial);
    if plan.irqchip() == Irqchip::Split {
        let ioapic = UserIoapic::new(fd).map_err(|source| VmError::Ioapic { vm: vm(), source })?;
        devices = devices.with_ioapic(ioapic);
    }
    if !plan.devices.is_empty() {
        let dir = options
            .device_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir);
        let transport = crate::virtio::Transport::of(plan);
        let virtio = crate::virtio::attach(
            fd,
            &plan.devices,
            transport,
            &plan.name,
            ram.guest_memory(),
            &dir,
        )
        .map_err(|source| VmError::Virtio {
            vm: vm(),
            source: Box::new(source),
        })?;
        for line in virtio.describe() {
            tracing::info!("{line}");
        }
        devices = devices.with_virtio(virtio);
    }
    Ok(devices)
}

/// The part of a restored Linux guest's VM that its saved state does not change: the KVM VM,
/// the RAM memslots, the in-kernel irqchip and PIT, and every vCPU's CPUID.
pub(crate) struct LinuxShell {
    kvm: Kvm,
    fd: VmFd,
    cpuids: Vec<CpuId>,
}

impl LinuxShell {
    /// Builds it over `ram` (`nested`: CPUID masked for an emulated ring 0).
    pub(crate) fn build(plan: &Plan, ram: &dyn GuestRam, nested: bool) -> Result<Self, VmError> {
        let (kvm, fd) = open_vm(plan)?;
        register_memslots(&fd, ram.guest_memory(), None)?;
        create_irqchip(&fd, plan.irqchip())?;
        let cpuids = vcpu_cpuids(&kvm, plan, nested)?;
        Ok(LinuxShell { kvm, fd, cpuids })
    }
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
    let LinuxShell { kvm, fd, cpuids } = match shell {
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
