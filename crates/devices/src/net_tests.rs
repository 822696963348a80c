#![allow(clippy::cast_possible_truncation)] // test data: small known values
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::testutil::{memory, TestQueue, DATA};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF,
};

const EVENT_IDX: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
const INDIRECT: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
const MAC: [u8; 6] = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];

/// A device on one end of a datagram socket pair; the other end plays the tap.
fn net() -> (Net, UnixDatagram) {
    let (a, b) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    (Net::new(File::from(OwnedFd::from(a)), MAC), b)
}

/// A header (12 bytes, zero) followed by an Ethernet frame of `len` bytes.
fn packet(len: usize, seed: u8) -> Vec<u8> {
    let mut p = vec![0u8; VNET_HDR_LEN];
    p.extend((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    p
}

#[test]
fn transmit_sends_header_and_frame_as_one_datagram() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let pkt = packet(1514, 7);
    mem.write_slice(&pkt[..VNET_HDR_LEN], GuestAddress(DATA))
        .unwrap();
    mem.write_slice(&pkt[VNET_HDR_LEN..], GuestAddress(DATA + 0x1000))
        .unwrap();
    q.post(&[(DATA, 12, false), (DATA + 0x1000, 1514, false)]);
    assert!(dev.process_queue(TX, &mut queue, &mem).unwrap());
    let mut got = vec![0u8; 4096];
    let n = peer.recv(&mut got).unwrap();
    assert_eq!(got[..n], pkt[..]);
    assert_eq!(q.used(0), (0, 0));
    assert_eq!(dev.stats().tx_frames, 1);
}

#[test]
fn receive_delivers_frames_byte_for_byte_with_one_buffer() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let pkt = packet(1000, 3);
    peer.send(&pkt).unwrap();
    q.post(&[(DATA, 2048, true)]);
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used(0), (0, 1012));
    let mut got = vec![0u8; 1012];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got[10..12], [1, 0], "num_buffers is 1");
    assert_eq!(got[..10], pkt[..10]);
    assert_eq!(got[12..], pkt[12..]);
}

#[test]
fn a_frame_waits_for_a_receive_buffer() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let first = packet(60, 1);
    let second = packet(70, 2);
    peer.send(&first).unwrap();
    peer.send(&second).unwrap();
    assert!(
        !dev.process_queue(RX, &mut queue, &mem).unwrap(),
        "no buffer yet"
    );
    q.post(&[(DATA, 2048, true)]);
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(
        q.used(0),
        (0, 72),
        "the first frame, held while there was no buffer"
    );
    q.post(&[(DATA + 0x1000, 2048, true)]);
    dev.process_queue(RX, &mut queue, &mem).unwrap();
    assert_eq!(q.used(1), (1, 82));
    let mut got = vec![0u8; 82];
    mem.read_slice(&mut got, GuestAddress(DATA + 0x1000))
        .unwrap();
    assert_eq!(got[12..], second[12..]);
    assert_eq!(dev.stats().rx_frames, 2);
}

#[test]
fn a_frame_larger_than_the_buffer_is_dropped_not_truncated() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    peer.send(&packet(1500, 9)).unwrap();
    q.post(&[(DATA, 256, true)]);
    dev.process_queue(RX, &mut queue, &mem).unwrap();
    assert_eq!(q.used(0), (0, 0));
    assert_eq!(dev.stats().rx_dropped, 1);
}

#[test]
fn wrong_directions_are_malformed() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post(&[(DATA, 12, false), (DATA + 0x100, 64, true)]);
    let err = dev.process_queue(TX, &mut queue, &mem).unwrap_err();
    assert!(
        matches!(err, DeviceError::Chain { queue: TX, .. }),
        "{err:?}"
    );

    let mut q = TestQueue::new(&mem, 0x8000, 16);
    let mut queue = q.queue();
    peer.send(&packet(60, 0)).unwrap();
    q.post(&[(DATA, 2048, false)]);
    let err = dev.process_queue(RX, &mut queue, &mem).unwrap_err();
    assert!(
        matches!(err, DeviceError::Chain { queue: RX, .. }),
        "{err:?}"
    );
}

#[test]
fn config_space_holds_the_mac() {
    let (dev, _peer) = net();
    assert_eq!(dev.config()[..6], MAC);
    assert_eq!(
        dev.features(),
        (1 << VIRTIO_NET_F_MAC) | MRG | EVENT_IDX | INDIRECT
    );
    assert_eq!(dev.queue_max_sizes(), &[NET_QUEUE_SIZE, NET_QUEUE_SIZE]);
}

#[test]
fn a_real_tap_is_created_and_disappears_with_its_fd() {
    assert!(
        Path::new("/dev/net/tun").exists(),
        "/dev/net/tun is missing: load the tun module (modprobe tun)"
    );
    let tap = Tap::open("vmhtest%d").expect("creating a tap needs root or CAP_NET_ADMIN");
    let name = tap.name().to_string();
    assert!(name.starts_with("vmhtest"), "{name}");
    assert!(tap.created());
    let sys = Path::new("/sys/class/net").join(&name);
    assert!(sys.exists());
    // Attaching by name to an interface that exists is refused while another fd holds it
    // (a non-multiqueue tap takes one fd).
    assert!(matches!(Tap::open(&name), Err(NetError::SetIff { .. })));
    drop(tap);
    assert!(!sys.exists(), "a non-persistent tap goes away with its fd");
}

/// Whether the kernel's `name` interface has TCP segmentation offload on (`ETHTOOL_GTSO`).
fn tso_on(name: &str) -> bool {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        data: *mut EthtoolValue,
        _pad: [u8; 16],
    }
    let mut value = EthtoolValue { cmd: 0x1e, data: 0 };
    let mut req = IfReq {
        name: [0; 16],
        data: &mut value,
        _pad: [0; 16],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    // SAFETY: SIOCETHTOOL reads the ifreq and writes one ethtool_value through `data`; both
    // live on this stack frame across the call.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            0x8946,
            &mut req as *mut IfReq,
        )
    };
    assert_eq!(
        rc,
        0,
        "SIOCETHTOOL on {name}: {}",
        std::io::Error::last_os_error()
    );
    value.data != 0
}

#[test]
fn a_tap_backed_nic_offers_offloads_and_turns_tso_on_for_what_the_guest_accepted() {
    let tap = Tap::open("vmhoff%d").expect("creating a tap needs root or CAP_NET_ADMIN");
    let name = tap.name().to_string();
    let (plain, _peer) = net();
    assert_eq!(
        plain.features(),
        (1 << VIRTIO_NET_F_MAC) | MRG | EVENT_IDX | INDIRECT,
        "no offloads off a tap"
    );
    let mut dev = Net::with_offloads(tap.into_file(), MAC);
    assert_eq!(
        dev.features(),
        (1 << VIRTIO_NET_F_MAC) | MRG | EVENT_IDX | INDIRECT | OFFLOAD_FEATURES
    );
    assert!(!tso_on(&name), "a new tap has TSO off");
    // A driver that takes checksums but no TSO: still off.
    dev.activate(1 << VIRTIO_NET_F_GUEST_CSUM);
    assert!(!tso_on(&name));
    dev.activate(OFFLOAD_FEATURES);
    assert!(
        tso_on(&name),
        "the guest accepted TSO: the tap may hand it 64 KiB frames"
    );
    dev.reset();
    assert!(!tso_on(&name), "a reset takes the offloads back");
    assert_eq!(
        tap_offloads(OFFLOAD_FEATURES),
        TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN
    );
    assert_eq!(
        tap_offloads(1 << VIRTIO_NET_F_GUEST_TSO4),
        0,
        "TSO needs GUEST_CSUM"
    );
}

/// The length of the next frame queued on the device's end of the socket pair (peeked).
fn queued_frame_len(dev: &Net) -> Option<usize> {
    let mut byte = 0u8;
    let flags = libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_TRUNC;
    // SAFETY: a 1-byte receive into `byte`, which outlives the call, on the device's open fd;
    // MSG_PEEK leaves the datagram queued, MSG_TRUNC returns its full length.
    let n = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(dev.backend()),
            (&raw mut byte).cast(),
            1,
            flags,
        )
    };
    usize::try_from(n).ok()
}

#[test]
fn receive_fills_a_chain_of_several_buffers_across_memory_regions() {
    use crate::testutil::{memory_two_regions, SPLIT};
    let (mut dev, peer) = net();
    let mem = memory_two_regions();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    // The header is split over two descriptors and the regions' boundary; num_buffers lies
    // in the second descriptor.
    let bufs = [(SPLIT - 7, 7), (SPLIT, 500), (SPLIT + 0x2000, 2000)];
    q.post(&bufs.map(|(a, l)| (a, l, true)));
    let pkt = packet(1200, 5);
    peer.send(&pkt).unwrap();
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used(0), (0, 1212));
    let mut got = Vec::new();
    for (addr, len) in bufs {
        let mut b = vec![0u8; len as usize];
        mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        got.extend(b);
    }
    assert_eq!(
        got[10..12],
        [1, 0],
        "num_buffers is 1, patched in guest memory"
    );
    assert_eq!(got[..10], pkt[..10]);
    assert_eq!(got[12..1212], pkt[12..]);
    assert_eq!(dev.stats().rx_frames, 1);
}

#[test]
fn without_a_receive_buffer_the_frame_stays_in_the_backend() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let pkt = packet(100, 4);
    peer.send(&pkt).unwrap();
    assert!(!dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(
        queued_frame_len(&dev),
        Some(112),
        "not read: the backend still holds the frame"
    );
    q.post(&[(DATA, 64, true), (DATA + 0x1000, 64, true)]);
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used(0), (0, 112));
    assert_eq!(queued_frame_len(&dev), None);
    let mut got = [0u8; 112];
    mem.read_slice(&mut got[..64], GuestAddress(DATA)).unwrap();
    mem.read_slice(&mut got[64..], GuestAddress(DATA + 0x1000))
        .unwrap();
    assert_eq!(got[12..], pkt[12..]);
}

#[test]
fn a_posted_buffer_waits_for_a_frame_and_is_not_used_meanwhile() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post(&[(DATA, 2048, true)]);
    assert!(!dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used_idx(), 0);
    assert_eq!(queue.next_avail(), 0, "the chain went back to the queue");
    let pkt = packet(300, 8);
    peer.send(&pkt).unwrap();
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used(0), (0, 312));
    assert_eq!(queue.next_avail(), 1);
}

#[test]
fn a_frame_that_fills_the_chain_exactly_is_delivered_one_byte_more_is_dropped() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    peer.send(&packet(60, 1)).unwrap();
    peer.send(&packet(61, 2)).unwrap();
    q.post(&[(DATA, 30, true), (DATA + 0x100, 42, true)]);
    q.post(&[(DATA + 0x1000, 30, true), (DATA + 0x1100, 42, true)]);
    dev.process_queue(RX, &mut queue, &mem).unwrap();
    assert_eq!(q.used(0), (0, 72));
    assert_eq!(
        q.used(1),
        (2, 0),
        "73 bytes do not fit 72: dropped, not cut"
    );
    assert_eq!(dev.stats().rx_frames, 1);
    assert_eq!(dev.stats().rx_dropped, 1);
}

#[test]
fn a_runt_frame_is_dropped_and_its_buffer_takes_the_next_frame() {
    let (mut dev, peer) = net();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    peer.send(&[1, 2, 3, 4, 5]).unwrap();
    let pkt = packet(80, 6);
    peer.send(&pkt).unwrap();
    q.post(&[(DATA, 2048, true)]);
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used_idx(), 1);
    assert_eq!(q.used(0), (0, 92));
    assert_eq!(dev.stats().rx_dropped, 1);
    assert_eq!(dev.stats().rx_frames, 1);
}

#[test]
fn transmit_of_a_chain_across_memory_regions_arrives_whole() {
    use crate::testutil::{memory_two_regions, SPLIT};
    let (mut dev, peer) = net();
    let mem = memory_two_regions();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let pkt = packet(3000, 11);
    // The header across the regions' boundary, then two more pieces, out of address order.
    let bufs = [
        (SPLIT - 5, 9u32),
        (SPLIT + 0x100, 3),
        (SPLIT - 0x1000, 3000),
    ];
    let mut done = 0;
    for (addr, len) in bufs {
        mem.write_slice(&pkt[done..done + len as usize], GuestAddress(addr))
            .unwrap();
        done += len as usize;
    }
    q.post(&bufs.map(|(a, l)| (a, l, false)));
    assert!(dev.process_queue(TX, &mut queue, &mem).unwrap());
    let mut got = vec![0u8; MAX_FRAME];
    let n = peer.recv(&mut got).unwrap();
    assert_eq!(n, pkt.len(), "one datagram, the whole frame");
    assert!(got[..n] == pkt[..], "byte for byte");
    assert_eq!(dev.stats().tx_frames, 1);
    assert_eq!(dev.stats().tx_dropped, 0);
}

/// The driver's "big packets" receive buffers and TSO frames come as indirect tables (the
/// device offers VIRTIO_RING_F_INDIRECT_DESC): one ring slot each, served like direct chains.
#[test]
fn receive_and_transmit_through_indirect_tables() {
    let (mut dev, peer) = net();
    assert_ne!(dev.features() & INDIRECT, 0);
    let mem = memory();
    let indirect = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
    let (next, write) = (1u16, 2u16);
    let table = |at: u64, descs: &[(u64, u32, u16)]| {
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let d = virtio_queue::desc::split::Descriptor::new(addr, len, flags, i as u16 + 1);
            mem.write_obj(d, GuestAddress(at + i as u64 * 16)).unwrap();
        }
    };
    // Receive: a 12-byte header buffer and three 1000-byte pages in one table.
    let rx_table = DATA + 0x10_0000;
    let rx_bufs = [
        (DATA, 12),
        (DATA + 0x1000, 1000),
        (DATA + 0x2000, 1000),
        (DATA + 0x3000, 1000),
    ];
    let descs: Vec<(u64, u32, u16)> = rx_bufs
        .iter()
        .enumerate()
        .map(|(i, &(a, l))| {
            (
                a,
                l,
                if i + 1 < rx_bufs.len() {
                    write | next
                } else {
                    write
                },
            )
        })
        .collect();
    table(rx_table, &descs);
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post_raw(&[(rx_table, descs.len() as u32 * 16, indirect, 0)], 0);
    let pkt = packet(2500, 9);
    peer.send(&pkt).unwrap();
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(q.used(0), (0, 2512));
    let mut got = Vec::new();
    for (addr, len) in rx_bufs {
        let mut b = vec![0u8; len as usize];
        mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        got.extend(b);
    }
    assert_eq!(got[..10], pkt[..10]);
    assert_eq!(got[10..12], [1, 0]);
    assert_eq!(got[12..2512], pkt[12..]);

    // Transmit: header and frame in two buffers of one table.
    let tx_table = DATA + 0x20_0000;
    let out = packet(3000, 4);
    mem.write_slice(&out[..VNET_HDR_LEN], GuestAddress(DATA + 0x8000))
        .unwrap();
    mem.write_slice(&out[VNET_HDR_LEN..], GuestAddress(DATA + 0x9000))
        .unwrap();
    table(
        tx_table,
        &[(DATA + 0x8000, 12, next), (DATA + 0x9000, 3000, 0)],
    );
    let mut q = TestQueue::new(&mem, 0x50_0000, 16);
    let mut queue = q.queue();
    q.post_raw(&[(tx_table, 32, indirect, 0)], 0);
    assert!(dev.process_queue(TX, &mut queue, &mem).unwrap());
    let mut sent = vec![0u8; 8192];
    let n = peer.recv(&mut sent).unwrap();
    assert_eq!(sent[..n], out[..]);
}

const MRG: u64 = 1 << VIRTIO_NET_F_MRG_RXBUF;
const TSO: u64 = (1 << VIRTIO_NET_F_GUEST_CSUM) | (1 << VIRTIO_NET_F_GUEST_TSO4);

/// Posts `n` one-buffer receive chains of `len` bytes each, `0x4000` apart from `DATA`.
fn post_buffers(q: &mut TestQueue<'_>, first: u64, n: u64, len: u32) {
    for i in first..first + n {
        q.post(&[(DATA + i * 0x4000, len, true)]);
    }
}

/// Where [`mrg_queue`] puts the used ring.
const USED: u64 = 0x8000;

/// The queue of `q` with its used ring at [`USED`]: the mock lays the used ring out right
/// after 8 available entries, so more than 8 posted chains would overlap it.
fn mrg_queue(q: &TestQueue<'_>) -> Queue {
    let mut queue = q.queue();
    queue.try_set_used_ring_address(GuestAddress(USED)).unwrap();
    queue
}

/// Used entry `i` (head, length) and the used index of a [`mrg_queue`].
fn used_at(mem: &GuestMemoryMmap, i: u16) -> (u32, u32) {
    let [id, len] = mem
        .read_obj::<[u32; 2]>(GuestAddress(USED + 4 + 8 * u64::from(i)))
        .unwrap();
    (id, len)
}

fn used_idx_at(mem: &GuestMemoryMmap) -> u16 {
    mem.read_obj(GuestAddress(USED + 2)).unwrap()
}

/// The `len` bytes of buffer `i` of [`post_buffers`].
fn buffer(mem: &GuestMemoryMmap, i: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    mem.read_slice(&mut b, GuestAddress(DATA + i * 0x4000))
        .unwrap();
    b
}

#[test]
fn the_device_offers_mergeable_receive_buffers() {
    let (dev, _peer) = net();
    assert_ne!(dev.features() & MRG, 0);
}

#[test]
fn mergeable_receive_spreads_a_frame_over_the_chains_it_needs_and_counts_them() {
    let (mut dev, peer) = net();
    dev.activate(MRG | TSO | EVENT_IDX);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = mrg_queue(&q);
    // 9 x 8 KiB: room for the largest TSO frame (65,562 bytes), which is taken first.
    post_buffers(&mut q, 0, 9, 8192);
    let pkt = packet(20_000, 6); // 20,012 bytes: 8192 + 8192 + 3628
    peer.send(&pkt).unwrap();
    let small = packet(100, 2);
    peer.send(&small).unwrap();
    // The second frame needs room for the largest frame again: 6 chains are left (48 KiB).
    // The first frame was expected to be an MTU frame (the first chain); its tail is copied
    // from the host buffer into the second and third.
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(used_idx_at(&mem), 3, "one frame, three chains");
    assert_eq!(used_at(&mem, 0), (0, 8192));
    assert_eq!(used_at(&mem, 1), (1, 8192));
    assert_eq!(used_at(&mem, 2), (2, 3628));
    assert_eq!(
        queue.next_avail(),
        9,
        "the device holds the six chains it did not fill, for the next frames"
    );
    let mut got = buffer(&mem, 0, 8192);
    got.extend(buffer(&mem, 1, 8192));
    got.extend(buffer(&mem, 2, 3628));
    assert_eq!(got[10..12], [3, 0], "num_buffers is 3");
    assert_eq!(got[..10], pkt[..10]);
    assert_eq!(got[12..], pkt[12..]);
    assert_eq!(
        queued_frame_len(&dev),
        Some(112),
        "the next frame waits for room for the largest frame"
    );
    // Three more chains: 9 held again; the small frame takes one, read straight into the
    // chains that hold a frame as long as the last (20,012 bytes).
    post_buffers(&mut q, 9, 3, 8192);
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(used_at(&mem, 3), (3, 112));
    let got = buffer(&mem, 3, 112);
    assert_eq!(got[10..12], [1, 0], "num_buffers is 1");
    assert_eq!(got[12..], small[12..]);
    assert_eq!(dev.stats().rx_frames, 2);
    assert_eq!(queued_frame_len(&dev), None);
}

#[test]
fn without_tso_a_mergeable_receive_needs_room_for_one_mtu_frame() {
    let (mut dev, peer) = net();
    dev.activate(MRG | EVENT_IDX);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = mrg_queue(&q);
    post_buffers(&mut q, 0, 1, 1024);
    let pkt = packet(1514, 1);
    peer.send(&pkt).unwrap();
    assert!(
        !dev.process_queue(RX, &mut queue, &mem).unwrap(),
        "1 KiB of room is less than one MTU frame: the backend is not read"
    );
    assert_eq!(queued_frame_len(&dev), Some(1526));
    assert_eq!(
        queue.next_avail(),
        1,
        "the chain is held until there is room"
    );
    post_buffers(&mut q, 1, 1, 1024);
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(used_at(&mem, 0), (0, 1024));
    assert_eq!(used_at(&mem, 1), (1, 502));
    let mut got = buffer(&mem, 0, 1024);
    got.extend(buffer(&mem, 1, 502));
    assert_eq!(got[10..12], [2, 0]);
    assert_eq!(got[12..], pkt[12..]);
}

#[test]
fn a_mergeable_frame_longer_than_the_room_is_dropped_and_the_chains_kept() {
    let (mut dev, peer) = net();
    dev.activate(MRG | EVENT_IDX);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = mrg_queue(&q);
    post_buffers(&mut q, 0, 1, 2048);
    peer.send(&packet(4000, 3)).unwrap(); // a jumbo frame the guest did not ask for
    let next = packet(60, 4);
    peer.send(&next).unwrap();
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(dev.stats().rx_dropped, 1);
    assert_eq!(
        used_idx_at(&mem),
        1,
        "the chain took the next frame instead"
    );
    assert_eq!(used_at(&mem, 0), (0, 72));
    assert_eq!(buffer(&mem, 0, 72)[12..], next[12..]);
}

#[test]
fn a_mergeable_buffer_smaller_than_the_header_is_malformed() {
    let (mut dev, peer) = net();
    dev.activate(MRG);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = mrg_queue(&q);
    peer.send(&packet(60, 0)).unwrap();
    q.post(&[(DATA, 8, true)]);
    let err = dev.process_queue(RX, &mut queue, &mem).unwrap_err();
    assert!(
        matches!(err, DeviceError::Chain { queue: RX, .. }),
        "{err:?}"
    );
    assert!(format!("{err:?}").contains("12-byte header"), "{err:?}");
}

#[test]
fn a_reset_turns_mergeable_receive_off() {
    let (mut dev, peer) = net();
    dev.activate(MRG | EVENT_IDX);
    dev.reset();
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = mrg_queue(&q);
    post_buffers(&mut q, 0, 1, 2048);
    peer.send(&packet(60, 0)).unwrap();
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    assert_eq!(buffer(&mem, 0, 12)[10..12], [1, 0]);
    assert_eq!(used_at(&mem, 0), (0, 72));
}

#[test]
fn mergeable_frames_longer_or_shorter_than_the_last_arrive_whole() {
    let (mut dev, peer) = net();
    dev.activate(MRG | TSO | EVENT_IDX);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = mrg_queue(&q);
    post_buffers(&mut q, 0, 16, 8192);
    // Small, then large (its tail copied from the host buffer), then large (read straight
    // into guest memory), then small again.
    let frames = [
        packet(60, 1),
        packet(30_000, 2),
        packet(40_000, 3),
        packet(70, 4),
    ];
    for f in &frames {
        peer.send(f).unwrap();
    }
    assert!(dev.process_queue(RX, &mut queue, &mem).unwrap());
    // 72 -> 1 chain; 30,012 -> 4; 40,012 -> 5; then 6 chains are left, 48 KiB: the last frame
    // waits for room for the largest frame.
    assert_eq!(used_idx_at(&mem), 10);
    assert_eq!(queued_frame_len(&dev), Some(82));
    let mut chain = 0u64;
    let mut used = 0u16;
    for f in &frames[..3] {
        let chains = f.len().div_ceil(8192) as u64;
        let mut got = Vec::new();
        for i in chain..chain + chains {
            got.extend(buffer(&mem, i, 8192));
        }
        got.truncate(f.len());
        assert_eq!(got[10..12], (chains as u16).to_le_bytes());
        assert_eq!(got[12..], f[12..], "frame of {} bytes", f.len());
        for i in 0..chains {
            let len = (f.len() - i as usize * 8192).min(8192) as u32;
            assert_eq!(used_at(&mem, used), ((chain + i) as u32, len));
            used += 1;
        }
        chain += chains;
    }
    assert_eq!(dev.stats().rx_frames, 3);
    assert_eq!(dev.stats().rx_dropped, 0);
}
