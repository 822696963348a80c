#![allow(clippy::cast_possible_truncation)] // test data: small known addresses
//! Ring placement for the kernel's vhost-vsock: each ring must lie inside one guest memory
//! region (a host mapping), or the kernel writes past the mapping.

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend};

use super::{ring_host_addr, RingAddrs};
use crate::testutil::{memory_two_regions, MEM_SIZE, SPLIT};

/// A 256-entry queue's used ring: 6 + 8·256 bytes.
const USED_LEN: u64 = 6 + 8 * 256;

#[test]
fn used_ring_crossing_adjacent_regions_is_refused() {
    let mem = memory_two_regions();
    // The two regions are back to back in guest-physical space: vm-memory's own range check
    // sees one contiguous range here, which is what let such a ring through.
    let gpa = SPLIT - 8;
    assert!(mem.check_range(GuestAddress(gpa), USED_LEN as usize));
    assert_eq!(ring_host_addr(&mem, gpa, USED_LEN), None);
}

#[test]
fn ring_inside_either_region_is_accepted_and_translated_there() {
    let mem = memory_two_regions();
    for gpa in [0, SPLIT - USED_LEN, SPLIT, MEM_SIZE as u64 - USED_LEN] {
        let want = mem.get_host_address(GuestAddress(gpa)).unwrap() as u64;
        assert_eq!(
            ring_host_addr(&mem, gpa, USED_LEN),
            Some(want),
            "ring at {gpa:#x}"
        );
    }
    // One byte past the end of guest memory is outside every region.
    assert_eq!(
        ring_host_addr(&mem, MEM_SIZE as u64 - USED_LEN + 1, USED_LEN),
        None
    );
}

#[test]
fn queue_with_used_ring_across_the_boundary_names_the_ring() {
    let mem = memory_two_regions();
    let mut queue = Queue::new(256).unwrap();
    queue.set_desc_table_address(Some(0x1000), Some(0));
    queue.set_avail_ring_address(Some(0x4000), Some(0));
    let used = SPLIT - 8;
    queue.set_used_ring_address(Some(used as u32), Some(0));
    let err = RingAddrs::resolve(1, &queue, &mem).unwrap_err();
    assert!(err.contains("queue 1 used ring"), "{err}");
    assert!(err.contains(&format!("{used:#x}")), "{err}");
    queue.set_used_ring_address(Some(SPLIT as u32), Some(0));
    let rings = RingAddrs::resolve(1, &queue, &mem).unwrap();
    assert_eq!(
        rings.used,
        mem.get_host_address(GuestAddress(SPLIT)).unwrap() as u64
    );
}
