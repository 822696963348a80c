//! Boot parameters: the zero page (`struct boot_params`) for the Linux 64-bit boot protocol and
//! `hvm_start_info` with its memory map and module list for PVH.

use std::ops::Range;

use linux_loader::configurator::BootParams;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::GuestAddress;

use super::BootError;
use crate::addrs::{
    CMDLINE_ADDR, PVH_MEMMAP_ADDR, PVH_MODLIST_ADDR, PVH_START_INFO_ADDR, ZERO_PAGE_ADDR,
};
use crate::e820::E820Entry;

/// `hvm_start_info.magic`.
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// `setup_header.boot_flag`.
const BOOT_FLAG: u16 = 0xaa55;
/// `setup_header.header`: "HdrS".
const HDRS: u32 = 0x5372_6448;
/// `setup_header.type_of_loader`: undefined loader.
const LOADER_OTHER: u8 = 0xff;
/// `setup_header.kernel_alignment` for an ELF kernel's synthesized header.
const ELF_KERNEL_ALIGNMENT: u32 = 0x100_0000;
/// Entries the zero page's e820 table holds.
pub const MAX_ZERO_PAGE_E820: usize = 128;
/// Entries that fit in the PVH memory map between [`PVH_MEMMAP_ADDR`] and the zero page.
pub const MAX_PVH_MEMMAP: usize = ((ZERO_PAGE_ADDR - PVH_MEMMAP_ADDR) / 24) as usize;

// start_info (56 bytes), the module list (32 bytes) and the memory map do not overlap.
const _: () = assert!(PVH_START_INFO_ADDR + 56 <= PVH_MODLIST_ADDR);
const _: () = assert!(PVH_MODLIST_ADDR + 32 <= PVH_MEMMAP_ADDR);

/// The zero page for the 64-bit entry. `setup` is the bzImage's header as loaded (`None` for an
/// ELF kernel, which gets a minimal one).
pub(super) fn zero_page(
    setup: Option<setup_header>,
    initrd: Option<&Range<u64>>,
    e820: &[E820Entry],
    rsdp_addr: u64,
) -> Result<BootParams, BootError> {
    if e820.len() > MAX_ZERO_PAGE_E820 {
        return Err(BootError::TooManyMemoryEntries {
            count: e820.len(),
            max: MAX_ZERO_PAGE_E820,
        });
    }
    let mut p = boot_params {
        hdr: setup.unwrap_or(setup_header {
            boot_flag: BOOT_FLAG,
            header: HDRS,
            kernel_alignment: ELF_KERNEL_ALIGNMENT,
            ..Default::default()
        }),
        ..Default::default()
    };
    p.hdr.type_of_loader = LOADER_OTHER;
    let (lo, hi) = split(CMDLINE_ADDR);
    p.hdr.cmd_line_ptr = lo;
    p.ext_cmd_line_ptr = hi;
    if let Some(r) = initrd {
        let (lo, hi) = split(r.start);
        p.hdr.ramdisk_image = lo;
        p.ext_ramdisk_image = hi;
        let (lo, hi) = split(r.end - r.start);
        p.hdr.ramdisk_size = lo;
        p.ext_ramdisk_size = hi;
    }
    p.acpi_rsdp_addr = rsdp_addr;
    for (slot, e) in p.e820_table.iter_mut().zip(e820) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind.code(),
        };
    }
    // Checked above: at most 128 entries.
    p.e820_entries = u8::try_from(e820.len()).unwrap_or(u8::MAX);
    Ok(BootParams::new(&p, GuestAddress(ZERO_PAGE_ADDR)))
}

/// `hvm_start_info`, the memory map and (with an initramfs) the module list for PVH.
pub(super) fn pvh_start_info(
    initrd: Option<&Range<u64>>,
    e820: &[E820Entry],
    rsdp_addr: u64,
) -> Result<BootParams, BootError> {
    let too_many = || BootError::TooManyMemoryEntries {
        count: e820.len(),
        max: MAX_PVH_MEMMAP,
    };
    if e820.len() > MAX_PVH_MEMMAP {
        return Err(too_many());
    }
    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind.code(),
            reserved: 0,
        })
        .collect();
    let modules: Vec<hvm_modlist_entry> = initrd
        .map(|r| hvm_modlist_entry {
            paddr: r.start,
            size: r.end - r.start,
            cmdline_paddr: 0,
            reserved: 0,
        })
        .into_iter()
        .collect();
    let info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        flags: 0,
        nr_modules: u32::try_from(modules.len()).map_err(|_| too_many())?,
        modlist_paddr: if modules.is_empty() {
            0
        } else {
            PVH_MODLIST_ADDR
        },
        cmdline_paddr: CMDLINE_ADDR,
        rsdp_paddr: rsdp_addr,
        memmap_paddr: PVH_MEMMAP_ADDR,
        memmap_entries: u32::try_from(memmap.len()).map_err(|_| too_many())?,
        reserved: 0,
    };
    let mut params = BootParams::new(&info, GuestAddress(PVH_START_INFO_ADDR));
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_ADDR));
    if !modules.is_empty() {
        params.set_modules(&modules, GuestAddress(PVH_MODLIST_ADDR));
    }
    Ok(params)
}

/// Low and high 32 bits.
fn split(x: u64) -> (u32, u32) {
    let [a, b, c, d, e, f, g, h] = x.to_le_bytes();
    (
        u32::from_le_bytes([a, b, c, d]),
        u32::from_le_bytes([e, f, g, h]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_halves() {
        assert_eq!(split(0x1_2345_6789), (0x2345_6789, 1));
    }

    #[test]
    fn pvh_memmap_fits_before_the_zero_page() {
        assert_eq!(MAX_PVH_MEMMAP, 165);
    }
}
