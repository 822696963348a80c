//! Attaching the plan's virtio devices to a KVM VM: for every slot of
//! [`vmhost_plan::devices::DevicePlan`], the host side is prepared
//! ([`vmhost_devices::host::HostDevices`]), the device's interrupt eventfd becomes an irqfd on
//! the slot's GSI, each queue's `QueueNotify` write becomes an ioeventfd (the queue index as
//! data match) that the I/O thread serves, and the transport goes on the MMIO bus at the
//! slot's base for the vCPUs' register accesses.
//!
//! A Linux guest gets its devices here ([`crate::linux`]); the MMIO exit handler consults
//! [`VirtioAttachment::mmio_read`]/[`VirtioAttachment::mmio_write`] through
//! [`crate::devices::LinuxDevices`], and the kernel learns the slots from the DSDT's
//! `LNRO0005` devices (or, with `boot.virtio_announce = "cmdline"`, from
//! `virtio_mmio.device=` on its command line; see `vmhost_plan::Plan::virtio_cmdline`).

use std::path::Path;
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::GuestMemoryMmap;
use vmhost_devices::bus::{BusError, MmioBus};
use vmhost_devices::host::{HostDevices, HostError};
use vmhost_devices::mmio::QUEUE_NOTIFY_OFFSET;
use vmhost_devices::worker::{IoSource, IoThread, WorkerError};
use vmhost_devices::{Interrupt, MmioError, MmioTransport};
use vmhost_plan::devices::DevicePlan;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Name of the device I/O thread.
pub const IO_THREAD_NAME: &str = "vmhost-io";

/// Why the devices could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// The host side (images, seeds, taps) could not be made.
    #[error("VM {vm}: virtio device")]
    Host {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: HostError,
    },
    /// The plan's slots and the prepared devices disagree (a bug).
    #[error("VM {vm}: {slots} virtio slots for {devices} devices")]
    Mismatch {
        /// VM name.
        vm: String,
        /// Slots in the plan.
        slots: usize,
        /// Devices prepared.
        devices: usize,
    },
    /// An eventfd could not be created.
    #[error("cannot create an eventfd for the virtio device at {base:#x}")]
    EventFd {
        /// The slot's base.
        base: u64,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// KVM refused an irqfd or ioeventfd.
    #[error("{op} for the virtio device at {base:#x} failed")]
    Kvm {
        /// `KVM_IRQFD` or `KVM_IOEVENTFD`.
        op: &'static str,
        /// The slot's base.
        base: u64,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The transport could not be built.
    #[error("virtio device at {base:#x}")]
    Transport {
        /// The slot's base.
        base: u64,
        /// The cause.
        #[source]
        source: MmioError,
    },
    /// Two windows overlap (a bug in the plan).
    #[error("virtio bus")]
    Bus(#[source] BusError),
    /// The I/O thread could not start.
    #[error("virtio I/O thread")]
    Io(#[source] WorkerError),
}

/// The attached devices of one VM; dropping it stops the I/O thread and removes the run's
/// scratch files.
#[derive(Debug)]
pub struct VirtioAttachment {
    bus: MmioBus,
    // Field order is drop order: the thread stops before the run's files go.
    io: Option<IoThread>,
    describe: Vec<String>,
    // Held for its scratch files (removed on drop); a Mutex so the attachment is Sync.
    _host: Mutex<HostDevices>,
}

impl VirtioAttachment {
    /// A guest read in the virtio windows; false if `gpa` is not in one.
    pub fn mmio_read(&self, gpa: u64, data: &mut [u8]) -> bool {
        self.bus.read(gpa, data)
    }

    /// A guest write in the virtio windows; false if `gpa` is not in one.
    pub fn mmio_write(&self, gpa: u64, data: &[u8]) -> bool {
        self.bus.write(gpa, data)
    }

    /// The I/O thread (to pin it and list it in the placement view).
    pub fn io_thread(&self) -> Option<&std::thread::Thread> {
        self.io.as_ref().and_then(IoThread::thread)
    }

    /// One line per device for the operator.
    pub fn describe(&self) -> Vec<String> {
        self.describe.clone()
    }
}

/// Attaches `plan`'s devices of VM `vm` to `fd` over guest memory `mem`; scratch images go to
/// `run_dir`; the I/O thread is pinned to `io_cpus` (none: it keeps the caller's affinity).
/// The VM needs an in-kernel irqchip (irqfds).
pub fn attach(
    fd: &VmFd,
    plan: &DevicePlan,
    vm: &str,
    mem: &GuestMemoryMmap,
    run_dir: &Path,
    io_cpus: &[u32],
) -> Result<VirtioAttachment, VirtioError> {
    let mut host =
        HostDevices::prepare(&plan.spec, vm, run_dir).map_err(|source| VirtioError::Host {
            vm: vm.to_string(),
            source,
        })?;
    if host.devices.len() != plan.slots.len() {
        return Err(VirtioError::Mismatch {
            vm: vm.to_string(),
            slots: plan.slots.len(),
            devices: host.devices.len(),
        });
    }
    let prepared = std::mem::take(&mut host.devices);
    let describe = prepared.iter().map(|d| d.describe.clone()).collect();
    let mut bus = MmioBus::default();
    let mut sources = Vec::new();
    for (slot, prepared) in plan.slots.iter().zip(prepared) {
        let base = slot.base;
        let evt =
            || EventFd::new(EFD_NONBLOCK).map_err(|source| VirtioError::EventFd { base, source });
        let kvm = |op| move |source| VirtioError::Kvm { op, base, source };
        let irq = evt()?;
        fd.register_irqfd(&irq, slot.gsi)
            .map_err(kvm("KVM_IRQFD"))?;
        let device = prepared.device;
        let queues = device.queue_max_sizes().len();
        let transport = MmioTransport::new(device, mem.clone(), Arc::new(Interrupt::new(irq)))
            .map_err(|source| VirtioError::Transport { base, source })?;
        let transport = Arc::new(Mutex::new(transport));
        let notify = IoEventAddress::Mmio(base + QUEUE_NOTIFY_OFFSET);
        for queue in 0..queues {
            let event = evt()?;
            let index = u32::try_from(queue).unwrap_or(u32::MAX);
            fd.register_ioevent(&event, &notify, index)
                .map_err(kvm("KVM_IOEVENTFD"))?;
            sources.push(IoSource::QueueEvent {
                transport: transport.clone(),
                queue,
                event,
            });
        }
        if let Some((fd, queue)) = prepared.backend {
            sources.push(IoSource::Backend {
                transport: transport.clone(),
                queue,
                fd,
            });
        }
        bus.insert(base, transport).map_err(VirtioError::Bus)?;
    }
    let io = if sources.is_empty() {
        None
    } else {
        let cpus = io_cpus.to_vec();
        let pin = move || {
            if !cpus.is_empty() {
                if let Err(e) = crate::sys::pin_current_thread(&cpus) {
                    tracing::warn!(error = %e, ?cpus, "cannot pin the virtio I/O thread");
                }
            }
        };
        let io = IoThread::spawn_with(IO_THREAD_NAME, sources, pin).map_err(VirtioError::Io)?;
        Some(io)
    };
    Ok(VirtioAttachment {
        bus,
        io,
        describe,
        _host: Mutex::new(host),
    })
}

#[cfg(test)]
#[path = "virtio_tests.rs"]
mod tests;
