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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes handed out one at a time, with an `EINTR` before each.
    struct Trickle<'a> {
        bytes: &'a [u8],
        interrupt: bool,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.interrupt = !self.interrupt;
            if self.interrupt {
                return Err(io::Error::from_raw_os_error(libc::EINTR));
            }
            let n = self.bytes.len().min(buf.len()).min(1);
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    #[test]
    fn reads_fill_the_buffer_and_stop_short_only_at_the_end_of_the_file() {
        let mut src = Trickle {
            bytes: b"kernel",
            interrupt: false,
        };
        let mut buf = [0u8; 4];
        assert_eq!(FullReads(&mut src).read(&mut buf).unwrap(), 4);
        assert_eq!(&buf, b"kern");
        // A truncated file still reads short, so the loaders' errors for it stay.
        assert_eq!(FullReads(&mut src).read(&mut buf).unwrap(), 2);
        assert_eq!(&buf[..2], b"el");
        assert_eq!(FullReads(&mut src).read(&mut buf).unwrap(), 0);
    }
}
