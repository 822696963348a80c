//! Kernel image parsing: a KubeVirt manifest or a spec may point `boot.kernel` at any file, so
//! any bytes go through the preflight check (`check_linux_inputs`) and the loader
//! (`load_linux`) into a fresh 2 MiB guest. Invariants: the loader never accepts what the
//! preflight refuses (and agrees on the format); an accepted image is complete (every
//! `PT_LOAD` segment's file range, or the bzImage's setup and `syssize` code, inside the
//! file); its footprint lies in guest RAM above 1 MiB; nothing is written past the
//! footprint's end (where the initramfs goes). All arithmetic here is checked.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmhost_boot::acpi::{build_acpi, AcpiTables};
use vmhost_boot::addrs::{ACPI_START, HIMEM_START};
use vmhost_boot::{check_linux_inputs, load_linux, KernelFormat};
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_plan::{Backing, GuestCell, Plan, VcpuPlacement};

/// Guest RAM: small, so that a load range past it is easy to reach and cheap to scan.
const RAM: u64 = 2 << 20;
const CMDLINE: &str = "console=ttyS0";

/// One cell of [`RAM`] with one vCPU, its layout and ACPI tables, built once.
fn guest() -> &'static (GuestLayout, AcpiTables) {
    static G: OnceLock<(GuestLayout, AcpiTables)> = OnceLock::new();
    G.get_or_init(|| {
        let cell = GuestCell {
            cell: 0,
            host_node: None,
            vcpus: vec![0],
            memory_bytes: RAM,
            prefault_cpus: Vec::new(),
            distances: vec![10],
            spans: Vec::new(),
        };
        let mut plan = Plan::memory_only("fuzz", vec![cell], Backing::Anonymous);
        plan.vcpus = vec![VcpuPlacement {
            vcpu: 0,
            socket: 0,
            core: 0,
            thread: 0,
            apic_id: 0,
            guest_cell: 0,
            host_cpu: None,
            host_node: None,
        }];
        let layout =
            GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).expect("guest layout");
        let acpi = build_acpi(&plan, &layout, ACPI_START).expect("ACPI tables");
        (layout, acpi)
    })
}

/// The kernel file, one per fuzzing process (rewritten by every run).
fn kernel_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        std::env::temp_dir().join(format!("vmhost-fuzz-kernel-{}.img", std::process::id()))
    })
}

fn le<const N: usize>(b: &[u8], off: usize) -> Option<[u8; N]> {
    b.get(off..off.checked_add(N)?)?.try_into().ok()
}

/// The file length an image's headers need, computed here from the formats' specifications
/// (ELF64 program headers; the x86 boot protocol's `setup_sects` and `syssize`), up to the
/// 64 program headers the loader reads.
fn needed_len(image: &[u8], format: KernelFormat) -> Option<u64> {
    match format {
        KernelFormat::BzImage => {
            let sects = match image.get(0x1f1).copied()? {
                0 => 4,
                n => u64::from(n),
            };
            let syssize = u64::from(u32::from_le_bytes(le(image, 0x1f4)?));
            sects
                .checked_add(1)?
                .checked_mul(512)?
                .checked_add(syssize.checked_mul(16)?)
        }
        KernelFormat::Elf => {
            let phoff = u64::from_le_bytes(le(image, 32)?);
            let phnum = u16::from_le_bytes(le(image, 56)?).min(64);
            let mut needed = phoff.checked_add(u64::from(phnum) * 56)?;
            for i in 0..u64::from(phnum) {
                let at = usize::try_from(phoff.checked_add(i * 56)?).ok()?;
                if u32::from_le_bytes(le(image, at)?) != 1 {
                    continue; // not PT_LOAD
                }
                let offset = u64::from_le_bytes(le(image, at.checked_add(8)?)?);
                let filesz = u64::from_le_bytes(le(image, at.checked_add(32)?)?);
                needed = needed.max(offset.checked_add(filesz)?);
            }
            Some(needed)
        }
    }
}

fuzz_target!(|image: &[u8]| {
    let path = kernel_path();
    std::fs::write(path, image).expect("write the kernel file");
    let (layout, acpi) = guest();
    let preflight = check_linux_inputs(path, None, CMDLINE);
    let mem = layout.anonymous_memory().expect("guest memory");
    let Ok(boot) = load_linux(&mem, layout, path, None, CMDLINE, acpi) else {
        return;
    };
    let format = preflight.expect("the loader accepted an image the preflight refuses");
    assert_eq!(
        format, boot.format,
        "preflight and loader disagree on the format"
    );
    let needed = needed_len(image, format).expect("an accepted image's header is complete");
    let len = u64::try_from(image.len()).expect("file length");
    assert!(
        needed <= len,
        "accepted a {len}-byte image whose headers need {needed} bytes"
    );
    let k = &boot.kernel;
    assert!(
        HIMEM_START <= k.start && k.start <= k.end && k.end <= RAM,
        "kernel footprint {k:#x?} outside guest RAM 1 MiB..{RAM:#x}"
    );
    // Nothing past the footprint: that is where the initramfs is placed.
    let mut rest = vec![0u8; usize::try_from(RAM - k.end).expect("size")];
    mem.read_slice(&mut rest, GuestAddress(k.end))
        .expect("read guest RAM");
    if let Some(i) = rest.iter().position(|&b| b != 0) {
        panic!(
            "byte written at {:#x}, past the footprint {k:#x?}",
            k.end + i as u64
        );
    }
});
