#![allow(clippy::cast_possible_truncation)] // test data: small known values
use vm_memory::Bytes;

use super::*;
use crate::chain::ChainError;
use crate::testutil::{memory, TestQueue, DATA};

#[test]
fn fills_writable_buffers_with_non_constant_bytes() {
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post(&[(DATA, 100, true), (DATA + 0x1000, 156, true)]);
    let mut rng = Rng::new();
    assert!(rng.process_queue(0, &mut queue, &mem).unwrap());
    assert_eq!(q.used(0), (0, 256));
    let mut a = [0u8; 100];
    let mut b = [0u8; 156];
    mem.read_slice(&mut a, GuestAddress(DATA)).unwrap();
    mem.read_slice(&mut b, GuestAddress(DATA + 0x1000)).unwrap();
    let all: Vec<u8> = a.iter().chain(b.iter()).copied().collect();
    let distinct = all.iter().collect::<std::collections::BTreeSet<_>>().len();
    assert!(
        distinct > 64,
        "256 random bytes have many distinct values, got {distinct}"
    );
}

#[test]
fn caps_a_huge_request_at_the_per_request_maximum() {
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post(&[(DATA, 1 << 20, true)]);
    Rng::new().process_queue(0, &mut queue, &mem).unwrap();
    assert_eq!(q.used(0), (0, RNG_MAX_REQUEST as u32));
}

#[test]
fn a_device_readable_buffer_is_a_wrong_direction() {
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    q.post(&[(DATA, 16, false)]);
    let err = Rng::new().process_queue(0, &mut queue, &mem).unwrap_err();
    assert!(
        matches!(
            err,
            DeviceError::Chain {
                queue: 0,
                source: ChainError::Direction { .. } | ChainError::Oversized { .. }
            }
        ),
        "{err:?}"
    );
    assert_eq!(q.used_idx(), 0);
}

#[test]
fn queue_one_does_not_exist() {
    let mem = memory();
    let q = TestQueue::new(&mem, 0, 16);
    let mut queue = q.queue();
    let err = Rng::new().process_queue(1, &mut queue, &mem).unwrap_err();
    assert!(matches!(err, DeviceError::NoSuchQueue { queue: 1 }));
}

use vm_memory::GuestAddress;
