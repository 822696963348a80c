//! virtio-blk over a raw image ([`crate::disk::DiskImage`]).
//!
//! One request queue. Reads and writes go straight between the image and the guest's data
//! buffers, `preadv`/`pwritev` over `iovec`s into guest memory ([`crate::iov`]), as QEMU
//! does. On an O_DIRECT image that needs the offset and every buffer's address and length
//! to be whole 4 KiB blocks ([`crate::sys::DIRECT_ALIGN`]); other requests there go through
//! an aligned bounce buffer (and whole-block read-modify-write in [`crate::disk`]), counted
//! in [`BlockStats::bounced`]. FLUSH is `fdatasync`; GET_ID returns the disk's serial. A read-only
//! disk offers VIRTIO_BLK_F_RO and answers writes with VIRTIO_BLK_S_IOERR. Requests larger
//! than the advertised `seg_max` × `size_max`, or shaped against the rules, are malformed
//! input: the device goes to NEEDS_RESET (see [`crate::chain`]).

use std::path::PathBuf;

use tracing::warn;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::Queue;
use vmhost_memory::GuestMemoryMmap;

use crate::chain::{Chain, ChainError, ChainLimits};
use crate::device::{serve_single_queue, DeviceError, VirtioDevice};
use crate::disk::{CacheMode, DiskError, DiskImage, SECTOR_SIZE};
use crate::iov::IoVecs;
use crate::persist::{DeviceState, StateError};
use crate::sys::AlignedBuf;

/// Size of the request queue.
pub const BLOCK_QUEUE_SIZE: u16 = 256;
/// Most data segments in one request (`seg_max`).
pub const BLOCK_SEG_MAX: u32 = BLOCK_QUEUE_SIZE as u32 - 2;
/// Largest data segment (`size_max`).
pub const BLOCK_SIZE_MAX: u32 = 128 * 1024;
/// Most data bytes in one request: `seg_max` × `size_max`.
pub const BLOCK_MAX_REQUEST: u64 = BLOCK_SEG_MAX as u64 * BLOCK_SIZE_MAX as u64;

const HEADER_LEN: u64 = 16;
const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;
const LIMITS: ChainLimits = ChainLimits {
    max_segments: BLOCK_SEG_MAX as usize + 2,
    max_readable: HEADER_LEN + BLOCK_MAX_REQUEST,
    max_writable: BLOCK_MAX_REQUEST + 1,
};

/// A disk to attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// The raw image.
    pub path: PathBuf,
    /// Refuse writes and tell the guest the disk is read-only.
    pub read_only: bool,
    /// Host caching.
    pub cache: CacheMode,
    /// Reported by GET_ID (at most 20 bytes are sent).
    pub serial: String,
}

/// Why a block device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image could not be opened.
    #[error("virtio-blk")]
    Image(#[source] DiskError),
    /// The request buffer could not be allocated.
    #[error("virtio-blk: cannot allocate the request buffer")]
    Buffer(#[source] std::io::Error),
}

/// Counters of completed requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Read requests answered OK.
    pub reads: u64,
    /// Write requests answered OK.
    pub writes: u64,
    /// FLUSH requests answered OK (each one an `fdatasync`).
    pub flushes: u64,
    /// Requests answered IOERR or UNSUPP.
    pub errors: u64,
    /// Reads and writes that went through the bounce buffer instead of straight between the
    /// image and guest memory (O_DIRECT requests that are not whole aligned blocks).
    pub bounced: u64,
}

/// A virtio-blk device.
pub struct Block {
    image: DiskImage,
    path: PathBuf,
    /// The image was made by vmhost for this run (an empty disk, a cloud-init seed).
    run_scratch: bool,
    read_only: bool,
    serial: [u8; ID_BYTES],
    capacity: u64,
    buffer: AlignedBuf,
    iovecs: IoVecs,
    stats: BlockStats,
    io_error_logged: bool,
    queue_sizes: [u16; 1],
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("image", &self.image)
            .field("read_only", &self.read_only)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Block {
    /// Opens the image of `config`.
    ///
    /// ```
    /// use vmhost_devices::{Block, BlockConfig, CacheMode, VirtioDevice};
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("disk.img");
    /// std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    /// let config = BlockConfig { path, read_only: true, cache: CacheMode::Writeback, serial: "d1".into() };
    /// let blk = Block::new(&config).unwrap();
    /// assert_eq!(blk.capacity_sectors(), 2048);
    /// assert_eq!(blk.config()[..8], 2048u64.to_le_bytes());
    /// ```
    pub fn new(config: &BlockConfig) -> Result<Self, BlockError> {
        let image = DiskImage::open(&config.path, config.read_only, config.cache)
            .map_err(BlockError::Image)?;
        let mut serial = [0u8; ID_BYTES];
        let bytes = config.serial.as_bytes();
        let n = bytes.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&bytes[..n]);
        Ok(Block {
            capacity: image.size() / SECTOR_SIZE,
            image,
            path: config.path.clone(),
            run_scratch: false,
            read_only: config.read_only,
            serial,
            buffer: AlignedBuf::new(64 * 1024).map_err(BlockError::Buffer)?,
            iovecs: IoVecs::default(),
            stats: BlockStats::default(),
            io_error_logged: false,
            queue_sizes: [BLOCK_QUEUE_SIZE],
        })
    }

    /// Marks the image as made by vmhost for this run (an empty disk, a cloud-init seed): a
    /// restore on another host makes its own and does not look for this path
    /// ([`crate::persist::check_restorable`]).
    pub fn set_run_scratch(&mut self, scratch: bool) {
        self.run_scratch = scratch;
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity
    }

    /// The cache mode in effect: `none` (O_DIRECT) or `writeback`.
    pub fn cache_mode(&self) -> &'static str {
        if self.image.is_direct() {
            "none"
        } else {
            "writeback"
        }
    }

    /// Request counters.
    pub fn stats(&self) -> BlockStats {
        self.stats
    }

    /// Serves one request; returns the bytes written into the guest's buffers.
    fn serve(&mut self, chain: &Chain, mem: &GuestMemoryMmap) -> Result<u32, ChainError> {
        let head = chain.head;
        let readable = chain.readable_len();
        let writable = chain.writable_len();
        if readable < HEADER_LEN {
            return Err(ChainError::Direction {
                head,
                what: "the 16-byte request header must be device-readable",
            });
        }
        if writable == 0 {
            return Err(ChainError::Direction {
                head,
                what: "the status byte must be device-writable",
            });
        }
        let mut header = [0u8; 16];
        chain.read_at(mem, 0, &mut header)?;
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let mut sector = [0u8; 8];
        sector.copy_from_slice(&header[8..16]);
        let sector = u64::from_le_bytes(sector);
        let data_in = writable - 1;
        let (status, written) = match kind {
            VIRTIO_BLK_T_IN => self.read(chain, mem, sector, data_in)?,
            VIRTIO_BLK_T_OUT => (self.write(chain, mem, sector, readable - HEADER_LEN)?, 0),
            VIRTIO_BLK_T_FLUSH => (self.flush(), 0),
            VIRTIO_BLK_T_GET_ID => {
                let n = usize::try_from(data_in).unwrap_or(usize::MAX).min(ID_BYTES);
                chain.write_at(mem, 0, &self.serial[..n])?;
                (VIRTIO_BLK_S_OK, n as u64)
            }
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        if status != VIRTIO_BLK_S_OK {
            self.stats.errors += 1;
        }
        chain.write_at(mem, data_in, &status.to_le_bytes()[..1])?;
        // At most BLOCK_MAX_REQUEST + 1 (checked by the chain limits), which fits in u32.
        Ok(u32::try_from(written + 1).unwrap_or(u32::MAX))
    }

    /// The byte range of `len` bytes at `sector`, if it is whole sectors inside the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        let offset = sector.checked_mul(SECTOR_SIZE)?;
        let end = offset.checked_add(len)?;
        (len % SECTOR_SIZE == 0 && end <= self.capacity * SECTOR_SIZE).then_some(offset)
    }

    fn read(
        &mut self,
        chain: &Chain,
        mem: &GuestMemoryMmap,
        sector: u64,
        len: u64,
    ) -> Result<(u32, u64), ChainError> {
        let Some(offset) = self.range(sector, len) else {
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        };
        // Straight into the guest's data buffers (all writable bytes but the status byte).
        let result = {
            let mut dst = chain.writable_iovecs(mem, &mut self.iovecs, 0, len)?;
            if self.image.takes_vectored(offset, |a| dst.aligned(a)) {
                self.image.read_vectored_at(offset, &mut dst)
            } else {
                drop(dst);
                self.stats.bounced += 1;
                let Some(n) = self.grow_buffer(len) else {
                    return Ok((VIRTIO_BLK_S_IOERR, 0));
                };
                let buf = &mut self.buffer.as_mut_slice()[..n];
                let read = self.image.read_at(offset, buf);
                if read.is_ok() {
                    chain.write_at(mem, 0, buf)?;
                }
                read
            }
        };
        if let Err(e) = result {
            self.log_io_error("read", offset, &e);
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        }
        self.stats.reads += 1;
        Ok((VIRTIO_BLK_S_OK, len))
    }

    fn write(
        &mut self,
        chain: &Chain,
        mem: &GuestMemoryMmap,
        sector: u64,
        len: u64,
    ) -> Result<u32, ChainError> {
        if self.read_only {
            return Ok(VIRTIO_BLK_S_IOERR);
        }
        let Some(offset) = self.range(sector, len) else {
            return Ok(VIRTIO_BLK_S_IOERR);
        };
        // Straight from the guest's data buffers (the readable bytes after the header).
        let result = {
            let mut src = chain.readable_iovecs(mem, &mut self.iovecs, HEADER_LEN, len)?;
            if self.image.takes_vectored(offset, |a| src.aligned(a)) {
                self.image.write_vectored_at(offset, &mut src)
            } else {
                drop(src);
                self.stats.bounced += 1;
                let Some(n) = self.grow_buffer(len) else {
                    return Ok(VIRTIO_BLK_S_IOERR);
                };
                let buf = &mut self.buffer.as_mut_slice()[..n];
                chain.read_at(mem, HEADER_LEN, buf)?;
                self.image.write_at(offset, buf)
            }
        };
        if let Err(e) = result {
            self.log_io_error("write", offset, &e);
            return Ok(VIRTIO_BLK_S_IOERR);
        }
        self.stats.writes += 1;
        Ok(VIRTIO_BLK_S_OK)
    }

    fn flush(&mut self) -> u32 {
        match self.image.flush() {
            Ok(()) => {
                self.stats.flushes += 1;
                VIRTIO_BLK_S_OK
            }
            Err(e) => {
                self.log_io_error("flush", 0, &e);
                VIRTIO_BLK_S_IOERR
            }
        }
    }

    /// Grows the request buffer to `len` bytes (bounded by the chain limits); None if it
    /// cannot be allocated.
    fn grow_buffer(&mut self, len: u64) -> Option<usize> {
        let len = usize::try_from(len).ok()?;
        if self.buffer.len() < len {
            self.buffer = AlignedBuf::new(len).ok()?;
        }
        Some(len)
    }

    fn log_io_error(&mut self, op: &str, offset: u64, e: &std::io::Error) {
        if !self.io_error_logged {
            self.io_error_logged = true;
            warn!(op, offset, error = %e, "virtio-blk: host I/O error, answering IOERR");
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_SIZE_MAX)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX)
            // A many-segment request takes one ring slot (its segments are in a table).
            | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC);
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    /// `struct virtio_blk_config` up to `blk_size`: capacity, size_max, seg_max, geometry
    /// (zero), blk_size (512).
    fn config(&self) -> Vec<u8> {
        let mut c = Vec::with_capacity(24);
        c.extend_from_slice(&self.capacity.to_le_bytes());
        c.extend_from_slice(&BLOCK_SIZE_MAX.to_le_bytes());
        c.extend_from_slice(&BLOCK_SEG_MAX.to_le_bytes());
        c.extend_from_slice(&[0; 4]);
        c.extend_from_slice(&512u32.to_le_bytes());
        c
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        serve_single_queue(index, queue, mem, &LIMITS, |c, m| self.serve(c, m))
    }

    /// Requests are served whole under the transport's lock, so a quiesced disk has none in
    /// flight: its state is its identity, checked again on restore.
    fn save_state(&mut self, _queues: &mut [Queue]) -> Result<DeviceState, StateError> {
        Ok(DeviceState::Block(self.state()))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), StateError> {
        self.check_restore(state)
    }
}

#[path = "block_persist.rs"]
mod persist;
pub use persist::BlockState;

#[cfg(test)]
#[path = "block_tests.rs"]
mod tests;
