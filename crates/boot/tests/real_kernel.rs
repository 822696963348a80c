//! Loader tests with a real Debian 6.1 kernel (bzImage and the vmlinux cut out of it).
//!
//! Run `crates/boot/scripts/fetch-test-kernel.sh` first (CI does): it puts `bzImage` and
//! `vmlinux` in `$VMHOST_TEST_KERNEL_DIR` (default `target/test-kernel`). These tests never
//! download anything; they fail with that hint when the files are missing, unless
//! `VMHOST_SKIP_KERNEL_TESTS=1`.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns panic on bad fixtures too

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use vm_memory::{Bytes, GuestAddress};
use vmhost_boot::addrs::{ACPI_START, CMDLINE_ADDR, PVH_START_INFO_ADDR, ZERO_PAGE_ADDR};
use vmhost_boot::{build_acpi, load_linux, BootError, BootMode, KernelFormat, LinuxBoot};
use vmhost_memory::layout::CellSpan;
use vmhost_memory::GuestMemoryMmap;
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_plan::Plan;

const MIB: u64 = 1 << 20;

/// Guest memory, layout and ACPI tables of a 2-cell, 4-vCPU plan (2 x 64 MiB).
struct Guest {
    layout: GuestLayout,
    mem: GuestMemoryMmap,
    acpi: vmhost_boot::AcpiTables,
    dir: tempfile::TempDir,
}

fn guest() -> Guest {
    let plan = plan();
    let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap();
    let mem = layout.anonymous_memory().unwrap();
    let acpi = build_acpi(&plan, &layout, ACPI_START).unwrap();
    Guest {
        layout,
        mem,
        acpi,
        dir: tempfile::tempdir().unwrap(),
    }
}

fn plan() -> Plan {
    let text = "name = \"k\"\n[cpu]\ncores = 4\ndedicated_cpu_placement = true\n\
                numa = { guest_mapping_passthrough = true }\n\
                [memory]\nguest = \"128Mi\"\nhugepages = { page_size = \"2Mi\" }\n";
    let spec = vmhost_config::from_toml_str(text, "k.toml").unwrap().spec;
    let mut host = vmhost_topology::load_synthetic("package:2 numa:1 core:2 pu:1").unwrap();
    let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=64,node1:2Mi=64").unwrap();
    vmhost_topology::apply_hugepages(&mut host, &pools).unwrap();
    vmhost_plan::plan(&spec, &host, &Default::default())
        .into_result()
        .unwrap()
}

impl Guest {
    fn load(
        &self,
        kernel: &Path,
        initrd: Option<&Path>,
        cmdline: &str,
    ) -> Result<LinuxBoot, BootError> {
        load_linux(&self.mem, &self.layout, kernel, initrd, cmdline, &self.acpi)
    }
    fn initrd(&self, size: usize) -> PathBuf {
        let p = self.dir.path().join("initrd.img");
        let bytes: Vec<u8> = (0..size).map(|i| u8::try_from(i % 253).unwrap()).collect();
        std::fs::write(&p, bytes).unwrap();
        p
    }
    fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }
}

/// `(p_offset, p_paddr)` of the first PT_LOAD of an ELF64 file.
fn first_load_segment(path: &Path) -> (u64, u64) {
    let mut f = std::fs::File::open(path).unwrap();
    let mut ehdr = [0u8; 64];
    f.read_exact(&mut ehdr).unwrap();
    let le64 = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let phoff = le64(&ehdr, 32);
    let phnum = u16::from_le_bytes([ehdr[56], ehdr[57]]);
    for i in 0..u64::from(phnum) {
        let mut ph = [0u8; 56];
        f.seek(SeekFrom::Start(phoff + 56 * i)).unwrap();
        f.read_exact(&mut ph).unwrap();
        if u32::from_le_bytes(ph[..4].try_into().unwrap()) == 1 {
            return (le64(&ph, 8), le64(&ph, 24));
        }
    }
    panic!("no PT_LOAD in {}", path.display());
}

#[test]
fn debian_vmlinux_boots_through_pvh() {
    let Some(vmlinux) = vmhost_testsupport::test_kernel_file("vmlinux") else {
        return;
    };
    let g = guest();
    let initrd = g.initrd(1 << 20);
    let boot = g
        .load(&vmlinux, Some(&initrd), "console=ttyS0 earlyprintk=ttyS0")
        .unwrap();

    assert_eq!(boot.format, KernelFormat::Elf);
    assert_eq!(
        boot.mode,
        BootMode::Pvh,
        "Debian's vmlinux carries the Xen PVH note"
    );
    assert_eq!(boot.params_addr, PVH_START_INFO_ADDR);
    assert!(
        boot.kernel.contains(&boot.entry),
        "{:#x} in {:x?}",
        boot.entry,
        boot.kernel
    );
    assert!(boot.entry < 1 << 32, "PVH entry is a 32-bit address");

    let (offset, paddr) = first_load_segment(&vmlinux);
    assert_eq!(boot.kernel.start, paddr);
    let mut want = vec![0u8; 4096];
    let mut f = std::fs::File::open(&vmlinux).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.read_exact(&mut want).unwrap();
    assert_eq!(g.bytes(paddr, 4096), want, "first page of the kernel text");

    let initrd_range = boot.initrd.clone().unwrap();
    assert!(initrd_range.start >= boot.kernel.end);
    assert_eq!(initrd_range.end - initrd_range.start, 1 << 20);
    assert_eq!(
        g.bytes(initrd_range.start, 4096),
        std::fs::read(&initrd).unwrap()[..4096]
    );
    let magic: u32 = g.mem.read_obj(GuestAddress(PVH_START_INFO_ADDR)).unwrap();
    assert_eq!(magic, 0x336e_c578);
    assert_eq!(g.bytes(CMDLINE_ADDR, 13), b"console=ttyS0");
    assert_eq!(boot.cpu_state().regs.rbx, PVH_START_INFO_ADDR);
}

#[test]
fn debian_bzimage_boots_through_the_64bit_protocol() {
    let Some(bzimage) = vmhost_testsupport::test_kernel_file("bzImage") else {
        return;
    };
    let g = guest();
    let initrd = g.initrd(1 << 20);
    let boot = g.load(&bzimage, Some(&initrd), "console=ttyS0").unwrap();

    assert_eq!(boot.format, KernelFormat::BzImage);
    assert_eq!(boot.mode, BootMode::Linux64);
    assert_eq!(boot.params_addr, ZERO_PAGE_ADDR);
    assert_eq!(boot.entry, boot.kernel.start + 0x200);

    let zp = ZERO_PAGE_ADDR;
    let hdr = g.bytes(zp + 0x1f1, 0x80);
    let at32 = |o: usize| u32::from_le_bytes(hdr[o - 0x1f1..o - 0x1f1 + 4].try_into().unwrap());
    assert_eq!(&hdr[0x202 - 0x1f1..0x206 - 0x1f1], b"HdrS");
    let version = u16::from_le_bytes([hdr[0x206 - 0x1f1], hdr[0x207 - 0x1f1]]);
    assert!(version >= 0x020c, "protocol {version:#x}");
    assert_eq!(hdr[0x210 - 0x1f1], 0xff, "type_of_loader");
    assert_eq!(u64::from(at32(0x214)), boot.kernel.start, "code32_start");
    assert_eq!(u64::from(at32(0x218)), boot.initrd.as_ref().unwrap().start);
    assert_eq!(at32(0x21c), 1 << 20);
    assert_eq!(u64::from(at32(0x228)), CMDLINE_ADDR);
    // The initramfs sits past load address + init_size.
    let init_size = u64::from(at32(0x260));
    assert!(boot.initrd.as_ref().unwrap().start >= boot.kernel.start + init_size);
    let rsdp: u64 = g.mem.read_obj(GuestAddress(zp + 0x70)).unwrap();
    assert_eq!(rsdp, ACPI_START);
    let e820_entries: u8 = g.mem.read_obj(GuestAddress(zp + 0x1e8)).unwrap();
    assert_eq!(usize::from(e820_entries), boot.e820.len());
    assert_eq!(boot.cpu_state().regs.rsi, ZERO_PAGE_ADDR);
}

#[test]
fn debian_bzimage_rejects_a_command_line_past_its_cmdline_size() {
    let Some(bzimage) = vmhost_testsupport::test_kernel_file("bzImage") else {
        return;
    };
    let g = guest();
    let err = g.load(&bzimage, None, &"x".repeat(4096)).unwrap_err();
    assert!(
        matches!(
            err,
            BootError::CmdlineTooLong {
                len: 4096,
                limit: 2047
            }
        ),
        "{err:?}"
    );
}

#[test]
fn debian_vmlinux_does_not_fit_in_32_mib() {
    let Some(vmlinux) = vmhost_testsupport::test_kernel_file("vmlinux") else {
        return;
    };
    let mut g = guest();
    let span = CellSpan {
        cell: 0,
        host_node: None,
        size_bytes: 32 * MIB,
    };
    g.layout = GuestLayout::new(&[span], MMIO_HOLE_START..MMIO_HOLE_END, 2 * MIB).unwrap();
    g.mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
    let err = g.load(&vmlinux, None, "").unwrap_err();
    assert!(matches!(err, BootError::LoadKernel { .. }), "{err:?}");
}
