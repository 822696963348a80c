//! virtio-net on a tap device (or any packet fd that carries a virtio-net header per frame).
//!
//! Queue 0 receives (frames from the backend into the guest), queue 1 transmits. The tap is
//! opened with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` and a 12-byte header size, the size of
//! the modern `virtio_net_hdr_v1`, so headers pass between guest and tap unchanged. On a tap
//! ([`Net::with_offloads`]) the device offers what the tap can do with those headers, as QEMU
//! and Cloud Hypervisor do: checksum offload both ways and TSO (v4, v6, ECN) both ways. The
//! guest then sends 64 KiB TCP segments the host kernel cuts (or hands on whole), and at
//! DRIVER_OK the tap is told (`TUNSETOFFLOAD`) which of them the guest accepts, so it delivers
//! unsegmented frames with partial checksums too.
//!
//! Receive buffers: the device offers `VIRTIO_NET_F_MRG_RXBUF`, as QEMU does, so Linux posts
//! page-sized buffers and a frame takes as many as it needs (`num_buffers` in its header).
//! The device holds chains until they make room for the largest frame the guest accepts
//! ([`MAX_FRAME`] with guest TSO, else [`MAX_MTU_FRAME`]), reads each frame with one `readv`
//! into as many held chains as the last frame took (a longer frame's tail is copied into the
//! next ones from the host buffer), and publishes a frame's chains in the used ring together,
//! with one store of the used index: the driver must not see the first before the rest. A
//! driver that declines it posts one chain per frame (the "big packet" chains with TSO), and
//! the rest of this paragraph's single-chain rules apply.
//!
//! Frames move straight between the tap and guest memory ([`crate::iov`]), as with QEMU: a
//! transmit chain is one `writev`, and a receive takes a chain first and `readv`s one frame
//! into its buffers, then sets `num_buffers` to 1 in the header there. While the guest has no
//! receive buffer the tap is not read and keeps its frames (its own queue, then its drops);
//! the guest posting buffers notifies queue 0, which reads again. A chain taken when the tap
//! has nothing goes back to the queue. A frame longer than its chain is dropped (`rx_dropped`,
//! the chain used with length 0), never cut short: the `readv` ends with a host buffer of
//! [`MAX_FRAME`] bytes after the guest's, so a longer frame spills into it and the read
//! returns more than the chain holds, whether the backend reports a cut frame's full length
//! (recent taps) or only what it copied (older taps, the XDP path, datagram sockets).

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use tracing::warn;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
    VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_ECN, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmhost_memory::GuestMemoryMmap;

use crate::chain::{Chain, ChainError, ChainLimits};
use crate::device::{add_used_together, serve_queue, DeviceError, VirtioDevice};
use crate::iov::{GuestDst, IoVecs, IOV_MAX};
use crate::persist::{DeviceState, StateError};
use crate::sys::{
    tun_set_iff, tun_set_offload, tun_set_vnet_hdr_size, IFF_NO_PI, IFF_TAP, IFF_VNET_HDR,
    TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN,
};

/// Size of each queue.
pub const NET_QUEUE_SIZE: u16 = 256;
/// Size of `virtio_net_hdr_v1` (VIRTIO_F_VERSION_1).
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame with its header: a 64 KiB TSO frame with its Ethernet header.
pub const MAX_FRAME: usize = VNET_HDR_LEN + 65_550;
/// Largest frame with its header when the guest takes no TSO: an Ethernet frame with a VLAN
/// tag at the tap's default MTU (1500).
pub const MAX_MTU_FRAME: usize = VNET_HDR_LEN + 1_518;
const RX: usize = 0;
const TX: usize = 1;

/// The offloads a tap-backed device offers: checksums and TSO both ways.
pub const OFFLOAD_FEATURES: u64 = (1 << VIRTIO_NET_F_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_TSO4)
    | (1 << VIRTIO_NET_F_GUEST_TSO6)
    | (1 << VIRTIO_NET_F_GUEST_ECN)
    | (1 << VIRTIO_NET_F_HOST_TSO4)
    | (1 << VIRTIO_NET_F_HOST_TSO6)
    | (1 << VIRTIO_NET_F_HOST_ECN);

/// The tap's `TUN_F_*` offloads for the guest features `features` accepted.
pub fn tap_offloads(features: u64) -> u32 {
    let has = |bit: u32| features & (1 << bit) != 0;
    let mut flags = 0;
    if has(VIRTIO_NET_F_GUEST_CSUM) {
        flags |= TUN_F_CSUM;
        if has(VIRTIO_NET_F_GUEST_TSO4) {
            flags |= TUN_F_TSO4;
        }
        if has(VIRTIO_NET_F_GUEST_TSO6) {
            flags |= TUN_F_TSO6;
        }
        if has(VIRTIO_NET_F_GUEST_ECN) && flags & (TUN_F_TSO4 | TUN_F_TSO6) != 0 {
            flags |= TUN_F_TSO_ECN;
        }
    }
    flags
}

/// Why a tap could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// /dev/net/tun could not be opened.
    #[error("cannot open /dev/net/tun")]
    OpenTun(#[source] io::Error),
    /// TUNSETIFF failed (no permission to create it, or a non-tap interface of that name).
    #[error("cannot create or attach to tap {name}")]
    SetIff {
        /// The interface name.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// TUNSETVNETHDRSZ failed.
    #[error("tap {name}: cannot set the virtio-net header size")]
    VnetHdr {
        /// The interface name.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// An open tap interface.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    created: bool,
}

impl Tap {
    /// Opens tap `name`, creating it if it does not exist (non-persistent: it disappears with
    /// the last fd). The fd is non-blocking.
    pub fn open(name: &str) -> Result<Self, NetError> {
        let existed = Path::new("/sys/class/net").join(name).exists();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(NetError::OpenTun)?;
        let flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
        let name = tun_set_iff(file.as_fd(), name, flags).map_err(|source| NetError::SetIff {
            name: name.to_string(),
            source,
        })?;
        tun_set_vnet_hdr_size(file.as_fd(), VNET_HDR_LEN).map_err(|source| NetError::VnetHdr {
            name: name.clone(),
            source,
        })?;
        Ok(Tap {
            file,
            name,
            created: !existed,
        })
    }

    /// The interface name the kernel gave.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this open created the interface.
    pub fn created(&self) -> bool {
        self.created
    }

    /// The fd, for the device.
    pub fn into_file(self) -> File {
        self.file
    }
}

/// What one receive over several chains (`VIRTIO_NET_F_MRG_RXBUF`) read.
enum Merged {
    /// A frame of this many bytes, header included, in the held chains' buffers.
    Frame(usize),
    /// A frame longer than the held chains, or shorter than its header: dropped.
    Dropped,
    /// No frame (or a backend error).
    Nothing,
}

/// What one receive did with the chain it was given.
enum Received {
    /// Used, with this many bytes written (0: the frame was too long and is dropped).
    Used(u32),
    /// A frame shorter than its header was read and dropped; the chain is unused.
    Runt,
    /// No frame (or a backend error): the chain is unused.
    Nothing,
}

/// Frame counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Frames sent by the guest.
    pub tx_frames: u64,
    /// Frames dropped on receive (too large for the guest's buffer, too short).
    pub rx_dropped: u64,
    /// Frames dropped on transmit (backend full or failing).
    pub tx_dropped: u64,
}

/// A virtio-net device.
#[derive(Debug)]
pub struct Net {
    backend: File,
    mac: [u8; 6],
    queue_sizes: [u16; 2],
    rx_overflow: Vec<u8>,
    iovecs: IoVecs,
    stats: NetStats,
    error_logged: bool,
    offloads: bool,
    /// `VIRTIO_NET_F_MRG_RXBUF` negotiated: a frame may take several receive chains.
    mergeable: bool,
    /// With `mergeable`: the room taken before the backend is read (the largest frame the
    /// guest accepts).
    rx_needed: usize,
    /// With `mergeable`: receive chains taken from the queue and not used yet, in order.
    rx_held: VecDeque<Chain>,
    /// The writable bytes of `rx_held`.
    rx_held_room: u64,
    /// With `mergeable`: the bytes a frame is expected to take (the last frame's length).
    rx_expect: usize,
    /// With `mergeable`: the used entries of the frame being received (reused storage).
    rx_used: Vec<(u16, u32)>,
}

impl Net {
    /// A NIC with address `mac` on `backend`: a tap from [`Tap::open`] or, in tests, one end
    /// of a `SOCK_SEQPACKET` socket pair; it must be non-blocking.
    pub fn new(backend: File, mac: [u8; 6]) -> Self {
        Net {
            backend,
            mac,
            queue_sizes: [NET_QUEUE_SIZE; 2],
            rx_overflow: vec![0; MAX_FRAME],
            iovecs: IoVecs::default(),
            stats: NetStats::default(),
            error_logged: false,
            offloads: false,
            mergeable: false,
            rx_needed: MAX_FRAME,
            rx_held: VecDeque::new(),
            rx_held_room: 0,
            rx_expect: MAX_MTU_FRAME,
            rx_used: Vec::new(),
        }
    }

    /// A NIC on a tap from [`Tap::open`] that offers the tap's offloads
    /// ([`OFFLOAD_FEATURES`]) and sets them on the tap at DRIVER_OK.
    pub fn with_offloads(tap: File, mac: [u8; 6]) -> Self {
        Net {
            offloads: true,
            ..Net::new(tap, mac)
        }
    }

    /// Tells the tap which offloads the guest accepted (none after a reset).
    fn set_tap_offloads(&mut self, features: u64) {
        if !self.offloads {
            return;
        }
        if let Err(e) = tun_set_offload(self.backend.as_fd(), tap_offloads(features)) {
            self.log_backend_error("TUNSETOFFLOAD", &e);
        }
    }

    /// Forgets the held receive chains (the queue was reset or set up anew).
    fn forget_held(&mut self) {
        self.rx_held.clear();
        self.rx_held_room = 0;
        self.rx_expect = MAX_MTU_FRAME;
    }

    /// Frame counters.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// The backend fd (to watch for readability: then notify queue 0).
    pub fn backend(&self) -> &File {
        &self.backend
    }

    fn process_rx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        if self.mergeable {
            return self.process_rx_mergeable(queue, mem);
        }
        let mut used = false;
        // A buffer first, then the frame: without one the backend is not read and keeps the
        // frame; queue 0's next notification (the guest posted buffers) or the backend's next
        // readable edge comes back here.
        while let Some(desc) = queue.iter(mem).map_err(DeviceError::queue(RX))?.next() {
            let chain = Chain::parse(desc, &RX_LIMITS).map_err(DeviceError::chain(RX))?;
            match self.receive(&chain, mem).map_err(DeviceError::chain(RX))? {
                Received::Used(written) => {
                    queue
                        .add_used(mem, chain.head, written)
                        .map_err(DeviceError::queue(RX))?;
                    used = true;
                }
                // The buffer goes back to the queue, untouched as far as the guest knows.
                Received::Runt => queue.go_to_previous_position(),
                Received::Nothing => {
                    queue.go_to_previous_position();
                    break;
                }
            }
        }
        Ok(used)
    }

    /// `VIRTIO_NET_F_MRG_RXBUF`: each frame goes into as many chains as it needs, and
    /// `num_buffers` in its header says how many. The device holds chains until they make
    /// room for `rx_needed` bytes, the largest frame the guest accepts; with less posted the
    /// backend is not read, and the frame waits in it until the guest posts more (which it
    /// notifies: the held chains are taken from the queue, so `avail_event` is past them).
    /// A frame is read (one `readv`) into the held chains that hold a frame as long as the
    /// last one, then the host overflow buffer; a longer frame's tail is copied from there
    /// into the next held chains. So a TCP ACK after an ACK takes one chain's `iovec`s, a
    /// 64 KiB segment after a segment is read into guest memory whole, and chains are parsed
    /// once however many frames pass them by.
    fn process_rx_mergeable(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        let needed = self.rx_needed as u64;
        let mut used = false;
        loop {
            if self.rx_held_room < needed {
                let mut iter = queue.iter(mem).map_err(DeviceError::queue(RX))?;
                while self.rx_held_room < needed {
                    let Some(desc) = iter.next() else { break };
                    let chain = Chain::parse(desc, &RX_LIMITS).map_err(DeviceError::chain(RX))?;
                    check_merge_buffer(&chain).map_err(DeviceError::chain(RX))?;
                    self.rx_held_room += chain.writable_len();
                    self.rx_held.push_back(chain);
                }
            }
            if self.rx_held_room < needed {
                break;
            }
            let n = match self.receive_merged(mem).map_err(DeviceError::chain(RX))? {
                Merged::Frame(n) => n as u64,
                Merged::Dropped => continue,
                Merged::Nothing => break,
            };
            // The chains the frame filled, in order; the header is in the first (each holds
            // at least a header).
            let mut entries = std::mem::take(&mut self.rx_used);
            entries.clear();
            let mut left = n;
            for chain in &self.rx_held {
                if left == 0 {
                    break;
                }
                let len = chain.writable_len().min(left);
                left -= len;
                // len <= MAX_FRAME.
                entries.push((chain.head, u32::try_from(len).unwrap_or(0)));
            }
            let count = u16::try_from(entries.len()).unwrap_or(u16::MAX);
            if let Some(first) = self.rx_held.front() {
                first
                    .write_at(mem, 10, &count.to_le_bytes())
                    .map_err(DeviceError::chain(RX))?;
            }
            // All of the frame's chains at once: the driver must not see the first
            // (num_buffers = count) before the others.
            add_used_together(RX, queue, mem, &entries)?;
            for _ in 0..entries.len() {
                if let Some(chain) = self.rx_held.pop_front() {
                    self.rx_held_room -= chain.writable_len();
                }
            }
            self.rx_used = entries;
            self.rx_expect = usize::try_from(n).unwrap_or(MAX_FRAME);
            self.stats.rx_frames += 1;
            used = true;
        }
        Ok(used)
    }

    /// Reads one frame from the backend into the held chains (see
    /// [`Net::process_rx_mergeable`]); the held room is at least `rx_needed`.
    fn receive_merged(&mut self, mem: &GuestMemoryMmap) -> Result<Merged, ChainError> {
        let expect = self.rx_expect.min(self.rx_needed) as u64;
        let mut dst = GuestDst::new(&mut self.iovecs);
        let mut direct_room = 0u64;
        for chain in &self.rx_held {
            if direct_room >= expect {
                break;
            }
            chain.push_writable(mem, &mut dst)?;
            direct_room += chain.writable_len();
        }
        let (direct, read) = dst.read_frame(&mut self.rx_overflow, &self.backend);
        let n = match read {
            Ok(0) => return Ok(Merged::Nothing),
            Ok(n) => n,
            Err(e) => {
                if e.kind() != io::ErrorKind::WouldBlock {
                    self.log_backend_error("readv", &e);
                }
                return Ok(Merged::Nothing);
            }
        };
        if n < VNET_HDR_LEN || n as u64 > self.rx_held_room {
            self.stats.rx_dropped += 1;
            return Ok(Merged::Dropped);
        }
        if n > direct {
            // Longer than the chains read into directly: the rest is in the host buffer, and
            // goes into the held chains after them (`direct` is where one of them starts).
            let mut tail = self.rx_overflow.get(..n - direct).unwrap_or_default();
            let mut start = 0usize;
            for chain in &self.rx_held {
                if tail.is_empty() {
                    break;
                }
                let len = usize::try_from(chain.writable_len()).unwrap_or(usize::MAX);
                if start < direct {
                    start = start.saturating_add(len);
                    continue;
                }
                let (now, rest) = tail.split_at(len.min(tail.len()));
                chain.write_at(mem, 0, now)?;
                tail = rest;
            }
        }
        Ok(Merged::Frame(n))
    }

    /// Reads one frame from the backend straight into a receive chain (`readv`).
    fn receive(&mut self, chain: &Chain, mem: &GuestMemoryMmap) -> Result<Received, ChainError> {
        if !chain.readable.is_empty() {
            return Err(ChainError::Direction {
                head: chain.head,
                what: "receive buffers must be device-writable only",
            });
        }
        // The guest's buffers (no frame is longer than MAX_FRAME), then `rx_overflow`: a
        // frame longer than the guest's buffers spills into it, the read says so and the frame
        // is dropped, not delivered cut short.
        let room = chain.writable_len().min(MAX_FRAME as u64);
        let dst = chain.writable_iovecs(mem, &mut self.iovecs, 0, room)?;
        // Buffers in more pieces than one readv takes: room 0, the frame is read and dropped.
        let (room, read) = dst.read_frame(&mut self.rx_overflow, &self.backend);
        match read {
            Ok(0) => Ok(Received::Nothing),
            Ok(n) if n < VNET_HDR_LEN => {
                self.stats.rx_dropped += 1;
                Ok(Received::Runt)
            }
            Ok(n) if n > room => {
                self.stats.rx_dropped += 1;
                Ok(Received::Used(0))
            }
            Ok(n) => {
                // num_buffers: one buffer per frame without VIRTIO_NET_F_MRG_RXBUF.
                chain.write_at(mem, 10, &1u16.to_le_bytes())?;
                self.stats.rx_frames += 1;
                // n <= room <= MAX_FRAME.
                Ok(Received::Used(u32::try_from(n).unwrap_or(0)))
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::WouldBlock {
                    self.log_backend_error("readv", &e);
                }
                Ok(Received::Nothing)
            }
        }
    }

    fn process_tx(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        let limits = ChainLimits {
            max_segments: usize::from(NET_QUEUE_SIZE),
            max_readable: MAX_FRAME as u64,
            max_writable: 0,
        };
        serve_queue(TX, queue, mem, &limits, |chain, mem| {
            self.send(chain, mem).map(|()| 0)
        })
    }

    /// Writes a transmit chain to the backend as one frame (`writev` from guest memory).
    fn send(&mut self, chain: &Chain, mem: &GuestMemoryMmap) -> Result<(), ChainError> {
        let len = chain.readable_len();
        if !chain.writable.is_empty() || len < VNET_HDR_LEN as u64 {
            return Err(ChainError::Direction {
                head: chain.head,
                what: "a transmit chain is a device-readable header and frame",
            });
        }
        let mut src = chain.readable_iovecs(mem, &mut self.iovecs, 0, len)?;
        let sent = if src.count() <= IOV_MAX {
            src.write_once(&self.backend)
        } else {
            // More pieces than one writev takes (a frame is one call): dropped.
            Ok(0)
        };
        drop(src);
        match sent {
            Ok(n) if n as u64 == len => self.stats.tx_frames += 1,
            Ok(_) => self.stats.tx_dropped += 1,
            Err(e) => {
                self.stats.tx_dropped += 1;
                if e.kind() != io::ErrorKind::WouldBlock {
                    self.log_backend_error("writev", &e);
                }
            }
        }
        Ok(())
    }

    fn log_backend_error(&mut self, op: &str, e: &io::Error) {
        if !self.error_logged {
            self.error_logged = true;
            warn!(op, error = %e, "virtio-net: backend error");
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        let offloads = if self.offloads { OFFLOAD_FEATURES } else { 0 };
        // Indirect descriptors: a receive buffer of the driver's "big packets" mode (19
        // segments) or a TSO frame takes one ring slot instead of one per segment, so the
        // 256-entry queues hold 256 of them, not 13.
        // Mergeable receive buffers, as QEMU offers them: the driver posts page-sized
        // buffers instead of 64 KiB "big packet" chains, so a small frame (a TCP ACK) takes
        // one page, not seventeen.
        (1 << VIRTIO_NET_F_MAC)
            | (1 << VIRTIO_NET_F_MRG_RXBUF)
            | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX)
            | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC)
            | offloads
    }

    fn activate(&mut self, features: u64) {
        self.set_tap_offloads(features);
        let has = |bit: u32| features & (1 << bit) != 0;
        self.mergeable = has(VIRTIO_NET_F_MRG_RXBUF);
        self.forget_held();
        self.rx_needed = if has(VIRTIO_NET_F_GUEST_TSO4) || has(VIRTIO_NET_F_GUEST_TSO6) {
            MAX_FRAME
        } else {
            MAX_MTU_FRAME
        };
    }

    /// `struct virtio_net_config` up to `status`: the MAC and a zero status.
    fn config(&self) -> Vec<u8> {
        let mut c = self.mac.to_vec();
        c.extend_from_slice(&[0, 0]);
        c
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        match index {
            RX => self.process_rx(queue, mem),
            TX => self.process_tx(queue, mem),
            _ => Err(DeviceError::NoSuchQueue { queue: index }),
        }
    }

    fn reset(&mut self) {
        self.set_tap_offloads(0);
        self.mergeable = false;
        self.rx_needed = MAX_FRAME;
        self.forget_held();
    }

    fn save_state(&mut self, queues: &mut [Queue]) -> Result<DeviceState, StateError> {
        self.give_back_held(queues);
        Ok(DeviceState::Net(self.state()))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), StateError> {
        self.check_restore(state)
    }

    /// Announces the guest's MAC on the new tap (see `net_persist.rs`).
    fn restored(
        &mut self,
        _queues: &mut [Queue],
        _mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        self.announce();
        Ok(false)
    }
}

/// Receive chains: device-writable buffers only, up to a queue's worth of segments.
const RX_LIMITS: ChainLimits = ChainLimits {
    max_segments: NET_QUEUE_SIZE as usize,
    max_readable: 0,
    max_writable: u32::MAX as u64,
};

/// A mergeable receive buffer: device-writable only, and (virtio 1.2, 5.1.6.3.1) large enough
/// for the header, so `num_buffers` is always in the first one.
fn check_merge_buffer(chain: &Chain) -> Result<(), ChainError> {
    if !chain.readable.is_empty() {
        return Err(ChainError::Direction {
            head: chain.head,
            what: "receive buffers must be device-writable only",
        });
    }
    if chain.writable_len() < VNET_HDR_LEN as u64 {
        return Err(ChainError::Direction {
            head: chain.head,
            what: "a mergeable receive buffer must hold the 12-byte header",
        });
    }
    Ok(())
}

#[path = "net_persist.rs"]
mod persist;
pub use persist::NetState;

#[cfg(test)]
#[path = "net_tests.rs"]
mod tests;
