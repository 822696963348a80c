//! Attaching the plan's virtio devices to a KVM VM: for every slot of
//! [`vmhost_plan::devices::DevicePlan`], the host side is prepared
//! ([`vmhost_devices::host::HostDevices`]), the device's interrupt eventfd becomes an irqfd on
//! the slot's GSI, each queue's `QueueNotify` write becomes an ioeventfd (the queue index as
//! data match) that the slot's planned I/O thread serves (`vmhost-io-<n>`, pinned to the
//! plan's PUs before it serves anything), and the transport goes on the MMIO bus at the
//! slot's base for the vCPUs' register accesses.
//!
//! A Linux guest gets its devices here ([`crate::linux`]); the MMIO exit handler consults
//! [`VirtioAttachment::mmio_read`]/[`VirtioAttachment::mmio_write`] through
//! [`crate::devices::LinuxDevices`], and the kernel learns the slots from the DSDT's
//! `LNRO0005` devices (or, with `boot.virtio_announce = "cmdline"`, from
//! `virtio_mmio.device=` on its command line; see `vmhost_plan::Plan::virtio_cmdline`).

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use vmhost_devices::bus::{Access, BusError, MmioBus, SharedTransport};
use vmhost_devices::host::{HostDevices, HostError, PreparedDevice};
use vmhost_devices::mmio::{INTERRUPT_ACK_OFFSET, QUEUE_NOTIFY_OFFSET};
use vmhost_devices::msix::{MsiSink, Msix};
use vmhost_devices::pci::PciRoot;
use vmhost_devices::persist::{restore_slot, save_transports, VirtioSlotState};
use vmhost_devices::virtio_pci::{self, msix_vectors, VirtioPciFront};
use vmhost_devices::worker::{IoSource, IoThread, WorkerError, STOP_WAIT};
use vmhost_devices::{Interrupt, MmioError, MmioTransport, PersistError};
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::devices::{DevicePlan, VirtioSlot};
use vmhost_plan::iothreads::IO_THREAD_PREFIX;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

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
    /// The VM's descriptor could not be duplicated for the MSI-X messages.
    #[error("cannot duplicate the VM's descriptor for the virtio-pci functions' MSI-X messages")]
    MsiFd(#[source] std::io::Error),
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
    /// An I/O thread could not be pinned to its planned PUs.
    #[error("cannot pin I/O thread {thread} to PUs {cpus:?}")]
    Pin {
        /// Thread name.
        thread: String,
        /// The planned PUs.
        cpus: Vec<u32>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An I/O thread ended before it reported that it was pinned.
    #[error("I/O thread {0} ended before it started serving")]
    NoStart(String),
    /// The saved device state does not fit the devices built here.
    #[error("restoring the virtio devices")]
    Restore(#[source] PersistError),
    /// The plan gives a device no I/O thread (a bug in the plan).
    #[error("the plan gives the virtio device at {base:#x} no I/O thread")]
    Unserved {
        /// The slot's base.
        base: u64,
    },
}

/// A running device I/O thread, as the placement view lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoThreadInfo {
    /// Thread name (`vmhost-io-<n>`).
    pub name: String,
    /// Kernel thread id.
    pub tid: i32,
    /// PUs it was pinned to (empty: it kept the VMM's affinity).
    pub cpus: Vec<u32>,
    /// Guest-physical bases of the devices it serves.
    pub device_bases: Vec<u64>,
}

/// How the devices reach the guest (`boot.virtio_announce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// virtio-mmio windows, each with a GSI (irqfd).
    Mmio,
    /// virtio-pci functions on bus 0, interrupting with MSI-X (`KVM_SIGNAL_MSI`).
    Pci,
}

impl Transport {
    /// The transport `plan` gives its devices.
    pub fn of(plan: &vmhost_plan::Plan) -> Self {
        if plan.virtio_pci() {
            Transport::Pci
        } else {
            Transport::Mmio
        }
    }
}

/// Sends a virtio-pci function's MSI-X messages into the VM with `KVM_SIGNAL_MSI`, on a
/// descriptor of its own (the I/O threads outlive no VM: the attachment is dropped first).
#[derive(Debug)]
struct KvmMsi(std::os::fd::OwnedFd);

impl MsiSink for KvmMsi {
    fn send(&self, address: u64, data: u32) -> std::io::Result<()> {
        crate::sys::signal_msi(&self.0, address, data)
    }
}

/// The attached devices of one VM; dropping it stops the I/O threads and removes the run's
/// scratch files.
#[derive(Debug)]
pub struct VirtioAttachment {
    bus: MmioBus,
    /// Bus 0 of virtio-pci functions (`None` for virtio-mmio).
    pci: Option<PciRoot>,
    // Field order is drop order: the threads stop (IoThread's Drop) before the run's files go.
    _io: Vec<IoThread>,
    // The InterruptACK ioeventfds (KVM holds its own reference; kept for the VM's life).
    _acks: Vec<EventFd>,
    io_info: Vec<IoThreadInfo>,
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

    /// A vCPU's read in the virtio windows: a device busy in a request is waited for only
    /// while `give_up` (the VM's stop flag) is false ([`MmioBus::read_or_give_up`]).
    pub fn mmio_read_or_give_up(
        &self,
        gpa: u64,
        data: &mut [u8],
        give_up: &dyn Fn() -> bool,
    ) -> Access {
        self.bus.read_or_give_up(gpa, data, give_up)
    }

    /// A vCPU's write in the virtio windows ([`MmioBus::write_or_give_up`]).
    pub fn mmio_write_or_give_up(
        &self,
        gpa: u64,
        data: &[u8],
        give_up: &dyn Fn() -> bool,
    ) -> Access {
        self.bus.write_or_give_up(gpa, data, give_up)
    }

    /// A guest `in` from a PCI configuration port; false when the VM has no PCI bus or the
    /// port is not the bus's.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) -> bool {
        self.pci.as_ref().is_some_and(|p| p.pio_read(port, data))
    }

    /// A guest `out` to a PCI configuration port; as [`VirtioAttachment::pio_read`].
    pub fn pio_write(&self, port: u16, data: &[u8]) -> bool {
        self.pci.as_ref().is_some_and(|p| p.pio_write(port, data))
    }

    /// The running I/O threads, in plan order.
    pub fn io_threads(&self) -> &[IoThreadInfo] {
        &self.io_info
    }

    /// One line per device for the operator.
    pub fn describe(&self) -> Vec<String> {
        self.describe.clone()
    }

    /// Quiesces the devices: every I/O thread completes the requests it was handed or
    /// notified of and parks ([`IoThread::pause`]); waits at most [`STOP_WAIT`] per thread
    /// (storage that does not answer fails the pause, naming the thread). All threads are
    /// asked first, then waited for.
    pub fn pause_io(&self) -> Result<(), WorkerError> {
        for t in &self._io {
            t.ask_pause();
        }
        for t in &self._io {
            t.wait_paused(STOP_WAIT)?;
        }
        Ok(())
    }

    /// Lets paused I/O threads serve their devices again (the VM runs on here: a snapshot
    /// without `--stop`, a failed migration).
    pub fn resume_io(&self) {
        for t in &self._io {
            t.resume();
        }
    }

    /// The state of every device, in slot order. Quiesces the I/O threads first
    /// ([`VirtioAttachment::pause_io`]) and leaves them paused: guest RAM and the devices must
    /// not change until the VM resumes ([`VirtioAttachment::resume_io`]) or ends.
    pub fn save(&self) -> Result<Vec<VirtioSlotState>, PersistError> {
        self.pause_io().map_err(PersistError::Quiesce)?;
        let mut slots = save_transports(self.bus.transports())?;
        for slot in &mut slots {
            slot.pci = self.bus.pci_front(slot.base).map(|f| f.save());
        }
        Ok(slots)
    }

    /// After [`attach_restored`], once the VM's interrupt controller is restored and before
    /// the vCPUs run: each device serves what its queues hold ([`MmioTransport::resume`]).
    pub fn resume_restored(&self) {
        for (_, t) in self.bus.transports() {
            t.lock().unwrap_or_else(PoisonError::into_inner).resume();
        }
    }

    /// Once every vCPU of the restored VM and its LAPIC are loaded, before the guest runs:
    /// each device with interrupt bits the driver has not acknowledged raises its line again
    /// ([`MmioTransport::raise_restored_interrupt`]). Returns how many did.
    pub fn raise_restored_interrupts(&self) -> usize {
        self.bus
            .transports()
            .filter(|(base, t)| match self.bus.pci_front(*base) {
                Some(front) => front.msix().release() > 0,
                None => t
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .raise_restored_interrupt(),
            })
            .count()
    }
}

/// Attaches `plan`'s devices of VM `vm` to `fd` over guest memory `mem`; scratch images go to
/// `run_dir`. Each device is served by its planned I/O thread, pinned to the plan's PUs; a
/// plan without I/O threads (made by hand, not by the planner) gets one thread,
/// `vmhost-io-0`, with the caller's affinity. The VM needs an in-kernel irqchip (irqfds).
pub fn attach(
    fd: &VmFd,
    plan: &DevicePlan,
    transport: Transport,
    vm: &str,
    mem: &GuestMemoryMmap,
    run_dir: &Path,
) -> Result<VirtioAttachment, VirtioError> {
    attach_with(fd, plan, transport, vm, mem, run_dir, None)
}

/// As [`attach`] for a restored VM (snapshot restore, migration target): the devices are
/// built from the plan as on a fresh start, then each slot's saved transport, queue and device
/// state (`saved`, in slot order) is applied before its I/O thread starts. A state that does
/// not fit the devices built here is refused ([`VirtioError::Restore`]) and nothing runs.
/// Call [`VirtioAttachment::resume_restored`] once the VM's irqchip state is restored, before
/// the vCPUs run.
pub fn attach_restored(
    fd: &VmFd,
    plan: &DevicePlan,
    transport: Transport,
    vm: &str,
    mem: &GuestMemoryMmap,
    run_dir: &Path,
    saved: &[VirtioSlotState],
) -> Result<VirtioAttachment, VirtioError> {
    if saved.len() != plan.slots.len() {
        return Err(VirtioError::Restore(PersistError::SlotCount {
            saved: saved.len(),
            built: plan.slots.len(),
        }));
    }
    attach_with(fd, plan, transport, vm, mem, run_dir, Some(saved))
}

fn attach_with(
    fd: &VmFd,
    plan: &DevicePlan,
    transport: Transport,
    vm: &str,
    mem: &GuestMemoryMmap,
    run_dir: &Path,
    saved: Option<&[VirtioSlotState]>,
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
    let mut per_slot = Vec::new();
    let mut acks = Vec::new();
    let sink: Option<Arc<dyn MsiSink>> = match transport {
        Transport::Mmio => None,
        Transport::Pci => Some(Arc::new(KvmMsi(
            crate::sys::dup_vm_fd(fd).map_err(VirtioError::MsiFd)?,
        ))),
    };
    let mut functions = Vec::new();
    for (index, (slot, prepared)) in plan.slots.iter().zip(prepared).enumerate() {
        let restore = saved.and_then(|s| s.get(index)).map(|s| (index, s));
        let Some(sink) = &sink else {
            let (transport, sources, ack) = attach_slot(fd, slot, prepared, mem, restore)?;
            acks.push(ack);
            per_slot.push(sources);
            bus.insert(slot.base, transport).map_err(VirtioError::Bus)?;
            continue;
        };
        let device_number = u8::try_from(index + 1).unwrap_or(u8::MAX);
        let pci = PciSlot {
            device_number,
            sink: sink.clone(),
        };
        let (transport, sources, front) = attach_pci_slot(fd, slot, pci, prepared, mem, restore)?;
        per_slot.push(sources);
        functions.push(front.function().clone());
        bus.insert_pci(slot.base, transport, front)
            .map_err(VirtioError::Bus)?;
    }
    let pci = sink.map(|_| PciRoot::new(functions));
    let (io, io_info) = spawn_io_threads(plan, per_slot)?;
    Ok(VirtioAttachment {
        bus,
        pci,
        _io: io,
        _acks: acks,
        io_info,
        describe,
        _host: Mutex::new(host),
    })
}

/// One slot's transport (its saved state applied when `restore` is given), wired to KVM:
/// the irqfd, the InterruptACK ioeventfd (returned) and the queues' ioeventfds (the sources of
/// its I/O thread).
fn attach_slot(
    fd: &VmFd,
    slot: &VirtioSlot,
    prepared: PreparedDevice,
    mem: &GuestMemoryMmap,
    restore: Option<(usize, &VirtioSlotState)>,
) -> Result<(SharedTransport, Vec<IoSource>, EventFd), VirtioError> {
    let base = slot.base;
    let evt = || EventFd::new(EFD_NONBLOCK).map_err(|source| VirtioError::EventFd { base, source });
    let kvm = |op| move |source| VirtioError::Kvm { op, base, source };
    let irq = evt()?;
    fd.register_irqfd(&irq, slot.gsi)
        .map_err(kvm("KVM_IRQFD"))?;
    // The driver's InterruptACK writes end in KVM (an ioeventfd nobody reads: its counter
    // only grows, saturating); reads of InterruptStatus acknowledge instead.
    let ack = evt()?;
    fd.register_ioevent(
        &ack,
        &IoEventAddress::Mmio(base + INTERRUPT_ACK_OFFSET),
        NoDatamatch,
    )
    .map_err(kvm("KVM_IOEVENTFD"))?;
    let interrupt = Arc::new(Interrupt::new(irq));
    interrupt.set_ack_on_read(true);
    let device = prepared.device;
    let queues = device.queue_max_sizes().len();
    let mut transport = MmioTransport::new(device, mem.clone(), interrupt)
        .map_err(|source| VirtioError::Transport { base, source })?;
    if let Some((index, saved)) = restore {
        if saved.pci.is_some() {
            return Err(VirtioError::Restore(PersistError::Transport {
                index,
                saved: "virtio-pci",
                built: "virtio-mmio",
            }));
        }
        restore_slot(index, base, &mut transport, saved).map_err(VirtioError::Restore)?;
    }
    let transport = Arc::new(Mutex::new(transport));
    let notify = Notify::Word(base + QUEUE_NOTIFY_OFFSET);
    let sources = queue_sources(fd, &transport, base, notify, queues, prepared.backend)?;
    Ok((transport, sources, ack))
}

/// What a virtio-pci slot needs beyond a virtio-mmio one.
struct PciSlot {
    /// Its device number on bus 0.
    device_number: u8,
    /// Where its MSI-X messages go.
    sink: Arc<dyn MsiSink>,
}

/// One slot as a virtio-pci function whose BAR 0 is at the slot's base: its MSI-X vectors
/// (one per queue and one for configuration changes), the transport (its saved state and the
/// function's applied when `restore` is given) and a 2-byte ioeventfd per queue on the
/// notification address (the value written is the queue index).
fn attach_pci_slot(
    fd: &VmFd,
    slot: &VirtioSlot,
    pci: PciSlot,
    prepared: PreparedDevice,
    mem: &GuestMemoryMmap,
    restore: Option<(usize, &VirtioSlotState)>,
) -> Result<(SharedTransport, Vec<IoSource>, Arc<VirtioPciFront>), VirtioError> {
    let base = slot.base;
    let evt = || EventFd::new(EFD_NONBLOCK).map_err(|source| VirtioError::EventFd { base, source });
    let device = prepared.device;
    let queues = device.queue_max_sizes().len();
    let device_type = device.device_type();
    let msix = Arc::new(Msix::new(msix_vectors(queues), queues, pci.sink));
    let bar0 = u32::try_from(base).map_err(|_| VirtioError::Unserved { base })?;
    let function = Arc::new(virtio_pci::function(
        pci.device_number,
        device_type,
        bar0,
        msix.clone(),
    ));
    let front =
        Arc::new(VirtioPciFront::new(function, queues).ok_or(VirtioError::Unserved { base })?);
    // No INTx: the function has no interrupt pin, and the DSDT no _PRT. The eventfd only
    // takes what the transport would raise before the driver enables MSI-X.
    let interrupt = Arc::new(Interrupt::with_msix(evt()?, msix));
    interrupt.set_ack_on_read(true);
    let mut transport = MmioTransport::new(device, mem.clone(), interrupt)
        .map_err(|source| VirtioError::Transport { base, source })?;
    if let Some((index, saved)) = restore {
        restore_pci_slot(index, base, &mut transport, &front, saved)?;
    }
    let transport = Arc::new(Mutex::new(transport));
    let notify = Notify::HalfWord(base + virtio_pci::NOTIFY_OFFSET);
    let sources = queue_sources(fd, &transport, base, notify, queues, prepared.backend)?;
    Ok((transport, sources, front))
}

/// Applies a saved slot to a virtio-pci function: the function's state (configuration space,
/// MSI-X, selectors), then the transport's.
fn restore_pci_slot(
    index: usize,
    base: u64,
    transport: &mut MmioTransport,
    front: &VirtioPciFront,
    saved: &VirtioSlotState,
) -> Result<(), VirtioError> {
    let Some(pci) = &saved.pci else {
        return Err(VirtioError::Restore(PersistError::Transport {
            index,
            saved: "virtio-mmio",
            built: "virtio-pci",
        }));
    };
    // The function first: a device the transport's restore activates may use buffers, and
    // their messages need the restored vectors (held until the vCPUs are loaded).
    front
        .restore(pci)
        .map_err(|why| VirtioError::Restore(PersistError::Pci { base, why }))?;
    restore_slot(index, base, transport, saved).map_err(VirtioError::Restore)
}

/// A transport's notification register: its address, and the width of the queue index the
/// driver writes there (the ioeventfds' data match).
#[derive(Debug, Clone, Copy)]
enum Notify {
    /// virtio-mmio's `QueueNotify`: 4 bytes.
    Word(u64),
    /// virtio-pci's notification structure: 2 bytes.
    HalfWord(u64),
}

/// The I/O thread's sources of one transport at `base`: an eventfd per queue, each a KVM
/// ioeventfd on `notify` matching the queue's index, and the device's backend descriptor if
/// it has one.
fn queue_sources(
    fd: &VmFd,
    transport: &SharedTransport,
    base: u64,
    notify: Notify,
    queues: usize,
    backend: Option<(std::os::fd::RawFd, usize)>,
) -> Result<Vec<IoSource>, VirtioError> {
    let kvm = |source| VirtioError::Kvm {
        op: "KVM_IOEVENTFD",
        base,
        source,
    };
    let mut sources = Vec::new();
    for queue in 0..queues {
        let event =
            EventFd::new(EFD_NONBLOCK).map_err(|source| VirtioError::EventFd { base, source })?;
        match notify {
            Notify::Word(at) => {
                let index = u32::try_from(queue).unwrap_or(u32::MAX);
                fd.register_ioevent(&event, &IoEventAddress::Mmio(at), index)
            }
            Notify::HalfWord(at) => {
                let index = u16::try_from(queue).unwrap_or(u16::MAX);
                fd.register_ioevent(&event, &IoEventAddress::Mmio(at), index)
            }
        }
        .map_err(kvm)?;
        sources.push(IoSource::QueueEvent {
            transport: transport.clone(),
            queue,
            event,
        });
    }
    if let Some((fd, queue)) = backend {
        sources.push(IoSource::Backend {
            transport: transport.clone(),
            queue,
            fd,
        });
    }
    Ok(sources)
}

/// The planned I/O threads (or one unpinned thread for a hand-made plan), each with the
/// sources of its devices; every thread reports its tid once pinned, before this returns.
fn spawn_io_threads(
    plan: &DevicePlan,
    mut per_slot: Vec<Vec<IoSource>>,
) -> Result<(Vec<IoThread>, Vec<IoThreadInfo>), VirtioError> {
    let threads: Vec<(String, Vec<u32>, Vec<usize>)> = if plan.io_threads.is_empty() {
        if per_slot.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let all = (0..per_slot.len()).collect();
        vec![(format!("{IO_THREAD_PREFIX}0"), Vec::new(), all)]
    } else {
        let t = plan.io_threads.iter();
        t.map(|t| (t.name.clone(), t.host_cpus.clone(), t.devices.clone()))
            .collect()
    };
    if let Some(slot) = (0..per_slot.len()).find(|i| !threads.iter().any(|t| t.2.contains(i))) {
        let base = plan.slots.get(slot).map_or(0, |s| s.base);
        return Err(VirtioError::Unserved { base });
    }
    let mut io = Vec::new();
    let mut info = Vec::new();
    for (name, cpus, devices) in threads {
        let sources = devices
            .iter()
            .filter_map(|&i| per_slot.get_mut(i).map(std::mem::take))
            .flatten()
            .collect();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let pin_to = cpus.clone();
        let init = move || {
            let pinned = if pin_to.is_empty() {
                Ok(())
            } else {
                crate::sys::pin_current_thread(&pin_to)
            };
            // The receiver waits for this; if it is gone, attach failed anyway.
            let _ = tx.send((crate::sys::gettid(), pinned));
        };
        // Pushed before the handshake: on an error below, dropping `io` stops every thread.
        io.push(IoThread::spawn_with(&name, sources, init).map_err(VirtioError::Io)?);
        let tid = match rx.recv() {
            Ok((tid, Ok(()))) => tid,
            Ok((_, Err(source))) => {
                return Err(VirtioError::Pin {
                    thread: name,
                    cpus,
                    source,
                })
            }
            Err(_) => return Err(VirtioError::NoStart(name)),
        };
        let device_bases = devices
            .iter()
            .filter_map(|&i| plan.slots.get(i).map(|s| s.base))
            .collect();
        info.push(IoThreadInfo {
            name,
            tid,
            cpus,
            device_bases,
        });
    }
    Ok((io, info))
}

#[cfg(test)]
#[path = "virtio_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "virtio_pci_tests.rs"]
mod pci_tests;
