//! The state of a Linux guest's devices that moves with the VM (snapshot/restore, live
//! migration): [`LinuxDevices::save`] gathers COM1's, the legacy ports' and every virtio
//! device's state into one [`DevicesState`] (vmhost-devices' aggregate, serde data);
//! [`LinuxDevices::restore`] builds the devices for a restored VM from the plan, as a fresh
//! start does, and applies it.
//!
//! Order on the source: the VM is paused (no vCPU in `KVM_RUN`), then `save` quiesces the
//! device I/O threads (each completes the requests it has and parks; the wait is bounded by
//! `vmhost_devices::worker::STOP_WAIT` per thread) and leaves them parked, so neither the
//! devices nor guest RAM change until [`LinuxDevices::resume_io`] (the VM runs on here) or
//! the VM ends. Order on the target: `vmhost_devices::persist::check_restorable` before any
//! memory moves; then, with guest RAM loaded, `restore` (the devices' state is applied
//! before any I/O thread starts), then the VM's irqchip state, then
//! [`LinuxDevices::resume_restored`] (each queue served once), then the vCPUs are created and
//! loaded, then [`LinuxDevices::raise_restored_interrupts`] (pending interrupts raised again),
//! then the guest runs.

use std::path::Path;

use kvm_ioctls::VmFd;
use vmhost_devices::persist::DevicesState;
use vmhost_devices::PersistError;
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::Plan;

use super::ioapic::UserIoapic;
use super::serial::{SerialConsole, SerialOut, COM1_GSI};
use super::LinuxDevices;
use crate::control::lock;
use crate::virtio::VirtioError;
use vmhost_config::Irqchip;

/// Why the devices of a restored VM could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// COM1 could not be created.
    #[error("cannot create COM1")]
    Serial(#[source] std::io::Error),
    /// KVM refused COM1's irqfd.
    #[error("KVM_IRQFD for COM1 (GSI {COM1_GSI}) failed")]
    SerialIrq(#[source] kvm_ioctls::Error),
    /// The virtio devices could not be built or their state applied.
    #[error("VM {vm}: virtio devices")]
    Virtio {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: Box<VirtioError>,
    },
    /// The saved I/O APIC could not be restored.
    #[error("the user-space I/O APIC")]
    Ioapic(#[source] super::ioapic::IoapicError),
    /// The saved state and the plan disagree on the irqchip.
    #[error(
        "VM {vm}: the spec's boot.irqchip is {irqchip:?} but the saved devices {} a user-space \
         I/O APIC; restore with the spec the VM ran with",
        if *saved_ioapic { "hold" } else { "hold no" }
    )]
    Irqchip {
        /// VM name.
        vm: String,
        /// The plan's.
        irqchip: Irqchip,
        /// Whether the saved state has an I/O APIC.
        saved_ioapic: bool,
    },
    /// The saved state of COM1 or the legacy ports does not apply.
    #[error("VM {vm}: device state")]
    State {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: PersistError,
    },
}

impl LinuxDevices {
    /// Every device's state, with the device I/O threads quiesced and left parked (see the
    /// module docs). The VM must be paused.
    pub fn save(&self) -> Result<DevicesState, PersistError> {
        let virtio = match &self.virtio {
            Some(v) => v.save()?,
            None => Vec::new(),
        };
        Ok(DevicesState {
            virtio,
            serial: Some(self.serial.save()),
            legacy: Some(lock(&self.legacy).save()),
            ioapic: self.ioapic.as_ref().map(UserIoapic::save),
        })
    }

    /// Lets the device I/O threads run again after [`LinuxDevices::save`] (the VM resumes on
    /// this host).
    pub fn resume_io(&self) {
        if let Some(v) = &self.virtio {
            v.resume_io();
        }
    }

    /// The devices of a restored VM: COM1 (its irqfd on GSI 4, output to `serial_out` or
    /// stdout) and the legacy ports with their saved state, and `plan`'s virtio devices
    /// (run-time files in `run_dir`) with theirs. Guest RAM `mem` must hold the saved memory.
    pub fn restore(
        fd: &VmFd,
        plan: &Plan,
        mem: &GuestMemoryMmap,
        serial_out: Option<SerialOut>,
        run_dir: &Path,
        saved: &DevicesState,
    ) -> Result<Self, RestoreError> {
        let state = |source| RestoreError::State {
            vm: plan.name.clone(),
            source,
        };
        let serial = SerialConsole::new(serial_out).map_err(RestoreError::Serial)?;
        fd.register_irqfd(serial.irq_fd(), COM1_GSI)
            .map_err(RestoreError::SerialIrq)?;
        if let Some(uart) = &saved.serial {
            serial.restore(uart).map_err(state)?;
        }
        let mut devices = LinuxDevices::new(serial);
        match (plan.irqchip(), &saved.ioapic) {
            (Irqchip::Kernel, None) => {}
            (Irqchip::Split, Some(chip)) => {
                let ioapic = UserIoapic::restore(fd, chip).map_err(RestoreError::Ioapic)?;
                devices = devices.with_ioapic(ioapic);
            }
            (irqchip, chip) => {
                return Err(RestoreError::Irqchip {
                    vm: plan.name.clone(),
                    irqchip,
                    saved_ioapic: chip.is_some(),
                })
            }
        }
        if let Some(legacy) = &saved.legacy {
            lock(&devices.legacy).restore(legacy);
        }
        if plan.devices.is_empty() && saved.virtio.is_empty() {
            return Ok(devices);
        }
        let virtio = crate::virtio::attach_restored(
            fd,
            &plan.devices,
            crate::virtio::Transport::of(plan),
            &plan.name,
            mem,
            run_dir,
            &saved.virtio,
        )
        .map_err(|source| RestoreError::Virtio {
            vm: plan.name.clone(),
            source: Box::new(source),
        })?;
        Ok(devices.with_virtio(virtio))
    }

    /// After [`LinuxDevices::restore`] and the VM's irqchip state, before the vCPUs run: each
    /// virtio queue is served once.
    pub fn resume_restored(&self) {
        if let Some(v) = &self.virtio {
            v.resume_restored();
        }
    }

    /// Once every vCPU of a restored guest and its LAPIC exist (before the guest runs): raises
    /// COM1's pending interrupt again ([`SerialConsole::raise_pending`]) and every virtio
    /// device's ([`crate::virtio::VirtioAttachment::raise_restored_interrupts`]). Returns how
    /// many it raised.
    pub(crate) fn raise_restored_interrupts(&self) -> usize {
        let virtio = self
            .virtio
            .as_ref()
            .map_or(0, |v| v.raise_restored_interrupts());
        usize::from(self.serial.raise_pending()) + virtio
    }
}
