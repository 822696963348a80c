//! The vsock device on the kernel's vhost-vsock (`devices.vsock.backend = "vhost"`): the
//! receive and transmit queues are served by the host kernel, and host programs reach the guest
//! through `AF_VSOCK` at (CID, port) instead of a Unix socket (docs/devices.md, "virtio-vsock").
//!
//! vmhost keeps the register file, the event queue and the interrupt status: at DRIVER_OK it
//! hands the kernel the guest memory table, each queue's size, position and addresses, a kick
//! eventfd and a call eventfd, then starts it. A guest notification reaches the I/O thread
//! through the queue's ioeventfd and is passed on to the kick eventfd; the kernel's call
//! eventfds are watched (through [`VhostVsock::poll_fd`]) and become the device's used-buffer
//! interrupt (virtio-mmio needs the interrupt status set before the line is raised).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use tracing::warn;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmhost_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::vhost_sys::{self as sys, MemRegion};
use super::{EVENT, RX, TX, VSOCK_QUEUE_SIZE};
use crate::device::{DeviceError, VirtioDevice};
use crate::persist::{DeviceState, StateError};

/// The kernel's vhost-vsock device node.
pub const VHOST_VSOCK_PATH: &str = "/dev/vhost-vsock";

/// Why the kernel's vhost-vsock could not be set up (host errors).
#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    /// /dev/vhost-vsock could not be opened.
    #[error("cannot open {VHOST_VSOCK_PATH} (load the vhost_vsock module, or use devices.vsock.backend = \"unix\")")]
    Open(#[source] io::Error),
    /// Another VM on this host has the CID.
    #[error("guest CID {0} is taken by another VM on this host (vhost-vsock CIDs are host-wide); choose another devices.vsock.cid")]
    CidInUse(u64),
    /// A vhost ioctl failed.
    #[error("vhost-vsock {op} failed")]
    Ioctl {
        /// The operation.
        op: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The kernel lacks a feature vmhost needs.
    #[error("the kernel's vhost-vsock does not offer VIRTIO_F_VERSION_1")]
    NoVersion1,
    /// eventfd or epoll setup failed.
    #[error("cannot set up the vhost-vsock eventfds")]
    Events(#[source] io::Error),
}

fn ioctl(op: &'static str) -> impl FnOnce(io::Error) -> VhostError {
    move |source| VhostError::Ioctl { op, source }
}

/// A vsock device whose queues the kernel serves.
#[derive(Debug)]
pub struct VhostVsock {
    cid: u64,
    file: File,
    kicks: [EventFd; 2],
    calls: [EventFd; 2],
    /// The rings whose call eventfd fired in the last `process_queue` (bit per queue).
    used: u64,
    epoll: Epoll,
    queue_sizes: [u16; 3],
    running: bool,
}

impl VhostVsock {
    /// Opens `/dev/vhost-vsock` for guest `cid` and claims the CID host-wide.
    pub fn new(cid: u64) -> Result<Self, VhostError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(VHOST_VSOCK_PATH)
            .map_err(VhostError::Open)?;
        sys::set_owner(&file).map_err(ioctl("VHOST_SET_OWNER"))?;
        let features = sys::get_features(&file).map_err(ioctl("VHOST_GET_FEATURES"))?;
        if features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(VhostError::NoVersion1);
        }
        sys::set_guest_cid(&file, cid).map_err(|e| match e.raw_os_error() {
            Some(libc::EADDRINUSE) => VhostError::CidInUse(cid),
            _ => VhostError::Ioctl {
                op: "VHOST_VSOCK_SET_GUEST_CID",
                source: e,
            },
        })?;
        let evt = || EventFd::new(EFD_NONBLOCK).map_err(VhostError::Events);
        let (kicks, calls) = ([evt()?, evt()?], [evt()?, evt()?]);
        let epoll = Epoll::new().map_err(VhostError::Events)?;
        for call in &calls {
            let ev = EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, 0);
            epoll
                .ctl(ControlOperation::Add, call.as_raw_fd(), ev)
                .map_err(VhostError::Events)?;
        }
        Ok(VhostVsock {
            cid,
            file,
            kicks,
            calls,
            used: 0,
            epoll,
            queue_sizes: [VSOCK_QUEUE_SIZE; 3],
            running: false,
        })
    }

    /// The fd to watch: readable when the kernel used buffers (its call eventfds).
    pub fn poll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Hands the queues to the kernel and starts it.
    fn start(
        &mut self,
        features: u64,
        queues: &[Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<(), String> {
        let regions: Vec<MemRegion> = mem
            .iter()
            .map(|r| MemRegion {
                guest_phys_addr: r.start_addr().0,
                size: r.len(),
                userspace_addr: r.as_ptr() as u64,
            })
            .collect();
        let f = &self.file;
        fn err(op: &'static str) -> impl Fn(io::Error) -> String {
            move |e| format!("vhost-vsock {op}: {e}")
        }
        sys::set_features(f, features & (1 << VIRTIO_F_VERSION_1))
            .map_err(err("VHOST_SET_FEATURES"))?;
        sys::set_mem_table(f, &regions).map_err(err("VHOST_SET_MEM_TABLE"))?;
        for index in [RX, TX] {
            let queue = queues.get(index).filter(|q| q.ready()).ok_or(format!(
                "vhost-vsock: queue {index} is not ready at DRIVER_OK"
            ))?;
            let rings = RingAddrs::resolve(index, queue, mem)?;
            sys::set_vring_num(f, index_u32(index), queue.size())
                .map_err(err("VHOST_SET_VRING_NUM"))?;
            sys::set_vring_base(f, index_u32(index), queue.next_avail())
                .map_err(err("VHOST_SET_VRING_BASE"))?;
            // SAFETY: `rings` came from `RingAddrs::resolve` for this queue's size, so each
            // address is the start of a ring's full extent inside one region of `mem`, whose
            // mappings live as long as the VM and are the ones `set_mem_table` just handed over.
            unsafe {
                sys::set_vring_addr(f, index_u32(index), rings.desc, rings.used, rings.avail)
            }
            .map_err(err("VHOST_SET_VRING_ADDR"))?;
            sys::set_vring_kick(f, index_u32(index), self.kicks[index].as_raw_fd())
                .map_err(err("VHOST_SET_VRING_KICK"))?;
            sys::set_vring_call(f, index_u32(index), self.calls[index].as_raw_fd())
                .map_err(err("VHOST_SET_VRING_CALL"))?;
        }
        sys::set_running(f, true).map_err(err("VHOST_VSOCK_SET_RUNNING"))?;
        self.running = true;
        Ok(())
    }

    fn stop(&mut self) {
        if self.running {
            if let Err(e) = sys::set_running(&self.file, false) {
                warn!(error = %e, "vhost-vsock: cannot stop the kernel's device");
            }
            self.running = false;
        }
    }
}

/// The host addresses of a queue's three rings, each checked to lie, whole, inside one guest
/// memory region (the kernel accesses a ring through one host pointer; a ring that crosses into
/// the next region would be read and written past the end of the first mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingAddrs {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

impl RingAddrs {
    /// Resolves queue `index`'s rings for its size, or says which ring is out of place.
    pub(crate) fn resolve(
        index: usize,
        queue: &Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<Self, String> {
        let n = u64::from(queue.size());
        let ring = |name: &str, gpa: u64, len: u64| {
            ring_host_addr(mem, gpa, len).ok_or_else(|| {
                format!(
                    "vhost-vsock: queue {index} {name} ring ({len} bytes at guest address \
                     {gpa:#x}) does not lie inside one guest memory region"
                )
            })
        };
        Ok(RingAddrs {
            desc: ring("descriptor", queue.desc_table(), 16 * n)?,
            avail: ring("available", queue.avail_ring(), 6 + 2 * n)?,
            used: ring("used", queue.used_ring(), 6 + 8 * n)?,
        })
    }
}

/// The host address of `len` bytes at guest-physical `gpa` when all of them lie in one region
/// of `mem` (translated within that region), else `None`.
pub(crate) fn ring_host_addr(mem: &GuestMemoryMmap, gpa: u64, len: u64) -> Option<u64> {
    let (region, offset) = mem.to_region_addr(GuestAddress(gpa))?;
    let end = offset.0.checked_add(len)?;
    if end > region.len() {
        return None;
    }
    region.get_host_address(offset).ok().map(|p| p as u64)
}

fn index_u32(index: usize) -> u32 {
    u32::try_from(index).unwrap_or(u32::MAX)
}

impl VirtioDevice for VhostVsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        0
    }

    fn config(&self) -> Vec<u8> {
        self.cid.to_le_bytes().to_vec()
    }

    fn activate_queues(
        &mut self,
        features: u64,
        queues: &[Queue],
        mem: &GuestMemoryMmap,
    ) -> Result<(), String> {
        self.start(features, queues, mem)
    }

    /// A guest notification goes on to the kernel; buffers the kernel used (its call
    /// eventfds) become the used-buffer interrupt.
    fn process_queue(
        &mut self,
        index: usize,
        _queue: &mut Queue,
        _mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        match index {
            RX | TX if self.running => {
                if let Err(e) = self.kicks[index].write(1) {
                    warn!(error = %e, "vhost-vsock: cannot kick the kernel");
                }
                let mut events = [EpollEvent::default(); 2];
                // Tidy only: the call eventfds are read below either way.
                let _ = self.epoll.wait(0, &mut events);
                // Which rings the kernel used: each one's vector is raised (virtio-pci).
                self.used = [RX, TX]
                    .into_iter()
                    .filter(|&q| self.calls[q].read().is_ok())
                    .fold(0, |mask, q| mask | (1 << q));
                Ok(self.used != 0)
            }
            RX | TX | EVENT => Ok(false),
            _ => Err(DeviceError::NoSuchQueue { queue: index }),
        }
    }

    fn used_queues(&self, _served: usize) -> u64 {
        self.used
    }

    fn reset(&mut self) {
        self.stop();
    }

    /// Not yet: the kernel holds the rings' positions (VHOST_GET_VRING_BASE stops them) and
    /// its writes to guest memory need VHOST_F_LOG_ALL for a live migration.
    fn save_state(&mut self, _queues: &mut [Queue]) -> Result<DeviceState, StateError> {
        Err(StateError::Unsupported {
            device: "vsock with backend vhost (use backend unix to snapshot or migrate)",
        })
    }
}

impl Drop for VhostVsock {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
#[path = "vhost_tests.rs"]
mod tests;
