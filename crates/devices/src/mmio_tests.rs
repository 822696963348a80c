#![allow(clippy::cast_possible_truncation)] // test data: small known values
use std::sync::Arc;

use virtio_bindings::virtio_config::*;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::rng::Rng;
use crate::testutil::{memory, TestQueue, DATA, F_NEXT, F_WRITE};

struct Rig {
    dev: MmioTransport,
    irq: EventFd,
    interrupt: Arc<Interrupt>,
}

fn rig(mem: &GuestMemoryMmap) -> Rig {
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
    let dev = MmioTransport::new(Box::new(Rng::new()), mem.clone(), interrupt.clone()).unwrap();
    Rig {
        dev,
        irq,
        interrupt,
    }
}

fn rd(dev: &MmioTransport, reg: u32) -> u32 {
    let mut b = [0u8; 4];
    dev.read(u64::from(reg), &mut b);
    u32::from_le_bytes(b)
}

fn wr(dev: &mut MmioTransport, reg: u32, v: u32) {
    dev.write(u64::from(reg), &v.to_le_bytes());
}

/// ACKNOWLEDGE, DRIVER, features (VERSION_1 only), FEATURES_OK.
fn negotiate(dev: &mut MmioTransport) {
    negotiate_with(dev, 0);
}

/// [`negotiate`] with `low` (feature bits 0–31, e.g. VIRTIO_RING_F_EVENT_IDX) accepted too.
fn negotiate_with(dev: &mut MmioTransport, low: u32) {
    wr(dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[0]);
    wr(dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[1]);
    if low != 0 {
        wr(dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        wr(dev, VIRTIO_MMIO_DRIVER_FEATURES, low);
    }
    wr(dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    wr(
        dev,
        VIRTIO_MMIO_DRIVER_FEATURES,
        1 << (VIRTIO_F_VERSION_1 - 32),
    );
    wr(dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[2]);
}

/// Programs queue 0 from the mock's addresses and sets it ready.
fn setup_queue(dev: &mut MmioTransport, q: &TestQueue<'_>, size: u32) {
    let m = &q.mock;
    wr(dev, VIRTIO_MMIO_QUEUE_SEL, 0);
    wr(dev, VIRTIO_MMIO_QUEUE_NUM, size);
    wr(
        dev,
        VIRTIO_MMIO_QUEUE_DESC_LOW,
        low32(m.desc_table_addr().0),
    );
    wr(dev, VIRTIO_MMIO_QUEUE_AVAIL_LOW, low32(m.avail_addr().0));
    wr(dev, VIRTIO_MMIO_QUEUE_USED_LOW, low32(m.used_addr().0));
    wr(dev, VIRTIO_MMIO_QUEUE_READY, 1);
}

fn driver_ok(dev: &mut MmioTransport) {
    let s = rd(dev, VIRTIO_MMIO_STATUS);
    wr(dev, VIRTIO_MMIO_STATUS, s | VIRTIO_CONFIG_S_DRIVER_OK);
}

#[test]
fn identification_registers() {
    let mem = memory();
    let r = rig(&mem);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_VERSION), 2);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_DEVICE_ID), 4);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_VENDOR_ID), MMIO_VENDOR_ID);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_QUEUE_NUM_MAX), 256);
}

#[test]
fn unaligned_or_narrow_register_reads_return_zero() {
    let mem = memory();
    let r = rig(&mem);
    let mut b = [0xffu8; 2];
    r.dev.read(0, &mut b);
    assert_eq!(
        b,
        [0xff, 0xff],
        "a 2-byte register read leaves the buffer alone"
    );
    let mut b = [0xffu8; 4];
    r.dev.read(2, &mut b);
    assert_eq!(b, [0; 4]);
}

#[test]
fn device_features_offer_version_1_in_the_high_word() {
    let mem = memory();
    let mut r = rig(&mem);
    wr(&mut r.dev, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_DEVICE_FEATURES), 1);
    wr(&mut r.dev, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    // The rng's only feature: VIRTIO_RING_F_EVENT_IDX (bit 29).
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_DEVICE_FEATURES), 1 << 29);
}

#[test]
fn features_ok_is_refused_without_version_1() {
    let mem = memory();
    let mut r = rig(&mem);
    wr(&mut r.dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[1]);
    wr(&mut r.dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[2]);
    assert_eq!(
        rd(&r.dev, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK,
        0
    );
}

#[test]
fn features_ok_is_refused_for_features_not_offered() {
    let mem = memory();
    let mut r = rig(&mem);
    wr(&mut r.dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[1]);
    wr(&mut r.dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    wr(&mut r.dev, VIRTIO_MMIO_DRIVER_FEATURES, 1);
    wr(&mut r.dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    wr(&mut r.dev, VIRTIO_MMIO_DRIVER_FEATURES, 1 << 5);
    wr(&mut r.dev, VIRTIO_MMIO_STATUS, DRIVER_INIT_SEQUENCE[2]);
    assert_eq!(
        rd(&r.dev, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK,
        0
    );
}

#[test]
fn queue_registers_are_ignored_before_features_ok() {
    let mem = memory();
    let mut r = rig(&mem);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_READY, 1);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_QUEUE_READY), 0);
    negotiate(&mut r.dev);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_READY, 1);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_QUEUE_READY), 1);
}

#[test]
fn notify_serves_the_queue_and_raises_the_vring_interrupt() {
    let mem = memory();
    let mut r = rig(&mem);
    let mut q = TestQueue::new(&mem, 0, 16);
    negotiate(&mut r.dev);
    setup_queue(&mut r.dev, &q, 16);
    driver_ok(&mut r.dev);
    assert_eq!(r.dev.acked_features(), 1 << VIRTIO_F_VERSION_1);
    q.post(&[(DATA, 64, true)]);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
    assert_eq!(q.used_idx(), 1);
    assert_eq!(q.used(0), (0, 64));
    assert_eq!(
        rd(&r.dev, VIRTIO_MMIO_INTERRUPT_STATUS),
        VIRTIO_MMIO_INT_VRING
    );
    assert_eq!(r.irq.read().unwrap(), 1);
    wr(&mut r.dev, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
    assert_eq!(r.interrupt.status(), 0);
}

#[test]
fn a_malformed_chain_sets_needs_reset_until_the_driver_resets() {
    let mem = memory();
    let mut r = rig(&mem);
    let mut q = TestQueue::new(&mem, 0, 16);
    negotiate(&mut r.dev);
    setup_queue(&mut r.dev, &q, 16);
    driver_ok(&mut r.dev);
    // A buffer past the end of guest memory.
    q.post(&[(MEM_END - 8, 64, true)]);
    r.dev.notify(0);
    assert!(r.dev.needs_reset());
    assert_eq!(q.used_idx(), 0, "nothing is used from a malformed chain");
    assert_eq!(r.interrupt.status(), VIRTIO_MMIO_INT_CONFIG);
    // Later notifications are ignored, even for good chains.
    q.post(&[(DATA, 64, true)]);
    r.dev.notify(0);
    assert_eq!(q.used_idx(), 0);
    // The driver cannot clear NEEDS_RESET by writing status; only a reset does.
    let s = rd(&r.dev, VIRTIO_MMIO_STATUS);
    wr(
        &mut r.dev,
        VIRTIO_MMIO_STATUS,
        s & !VIRTIO_CONFIG_S_NEEDS_RESET,
    );
    assert!(r.dev.needs_reset());
    wr(&mut r.dev, VIRTIO_MMIO_STATUS, 0);
    assert_eq!(rd(&r.dev, VIRTIO_MMIO_STATUS), 0);
    assert_eq!(r.interrupt.status(), 0);
    assert_eq!(
        rd(&r.dev, VIRTIO_MMIO_QUEUE_READY),
        0,
        "reset clears the queues"
    );
}

const MEM_END: u64 = crate::testutil::MEM_SIZE as u64;

#[test]
fn an_invalid_queue_size_or_misaligned_ring_is_ignored_and_the_last_good_value_kept() {
    let mem = memory();
    let mut r = rig(&mem);
    negotiate(&mut r.dev);
    let max = r.dev.queues[0].max_size();
    for bad in [0, 3, u32::from(max) * 2, 0x1_0000, u32::MAX] {
        wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NUM, bad);
        assert_eq!(r.dev.queues[0].size(), max, "QueueNum {bad:#x}");
    }
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NUM, 16);
    assert_eq!(r.dev.queues[0].size(), 16);
    // Descriptor table: 16-byte alignment; available ring: 2; used ring: 4.
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_DESC_LOW, 0x1000);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_DESC_LOW, 0x2008);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_DESC_HIGH, 1);
    assert_eq!(r.dev.queues[0].desc_table(), 0x1_0000_1000);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x3001);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x3002);
    assert_eq!(r.dev.queues[0].avail_ring(), 0x3002);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_USED_LOW, 0x4000);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_USED_LOW, 0x4002);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_USED_HIGH, 2);
    assert_eq!(r.dev.queues[0].used_ring(), 0x2_0000_4000);
    assert!(
        !r.dev.needs_reset(),
        "an ignored write is not an error state"
    );
}

#[test]
fn a_driver_looping_on_reset_and_bad_input_stays_within_the_device_log_budget() {
    let mem = memory();
    let mut r = rig(&mem);
    let cycles = 1000u32;
    for _ in 0..cycles {
        wr(&mut r.dev, VIRTIO_MMIO_STATUS, 0);
        negotiate(&mut r.dev);
        // Many bad writes, one warning per reset.
        for _ in 0..10 {
            wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NUM, 3);
        }
    }
    // The cycles run well inside one window: its burst was written, the rest counted (and
    // reported when the next window opens or the device goes away).
    assert_eq!(
        r.dev.log_budget.unreported(),
        u64::from(cycles - DEVICE_LOG_BURST)
    );
}

#[test]
fn rings_outside_guest_memory_are_found_without_virtio_queue() {
    let mem = memory();
    let mut q = Queue::new(16).unwrap();
    q.try_set_desc_table_address(GuestAddress(0)).unwrap();
    q.try_set_avail_ring_address(GuestAddress(0x1000)).unwrap();
    q.try_set_used_ring_address(GuestAddress(0x2000)).unwrap();
    assert!(rings_in_memory(&q, &mem));
    // The used ring (6 + 8 * 16 = 134 bytes) at MEM_END - 132 ends 2 bytes past memory; at
    // MEM_END - 136 it fits.
    q.try_set_used_ring_address(GuestAddress(MEM_END - 132))
        .unwrap();
    assert!(!rings_in_memory(&q, &mem));
    q.try_set_used_ring_address(GuestAddress(MEM_END - 136))
        .unwrap();
    assert!(rings_in_memory(&q, &mem));
    q.try_set_desc_table_address(GuestAddress(u64::MAX - 0xf))
        .unwrap();
    assert!(!rings_in_memory(&q, &mem));
}

#[test]
fn driver_ok_with_a_queue_outside_guest_memory_needs_reset() {
    let mem = memory();
    let mut r = rig(&mem);
    negotiate(&mut r.dev);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NUM, 16);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_DESC_LOW, 0);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_DESC_HIGH, 1);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x1000);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_USED_LOW, 0x2000);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_READY, 1);
    driver_ok(&mut r.dev);
    assert!(r.dev.needs_reset());
}

#[test]
fn an_available_index_far_ahead_needs_reset_instead_of_spinning() {
    let mem = memory();
    let mut r = rig(&mem);
    let q = TestQueue::new(&mem, 0, 16);
    negotiate(&mut r.dev);
    setup_queue(&mut r.dev, &q, 16);
    driver_ok(&mut r.dev);
    q.mock.avail().idx().store(1000);
    r.dev.notify(0);
    assert!(r.dev.needs_reset());
}

#[test]
fn a_broken_device_leaves_another_device_working() {
    let mem = memory();
    let mut bad = rig(&mem);
    let mut good = rig(&mem);
    let mut qb = TestQueue::new(&mem, 0, 16);
    let mut qg = TestQueue::new(&mem, 0x8000, 16);
    for (r, q) in [(&mut bad, &qb), (&mut good, &qg)] {
        negotiate(&mut r.dev);
        setup_queue(&mut r.dev, q, 16);
        driver_ok(&mut r.dev);
    }
    // A descriptor loop: 0 -> 1 -> 0.
    qb.post_raw(
        &[
            (DATA, 8, F_WRITE | F_NEXT, 1),
            (DATA, 8, F_WRITE | F_NEXT, 0),
        ],
        0,
    );
    bad.dev.notify(0);
    assert!(bad.dev.needs_reset());
    qg.post(&[(DATA + 0x1000, 32, true)]);
    good.dev.notify(0);
    assert!(!good.dev.needs_reset());
    assert_eq!(qg.used(0), (0, 32));
}

#[test]
fn config_space_reads_past_the_end_are_zero() {
    let mem = memory();
    let r = rig(&mem);
    let mut b = [0xffu8; 8];
    r.dev.read(0x100, &mut b);
    assert_eq!(b, [0; 8], "virtio-rng has no configuration space");
}

#[test]
fn with_event_idx_the_device_rearms_notifications_and_interrupts_only_when_asked() {
    use vm_memory::{Bytes, GuestAddress};
    let mem = memory();
    let mut r = rig(&mem);
    let mut q = TestQueue::new(&mem, 0, 16);
    negotiate_with(&mut r.dev, 1 << VIRTIO_RING_F_EVENT_IDX);
    // The mock lays the used ring right after the avail ring's entries, over used_event:
    // the used ring goes elsewhere here, as a driver with EVENT_IDX lays it out.
    let used = 0x8000u64;
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_SEL, 0);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NUM, 16);
    wr(
        &mut r.dev,
        VIRTIO_MMIO_QUEUE_DESC_LOW,
        low32(q.mock.desc_table_addr().0),
    );
    wr(
        &mut r.dev,
        VIRTIO_MMIO_QUEUE_AVAIL_LOW,
        low32(q.mock.avail_addr().0),
    );
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_USED_LOW, low32(used));
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_READY, 1);
    driver_ok(&mut r.dev);
    let used_idx = || mem.read_obj::<u16>(GuestAddress(used + 2)).unwrap();
    // used_event (after the avail ring's 16 entries): interrupt when used idx passes 1.
    let used_event = GuestAddress(q.mock.avail_addr().0 + 4 + 2 * 16);
    let avail_event = GuestAddress(used + 4 + 8 * 16);
    mem.write_obj(1u16, used_event).unwrap();
    q.post(&[(DATA, 64, true)]);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
    assert_eq!(used_idx(), 1);
    assert!(
        r.irq.read().is_err(),
        "used idx 1 has not passed used_event 1: no interrupt"
    );
    assert_eq!(
        mem.read_obj::<u16>(avail_event).unwrap(),
        1,
        "the device asks to be notified for the next buffer"
    );
    q.post(&[(DATA + 0x1000, 64, true)]);
    wr(&mut r.dev, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
    assert_eq!(used_idx(), 2);
    assert_eq!(r.irq.read().unwrap(), 1, "used idx 2 passed used_event 1");
    assert_eq!(mem.read_obj::<u16>(avail_event).unwrap(), 2);
}

/// Regression: with EVENT_IDX, a receive queue whose buffers wait for frames made the
/// transport re-serve it forever (the I/O thread spun and the NIC went dead).
#[test]
fn with_event_idx_a_receive_queue_waiting_for_frames_returns() {
    use std::fs::File;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixDatagram;
    let (a, peer) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let net = crate::net::Net::new(File::from(OwnedFd::from(a)), [2, 0, 0, 0, 0, 1]);
    let mem = memory();
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    let interrupt = Arc::new(Interrupt::new(irq.try_clone().unwrap()));
    let mut dev = MmioTransport::new(Box::new(net), mem.clone(), interrupt).unwrap();
    let mut rx = TestQueue::new(&mem, 0, 16);
    negotiate_with(&mut dev, 1 << VIRTIO_RING_F_EVENT_IDX);
    setup_queue(&mut dev, &rx, 16);
    driver_ok(&mut dev);
    rx.post(&[(DATA, 2048, true)]);
    rx.post(&[(DATA + 0x1000, 2048, true)]);
    let (tx, done) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        dev.notify(0); // no frame yet: the buffers stay
        let _ = tx.send(());
        dev
    });
    done.recv_timeout(std::time::Duration::from_secs(5))
        .expect("notify returned while the receive queue waits for frames");
    let mut dev = worker.join().unwrap();
    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&[0xab; 60]);
    peer.send(&frame).unwrap();
    dev.notify(0); // the backend became readable
    assert_eq!(rx.used_idx(), 1, "the frame went into the first buffer");
    assert_eq!(rx.used(0), (0, 72));
}

#[test]
fn a_mergeable_receive_short_of_room_holds_its_buffers_and_asks_for_the_next() {
    use crate::net::Net;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixDatagram;
    use virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;
    use vm_memory::Bytes;

    let (a, peer) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let mut net = Net::new(std::fs::File::from(OwnedFd::from(a)), [2, 0, 0, 0, 0, 1]);
    net.activate((1 << VIRTIO_NET_F_MRG_RXBUF) | (1 << VIRTIO_RING_F_EVENT_IDX));
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    // The mock lays the used ring over the avail ring's used_event: move it, as a driver with
    // EVENT_IDX lays it out. used_event 1: interrupt when the used index passes 1.
    let used = 0x8000u64;
    queue.try_set_used_ring_address(GuestAddress(used)).unwrap();
    queue.set_event_idx(true);
    mem.write_obj(1u16, GuestAddress(q.mock.avail_addr().0 + 4 + 2 * 16))
        .unwrap();
    let avail_event = || {
        mem.read_obj::<u16>(GuestAddress(used + 4 + 8 * 16))
            .unwrap()
    };
    let used_elem = |i: u64| {
        mem.read_obj::<[u32; 2]>(GuestAddress(used + 4 + 8 * i))
            .unwrap()
    };
    // Two buffers of 512 bytes: less than one MTU frame, so the frame waits for more.
    q.post(&[(DATA, 512, true)]);
    q.post(&[(DATA + 0x1000, 512, true)]);
    let mut frame = vec![0u8; 12 + 1000];
    frame[12] = 0xee;
    peer.send(&frame).unwrap();
    assert!(!serve(&mut net, 0, &mut queue, &mem, true).unwrap());
    assert_eq!(queue.next_avail(), 2, "the device holds both buffers");
    assert_eq!(
        avail_event(),
        2,
        "and asks the driver to notify when it makes buffer 2 available"
    );
    q.post(&[(DATA + 0x2000, 512, true)]);
    // Room for an MTU frame now: the 1,012-byte frame takes two buffers, published together
    // (used index 0 -> 2), and used_event 1 lies among them: an interrupt.
    assert!(serve(&mut net, 0, &mut queue, &mem, true).unwrap());
    assert_eq!(mem.read_obj::<u16>(GuestAddress(used + 2)).unwrap(), 2);
    assert_eq!(used_elem(0), [0, 512]);
    assert_eq!(used_elem(1), [1, 500]);
    assert_eq!(
        queue.next_avail(),
        3,
        "the third buffer is held for the next frame"
    );
    assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA + 12)).unwrap(), 0xee);
    assert_eq!(mem.read_obj::<u16>(GuestAddress(DATA + 10)).unwrap(), 2);
}

#[test]
fn entries_added_together_count_for_the_interrupt_decision() {
    use vm_memory::Bytes;
    let mem = memory();
    let q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let used = 0x8000u64;
    queue.try_set_used_ring_address(GuestAddress(used)).unwrap();
    let used_event = GuestAddress(q.mock.avail_addr().0 + 4 + 2 * 16);
    // used_event 4: the driver wants an interrupt once the used index passes 4.
    mem.write_obj(4u16, used_event).unwrap();
    crate::device::add_used_together(0, &mut queue, &mem, &[(0, 10), (1, 20), (2, 30)]).unwrap();
    assert_eq!(mem.read_obj::<u16>(GuestAddress(used + 2)).unwrap(), 3);
    assert!(
        !needs_interrupt(&queue, &mem, true, 0).unwrap(),
        "0..3 does not pass 4"
    );
    assert!(
        needs_interrupt(&queue, &mem, false, 0).unwrap(),
        "always without EVENT_IDX"
    );
    crate::device::add_used_together(0, &mut queue, &mem, &[(3, 1), (4, 1)]).unwrap();
    assert_eq!(queue.next_used(), 5);
    assert!(
        needs_interrupt(&queue, &mem, true, 3).unwrap(),
        "3..5 passes 4"
    );
    assert!(
        crate::device::add_used_together(0, &mut queue, &mem, &[(16, 1)]).is_err(),
        "a head outside the queue"
    );
}
