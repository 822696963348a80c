//! Descriptor chains checked before a device touches them.
//!
//! virtio-queue's iterator ends a chain quietly when a descriptor cannot be read, when an
//! indirect table is malformed or after `queue size` descriptors (a loop). [`Chain::parse`]
//! turns each of those into an error, checks every buffer against guest memory and the order
//! of directions (device-readable before device-writable), and bounds the number of segments
//! and bytes, so that devices only see well-formed requests.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryError, Permissions};
use vmhost_memory::GuestMemoryMmap;

use crate::iov::{GuestDst, GuestSrc, IoVecs};

/// A guest request that breaks the virtio rules; the device goes to NEEDS_RESET.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// The chain ended early: an unreadable descriptor, a bad indirect table or a loop.
    #[error("descriptor chain {head} is truncated, loops or has an invalid indirect table")]
    Broken {
        /// Head descriptor index.
        head: u16,
    },
    /// A buffer lies (partly) outside guest memory.
    #[error("descriptor chain {head}: buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutOfRange {
        /// Head descriptor index.
        head: u16,
        /// Guest-physical address of the buffer.
        addr: u64,
        /// Its length.
        len: u32,
    },
    /// A device-readable buffer follows a device-writable one.
    #[error("descriptor chain {head}: a device-readable buffer follows a device-writable one")]
    ReadableAfterWritable {
        /// Head descriptor index.
        head: u16,
    },
    /// The request has buffers in a direction the device does not accept, or too few bytes.
    #[error("descriptor chain {head}: {what}")]
    Direction {
        /// Head descriptor index.
        head: u16,
        /// What the device expected.
        what: &'static str,
    },
    /// More segments or bytes than the device advertised.
    #[error("descriptor chain {head}: {what} exceeds the device limit of {limit}")]
    Oversized {
        /// Head descriptor index.
        head: u16,
        /// `segments` or `bytes`.
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// Guest memory could not be accessed although the range was checked.
    #[error("descriptor chain {head}: guest memory access failed")]
    Memory {
        /// Head descriptor index.
        head: u16,
        /// The cause.
        #[source]
        source: GuestMemoryError,
    },
}

/// One buffer of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// Limits a device puts on one chain.
#[derive(Debug, Clone, Copy)]
pub struct ChainLimits {
    /// Most descriptors in a chain.
    pub max_segments: usize,
    /// Most bytes in the device-readable part.
    pub max_readable: u64,
    /// Most bytes in the device-writable part.
    pub max_writable: u64,
}

/// A validated chain: its readable buffers, then its writable ones.
#[derive(Debug, Clone, Default)]
pub struct Chain {
    /// Head descriptor index (what goes into the used ring).
    pub head: u16,
    /// Device-readable buffers, in order.
    pub readable: Vec<Segment>,
    /// Device-writable buffers, in order.
    pub writable: Vec<Segment>,
}

impl Chain {
    /// Walks and checks a chain popped from a queue.
    pub fn parse<M>(mut chain: DescriptorChain<M>, limits: &ChainLimits) -> Result<Self, ChainError>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        let head = chain.head_index();
        let mut descs = Vec::new();
        for desc in chain.by_ref() {
            if descs.len() >= limits.max_segments {
                return Err(oversized(head, "segments", limits.max_segments as u64));
            }
            descs.push(desc);
        }
        // A loop ends after `queue size` descriptors, an unreadable descriptor or a bad
        // indirect table ends the walk early: either way the last one still says NEXT.
        if descs.last().is_none_or(|d| d.has_next()) {
            return Err(ChainError::Broken { head });
        }
        let mem = chain.memory();
        let mut out = Chain {
            head,
            ..Chain::default()
        };
        let (mut readable, mut writable) = (0u64, 0u64);
        for desc in descs {
            let seg = Segment {
                addr: desc.addr(),
                len: desc.len(),
            };
            if desc.is_write_only() {
                writable += u64::from(seg.len);
                if writable > limits.max_writable {
                    return Err(oversized(head, "writable bytes", limits.max_writable));
                }
                out.writable.push(seg);
            } else {
                if !out.writable.is_empty() {
                    return Err(ChainError::ReadableAfterWritable { head });
                }
                readable += u64::from(seg.len);
                if readable > limits.max_readable {
                    return Err(oversized(head, "readable bytes", limits.max_readable));
                }
                out.readable.push(seg);
            }
            if !mem.check_range(seg.addr, seg.len as usize, Permissions::ReadWrite) {
                return Err(ChainError::OutOfRange {
                    head,
                    addr: seg.addr.raw_value(),
                    len: seg.len,
                });
            }
        }
        Ok(out)
    }

    /// Total bytes of the device-readable buffers.
    pub fn readable_len(&self) -> u64 {
        self.readable.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Total bytes of the device-writable buffers.
    pub fn writable_len(&self) -> u64 {
        self.writable.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Copies device-readable bytes from `offset` (in the readable stream) into `buf`.
    pub fn read_at<M: GuestMemory>(
        &self,
        mem: &M,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), ChainError> {
        let mut done = 0usize;
        for (addr, n) in span(&self.readable, offset, buf.len()) {
            let dst = &mut buf[done..done + n];
            mem.read_slice(dst, addr)
                .map_err(|source| ChainError::Memory {
                    head: self.head,
                    source,
                })?;
            done += n;
        }
        Ok(())
    }

    /// Copies `buf` into the device-writable stream at `offset`.
    pub fn write_at<M: GuestMemory>(
        &self,
        mem: &M,
        offset: u64,
        buf: &[u8],
    ) -> Result<(), ChainError> {
        let mut done = 0usize;
        for (addr, n) in span(&self.writable, offset, buf.len()) {
            mem.write_slice(&buf[done..done + n], addr)
                .map_err(|source| ChainError::Memory {
                    head: self.head,
                    source,
                })?;
            done += n;
        }
        Ok(())
    }
}

impl Chain {
    /// The device-readable bytes `offset..offset + len` as `iovec`s into guest memory (for
    /// `pwritev`/`writev`), in `store`. `len` is cut at the end of the readable buffers.
    pub fn readable_iovecs<'a>(
        &self,
        mem: &'a GuestMemoryMmap,
        store: &'a mut IoVecs,
        offset: u64,
        len: u64,
    ) -> Result<GuestSrc<'a>, ChainError> {
        let mut src = GuestSrc::new(store);
        for (addr, n) in span(&self.readable, offset, to_usize(len)) {
            src.push(mem, addr, n)
                .map_err(|source| ChainError::Memory {
                    head: self.head,
                    source,
                })?;
        }
        Ok(src)
    }

    /// The device-writable bytes `offset..offset + len` as `iovec`s into guest memory (for
    /// `preadv`/`readv`), in `store`. `len` is cut at the end of the writable buffers.
    pub fn writable_iovecs<'a>(
        &self,
        mem: &'a GuestMemoryMmap,
        store: &'a mut IoVecs,
        offset: u64,
        len: u64,
    ) -> Result<GuestDst<'a>, ChainError> {
        let mut dst = GuestDst::new(store);
        self.push_writable_span(mem, &mut dst, offset, len)?;
        Ok(dst)
    }

    /// Appends all of this chain's device-writable bytes to `dst`, after what it holds (a
    /// frame spread over several receive chains, `VIRTIO_NET_F_MRG_RXBUF`).
    pub fn push_writable<'a>(
        &self,
        mem: &'a GuestMemoryMmap,
        dst: &mut GuestDst<'a>,
    ) -> Result<(), ChainError> {
        self.push_writable_span(mem, dst, 0, self.writable_len())
    }

    /// Appends the device-writable bytes `offset..offset + len` to `dst`.
    fn push_writable_span<'a>(
        &self,
        mem: &'a GuestMemoryMmap,
        dst: &mut GuestDst<'a>,
        offset: u64,
        len: u64,
    ) -> Result<(), ChainError> {
        for (addr, n) in span(&self.writable, offset, to_usize(len)) {
            dst.push(mem, addr, n)
                .map_err(|source| ChainError::Memory {
                    head: self.head,
                    source,
                })?;
        }
        Ok(())
    }
}

/// A byte count as usize (64-bit hosts: never cut).
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn oversized(head: u16, what: &'static str, limit: u64) -> ChainError {
    ChainError::Oversized { head, what, limit }
}

/// The (address, length) pieces of `len` bytes at `offset` in a segment stream; stops at the
/// stream's end (callers check the lengths first).
fn span(segs: &[Segment], offset: u64, len: usize) -> Span<'_> {
    Span {
        segs: segs.iter(),
        offset,
        left: len,
    }
}

struct Span<'a> {
    segs: std::slice::Iter<'a, Segment>,
    offset: u64,
    left: usize,
}

impl Iterator for Span<'_> {
    type Item = (GuestAddress, usize);

    fn next(&mut self) -> Option<Self::Item> {
        while self.left > 0 {
            let seg = self.segs.next()?;
            let seg_len = u64::from(seg.len);
            if self.offset >= seg_len {
                self.offset -= seg_len;
                continue;
            }
            let n = usize::try_from(seg_len - self.offset).map_or(self.left, |r| r.min(self.left));
            // Within a checked segment: addr + offset + n <= addr + len, which fits.
            let addr = seg.addr.unchecked_add(self.offset);
            self.left -= n;
            self.offset = 0;
            return Some((addr, n));
        }
        None
    }
}
