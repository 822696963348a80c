//! Loading a Linux kernel, its initramfs and command line, and the boot parameters.
//!
//! [`load_linux`] recognises the image ([`KernelFormat`]), loads it with `linux-loader`, places
//! the initramfs right after the kernel's footprint, writes the command line, the ACPI tables,
//! the boot GDT and page tables, and the boot parameters, and returns a [`LinuxBoot`] that says
//! how the boot vCPU starts ([`BootMode`], entry, parameter address; [`LinuxBoot::cpu_state`]
//! gives the registers, documented in [`crate::cpu`]):
//!
//! - an ELF `vmlinux` with a Xen PVH entry note boots through **PVH** (32-bit protected mode,
//!   `ebx` = `hvm_start_info` at [`PVH_START_INFO_ADDR`]);
//! - an ELF without the note, and any bzImage, boot through the **Linux 64-bit boot
//!   protocol** (long mode, `rsi` = zero page at [`ZERO_PAGE_ADDR`]); a bzImage is loaded at
//!   its `pref_address` and entered at load address + 0x200, an ELF at its `e_entry`.
//!
//! Every input is checked before the VM starts: the kernel and initramfs must be readable, the
//! image must be an x86-64 ELF or a bzImage with a 64-bit entry, the initramfs must end below
//! the kernel's `initrd_addr_max` ([`ELF_INITRD_ADDR_MAX`] for ELF) and below the end of low
//! RAM, and the command line must fit the protocol's `cmdline_size` ([`ELF_CMDLINE_MAX`] for
//! ELF).

mod image;
mod params;
mod preflight;
mod reader;
#[cfg(test)]
mod short_read_tests;
mod sparse;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::io::{Read, Seek};
use std::ops::Range;
use std::path::{Path, PathBuf};

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::BootConfigurator;
use linux_loader::loader::bootparam::setup_header;
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, Cmdline, KernelLoader, KernelLoaderResult};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError, ReadVolatile};
use vmhost_memory::GuestLayout;

use crate::acpi::{AcpiError, AcpiTables};
use crate::addrs::{
    CMDLINE_ADDR, FIRMWARE_RESERVED, HIMEM_START, PAGE_SIZE, PVH_START_INFO_ADDR, ZERO_PAGE_ADDR,
};
use crate::cpu::{write_boot_tables, CpuSetupError, CpuState};
use crate::e820::{e820_map, E820Entry};
use reader::FullReads;

pub use image::{KernelFormat, ELF_CMDLINE_MAX, ELF_INITRD_ADDR_MAX, MIN_BZIMAGE_VERSION};
pub use params::{MAX_PVH_MEMMAP, MAX_ZERO_PAGE_E820};
pub use preflight::check_linux_inputs;

/// Offset of the 64-bit entry (`startup_64`) in a bzImage's protected-mode code.
const BZIMAGE_ENTRY64_OFFSET: u64 = 0x200;

/// Why a Linux guest cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel image cannot be opened.
    #[error("cannot open kernel image {path}")]
    OpenKernel {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kernel image's header cannot be read.
    #[error("cannot read kernel image {path}")]
    ReadKernel {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kernel or initramfs path names something other than a regular file (a FIFO, a
    /// device, a directory): reading it could block the start forever.
    #[error("{what} {path} is a {kind}, not a regular file; point boot.{field} at the image file itself")]
    NotAFile {
        /// `kernel image` or `initramfs`.
        what: &'static str,
        /// The spec field (`kernel` or `initrd`).
        field: &'static str,
        /// The path.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// The image is shorter than its own header says (a truncated copy or download).
    #[error("kernel image {path} is truncated: {size} bytes, its headers need {needed}")]
    TruncatedKernel {
        /// The image.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The size its headers promise.
        needed: u64,
    },
    /// The file is neither ELF nor bzImage.
    #[error("{path} is neither an ELF vmlinux nor a bzImage (no \\x7fELF magic, no HdrS header)")]
    NotAKernel {
        /// The file.
        path: PathBuf,
    },
    /// An ELF file that is not a little-endian ELF64 x86-64 executable.
    #[error("{path} is an ELF file but not x86-64 ELF64 (class {class}, machine {machine})")]
    UnsupportedElf {
        /// The file.
        path: PathBuf,
        /// `EI_CLASS` (2 = ELF64).
        class: u8,
        /// `e_machine` (62 = x86-64).
        machine: u16,
    },
    /// A bzImage without the 64-bit entry point.
    #[error(
        "bzImage {path} (boot protocol {}.{:02}) has no 64-bit entry point: \
         needs protocol 2.12+ with XLF_KERNEL_64 and LOADED_HIGH",
        .version >> 8, .version & 0xff
    )]
    NoLongModeEntry {
        /// The file.
        path: PathBuf,
        /// Boot protocol version from the header.
        version: u16,
    },
    /// The command line is longer than the kernel accepts.
    #[error("kernel command line is {len} bytes, the kernel accepts at most {limit}")]
    CmdlineTooLong {
        /// Its length.
        len: usize,
        /// The boot protocol's `cmdline_size`.
        limit: usize,
    },
    /// The command line has a character the kernel cannot take.
    #[error(
        "kernel command line has {byte:?} at byte {position}: only printable ASCII is allowed"
    )]
    InvalidCmdline {
        /// Byte offset.
        position: usize,
        /// The character.
        byte: char,
    },
    /// `linux-loader` rejected the command line.
    #[error("cannot build the kernel command line")]
    BuildCmdline {
        /// The cause.
        #[source]
        source: linux_loader::cmdline::Error,
    },
    /// The initramfs cannot be opened or its size read.
    #[error("cannot open initramfs {path}")]
    OpenInitrd {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `linux-loader` failed to load the kernel.
    #[error("cannot load kernel image {path} into guest memory")]
    LoadKernel {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: linux_loader::loader::Error,
    },
    /// The kernel's memory footprint is not inside low RAM above 1 MiB.
    #[error(
        "kernel {path} needs {start:#x}..{end:#x}, but low guest RAM is 0x100000..{ram_end:#x}"
    )]
    KernelOutsideRam {
        /// The image.
        path: PathBuf,
        /// Load address.
        start: u64,
        /// End of its footprint (bzImage: load address + `init_size`).
        end: u64,
        /// End of RAM below the MMIO hole.
        ram_end: u64,
    },
    /// An ELF `PT_LOAD` segment with more bytes in the file than in memory: the loader would
    /// copy them past the segment's end, where the initramfs goes.
    #[error(
        "ELF kernel {path}: the PT_LOAD segment at {paddr:#x} has {filesz} bytes in the file but \
         {memsz} in memory (p_filesz > p_memsz); point boot.kernel at a valid vmlinux"
    )]
    ElfSegmentFileSize {
        /// The image.
        path: PathBuf,
        /// The segment's physical address.
        paddr: u64,
        /// `p_filesz`.
        filesz: u64,
        /// `p_memsz`.
        memsz: u64,
    },
    /// An ELF whose entry point is not below the end of its loadable segments (it has none,
    /// or they all lie below the entry): it is no vmlinux, and its footprint would be empty.
    #[error(
        "ELF kernel {path} enters at {entry:#x} but its PT_LOAD segments end at {end:#x}: \
         a vmlinux's entry lies inside its segments; point boot.kernel at a vmlinux or bzImage"
    )]
    ElfEntryOutsideSegments {
        /// The image.
        path: PathBuf,
        /// `e_entry`.
        entry: u64,
        /// End of the loaded segments (0: none).
        end: u64,
    },
    /// The initramfs does not fit after the kernel below the limit.
    #[error(
        "initramfs {path} ({size} bytes) placed at {addr:#x} after the kernel would end at \
         {end:#x}, past {limit:#x} (the kernel's initrd_addr_max {addr_max:#x} or the end of \
         low RAM)",
        end = .addr.saturating_add(*.size)
    )]
    InitrdTooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// Where it would start.
        addr: u64,
        /// The exclusive end it must stay below.
        limit: u64,
        /// The kernel's `initrd_addr_max` (inclusive).
        addr_max: u64,
    },
    /// Copying the initramfs into guest memory failed.
    #[error("cannot read initramfs {path} into guest memory at {addr:#x}")]
    ReadInitrd {
        /// The file.
        path: PathBuf,
        /// Guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: GuestMemoryError,
    },
    /// Writing the command line failed.
    #[error("cannot write the kernel command line at {addr:#x}")]
    WriteCmdline {
        /// Guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: linux_loader::loader::Error,
    },
    /// The memory map has more entries than the boot protocol carries.
    #[error("the guest memory map has {count} entries, the boot protocol carries {max}")]
    TooManyMemoryEntries {
        /// Entries.
        count: usize,
        /// Capacity.
        max: usize,
    },
    /// Writing the ACPI tables failed.
    #[error("cannot write the ACPI tables")]
    WriteAcpi {
        /// The cause.
        #[source]
        source: AcpiError,
    },
    /// Writing the boot GDT or page tables failed.
    #[error("cannot write the boot GDT and page tables")]
    WriteBootTables {
        /// The cause.
        #[source]
        source: CpuSetupError,
    },
    /// Writing the zero page or PVH start info failed.
    #[error("cannot write the boot parameters at {addr:#x}")]
    WriteBootParams {
        /// Guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: linux_loader::configurator::Error,
    },
}

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootMode {
    /// PVH: 32-bit protected mode, paging off, `ebx` = `hvm_start_info` address.
    Pvh,
    /// Linux 64-bit boot protocol: long mode with identity paging, `rsi` = zero page address.
    Linux64,
}

/// A kernel loaded into guest memory, ready for the boot vCPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinuxBoot {
    /// The image format.
    pub format: KernelFormat,
    /// The entry protocol.
    pub mode: BootMode,
    /// Entry point (guest-physical).
    pub entry: u64,
    /// `hvm_start_info` (PVH) or zero page (64-bit) address.
    pub params_addr: u64,
    /// The kernel's footprint: load address to the end of what it may use while booting.
    pub kernel: Range<u64>,
    /// Where the initramfs sits.
    pub initrd: Option<Range<u64>>,
    /// The command line's address.
    pub cmdline_addr: u64,
    /// The memory map given to the kernel.
    pub e820: Vec<E820Entry>,
}

impl LinuxBoot {
    /// Registers and segments of the boot vCPU at the entry (see [`crate::cpu`]).
    pub fn cpu_state(&self) -> CpuState {
        match self.mode {
            BootMode::Pvh => CpuState::pvh(self.entry, self.params_addr),
            BootMode::Linux64 => CpuState::linux64(self.entry, self.params_addr),
        }
    }
}

/// Loads `kernel` (and `initrd`) into `mem`, laid out as `layout`, with `cmdline` and the
/// already-built `acpi` tables, and writes everything the kernel needs to boot. `mem` must be
/// zero where the kernel goes (new guest RAM is): a vmlinux's `.bss` is not copied from the
/// file.
pub fn load_linux<M: GuestMemoryBackend>(
    mem: &M,
    layout: &GuestLayout,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
    acpi: &AcpiTables,
) -> Result<LinuxBoot, BootError> {
    let mut kfile = open_regular(kernel, "kernel image", "kernel").map_err(|e| {
        e.into_boot_error(|source| BootError::OpenKernel {
            path: kernel.to_path_buf(),
            source,
        })
    })?;
    let probe = image::probe(kernel, &mut kfile)?;
    preflight::check_complete(kernel, &mut kfile, probe.format)?;
    let cmdline = check_cmdline(cmdline, probe.cmdline_max)?;
    let initrd_file = initrd.map(open_initrd).transpose()?;
    let ram_end = low_ram_end(layout);

    let (loaded, kernel_range) = load_kernel(mem, kernel, &mut kfile, &probe, ram_end)?;
    let initrd_range = match initrd_file {
        Some((path, mut file, size)) => Some(load_initrd(
            mem,
            &path,
            &mut file,
            size,
            kernel_range.end,
            &probe,
            ram_end,
        )?),
        None => None,
    };

    load_cmdline(mem, GuestAddress(CMDLINE_ADDR), &cmdline).map_err(|source| {
        BootError::WriteCmdline {
            addr: CMDLINE_ADDR,
            source,
        }
    })?;
    let e820 = e820_map(layout, &[FIRMWARE_RESERVED, acpi.range()]);
    acpi.write_to(mem)
        .map_err(|source| BootError::WriteAcpi { source })?;
    write_boot_tables(mem).map_err(|source| BootError::WriteBootTables { source })?;

    let (mode, entry) = match (probe.format, loaded.pvh_boot_cap) {
        (KernelFormat::Elf, PvhBootCapability::PvhEntryPresent(addr)) => (BootMode::Pvh, addr.0),
        (KernelFormat::Elf, _) => (BootMode::Linux64, loaded.kernel_load.0),
        (KernelFormat::BzImage, _) => (
            BootMode::Linux64,
            loaded.kernel_load.0 + BZIMAGE_ENTRY64_OFFSET,
        ),
    };
    let params_addr = write_params(
        mem,
        mode,
        loaded.setup_header,
        initrd_range.as_ref(),
        &e820,
        acpi.rsdp_addr(),
    )?;

    Ok(LinuxBoot {
        format: probe.format,
        mode,
        entry,
        params_addr,
        kernel: kernel_range,
        initrd: initrd_range,
        cmdline_addr: CMDLINE_ADDR,
        e820,
    })
}

/// Writes the PVH start info or the zero page and returns its address.
fn write_params<M: GuestMemoryBackend>(
    mem: &M,
    mode: BootMode,
    setup_header: Option<setup_header>,
    initrd: Option<&Range<u64>>,
    e820: &[E820Entry],
    rsdp: u64,
) -> Result<u64, BootError> {
    let (addr, written) = match mode {
        BootMode::Pvh => {
            let p = params::pvh_start_info(initrd, e820, rsdp)?;
            (
                PVH_START_INFO_ADDR,
                PvhBootConfigurator::write_bootparams(&p, mem),
            )
        }
        BootMode::Linux64 => {
            let p = params::zero_page(setup_header, initrd, e820, rsdp)?;
            (
                ZERO_PAGE_ADDR,
                LinuxBootConfigurator::write_bootparams(&p, mem),
            )
        }
    };
    written.map_err(|source| BootError::WriteBootParams { addr, source })?;
    Ok(addr)
}

/// Loads the kernel image from `file` and returns the loader's result and the kernel's
/// footprint, which must lie in low RAM above 1 MiB.
fn load_kernel<M: GuestMemoryBackend, F: Read + Seek + ReadVolatile>(
    mem: &M,
    path: &Path,
    file: &mut F,
    probe: &image::Probe,
    ram_end: u64,
) -> Result<(KernelLoaderResult, Range<u64>), BootError> {
    let outside = |start: u64, end: u64| BootError::KernelOutsideRam {
        path: path.to_path_buf(),
        start,
        end,
        ram_end,
    };
    let load_err = |source| BootError::LoadKernel {
        path: path.to_path_buf(),
        source,
    };
    // The loaders expect every read to fill its buffer; a 9p or FUSE file may read short.
    let file = &mut FullReads(file);
    let (loaded, end) = match probe.format {
        KernelFormat::Elf => {
            // Guest RAM is new, hence zero: the .bss bytes in the file need no copying.
            let holes = sparse::nobits_file_ranges(file).unwrap_or_default();
            let mut image =
                sparse::SparseElf::new(file, holes).map_err(|source| BootError::ReadKernel {
                    path: path.to_path_buf(),
                    source,
                })?;
            let r = Elf::load(mem, None, &mut image, Some(GuestAddress(HIMEM_START)))
                .map_err(load_err)?;
            // kernel_load is e_entry, kernel_end the segments' end (0 without segments).
            if r.kernel_end <= r.kernel_load.0 {
                return Err(BootError::ElfEntryOutsideSegments {
                    path: path.to_path_buf(),
                    entry: r.kernel_load.0,
                    end: r.kernel_end,
                });
            }
            (r, r.kernel_end)
        }
        KernelFormat::BzImage => {
            // Check the footprint first: the decompressor uses init_size bytes from here.
            let end = probe.load_addr.saturating_add(probe.init_size);
            if probe.load_addr < HIMEM_START || end > ram_end {
                return Err(outside(probe.load_addr, end));
            }
            let r = BzImage::load(mem, Some(GuestAddress(probe.load_addr)), file, None)
                .map_err(load_err)?;
            (r, r.kernel_end.max(end))
        }
    };
    let range = loaded.kernel_load.0..end;
    if range.start < HIMEM_START || range.end > ram_end {
        return Err(outside(range.start, range.end));
    }
    Ok((loaded, range))
}

/// Checks the length against the protocol limit and the characters, then builds the
/// `linux-loader` command line.
fn check_cmdline(cmdline: &str, limit: usize) -> Result<Cmdline, BootError> {
    if cmdline.len() > limit {
        return Err(BootError::CmdlineTooLong {
            len: cmdline.len(),
            limit,
        });
    }
    if let Some((position, byte)) = cmdline
        .char_indices()
        .find(|(_, c)| !matches!(c, ' '..='~'))
    {
        return Err(BootError::InvalidCmdline { position, byte });
    }
    Cmdline::try_from(cmdline, limit + 1).map_err(|source| BootError::BuildCmdline { source })
}

fn open_initrd(path: &Path) -> Result<(PathBuf, File, u64), BootError> {
    let err = |source| BootError::OpenInitrd {
        path: path.to_path_buf(),
        source,
    };
    let file = open_regular(path, "initramfs", "initrd").map_err(|e| e.into_boot_error(err))?;
    let size = file.metadata().map_err(err)?.len();
    Ok((path.to_path_buf(), file, size))
}

/// Why [`open_regular`] failed: the open itself, or the file's type.
enum OpenError {
    Io(std::io::Error),
    NotAFile(BootError),
}

impl OpenError {
    fn into_boot_error(self, io: impl FnOnce(std::io::Error) -> BootError) -> BootError {
        match self {
            OpenError::Io(e) => io(e),
            OpenError::NotAFile(e) => e,
        }
    }
}

/// Opens `path` for reading without blocking (`O_NONBLOCK`: opening a FIFO with no writer
/// would wait forever) and accepts it only when it is a regular file, which it then reads in
/// blocking mode: on 9p a non-blocking read returns at most one server reply (the mount's
/// `iounit`, 258048 bytes with `msize=262144`), however large the buffer.
fn open_regular(path: &Path, what: &'static str, field: &'static str) -> Result<File, OpenError> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(OpenError::Io)?;
    let ft = file.metadata().map_err(OpenError::Io)?.file_type();
    if ft.is_file() {
        crate::sys::clear_nonblocking(file.as_fd()).map_err(OpenError::Io)?;
        return Ok(file);
    }
    let kind = if ft.is_fifo() {
        "FIFO"
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_char_device() || ft.is_block_device() {
        "device"
    } else if ft.is_socket() {
        "socket"
    } else {
        "special file"
    };
    Err(OpenError::NotAFile(BootError::NotAFile {
        what,
        field,
        path: path.to_path_buf(),
        kind,
    }))
}

/// Places the initramfs at the first page after `after` and reads it in, if it ends below
/// both the kernel's `initrd_addr_max` and `ram_end`.
fn load_initrd<M: GuestMemoryBackend, F: ReadVolatile>(
    mem: &M,
    path: &Path,
    file: &mut F,
    size: u64,
    after: u64,
    probe: &image::Probe,
    ram_end: u64,
) -> Result<Range<u64>, BootError> {
    let addr_max = probe.initrd_addr_max;
    let limit = ram_end.min(addr_max.saturating_add(1));
    let addr = after.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    let too_large = || BootError::InitrdTooLarge {
        path: path.to_path_buf(),
        size,
        addr,
        limit,
        addr_max,
    };
    let end = addr.checked_add(size).ok_or_else(too_large)?;
    if end > limit {
        return Err(too_large());
    }
    let count = usize::try_from(size).map_err(|_| too_large())?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut FullReads(file), count)
        .map_err(|source| BootError::ReadInitrd {
            path: path.to_path_buf(),
            addr,
            source,
        })?;
    Ok(addr..end)
}

/// End of the RAM that runs contiguously from GPA 0 below the MMIO hole.
fn low_ram_end(layout: &GuestLayout) -> u64 {
    let mut end = 0;
    for r in &layout.regions {
        if r.gpa != end || r.gpa >= layout.mmio_hole_start {
            break;
        }
        end = r.gpa + r.size_bytes;
    }
    end.min(layout.mmio_hole_start)
}
