//! Reading kernel and initramfs bytes from files whose `read` returns less than asked.
//!
//! `read(2)` on a regular file may return fewer bytes than asked before the end of the file:
//! network and virtual file systems do (a 9p mount with a small `msize`, FUSE, NFS), and any
//! read may fail with `EINTR`. The libraries vmhost loads with assume otherwise: vm-memory's
//! `read_exact_volatile_from` issues one `read` per guest memory region and fails with
//! `PartialBuffer` on a short one (linux-loader's bzImage loader and the initramfs use it), and
//! linux-loader reads the bzImage setup header with a single `read_volatile`. [`FullReads`]
//! wraps the file so that every read fills the whole buffer unless the file ends, retrying
//! `EINTR`: the bytes land where they belong and only a file that really is shorter reads
//! short.

use std::io::{self, ErrorKind, Read, Seek, SeekFrom};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice};

/// The source `R`, with every `read` and `read_volatile` looping until the buffer is full or the file
/// ends (a read of 0 bytes), and retrying `EINTR`.
#[derive(Debug)]
pub(super) struct FullReads<'a, R>(pub &'a mut R);

fn interrupted(e: &VolatileMemoryError) -> bool {
    matches!(e, VolatileMemoryError::IOError(io) if io.kind() == ErrorKind::Interrupted)
}

impl<R: ReadVolatile> ReadVolatile for FullReads<'_, R> {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let mut done = 0;
        while done < buf.len() {
            let mut rest = buf.offset(done)?;
            match self.0.read_volatile(&mut rest) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if interrupted(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}

impl<R: Read> Read for FullReads<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
            match self.0.read(rest) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}

impl<R: Seek> Seek for FullReads<'_, R> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        self.0.seek(to)
    }
}
