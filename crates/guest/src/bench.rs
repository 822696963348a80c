//! `numa-bench`: for each vCPU and each guest cell, a dependent-load pointer chase (latency) and
//! a sequential read stream (bandwidth), both in ring 3 and timed with `rdtsc` in the guest.
//!
//! The VMM builds the chains (vmhost-vcpu's `payload::bench`) and fills one
//! [`crate::mailbox::BenchSlot`] per cell; these are the constants both sides use.

/// Cache-line size the chain is built on.
pub const LINE: u64 = 64;
/// Dependent loads per chase loop iteration.
pub const LOADS_PER_ITER: u64 = 8;
/// Bytes read per stream loop iteration (a stream length is a multiple of it).
pub const STREAM_STEP: u64 = 128;
