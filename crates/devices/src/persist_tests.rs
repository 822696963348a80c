#![allow(clippy::cast_possible_truncation)] // test data: small known values
//! Save and restore on real parts: guest memory from vm-memory, virtio-queue's rings as a
//! driver fills them, real image files, socket pairs, eventfds.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::block::{Block, BlockConfig};
use crate::device::VirtioDevice;
use crate::interrupt::Interrupt;
use crate::net::Net;
use crate::rng::Rng;
use crate::testutil::{activate, memory, TestQueue, DATA, MEM_SIZE};
use crate::vsock::Vsock;

/// A transport over `mem` for `device`, and the eventfd its interrupt writes.
fn transport(device: Box<dyn VirtioDevice>, mem: &GuestMemoryMmap) -> (MmioTransport, EventFd) {
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
    (
        MmioTransport::new(device, mem.clone(), interrupt).unwrap(),
        irq,
    )
}

/// A second guest RAM holding a copy of `mem` (what a snapshot or a migration carries).
fn copy_of(mem: &GuestMemoryMmap) -> GuestMemoryMmap {
    let mut bytes = vec![0u8; MEM_SIZE];
    mem.read_slice(&mut bytes, GuestAddress(0)).unwrap();
    let copy = memory();
    copy.write_slice(&bytes, GuestAddress(0)).unwrap();
    copy
}

/// The state through JSON, as it travels.
fn through_json(transport: &TransportState, device: &DeviceState) -> (TransportState, DeviceState) {
    let state = DevicesState {
        virtio: vec![VirtioSlotState {
            pci: None,
            base: 0xd000_0000,
            transport: transport.clone(),
            device: device.clone(),
        }],
        serial: None,
        legacy: None,
        ioapic: None,
    };
    let json = serde_json::to_string(&state).unwrap();
    let back: DevicesState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, state);
    let slot = back.virtio.into_iter().next().unwrap();
    (slot.transport, slot.device)
}

fn reg(dev: &MmioTransport, reg: u32) -> u32 {
    let mut b = [0u8; 4];
    dev.read(u64::from(reg), &mut b);
    u32::from_le_bytes(b)
}

fn used_idx(mem: &GuestMemoryMmap, q: &QueueState) -> u16 {
    mem.read_obj(GuestAddress(q.used_ring + 2)).unwrap()
}

/// Used element `i` of `q` in `mem`: (head, length).
fn used_elem(mem: &GuestMemoryMmap, q: &QueueState, i: u16) -> (u32, u32) {
    let [id, len] = mem
        .read_obj::<[u32; 2]>(GuestAddress(q.used_ring + 4 + 8 * u64::from(i)))
        .unwrap();
    (id, len)
}

const SECTORS_PER_REQ: u64 = 8;
const REQ_LEN: u32 = 4096;

fn hdr_at(i: u64) -> u64 {
    DATA + i * 0x1000
}
fn data_at(i: u64) -> u64 {
    DATA + 0x10_0000 + i * 0x1000
}
fn status_at(i: u64) -> u64 {
    DATA + 0x20_0000 + i
}

/// Posts block request `i`: `kind` at `sector`, a 4 KiB data buffer (filled with `fill` for a
/// write), a status byte.
fn post_request(
    q: &mut TestQueue<'_>,
    mem: &GuestMemoryMmap,
    i: u64,
    kind: u32,
    sector: u64,
    fill: u8,
) {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(hdr_at(i))).unwrap();
    mem.write_slice(&[fill; REQ_LEN as usize], GuestAddress(data_at(i)))
        .unwrap();
    mem.write_obj(0xeeu8, GuestAddress(status_at(i))).unwrap();
    let write = kind == VIRTIO_BLK_T_IN;
    q.post(&[
        (hdr_at(i), 16, false),
        (data_at(i), REQ_LEN, write),
        (status_at(i), 1, true),
    ]);
}

fn block_on(path: &Path) -> Block {
    Block::new(&BlockConfig {
        path: path.to_path_buf(),
        read_only: false,
        cache: crate::disk::CacheMode::Writeback,
        serial: "disk0".into(),
    })
    .unwrap()
}

/// The disk is saved mid-stream: two requests used, two available and not notified yet. The
/// restored device, on a copy of guest RAM, starts at the saved ring index: it completes the
/// two waiting requests once each (the used ring grows by exactly two, in order, the read
/// sees the write before it) and redoes none of the first two; the source's RAM is untouched
/// after the save.
#[test]
fn a_disk_saved_mid_stream_continues_at_the_saved_ring_index_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0u8; 64 * 512]).unwrap();
    let mem = memory();
    let (mut dev, _irq) = transport(Box::new(block_on(&path)), &mem);
    let mut q = TestQueue::new(&mem, 0, 16);
    activate(&mut dev, &[(0, &q, 16)]);
    post_request(&mut q, &mem, 0, VIRTIO_BLK_T_OUT, 0, b'A');
    post_request(&mut q, &mem, 1, VIRTIO_BLK_T_OUT, SECTORS_PER_REQ, b'B');
    dev.notify(0);
    post_request(&mut q, &mem, 2, VIRTIO_BLK_T_OUT, 0, b'C');
    post_request(&mut q, &mem, 3, VIRTIO_BLK_T_IN, 0, 0);

    let (ts, ds) = dev.save().unwrap();
    let saved_q = ts.queues[0];
    assert_eq!((saved_q.next_avail, saved_q.next_used), (2, 2));
    assert_eq!(used_idx(&mem, &saved_q), 2);
    let target_mem = copy_of(&mem);
    let (ts, ds) = through_json(&ts, &ds);

    let (mut restored, irq) = transport(Box::new(block_on(&path)), &target_mem);
    restored.restore(&ts, &ds).unwrap();
    assert_eq!(
        restored.save().unwrap(),
        (ts.clone(), ds),
        "the state reads back"
    );
    assert_eq!(reg(&restored, VIRTIO_MMIO_STATUS), 15);
    restored.resume();

    assert_eq!(
        used_idx(&target_mem, &saved_q),
        4,
        "two more requests, no more"
    );
    assert_eq!(
        used_elem(&target_mem, &saved_q, 2),
        (6, 1),
        "request 2 (head 6)"
    );
    assert_eq!(
        used_elem(&target_mem, &saved_q, 3),
        (9, REQ_LEN + 1),
        "request 3 (head 9)"
    );
    for i in 2..4 {
        let s: u8 = target_mem.read_obj(GuestAddress(status_at(i))).unwrap();
        assert_eq!(s, 0, "request {i}: VIRTIO_BLK_S_OK");
    }
    let mut read = vec![0u8; REQ_LEN as usize];
    target_mem
        .read_slice(&mut read, GuestAddress(data_at(3)))
        .unwrap();
    assert!(
        read.iter().all(|&b| b == b'C'),
        "the read saw the write before it"
    );
    let image = std::fs::read(&path).unwrap();
    assert!(image[..4096].iter().all(|&b| b == b'C'));
    assert!(image[4096..8192].iter().all(|&b| b == b'B'));
    assert!(image[8192..].iter().all(|&b| b == 0));
    assert_eq!(
        ts.interrupt_status, 1,
        "not acknowledged by the driver at the save"
    );
    assert_eq!(
        irq.read().unwrap(),
        1,
        "resume signalled the new used buffers once"
    );
    assert!(
        restored.raise_restored_interrupt(),
        "bits still unacknowledged: raised again once the vCPUs exist"
    );
    assert_eq!(irq.read().unwrap(), 1);
    assert_eq!(
        used_idx(&mem, &saved_q),
        2,
        "the source did nothing after the save"
    );
}

/// The register file and the queue round trip through JSON into a fresh transport, with the
/// pending interrupt status; the line is raised again only by `raise_restored_interrupt`
/// (once the restored VM's vCPUs exist), not by the restore or by serving the queues.
#[test]
fn transport_state_round_trips_with_the_interrupt_status() {
    let mem = memory();
    let (mut dev, _irq) = transport(Box::new(Rng::new()), &mem);
    let q = TestQueue::new(&mem, 0, 16);
    activate(&mut dev, &[(0, &q, 16)]);
    dev.write(
        u64::from(VIRTIO_MMIO_DEVICE_FEATURES_SEL),
        &1u32.to_le_bytes(),
    );
    dev.interrupt().signal_used_queue().unwrap();
    let (ts, ds) = dev.save().unwrap();
    assert_eq!(ts.interrupt_status, 1);
    assert_eq!(ts.device_features_sel, 1);
    let (ts, ds) = through_json(&ts, &ds);

    let target = copy_of(&mem);
    let (mut restored, irq) = transport(Box::new(Rng::new()), &target);
    restored.restore(&ts, &ds).unwrap();
    assert_eq!(reg(&restored, VIRTIO_MMIO_INTERRUPT_STATUS), 1);
    assert_eq!(reg(&restored, VIRTIO_MMIO_STATUS), 15);
    assert_eq!(reg(&restored, VIRTIO_MMIO_QUEUE_READY), 1);
    assert_eq!(
        reg(&restored, VIRTIO_MMIO_DEVICE_FEATURES),
        1,
        "high word (VERSION_1) selected"
    );
    assert!(irq.read().is_err(), "no interrupt before resume");
    assert_eq!(restored.save().unwrap().0, ts);
    restored.resume();
    assert!(irq.read().is_err(), "serving empty queues raises nothing");
    assert!(restored.raise_restored_interrupt());
    assert_eq!(irq.read().unwrap(), 1, "the pending interrupt raised again");
    restored.interrupt().ack(1);
    assert!(
        !restored.raise_restored_interrupt(),
        "acknowledged: nothing to raise"
    );
    assert!(irq.read().is_err());
}

/// virtio-rng carries on: a buffer made available before the save is filled after the
/// restore, on the target's RAM.
#[test]
fn rng_round_trip_serves_the_buffer_left_available() {
    let mem = memory();
    let (mut dev, _irq) = transport(Box::new(Rng::new()), &mem);
    let mut q = TestQueue::new(&mem, 0, 16);
    activate(&mut dev, &[(0, &q, 16)]);
    q.post(&[(DATA, 64, true)]);
    dev.notify(0);
    q.post(&[(DATA + 0x1000, 32, true)]);
    let (ts, ds) = dev.save().unwrap();
    assert_eq!(ds, DeviceState::Rng(RngState {}));
    let (ts, ds) = through_json(&ts, &ds);
    let target = copy_of(&mem);
    let (mut restored, _irq) = transport(Box::new(Rng::new()), &target);
    restored.restore(&ts, &ds).unwrap();
    restored.resume();
    let q0 = ts.queues[0];
    assert_eq!(used_idx(&target, &q0), 2);
    assert_eq!(used_elem(&target, &q0, 1), (1, 32));
    assert_eq!(used_idx(&mem, &q0), 1, "not on the source");
}

const MAC: [u8; 6] = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];
const MRG: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;

fn nic(mac: [u8; 6]) -> (Net, UnixDatagram) {
    let (a, b) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    (Net::new(std::fs::File::from(OwnedFd::from(a)), mac), b)
}

/// The NIC's state round trips; a mergeable receive chain the device held (waiting for a
/// frame) is given back on save, so the restored device takes it again; another MAC is
/// refused, naming both.
#[test]
fn net_state_round_trips_and_gives_back_held_receive_chains() {
    let mem = memory();
    let (mut net, _peer) = nic(MAC);
    net.activate(MRG);
    let q = TestQueue::new(&mem, 0, 16);
    let mut rx = q.queue();
    let tx = TestQueue::new(&mem, 0x2000, 16).queue();
    let mut q = q;
    q.post(&[(DATA, 1024, true)]); // less than one MTU frame: held, no frame read
    assert!(!net.process_queue(0, &mut rx, &mem).unwrap());
    assert_eq!(rx.next_avail(), 1, "the chain is held");
    let mut queues = [rx, tx];
    let state = net.save_state(&mut queues).unwrap();
    assert_eq!(queues[0].next_avail(), 0, "given back");
    let json = serde_json::to_string(&state).unwrap();
    let back: DeviceState = serde_json::from_str(&json).unwrap();
    assert_eq!(
        back,
        DeviceState::Net(NetState {
            mac: MAC,
            offloads: false
        })
    );

    let (mut same, _p) = nic(MAC);
    same.restore_state(&back).unwrap();
    let (mut other, _p) = nic([0x02, 0, 0, 0, 0, 1]);
    let err = other.restore_state(&back).unwrap_err().to_string();
    assert!(
        err.contains("02:11:22:33:44:55") && err.contains("02:00:00:00:00:01"),
        "{err}"
    );
    let err = same
        .restore_state(&DeviceState::Rng(RngState {}))
        .unwrap_err();
    assert!(matches!(err, StateError::Kind { .. }), "{err:?}");
}

/// A restored vsock device tells the guest its connections are gone: the event buffer it had
/// posted holds VIRTIO_VSOCK_EVENT_TRANSPORT_RESET and is used, with the interrupt.
#[test]
fn a_restored_vsock_posts_a_transport_reset_event() {
    let dir = tempfile::tempdir().unwrap();
    let mem = memory();
    let vsock = Vsock::new(3, &dir.path().join("a.sock")).unwrap();
    let (mut dev, _irq) = transport(Box::new(vsock), &mem);
    let q0 = TestQueue::new(&mem, 0, 16);
    let q1 = TestQueue::new(&mem, 0x2000, 16);
    let mut q2 = TestQueue::new(&mem, 0x4000, 16);
    activate(&mut dev, &[(0, &q0, 16), (1, &q1, 16), (2, &q2, 16)]);
    mem.write_obj(0xffff_ffffu32, GuestAddress(DATA)).unwrap();
    q2.post(&[(DATA, 8, true)]);
    dev.notify(2);
    assert_eq!(q2.used_idx(), 0, "event buffers stay with the device");
    let (ts, ds) = dev.save().unwrap();
    assert_eq!(ds, DeviceState::Vsock(VsockState { cid: 3 }));
    let (ts, ds) = through_json(&ts, &ds);

    let target = copy_of(&mem);
    let vsock = Vsock::new(3, &dir.path().join("b.sock")).unwrap();
    let (mut restored, irq) = transport(Box::new(vsock), &target);
    restored.restore(&ts, &ds).unwrap();
    let event_q = ts.queues[2];
    assert_eq!(used_idx(&target, &event_q), 1);
    assert_eq!(used_elem(&target, &event_q, 0), (0, 4));
    let event: u32 = target.read_obj(GuestAddress(DATA)).unwrap();
    assert_eq!(event, crate::vsock::event::TRANSPORT_RESET);
    assert_eq!(reg(&restored, VIRTIO_MMIO_INTERRUPT_STATUS) & 1, 1);
    restored.resume();
    assert!(irq.read().is_err(), "raised only once the vCPUs exist");
    assert!(restored.raise_restored_interrupt());
    assert_eq!(irq.read().unwrap(), 1);
    assert_eq!(q2.used_idx(), 0, "not on the source");
    let other = Vsock::new(4, &dir.path().join("c.sock")).unwrap();
    let (mut wrong, _irq) = transport(Box::new(other), &memory());
    let err = wrong.restore(&ts, &ds).unwrap_err().to_string();
    assert!(
        err.contains("vsock guest CID") && err.contains('4'),
        "{err}"
    );
}

fn disk_state(path: &Path, sectors: u64, run_scratch: bool) -> DevicesState {
    let q = QueueState {
        max_size: 256,
        size: 0,
        ready: false,
        desc_table: 0,
        avail_ring: 0,
        used_ring: 0,
        next_avail: 0,
        next_used: 0,
        event_idx: false,
    };
    DevicesState {
        virtio: vec![VirtioSlotState {
            pci: None,
            base: 0xd000_0000,
            transport: TransportState {
                device_type: 2,
                status: 0,
                device_features_sel: 0,
                driver_features_sel: 0,
                acked_features: 0,
                queue_sel: 0,
                config_generation: 0,
                interrupt_status: 0,
                queues: vec![q],
            },
            device: DeviceState::Block(BlockState {
                path: path.to_path_buf(),
                run_scratch,
                read_only: false,
                capacity_sectors: sectors,
                serial: "disk0".into(),
            }),
        }],
        serial: None,
        legacy: None,
        ioapic: None,
    }
}

/// Before any memory moves: a disk image that is not there is refused, naming its path; one
/// of another size is refused with both sizes; a per-run image is not looked for.
#[test]
fn a_state_with_a_missing_disk_is_refused_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("gone.img");
    let err = check_restorable(&disk_state(&missing, 8, false)).unwrap_err();
    assert!(matches!(err, PersistError::DiskMissing { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    check_restorable(&disk_state(&missing, 8, true)).unwrap();

    let present = dir.path().join("disk.img");
    std::fs::write(&present, vec![0u8; 16 * 512]).unwrap();
    check_restorable(&disk_state(&present, 16, false)).unwrap();
    let err = check_restorable(&disk_state(&present, 8, false)).unwrap_err();
    assert!(
        err.to_string().contains("8192 bytes here") || err.to_string().contains("4096"),
        "{err}"
    );
}

/// A block device built here on another image than the saved one is refused.
#[test]
fn a_disk_restored_onto_another_image_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.img");
    let b = dir.path().join("b.img");
    std::fs::write(&a, vec![0u8; 4096]).unwrap();
    std::fs::write(&b, vec![0u8; 4096]).unwrap();
    let mut blk = block_on(&b);
    let state = DeviceState::Block(BlockState {
        path: a.clone(),
        run_scratch: false,
        read_only: false,
        capacity_sectors: 8,
        serial: "disk0".into(),
    });
    let err = blk.restore_state(&state).unwrap_err().to_string();
    assert!(
        err.contains("disk image path") && err.contains("a.img"),
        "{err}"
    );
}

/// A saved rng transport after the driver's handshake, for corrupting.
fn saved_rng() -> (TransportState, DeviceState) {
    let mem = memory();
    let (mut dev, _irq) = transport(Box::new(Rng::new()), &mem);
    let q = TestQueue::new(&mem, 0, 16);
    activate(&mut dev, &[(0, &q, 16)]);
    dev.save().unwrap()
}

/// Corrupted states are refused with what is wrong, and the fresh transport is left as it
/// was (never half applied, never a panic).
#[test]
fn a_corrupted_transport_state_is_refused_and_nothing_is_applied() {
    let (good, ds) = saved_rng();
    type Corrupt = fn(&mut TransportState);
    let cases: [(Corrupt, &str); 10] = [
        (|t| t.queues[0].size = 3, "size 3"),
        (|t| t.queues[0].size = 512, "size 512"),
        (|t| t.queues[0].max_size = 128, "maximum size 128"),
        (
            |t| t.queues[0].desc_table = 0x1_0000_0000,
            "inside guest RAM",
        ),
        (
            |t| t.queues[0].used_ring = (MEM_SIZE as u64) - 8,
            "inside guest RAM",
        ),
        (|t| t.queues[0].avail_ring = 0x1001, "misaligned"),
        (|t| t.device_type = 2, "device type"),
        (|t| t.status |= 0x1000, "Status"),
        (|t| t.interrupt_status = 4, "InterruptStatus"),
        (|t| t.acked_features |= 1 << 40, "not all offered"),
    ];
    for (corrupt, expect) in cases {
        let mut bad = good.clone();
        corrupt(&mut bad);
        let (mut fresh, _irq) = transport(Box::new(Rng::new()), &memory());
        let err = fresh.restore(&bad, &ds).unwrap_err();
        let message = format!("{err}");
        assert!(message.contains(expect), "{expect}: {message}");
        assert_eq!(
            reg(&fresh, VIRTIO_MMIO_STATUS),
            0,
            "{expect}: nothing applied"
        );
    }
    let mut fewer = good.clone();
    fewer.queues.clear();
    let (mut fresh, _irq) = transport(Box::new(Rng::new()), &memory());
    assert!(fresh
        .restore(&fewer, &ds)
        .unwrap_err()
        .to_string()
        .contains("queue count"));
    let json = serde_json::to_string(&good)
        .unwrap()
        .replace("\"status\"", "\"stat\"");
    assert!(serde_json::from_str::<TransportState>(&json).is_err());
}

fn arb_queue() -> impl Strategy<Value = QueueState> {
    (
        any::<u16>(),
        prop_oneof![Just(16u16), Just(256u16), any::<u16>()],
        any::<bool>(),
        prop_oneof![Just(0u64), 0u64..(MEM_SIZE as u64 + 0x1000), any::<u64>()],
        (
            any::<u64>(),
            any::<u64>(),
            any::<u16>(),
            any::<u16>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(size, max_size, ready, desc_table, (a, u, na, nu, ev))| QueueState {
                max_size,
                size,
                ready,
                desc_table,
                avail_ring: a % (MEM_SIZE as u64 * 2),
                used_ring: u % (MEM_SIZE as u64 * 2),
                next_avail: na,
                next_used: nu,
                event_idx: ev,
            },
        )
}

fn arb_transport() -> impl Strategy<Value = TransportState> {
    (
        prop_oneof![Just(4u32), any::<u32>()],
        any::<u32>(),
        prop_oneof![Just(1u64 << 32), any::<u64>()],
        0u32..8,
        proptest::collection::vec(arb_queue(), 0..3),
    )
        .prop_map(
            |(device_type, status, acked_features, interrupt_status, queues)| TransportState {
                device_type,
                status: status & 0xff,
                device_features_sel: 0,
                driver_features_sel: 0,
                acked_features,
                queue_sel: 0,
                config_generation: 0,
                interrupt_status,
                queues,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any transport state decodes into a refusal or a transport whose ready queues lie in
    /// guest RAM and whose state reads back as given; it never panics.
    #[test]
    fn any_transport_state_is_refused_or_applied_whole(state in arb_transport()) {
        let mem = memory();
        let (mut fresh, _irq) = transport(Box::new(Rng::new()), &mem);
        let device = DeviceState::Rng(RngState {});
        if fresh.restore(&state, &device).is_ok() {
            let (back, _) = fresh.save().unwrap();
            prop_assert_eq!(&back.queues, &state.queues);
            for q in &state.queues {
                if q.ready {
                    let end = q.desc_table + 16 * u64::from(q.size);
                    prop_assert!(end <= MEM_SIZE as u64);
                }
            }
        } else {
            prop_assert_eq!(reg(&fresh, VIRTIO_MMIO_STATUS), 0);
        }
    }
}

/// A NIC restored with the driver running announces the guest's MAC on its new backend: one
/// broadcast RARP frame from the MAC, behind a virtio-net header.
#[test]
fn a_restored_nic_announces_its_mac_on_the_new_backend() {
    let mem = memory();
    let (net, _old_peer) = nic(MAC);
    let (mut dev, _irq) = transport(Box::new(net), &mem);
    let rx = TestQueue::new(&mem, 0, 16);
    let tx = TestQueue::new(&mem, 0x2000, 16);
    activate(&mut dev, &[(0, &rx, 16), (1, &tx, 16)]);
    let (ts, ds) = dev.save().unwrap();
    let (ts, ds) = through_json(&ts, &ds);

    let target = copy_of(&mem);
    let (net, peer) = nic(MAC);
    let (mut restored, _irq) = transport(Box::new(net), &target);
    restored.restore(&ts, &ds).unwrap();
    let mut frame = [0u8; 128];
    let n = peer
        .recv(&mut frame)
        .expect("the announcement was sent at restore");
    let frame = &frame[..n];
    assert_eq!(n, crate::net::VNET_HDR_LEN + 60);
    let eth = &frame[crate::net::VNET_HDR_LEN..];
    assert_eq!(eth[..6], [0xff; 6], "broadcast");
    assert_eq!(eth[6..12], MAC, "from the guest's MAC");
    assert_eq!(eth[12..14], [0x80, 0x35], "RARP");
    assert_eq!(eth[20..22], [0, 3], "reverse request");
    assert_eq!(eth[22..28], MAC, "sender hardware address");
    assert!(peer.recv(&mut [0u8; 128]).is_err(), "one frame");
}
