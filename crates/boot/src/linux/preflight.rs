//! Checking a Linux guest's inputs before anything is allocated: [`check_linux_inputs`] reads
//! only headers and file sizes, so a bad kernel, initramfs or command line fails before guest
//! memory is reserved and before `/dev/kvm` is opened, naming the file and the problem.
//!
//! A truncated image is recognised by what its own header promises: a bzImage's setup sectors
//! and `syssize` (16-byte units of protected-mode code), an ELF's program headers and the file
//! range of every `PT_LOAD` segment.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use super::image::{self, le16, le32, le64, KernelFormat};
use super::{check_cmdline, open_initrd, BootError};

/// ELF program header type of a loadable segment.
const PT_LOAD: u32 = 1;
/// Size of an ELF64 program header.
const PHDR_SIZE: usize = 56;
/// Most program headers read (a vmlinux has a handful).
const MAX_PHDRS: usize = 64;

/// Checks that `kernel` is a complete x86-64 ELF or bzImage, that `initrd` (if any) is a
/// readable regular file and that `cmdline` fits the image's boot protocol; returns the format.
pub fn check_linux_inputs(
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
) -> Result<KernelFormat, BootError> {
    let mut file = File::open(kernel).map_err(|source| BootError::OpenKernel {
        path: kernel.to_path_buf(),
        source,
    })?;
    let probe = image::probe(kernel, &mut file)?;
    check_complete(kernel, &mut file, probe.format)?;
    check_cmdline(cmdline, probe.cmdline_max)?;
    if let Some(path) = initrd {
        open_initrd(path)?;
    }
    Ok(probe.format)
}

/// Fails with [`BootError::TruncatedKernel`] when the file is shorter than its header says.
pub(super) fn check_complete(
    path: &Path,
    file: &mut File,
    format: KernelFormat,
) -> Result<(), BootError> {
    let read_err = |source| BootError::ReadKernel {
        path: path.to_path_buf(),
        source,
    };
    let size = file.metadata().map_err(read_err)?.len();
    let mut hdr = [0u8; 64];
    file.seek(SeekFrom::Start(0)).map_err(read_err)?;
    let needed = match format {
        KernelFormat::BzImage => {
            let mut setup = [0u8; 0x1f8];
            file.read_exact(&mut setup).map_err(read_err)?;
            let sects = match setup[0x1f1] {
                0 => 4,
                n => u64::from(n),
            };
            (sects + 1) * 512 + u64::from(le32(&setup, 0x1f4)) * 16
        }
        KernelFormat::Elf => {
            file.read_exact(&mut hdr).map_err(read_err)?;
            let (needed, oversized) = elf_needed(file, &hdr, size).map_err(read_err)?;
            if let Some((paddr, filesz, memsz)) = oversized {
                return Err(BootError::ElfSegmentFileSize {
                    path: path.to_path_buf(),
                    paddr,
                    filesz,
                    memsz,
                });
            }
            needed
        }
    };
    if size < needed {
        return Err(BootError::TruncatedKernel {
            path: path.to_path_buf(),
            size,
            needed,
        });
    }
    Ok(())
}

/// A `PT_LOAD` segment's physical address, file size and memory size.
type Segment = (u64, u64, u64);

/// The file length an ELF's program headers and `PT_LOAD` segments need, and the first
/// `PT_LOAD` segment with more bytes in the file than in memory, if any (the loader copies
/// `p_filesz` bytes, past the `p_memsz` the kernel's footprint counts).
fn elf_needed(file: &mut File, hdr: &[u8], size: u64) -> std::io::Result<(u64, Option<Segment>)> {
    let phoff = le64(hdr, 32);
    let phnum = usize::from(le16(hdr, 56)).min(MAX_PHDRS);
    let table_end = phoff.saturating_add((phnum * PHDR_SIZE) as u64);
    if table_end > size {
        return Ok((table_end, None));
    }
    let mut table = vec![0u8; phnum * PHDR_SIZE];
    file.seek(SeekFrom::Start(phoff))?;
    file.read_exact(&mut table)?;
    let loads = || {
        table
            .chunks_exact(PHDR_SIZE)
            .filter(|p| le32(p, 0) == PT_LOAD)
    };
    let needed = loads()
        .map(|p| le64(p, 8).saturating_add(le64(p, 32)))
        .fold(table_end, u64::max);
    let oversized = loads()
        .map(|p| (le64(p, 24), le64(p, 32), le64(p, 40)))
        .find(|&(_, filesz, memsz)| filesz > memsz);
    Ok((needed, oversized))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linux::image::fake;

    fn file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vmhost-preflight-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn complete_images_pass_and_truncated_ones_name_the_file_and_sizes() {
        let elf = fake::elf(0x100_0000, 0x2000, Some(0x100_0000));
        let ok = file("ok.elf", &elf);
        assert_eq!(
            check_linux_inputs(&ok, None, "console=ttyS0").unwrap(),
            KernelFormat::Elf
        );
        let cut = file("cut.elf", &elf[..elf.len() - 100]);
        let err = check_linux_inputs(&cut, None, "").unwrap_err();
        assert!(
            matches!(err, BootError::TruncatedKernel { size, needed, .. } if needed == size + 100),
            "{err:?}"
        );
        assert!(err.to_string().contains("cut.elf"), "{err}");

        let mut bz = fake::bzimage(0x020f, 1, 0x7fff_ffff, 2047);
        // syssize: the protected-mode code is 0x1000 bytes (256 paragraphs).
        bz[0x1f4..0x1f8].copy_from_slice(&256u32.to_le_bytes());
        let ok = file("ok.bz", &bz);
        assert_eq!(
            check_linux_inputs(&ok, None, "").unwrap(),
            KernelFormat::BzImage
        );
        let cut = file("cut.bz", &bz[..bz.len() - 1]);
        assert!(matches!(
            check_linux_inputs(&cut, None, "").unwrap_err(),
            BootError::TruncatedKernel { .. }
        ));
    }

    #[test]
    fn a_missing_initrd_and_a_long_cmdline_fail_before_anything_is_loaded() {
        let ok = file("k.elf", &fake::elf(0x100_0000, 0x1000, None));
        let missing = std::path::Path::new("/nonexistent/initrd.cpio");
        let err = check_linux_inputs(&ok, Some(missing), "").unwrap_err();
        assert!(matches!(err, BootError::OpenInitrd { .. }), "{err:?}");
        assert!(
            err.to_string().contains("/nonexistent/initrd.cpio"),
            "{err}"
        );
        let dir = std::env::temp_dir();
        // A directory is refused as what it is, before any read.
        assert!(matches!(
            check_linux_inputs(&ok, Some(&dir), "").unwrap_err(),
            BootError::NotAFile { .. }
        ));
        let long = "x".repeat(image::ELF_CMDLINE_MAX + 1);
        assert!(matches!(
            check_linux_inputs(&ok, None, &long).unwrap_err(),
            BootError::CmdlineTooLong { .. }
        ));
        let not = file("not-a-kernel", b"hello, world");
        assert!(matches!(
            check_linux_inputs(&not, None, "").unwrap_err(),
            BootError::NotAKernel { .. }
        ));
    }
}
