//! vmhost's Linux guest boot: kernel + initramfs loading, boot parameters with an e820 map
//! taken from the memory layout, and ACPI tables that describe the guest's CPUs and NUMA cells.
//!
//! Data flow, all before the VM starts:
//! 1. [`build_acpi`] turns the [`Plan`](vmhost_plan::Plan) and the
//!    [`GuestLayout`](vmhost_memory::GuestLayout) into RSDP, XSDT, FADT, DSDT, MADT (APIC IDs =
//!    `plan.vcpus[i].apic_id`), SRAT (vCPUs and memory ranges per guest cell) and SLIT (guest
//!    distances), laid out at [`ACPI_START`] ([`acpi`]);
//! 2. [`load_linux`] loads a vmlinux (PVH when it has the entry note) or a bzImage through
//!    `linux-loader`, places the initramfs after the kernel and the command line below 1 MiB,
//!    and writes the ACPI tables, boot page tables and boot parameters with the [`e820_map`]
//!    ([`linux`]);
//! 3. the vCPU code loads [`LinuxBoot::cpu_state`] into the boot vCPU ([`cpu`] documents the
//!    registers per [`BootMode`]) and leaves the other vCPUs waiting for INIT/SIPI.
//!
//! Where everything sits in guest memory is in [`addrs`].
#![warn(missing_docs)]

pub mod acpi;
pub mod addrs;
pub mod cpu;
pub mod e820;
pub mod linux;
mod sys;
#[cfg(test)]
mod testutil;

pub use acpi::{
    build_acpi, write_tables, AcpiError, AcpiTables, Table, COM1_GSI, GED_GSI, IOAPIC_ADDR,
    PVPANIC_CRASH_LOADED, PVPANIC_PANICKED, PVPANIC_PORT, RESET_PORT, RESET_VALUE, S5_SLEEP_TYPE,
    SLEEP_CONTROL_PORT, SLEEP_STATUS_PORT, SLP_EN, SLP_TYP_MASK,
};
pub use addrs::{ACPI_END, ACPI_START, FIRMWARE_RESERVED};
pub use cpu::{CpuSetupError, CpuState};
pub use e820::{e820_map, E820Entry, E820Kind};
pub use linux::{check_linux_inputs, load_linux, BootError, BootMode, KernelFormat, LinuxBoot};
