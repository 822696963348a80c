//! Loader tests on synthetic ELF and bzImage images: they run anywhere.

use std::path::PathBuf;

use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::GuestMemoryMmap;

use super::image::fake;
use super::*;
use crate::acpi::build_acpi;
use crate::addrs::{ACPI_START, PVH_MEMMAP_ADDR, PVH_MODLIST_ADDR};
use crate::testutil::{guest_memory, layout_of, two_cell_plan};

const MIB: u64 = 1 << 20;

struct Guest {
    dir: tempfile::TempDir,
    layout: GuestLayout,
    mem: GuestMemoryMmap,
    acpi: AcpiTables,
}

impl Guest {
    /// Two cells of `cell_bytes` each.
    fn new(cell_bytes: u64) -> Self {
        let plan = two_cell_plan(cell_bytes);
        let layout = layout_of(&plan);
        let acpi = build_acpi(&plan, &layout, ACPI_START).unwrap();
        Guest {
            dir: tempfile::tempdir().unwrap(),
            mem: guest_memory(&layout),
            layout,
            acpi,
        }
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn load(
        &self,
        kernel: &Path,
        initrd: Option<&Path>,
        cmdline: &str,
    ) -> Result<LinuxBoot, BootError> {
        load_linux(&self.mem, &self.layout, kernel, initrd, cmdline, &self.acpi)
    }

    fn u8_at(&self, a: u64) -> u8 {
        self.mem.read_obj(GuestAddress(a)).unwrap()
    }
    fn u32_at(&self, a: u64) -> u32 {
        self.mem.read_obj(GuestAddress(a)).unwrap()
    }
    fn u64_at(&self, a: u64) -> u64 {
        self.mem.read_obj(GuestAddress(a)).unwrap()
    }
    fn bytes(&self, a: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(a)).unwrap();
        v
    }
}

#[test]
fn elf_with_pvh_note_boots_through_pvh() {
    let g = Guest::new(64 * MIB);
    let kernel = g.file("vmlinux", &fake::elf(0x100_0000, 0x3000, Some(0x100_0040)));
    let initrd_bytes: Vec<u8> = (0..10_000u32)
        .map(|i| u8::try_from(i % 251).unwrap())
        .collect();
    let initrd = g.file("initrd", &initrd_bytes);
    let boot = g
        .load(&kernel, Some(&initrd), "console=ttyS0 quiet")
        .unwrap();

    assert_eq!(boot.format, KernelFormat::Elf);
    assert_eq!(boot.mode, BootMode::Pvh);
    assert_eq!(boot.entry, 0x100_0040);
    assert_eq!(boot.params_addr, PVH_START_INFO_ADDR);
    assert_eq!(boot.kernel, 0x100_0000..0x100_3000);
    assert_eq!(boot.initrd, Some(0x100_3000..0x100_3000 + 10_000));
    assert_eq!(g.bytes(0x100_3000, 10_000), initrd_bytes);
    assert_eq!(g.u8_at(0x100_0000), 0xcc, "kernel loaded at p_paddr");

    let info: hvm_start_info = g.mem.read_obj(GuestAddress(PVH_START_INFO_ADDR)).unwrap();
    assert_eq!(info.magic, 0x336e_c578);
    assert_eq!(info.version, 1);
    assert_eq!(info.cmdline_paddr, CMDLINE_ADDR);
    assert_eq!(info.rsdp_paddr, ACPI_START);
    assert_eq!((info.nr_modules, info.modlist_paddr), (1, PVH_MODLIST_ADDR));
    let module: hvm_modlist_entry = g.mem.read_obj(GuestAddress(PVH_MODLIST_ADDR)).unwrap();
    assert_eq!((module.paddr, module.size), (0x100_3000, 10_000));
    assert_eq!(info.memmap_paddr, PVH_MEMMAP_ADDR);
    assert_eq!(info.memmap_entries as usize, boot.e820.len());
    for (i, e) in boot.e820.iter().enumerate() {
        let m: hvm_memmap_table_entry = g
            .mem
            .read_obj(GuestAddress(PVH_MEMMAP_ADDR + 24 * i as u64))
            .unwrap();
        assert_eq!((m.addr, m.size, m.type_), (e.addr, e.size, e.kind.code()));
    }
    assert_eq!(g.bytes(CMDLINE_ADDR, 20), b"console=ttyS0 quiet\0");
    assert_eq!(&g.bytes(ACPI_START, 8), b"RSD PTR ");
    assert_eq!(
        g.u64_at(crate::addrs::PML4_ADDR) & !0xfff,
        crate::addrs::PDPT_ADDR
    );

    let cpu = boot.cpu_state();
    assert_eq!(
        (cpu.regs.rip, cpu.regs.rbx),
        (0x100_0040, PVH_START_INFO_ADDR)
    );
}

#[test]
fn e820_has_ram_per_cell_and_the_firmware_area_reserved() {
    let g = Guest::new(64 * MIB);
    let kernel = g.file("vmlinux", &fake::elf(0x100_0000, 0x1000, Some(0x100_0000)));
    let boot = g.load(&kernel, None, "").unwrap();
    let got: Vec<(u64, u64, E820Kind)> =
        boot.e820.iter().map(|e| (e.addr, e.size, e.kind)).collect();
    use crate::e820::E820Kind;
    assert_eq!(
        got,
        vec![
            (0, 0xa_0000, E820Kind::Ram),
            (0xa_0000, 0x6_0000, E820Kind::Reserved),
            (0x10_0000, 63 * MIB, E820Kind::Ram),
            (64 * MIB, 64 * MIB, E820Kind::Ram),
        ]
    );
    assert!(boot.initrd.is_none());
    let info: hvm_start_info = g.mem.read_obj(GuestAddress(PVH_START_INFO_ADDR)).unwrap();
    assert_eq!((info.nr_modules, info.modlist_paddr), (0, 0));
    assert_eq!(
        g.u8_at(CMDLINE_ADDR),
        0,
        "empty command line is just the NUL"
    );
}

#[test]
fn elf_without_pvh_note_uses_the_64bit_entry_and_zero_page() {
    let g = Guest::new(64 * MIB);
    let kernel = g.file("vmlinux", &fake::elf(0x100_0000, 0x2000, None));
    let initrd = g.file("initrd", &[7u8; 100]);
    let boot = g.load(&kernel, Some(&initrd), "root=/dev/vda").unwrap();
    assert_eq!(boot.mode, BootMode::Linux64);
    assert_eq!(boot.entry, 0x100_0000);
    assert_eq!(boot.params_addr, ZERO_PAGE_ADDR);
    let zp = ZERO_PAGE_ADDR;
    assert_eq!(&g.bytes(zp + 0x202, 4), b"HdrS");
    assert_eq!(g.u8_at(zp + 0x210), 0xff, "type_of_loader");
    assert_eq!(
        u64::from(g.u32_at(zp + 0x228)),
        CMDLINE_ADDR,
        "cmd_line_ptr"
    );
    assert_eq!(u64::from(g.u32_at(zp + 0x218)), 0x100_2000, "ramdisk_image");
    assert_eq!(g.u32_at(zp + 0x21c), 100, "ramdisk_size");
    assert_eq!(g.u64_at(zp + 0x70), ACPI_START, "acpi_rsdp_addr");
    assert_eq!(usize::from(g.u8_at(zp + 0x1e8)), boot.e820.len());
    let first = g.bytes(zp + 0x2d0, 20);
    assert_eq!(&first[8..16], &0xa_0000u64.to_le_bytes(), "e820[0].size");
    let cpu = boot.cpu_state();
    assert_eq!((cpu.regs.rip, cpu.regs.rsi), (0x100_0000, ZERO_PAGE_ADDR));
    assert_eq!(cpu.sregs.efer, 0x500);
}

#[test]
fn bzimage_loads_at_pref_address_and_enters_at_0x200() {
    let g = Guest::new(64 * MIB);
    let kernel = g.file("bzImage", &fake::bzimage(0x020f, 1, 0x7fff_ffff, 2047));
    let initrd = g.file("initrd", &[1u8; 4096]);
    let boot = g.load(&kernel, Some(&initrd), "console=ttyS0").unwrap();
    assert_eq!(boot.format, KernelFormat::BzImage);
    assert_eq!(boot.mode, BootMode::Linux64);
    assert_eq!(boot.entry, 0x100_0200);
    // Footprint: load address + init_size (2 MiB), not just the 4 KiB image.
    assert_eq!(boot.kernel, 0x100_0000..0x120_0000);
    assert_eq!(boot.initrd, Some(0x120_0000..0x120_1000));
    assert_eq!(g.u8_at(0x100_0000), 0x90);
    let zp = ZERO_PAGE_ADDR;
    assert_eq!(
        g.bytes(zp + 0x206, 2),
        [0x0f, 0x02],
        "the image's header is kept"
    );
    assert_eq!(
        g.u32_at(zp + 0x214),
        0x100_0000,
        "code32_start = load address"
    );
    assert_eq!(g.u32_at(zp + 0x218), 0x120_0000);
    assert_eq!(g.u8_at(zp + 0x210), 0xff);
}

#[test]
fn missing_or_unreadable_kernel() {
    let g = Guest::new(64 * MIB);
    let missing = g.dir.path().join("nope");
    let err = g.load(&missing, None, "").unwrap_err();
    assert!(
        matches!(&err, BootError::OpenKernel { path, .. } if *path == missing),
        "{err:?}"
    );
    assert!(err.to_string().contains("nope"), "{err}");
    // A directory is not an image.
    let err = g.load(g.dir.path(), None, "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::NotAFile {
                kind: "directory",
                ..
            }
        ),
        "{err:?}"
    );
}

/// A FIFO in the test directory.
fn fifo(g: &Guest, name: &str) -> PathBuf {
    let p = g.dir.path().join(name);
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that lives for the whole call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    p
}

/// Runs `f` on a thread and fails the test when it does not return within 10 s.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()));
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .expect("loading blocked: a FIFO hangs the start")
}

#[test]
fn a_fifo_as_kernel_or_initrd_is_refused_without_blocking() {
    let g = std::sync::Arc::new(Guest::new(64 * MIB));
    let kfifo = fifo(&g, "kernel.fifo");
    let gk = std::sync::Arc::clone(&g);
    let err = within_10s(move || gk.load(&kfifo, None, "").unwrap_err());
    assert!(
        matches!(
            err,
            BootError::NotAFile {
                kind: "FIFO",
                field: "kernel",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("not a regular file"), "{err}");
    let kernel = g.file("vmlinux", &fake::elf(0x100_0000, 0x1000, Some(0x100_0000)));
    let ififo = fifo(&g, "initrd.fifo");
    let gi = std::sync::Arc::clone(&g);
    let err = within_10s(move || gi.load(&kernel, Some(&ififo), "").unwrap_err());
    assert!(
        matches!(
            err,
            BootError::NotAFile {
                kind: "FIFO",
                field: "initrd",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn neither_elf_nor_bzimage() {
    let g = Guest::new(64 * MIB);
    let text = g.file("README", b"this is not a kernel\n");
    let err = g.load(&text, None, "").unwrap_err();
    assert!(matches!(err, BootError::NotAKernel { .. }), "{err:?}");
    let empty = g.file("empty", b"");
    let err = g.load(&empty, None, "").unwrap_err();
    assert!(matches!(err, BootError::NotAKernel { .. }), "{err:?}");

    let mut elf32 = fake::elf(0x100_0000, 0x1000, None);
    elf32[4] = 1; // ELFCLASS32
    let err = g.load(&g.file("elf32", &elf32), None, "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::UnsupportedElf {
                class: 1,
                machine: 62,
                ..
            }
        ),
        "{err:?}"
    );
    let mut arm = fake::elf(0x100_0000, 0x1000, None);
    arm[18] = 183; // EM_AARCH64
    let err = g.load(&g.file("arm", &arm), None, "").unwrap_err();
    assert!(
        matches!(err, BootError::UnsupportedElf { machine: 183, .. }),
        "{err:?}"
    );
}

#[test]
fn bzimage_without_64bit_entry_is_rejected() {
    let g = Guest::new(64 * MIB);
    let old = g.file("old", &fake::bzimage(0x020a, 0, 0x37ff_ffff, 255));
    let err = g.load(&old, None, "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::NoLongModeEntry {
                version: 0x020a,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("protocol 2.10"), "{err}");
    let no64 = g.file("no64", &fake::bzimage(0x020f, 0, 0x7fff_ffff, 2047));
    let err = g.load(&no64, None, "").unwrap_err();
    assert!(matches!(err, BootError::NoLongModeEntry { .. }), "{err:?}");
}

#[test]
fn missing_or_unreadable_initrd() {
    let g = Guest::new(64 * MIB);
    let kernel = g.file("vmlinux", &fake::elf(0x100_0000, 0x1000, Some(0x100_0000)));
    let missing = g.dir.path().join("initrd.missing");
    let err = g.load(&kernel, Some(&missing), "").unwrap_err();
    assert!(
        matches!(&err, BootError::OpenInitrd { path, .. } if *path == missing),
        "{err:?}"
    );
    // A directory opens, but is refused before the kernel is loaded.
    let err = g.load(&kernel, Some(g.dir.path()), "").unwrap_err();
    assert!(matches!(err, BootError::NotAFile { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&*g.dir.path().to_string_lossy()),
        "{err}"
    );
}

#[test]
fn initrd_must_fit_below_initrd_addr_max() {
    let g = Guest::new(64 * MIB);
    // initrd_addr_max 0x13f_ffff: the kernel's footprint ends at 0x120_0000, 2 MiB left.
    let kernel = g.file("bzImage", &fake::bzimage(0x020f, 1, 0x13f_ffff, 2047));
    let fits = g.file("fits", &vec![0u8; 2 << 20]);
    g.load(&kernel, Some(&fits), "").unwrap();
    let big = g.file("big", &vec![0u8; (2 << 20) + 1]);
    let err = g.load(&kernel, Some(&big), "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::InitrdTooLarge {
                addr: 0x120_0000,
                limit: 0x140_0000,
                addr_max: 0x13f_ffff,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn initrd_must_fit_in_low_ram_for_elf() {
    let g = Guest::new(16 * MIB);
    let kernel = g.file("vmlinux", &fake::elf(0x100_0000, 0x1000, Some(0x100_0000)));
    let initrd = g.dir.path().join("huge");
    std::fs::File::create(&initrd)
        .unwrap()
        .set_len(16 * MIB)
        .unwrap();
    let err = g.load(&kernel, Some(&initrd), "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::InitrdTooLarge {
                limit: 0x200_0000,
                addr_max: ELF_INITRD_ADDR_MAX,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn command_line_limits_come_from_the_image() {
    let g = Guest::new(64 * MIB);
    let bz = g.file("bzImage", &fake::bzimage(0x020f, 1, 0x7fff_ffff, 64));
    g.load(&bz, None, &"a".repeat(64)).unwrap();
    let err = g.load(&bz, None, &"a".repeat(65)).unwrap_err();
    assert!(
        matches!(err, BootError::CmdlineTooLong { len: 65, limit: 64 }),
        "{err:?}"
    );

    let elf = g.file("vmlinux", &fake::elf(0x100_0000, 0x1000, Some(0x100_0000)));
    g.load(&elf, None, &"b".repeat(ELF_CMDLINE_MAX)).unwrap();
    let err = g
        .load(&elf, None, &"b".repeat(ELF_CMDLINE_MAX + 1))
        .unwrap_err();
    assert!(
        matches!(
            err,
            BootError::CmdlineTooLong {
                len: 2048,
                limit: 2047
            }
        ),
        "{err:?}"
    );

    let err = g.load(&elf, None, "console=ttyS0\nquiet").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::InvalidCmdline {
                position: 13,
                byte: '\n'
            }
        ),
        "{err:?}"
    );
    let err = g.load(&elf, None, "a\0b").unwrap_err();
    assert!(
        matches!(err, BootError::InvalidCmdline { position: 1, .. }),
        "{err:?}"
    );
}

#[test]
fn kernel_must_fit_in_low_ram() {
    // 2 x 8 MiB of RAM: a bzImage preferring 16 MiB does not fit.
    let g = Guest::new(8 * MIB);
    let bz = g.file("bzImage", &fake::bzimage(0x020f, 1, 0x7fff_ffff, 2047));
    let err = g.load(&bz, None, "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::KernelOutsideRam {
                start: 0x100_0000,
                end: 0x120_0000,
                ram_end: 0x100_0000,
                ..
            }
        ),
        "{err:?}"
    );
    // An ELF whose segment runs past RAM fails in the loader.
    let elf = g.file("vmlinux", &fake::elf(0xf0_0000, 0x20_0000, None));
    let err = g.load(&elf, None, "").unwrap_err();
    assert!(matches!(err, BootError::LoadKernel { .. }), "{err:?}");
    // An ELF entry below 1 MiB would overwrite the boot structures.
    let low = g.file("low", &fake::elf(0x8000, 0x1000, None));
    let err = g.load(&low, None, "").unwrap_err();
    assert!(matches!(err, BootError::LoadKernel { .. }), "{err:?}");
}

#[test]
fn low_ram_end_stops_at_the_hole() {
    use vmhost_memory::layout::CellSpan;
    let span = |cell, size_bytes| CellSpan {
        cell,
        host_node: None,
        size_bytes,
    };
    let gib = 1u64 << 30;
    let l = GuestLayout::new(
        &[span(0, 2 * gib), span(1, 2 * gib)],
        3 * gib..4 * gib,
        2 * MIB,
    )
    .unwrap();
    assert_eq!(low_ram_end(&l), 3 * gib);
    let l = GuestLayout::new(&[span(0, 64 * MIB)], 3 * gib..4 * gib, 2 * MIB).unwrap();
    assert_eq!(low_ram_end(&l), 64 * MIB);
}

#[test]
fn an_elf_entry_past_its_segments_is_refused() {
    // Found by fuzz/fuzz_targets/kernel_image.rs: an ELF without program headers (or with its
    // entry above every segment) was accepted with the footprint e_entry..0, and an initramfs
    // was then placed at guest address 0, over the boot structures.
    let g = Guest::new(8 * MIB);
    let initrd = g.file("initrd", &[0x5a; 4096]);
    let mut bytes = fake::elf(0x10_0000, 0x1000, None);
    bytes[56..58].copy_from_slice(&0u16.to_le_bytes()); // e_phnum = 0
    let empty = g.file("empty", &bytes);
    let err = g.load(&empty, Some(&initrd), "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::ElfEntryOutsideSegments {
                entry: 0x10_0000,
                end: 0,
                ..
            }
        ),
        "{err:?}"
    );
    assert_ne!(g.u8_at(0), 0x5a, "the initramfs went to address 0");
    let mut bytes = fake::elf(0x10_0000, 0x1000, None);
    bytes[24..32].copy_from_slice(&0x20_0000u64.to_le_bytes()); // e_entry past the segment
    let past = g.file("past", &bytes);
    let err = g.load(&past, None, "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::ElfEntryOutsideSegments {
                entry: 0x20_0000,
                end: 0x10_1000,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn an_elf_segment_larger_in_the_file_than_in_memory_is_refused() {
    // Found by fuzz/fuzz_targets/kernel_image.rs: a PT_LOAD with p_filesz > p_memsz was
    // loaded whole, past the footprint that counts p_memsz (where the initramfs goes).
    let g = Guest::new(8 * MIB);
    let mut bytes = fake::elf(0x10_0000, 0x100, None);
    bytes[64 + 40..64 + 48].copy_from_slice(&0x40u64.to_le_bytes()); // p_memsz
    let kernel = g.file("oversized", &bytes);
    let err = g.load(&kernel, None, "").unwrap_err();
    assert!(
        matches!(
            err,
            BootError::ElfSegmentFileSize {
                paddr: 0x10_0000,
                filesz: 0x100,
                memsz: 0x40,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(g.u8_at(0x10_0040), 0, "file bytes were copied past p_memsz");
    assert!(matches!(
        check_linux_inputs(&kernel, None, "").unwrap_err(),
        BootError::ElfSegmentFileSize { .. }
    ));
}
