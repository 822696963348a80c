//! Loading a vmlinux without copying its `.bss`.
//!
//! A vmlinux's last loadable segment usually carries `.bss` and `.brk` inside its file size,
//! because a section with contents (`.init.scratch`) follows them in the same segment: Debian's
//! 6.1 kernel has 17 MiB of such bytes among its 59 MiB of segments. The ELF rules say a
//! `SHT_NOBITS` section's memory is zero whatever the file holds at that place, and vmhost loads
//! the kernel into guest RAM it has just allocated, which is zero. [`SparseElf`] is the file as
//! the ELF loader reads it, except that the byte ranges of `SHT_NOBITS` sections are not read
//! and their guest memory is not written: the loader still sees every byte "read".
//!
//! The holes are found from the section headers: each `SHT_NOBITS` section's addresses, mapped
//! into the file through the `PT_LOAD` segment whose file-backed addresses contain them. An image
//! without section headers, or with headers that do not parse, has no holes and loads whole.

use std::io::{self, Read, Seek, SeekFrom};
use std::ops::Range;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice};

use super::image::{le16, le32, le64};

/// `sh_type` of a section that occupies no file space.
const SHT_NOBITS: u32 = 8;
/// `p_type` of a loadable segment.
const PT_LOAD: u32 = 1;
/// Sizes of an ELF64 section header and program header.
const SHDR_SIZE: usize = 64;
const PHDR_SIZE: usize = 56;
/// Most section and program headers read (a vmlinux has about 40 sections and 5 segments).
const MAX_SHDRS: usize = 256;
const MAX_PHDRS: usize = 64;

/// The file ranges of a 64-bit ELF's `SHT_NOBITS` sections that lie inside the file-backed part
/// of a `PT_LOAD` segment, sorted and merged (Debian's 6.1 vmlinux: `.bss` and `.brk`, one range
/// of 17.2 MiB). Empty when the file has no (usable) section headers.
pub(super) fn nobits_file_ranges<F: Read + Seek>(file: &mut F) -> io::Result<Vec<Range<u64>>> {
    let mut ehdr = [0u8; 64];
    file.seek(SeekFrom::Start(0))?;
    file.read_exact(&mut ehdr)?;
    let (phoff, shoff) = (le64(&ehdr, 32), le64(&ehdr, 40));
    let (phentsize, phnum) = (usize::from(le16(&ehdr, 54)), usize::from(le16(&ehdr, 56)));
    let (shentsize, shnum) = (usize::from(le16(&ehdr, 58)), usize::from(le16(&ehdr, 60)));
    if shoff == 0
        || shnum == 0
        || shnum > MAX_SHDRS
        || shentsize != SHDR_SIZE
        || phentsize != PHDR_SIZE
        || phnum > MAX_PHDRS
    {
        return Ok(Vec::new());
    }
    let phdrs = read_table(file, phoff, phnum * PHDR_SIZE)?;
    let shdrs = read_table(file, shoff, shnum * SHDR_SIZE)?;
    // (vaddr range backed by the file, file offset of its start) of each PT_LOAD.
    let segments: Vec<(Range<u64>, u64)> = phdrs
        .chunks_exact(PHDR_SIZE)
        .filter(|p| le32(p, 0) == PT_LOAD)
        .filter_map(|p| {
            let (offset, vaddr, filesz) = (le64(p, 8), le64(p, 16), le64(p, 32));
            Some((vaddr..vaddr.checked_add(filesz)?, offset))
        })
        .collect();
    let mut holes: Vec<Range<u64>> = shdrs
        .chunks_exact(SHDR_SIZE)
        .filter(|s| le32(s, 4) == SHT_NOBITS)
        .filter_map(|s| {
            let (addr, size) = (le64(s, 16), le64(s, 32));
            let end = addr.checked_add(size)?;
            let (seg, offset) = segments
                .iter()
                .find(|(seg, _)| seg.start <= addr && addr < seg.end)?;
            // Only the part the file backs: past the segment's file size nothing is read.
            let end = end.min(seg.end);
            let start = offset.checked_add(addr - seg.start)?;
            Some(start..start.checked_add(end - addr)?)
        })
        .filter(|r| !r.is_empty())
        .collect();
    holes.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(holes.len());
    for h in holes {
        match merged.last_mut() {
            Some(last) if h.start <= last.end => last.end = last.end.max(h.end),
            _ => merged.push(h),
        }
    }
    Ok(merged)
}

fn read_table<F: Read + Seek>(file: &mut F, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut table = vec![0u8; len];
    file.seek(SeekFrom::Start(offset))?;
    file.read_exact(&mut table)?;
    Ok(table)
}

/// A kernel file whose `holes` (file ranges) read as "done" without touching the destination:
/// for loading into guest memory that is already zero (see the module documentation).
pub(super) struct SparseElf<'a, F> {
    file: &'a mut F,
    pos: u64,
    holes: Vec<Range<u64>>,
    /// Bytes not copied because they lie in a hole.
    pub skipped: u64,
}

impl<'a, F: Seek> SparseElf<'a, F> {
    /// `file` with `holes` (sorted, disjoint), positioned at its start.
    pub(super) fn new(file: &'a mut F, holes: Vec<Range<u64>>) -> io::Result<Self> {
        file.seek(SeekFrom::Start(0))?;
        Ok(SparseElf {
            file,
            pos: 0,
            holes,
            skipped: 0,
        })
    }

    /// The hole holding `pos`, or the start of the next one.
    fn at(&self, pos: u64) -> (Option<u64>, u64) {
        match self.holes.iter().find(|h| pos < h.end) {
            Some(h) if h.start <= pos => (Some(h.end), h.end),
            Some(h) => (None, h.start),
            None => (None, u64::MAX),
        }
    }
}

impl<F: Read> Read for SparseElf<'_, F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // Headers and notes: plain reads (the loader reads those with `Read`).
        let n = self.file.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<F: Seek> Seek for SparseElf<'_, F> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        self.pos = self.file.seek(to)?;
        Ok(self.pos)
    }
}

impl<F: ReadVolatile + Seek> ReadVolatile for SparseElf<'_, F> {
    /// Fills all of `buf` (the loader asks for a whole segment in one call) except the parts
    /// in holes, which are left as they are; returns fewer bytes only at the end of the file.
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let len = buf.len();
        let mut done = 0usize;
        while done < len {
            let pos = self.pos;
            let left = len - done;
            let (in_hole, boundary) = self.at(pos);
            let span = usize::try_from(boundary - pos).map_or(left, |s| s.min(left));
            if in_hole.is_some() {
                done += span;
                self.skipped += span as u64;
                self.pos += span as u64;
                self.file
                    .seek(SeekFrom::Start(self.pos))
                    .map_err(VolatileMemoryError::IOError)?;
                continue;
            }
            let mut part = buf.subslice(done, span)?;
            let n = self.file.read_volatile(&mut part)?;
            if n == 0 {
                break;
            }
            done += n;
            self.pos += n as u64;
        }
        Ok(done)
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, clippy::single_range_in_vec_init)] // small test sizes
mod tests {
    use super::*;
    use linux_loader::loader::elf::Elf;
    use linux_loader::loader::KernelLoader;
    use std::fs::File;
    use vm_memory::{Bytes, GuestAddress};
    use vmhost_memory::GuestMemoryMmap;

    const PADDR: u64 = 0x100_0000;
    const VADDR: u64 = 0xffff_ffff_8100_0000;
    const SIZE: u64 = 0x4000;

    /// An ELF with one PT_LOAD of SIZE bytes of 0xcc at PADDR (virtual VADDR), and sections:
    /// PROGBITS over the first half, NOBITS over the third quarter (its file bytes are 0xcc too).
    fn image(with_sections: bool) -> Vec<u8> {
        let data_off = 0x1000u64;
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[6] = 1;
        b[16..18].copy_from_slice(&2u16.to_le_bytes());
        b[18..20].copy_from_slice(&62u16.to_le_bytes());
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        b[24..32].copy_from_slice(&PADDR.to_le_bytes());
        b[32..40].copy_from_slice(&64u64.to_le_bytes());
        let shoff = data_off + SIZE;
        if with_sections {
            b[40..48].copy_from_slice(&shoff.to_le_bytes());
            b[58..60].copy_from_slice(&64u16.to_le_bytes());
            b[60..62].copy_from_slice(&3u16.to_le_bytes());
        }
        b[52..54].copy_from_slice(&64u16.to_le_bytes());
        b[54..56].copy_from_slice(&56u16.to_le_bytes());
        b[56..58].copy_from_slice(&1u16.to_le_bytes());
        for v in [
            PT_LOAD as u64 | (7 << 32),
            data_off,
            VADDR,
            PADDR,
            SIZE,
            SIZE,
            0x1000,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.resize(data_off as usize, 0);
        b.extend(std::iter::repeat_n(0xcc, SIZE as usize));
        if with_sections {
            let shdr = |ty: u32, addr: u64, offset: u64, size: u64| {
                let mut s = vec![0u8; 64];
                s[4..8].copy_from_slice(&ty.to_le_bytes());
                s[8..16].copy_from_slice(&2u64.to_le_bytes()); // SHF_ALLOC
                s[16..24].copy_from_slice(&addr.to_le_bytes());
                s[24..32].copy_from_slice(&offset.to_le_bytes());
                s[32..40].copy_from_slice(&size.to_le_bytes());
                s
            };
            b.extend(vec![0u8; 64]);
            b.extend(shdr(1, VADDR, data_off, SIZE / 2));
            // NOBITS: sh_offset is meaningless (here deliberately wrong); the address counts.
            b.extend(shdr(SHT_NOBITS, VADDR + SIZE / 2, 0, SIZE / 4));
        }
        b
    }

    fn load(bytes: &[u8]) -> (GuestMemoryMmap, u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmlinux");
        std::fs::write(&path, bytes).unwrap();
        let mut file = File::open(&path).unwrap();
        let holes = nobits_file_ranges(&mut file).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let mut sparse = SparseElf::new(&mut file, holes).unwrap();
        let r = Elf::load(&mem, None, &mut sparse, Some(GuestAddress(0x10_0000))).unwrap();
        assert_eq!(r.kernel_load, GuestAddress(PADDR));
        (mem, sparse.skipped)
    }

    #[test]
    fn nobits_bytes_are_neither_read_nor_written() {
        let (mem, skipped) = load(&image(true));
        assert_eq!(skipped, SIZE / 4);
        let mut got = vec![0u8; SIZE as usize];
        mem.read_slice(&mut got, GuestAddress(PADDR)).unwrap();
        let (half, quarter) = ((SIZE / 2) as usize, (SIZE / 4) as usize);
        assert!(got[..half].iter().all(|&b| b == 0xcc), "PROGBITS copied");
        assert!(
            got[half..half + quarter].iter().all(|&b| b == 0),
            "the NOBITS range stays zero"
        );
        assert!(
            got[half + quarter..].iter().all(|&b| b == 0xcc),
            "bytes after it are copied"
        );
    }

    #[test]
    fn an_image_without_section_headers_loads_whole() {
        let (mem, skipped) = load(&image(false));
        assert_eq!(skipped, 0);
        let mut got = vec![0u8; SIZE as usize];
        mem.read_slice(&mut got, GuestAddress(PADDR)).unwrap();
        assert!(got.iter().all(|&b| b == 0xcc));
    }

    #[test]
    fn holes_are_mapped_through_the_segment_and_merged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmlinux");
        std::fs::write(&path, image(true)).unwrap();
        let holes = nobits_file_ranges(&mut File::open(&path).unwrap()).unwrap();
        assert_eq!(holes, [0x1000 + SIZE / 2..0x1000 + SIZE / 2 + SIZE / 4]);
    }
}
