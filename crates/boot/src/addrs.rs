//! The guest-physical addresses this crate owns for Linux guests.
//!
//! Everything the boot code places in guest RAM sits below 1 MiB (boot GDT, PVH start info,
//! zero page, page tables, command line, ACPI tables) or right after the kernel's footprint
//! (the initramfs). The vCPU crate's own boot area for built-in payloads lives in a separate
//! memslot inside the MMIO hole, so the two never overlap.
//!
//! | range               | what                                                   |
//! |---------------------|--------------------------------------------------------|
//! | `0x0500..0x0528`    | boot GDT ([`BOOT_GDT_ADDR`]), then an empty IDT        |
//! | `0x6000..0x6038`    | PVH `hvm_start_info` ([`PVH_START_INFO_ADDR`])         |
//! | `0x6040..0x6060`    | PVH module list (the initramfs)                        |
//! | `0x6080..0x7000`    | PVH memory map ([`PVH_MEMMAP_ADDR`])                   |
//! | `0x7000..0x8000`    | Linux zero page, `struct boot_params` ([`ZERO_PAGE_ADDR`]) |
//! | `0x8000..0x9000`    | boot stack (top: [`BOOT_STACK_TOP`])                   |
//! | `0x9000..0xF000`    | identity page tables for the 64-bit entry ([`PML4_ADDR`]) |
//! | `0x20000..0x30000`  | kernel command line ([`CMDLINE_ADDR`])                 |
//! | `0xA0000..0x100000` | reserved in e820 ([`FIRMWARE_RESERVED`]); ACPI tables from [`ACPI_START`] |
//! | `0xFFFF0..0x100000` | the reset vector's stub ([`RESET_VECTOR`]), past [`ACPI_END`] |

use std::ops::Range;

/// The boot GDT: null, flat 32-bit code (0x08), 64-bit code (0x10), flat data (0x18), TSS (0x20).
pub const BOOT_GDT_ADDR: u64 = 0x500;
/// An empty IDT (limit 0): interrupts stay disabled until the kernel installs its own.
pub const BOOT_IDT_ADDR: u64 = 0x520;
/// PVH `struct hvm_start_info` (56 bytes); its address goes in `ebx` at the PVH entry.
pub const PVH_START_INFO_ADDR: u64 = 0x6000;
/// PVH module list: one `hvm_modlist_entry` for the initramfs.
pub const PVH_MODLIST_ADDR: u64 = 0x6040;
/// PVH memory map (`hvm_memmap_table_entry`, 24 bytes each) up to [`ZERO_PAGE_ADDR`].
pub const PVH_MEMMAP_ADDR: u64 = 0x6080;
/// The Linux zero page (`struct boot_params`, 4 KiB); its address goes in `rsi` at the 64-bit
/// entry.
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer (the stack grows down from here over `0x8000..0x9000`).
pub const BOOT_STACK_TOP: u64 = 0x8ff0;
/// Page-map level 4 of the identity map used by the 64-bit entry (`cr3`).
pub const PML4_ADDR: u64 = 0x9000;
/// Page-directory-pointer table of the identity map.
pub const PDPT_ADDR: u64 = 0xa000;
/// First of four page directories (2 MiB pages) that identity-map the low 4 GiB.
pub const PD_ADDR: u64 = 0xb000;
/// The kernel command line, NUL-terminated.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Where [`crate::build_acpi`] is normally asked to place the tables: the RSDP sits here,
/// 16-byte aligned inside the BIOS area the kernel scans.
pub const ACPI_START: u64 = 0xe_0000;
/// One past the last byte the ACPI tables may use (the reset vector's stub follows).
pub const ACPI_END: u64 = RESET_VECTOR;
/// The x86 reset vector (F000:FFF0 in real mode), where a "BIOS" reboot jumps.
pub const RESET_VECTOR: u64 = 0xf_fff0;
/// Legacy video, option ROM and BIOS area, reported as reserved in e820 (holds the ACPI tables).
pub const FIRMWARE_RESERVED: Range<u64> = 0xa_0000..0x10_0000;
/// Start of "high" memory: kernels must load at or above 1 MiB.
pub const HIMEM_START: u64 = 0x10_0000;
/// Guest RAM pages: initramfs placement is aligned to this.
pub const PAGE_SIZE: u64 = 0x1000;
