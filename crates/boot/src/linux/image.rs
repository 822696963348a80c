//! Recognising a kernel image and reading the limits the boot protocol sets.
//!
//! An ELF file (`\x7fELF`) must be a little-endian ELF64 for x86-64; a bzImage carries `HdrS` at
//! offset 0x202 and must offer the 64-bit entry (boot protocol 2.12+, `XLF_KERNEL_64`).
//! Anything else is rejected before a byte is loaded into guest memory.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::BootError;

/// Linux's `COMMAND_LINE_SIZE` on x86 (2048 with the NUL): the limit for ELF kernels, which
/// carry no setup header.
pub const ELF_CMDLINE_MAX: usize = 2047;
/// Highest initramfs address for ELF kernels: what x86-64 bzImages advertise in
/// `initrd_addr_max`.
pub const ELF_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;
/// `initrd_addr_max` of boot protocols before 2.03.
const OLD_INITRD_ADDR_MAX: u64 = 0x37ff_ffff;
/// `cmdline_size` of boot protocols before 2.06.
const OLD_CMDLINE_MAX: usize = 255;
/// Oldest boot protocol with a 64-bit entry point (`xloadflags`).
pub const MIN_BZIMAGE_VERSION: u16 = 0x020c;
/// `xloadflags` bit: the kernel has the legacy 64-bit entry at load address + 0x200.
const XLF_KERNEL_64: u16 = 1;
/// `loadflags` bit: protected-mode code is loaded at 0x100000 or above.
const LOADED_HIGH: u8 = 1;
/// Bytes of the image header we look at.
const HEADER_LEN: usize = 0x268;

/// The two image formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFormat {
    /// An uncompressed `vmlinux` (ELF64, x86-64).
    Elf,
    /// A bzImage.
    BzImage,
}

/// What the image header says, before loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Probe {
    pub format: KernelFormat,
    /// Longest command line without the NUL.
    pub cmdline_max: usize,
    /// Highest address the initramfs may reach (inclusive).
    pub initrd_addr_max: u64,
    /// bzImage: preferred load address (`pref_address`).
    pub load_addr: u64,
    /// bzImage: memory the kernel needs from its load address (`init_size`).
    pub init_size: u64,
}

/// Reads the header of `file` and classifies it.
pub(super) fn probe(path: &Path, file: &mut File) -> Result<Probe, BootError> {
    let mut hdr = Vec::with_capacity(HEADER_LEN);
    file.by_ref()
        .take(HEADER_LEN as u64)
        .read_to_end(&mut hdr)
        .map_err(|source| BootError::ReadKernel {
            path: path.to_path_buf(),
            source,
        })?;
    if hdr.starts_with(b"\x7fELF") {
        return probe_elf(path, &hdr);
    }
    if hdr.get(0x202..0x206) == Some(b"HdrS") {
        return probe_bzimage(path, &hdr);
    }
    Err(BootError::NotAKernel {
        path: path.to_path_buf(),
    })
}

fn probe_elf(path: &Path, hdr: &[u8]) -> Result<Probe, BootError> {
    let class = hdr.get(4).copied().unwrap_or(0);
    let data = hdr.get(5).copied().unwrap_or(0);
    let machine = le16(hdr, 18);
    // ELFCLASS64, ELFDATA2LSB, EM_X86_64
    if class != 2 || data != 1 || machine != 62 {
        return Err(BootError::UnsupportedElf {
            path: path.to_path_buf(),
            class,
            machine,
        });
    }
    Ok(Probe {
        format: KernelFormat::Elf,
        cmdline_max: ELF_CMDLINE_MAX,
        initrd_addr_max: ELF_INITRD_ADDR_MAX,
        load_addr: 0,
        init_size: 0,
    })
}

fn probe_bzimage(path: &Path, hdr: &[u8]) -> Result<Probe, BootError> {
    let version = le16(hdr, 0x206);
    let loadflags = hdr.get(0x211).copied().unwrap_or(0);
    let xloadflags = le16(hdr, 0x236);
    if version < MIN_BZIMAGE_VERSION
        || xloadflags & XLF_KERNEL_64 == 0
        || loadflags & LOADED_HIGH == 0
    {
        return Err(BootError::NoLongModeEntry {
            path: path.to_path_buf(),
            version,
        });
    }
    // Versions we accept have both fields; 0 would mean "not set": use the old defaults.
    let initrd_addr_max = match le32(hdr, 0x22c) {
        0 => OLD_INITRD_ADDR_MAX,
        v => u64::from(v),
    };
    let cmdline_max = match le32(hdr, 0x238) {
        0 => OLD_CMDLINE_MAX,
        v => usize::try_from(v).unwrap_or(usize::MAX),
    };
    Ok(Probe {
        format: KernelFormat::BzImage,
        cmdline_max,
        initrd_addr_max,
        load_addr: le64(hdr, 0x258),
        init_size: u64::from(le32(hdr, 0x260)),
    })
}

fn bytes<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(s) = b.get(off..off + N) {
        out.copy_from_slice(s);
    }
    out
}

pub(super) fn le16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(bytes(b, off))
}

pub(super) fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(bytes(b, off))
}

pub(super) fn le64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(bytes(b, off))
}

/// Synthetic image headers for tests.
#[cfg(test)]
pub(crate) mod fake {
    /// A bzImage header with the given protocol version, `xloadflags`, `initrd_addr_max` and
    /// `cmdline_size`, followed by `payload` bytes of protected-mode kernel.
    pub fn bzimage(version: u16, xloadflags: u16, initrd_max: u32, cmdline: u32) -> Vec<u8> {
        let setup_sects = 4u8;
        let mut b = vec![0u8; (usize::from(setup_sects) + 1) * 512];
        b[0x1f1] = setup_sects;
        b[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        b[0x202..0x206].copy_from_slice(b"HdrS");
        b[0x206..0x208].copy_from_slice(&version.to_le_bytes());
        b[0x211] = 1; // LOADED_HIGH
        b[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
        b[0x22c..0x230].copy_from_slice(&initrd_max.to_le_bytes());
        b[0x230..0x234].copy_from_slice(&0x20_0000u32.to_le_bytes());
        b[0x234] = 1;
        b[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
        b[0x238..0x23c].copy_from_slice(&cmdline.to_le_bytes());
        b[0x258..0x260].copy_from_slice(&0x100_0000u64.to_le_bytes());
        b[0x260..0x264].copy_from_slice(&0x20_0000u32.to_le_bytes()); // init_size 2 MiB
        b.extend(std::iter::repeat_n(0x90, 0x1000)); // "kernel"
        b
    }

    /// A minimal x86-64 ELF64 executable: one PT_LOAD of `size` bytes at physical `paddr`
    /// (entry there), plus a PT_NOTE with a Xen PVH entry note when `pvh_entry` is given.
    pub fn elf(paddr: u64, size: u64, pvh_entry: Option<u32>) -> Vec<u8> {
        let phnum: u16 = if pvh_entry.is_some() { 2 } else { 1 };
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2; // ELFCLASS64
        b[5] = 1; // little-endian
        b[6] = 1; // EV_CURRENT
        b[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        b[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        b[24..32].copy_from_slice(&paddr.to_le_bytes()); // e_entry
        b[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        b[52..54].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        b[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        b[56..58].copy_from_slice(&phnum.to_le_bytes());
        let data_off = 64 + 56 * u64::from(phnum);
        let note: Vec<u8> = match pvh_entry {
            Some(entry) => {
                let mut n = Vec::new();
                n.extend_from_slice(&4u32.to_le_bytes()); // namesz
                n.extend_from_slice(&4u32.to_le_bytes()); // descsz
                n.extend_from_slice(&18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
                n.extend_from_slice(b"Xen\0");
                n.extend_from_slice(&entry.to_le_bytes());
                n
            }
            None => Vec::new(),
        };
        let load_off = data_off + note.len() as u64;
        b.extend(phdr(1, load_off, paddr, size)); // PT_LOAD
        if pvh_entry.is_some() {
            b.extend(phdr(4, data_off, 0, note.len() as u64)); // PT_NOTE
        }
        b.extend(note);
        b.extend(std::iter::repeat_n(0xcc, usize::try_from(size).unwrap()));
        b
    }

    fn phdr(p_type: u32, offset: u64, paddr: u64, size: u64) -> Vec<u8> {
        let mut p = Vec::with_capacity(56);
        p.extend_from_slice(&p_type.to_le_bytes());
        p.extend_from_slice(&5u32.to_le_bytes()); // R+X
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&paddr.to_le_bytes()); // vaddr
        p.extend_from_slice(&paddr.to_le_bytes()); // paddr
        p.extend_from_slice(&size.to_le_bytes()); // filesz
        p.extend_from_slice(&size.to_le_bytes()); // memsz
        p.extend_from_slice(&4u64.to_le_bytes()); // align
        p
    }
}
