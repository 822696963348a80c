//! ACPI tables that describe the guest's CPUs and NUMA cells, built from the plan.
//!
//! This module owns the firmware tables of a Linux guest: RSDP, XSDT, FADT (hardware-reduced
//! ACPI, no FACS; power-off through the sleep control register at [`SLEEP_CONTROL_PORT`] and
//! reboot through the reset register at [`RESET_PORT`]), a DSDT (processors, `\_S5_`, COM1,
//! the power button behind a Generic Event Device, pvpanic: see `devices`), MADT, SRAT and SLIT. [`build_acpi`] lays them out from a base
//! address (normally [`ACPI_START`], in the e820-reserved BIOS area) with the right pointers and
//! checksums; [`AcpiTables::write_to`] copies them into guest memory and [`write_tables`] writes
//! them as `.dat` files that ACPICA's `iasl -d` disassembles.
//!
//! Tables are built with the rust-vmm `acpi_tables` crate; the x86 structures it lacks
//! (x2APIC MADT entries, SRAT processor affinity, an asymmetric SLIT) are written in
//! the private `cpus` and `numa` modules on its generic `Sdt` builder.
//!
//! ```
//! use vmhost_boot::{build_acpi, ACPI_START};
//! use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
//! # use std::collections::BTreeMap;
//! # use vmhost_config::{BootSpec, CpuTopology, Payload};
//! # use vmhost_plan::*;
//! # let vcpu = |i: u32, cell: u32| VcpuPlacement {
//! #     vcpu: i, socket: 0, core: i, thread: 0, apic_id: i, guest_cell: cell,
//! #     host_cpu: None, host_node: None,
//! # };
//! # let cell = |c: u32, vcpus: Vec<u32>| GuestCell {
//! #     cell: c, host_node: Some(c), vcpus, memory_bytes: 64 << 20, prefault_cpus: vec![],
//! #     distances: if c == 0 { vec![10, 21] } else { vec![21, 10] }, spans: vec![],
//! # };
//! # let plan = Plan {
//! #     name: "doc".into(),
//! #     guest_topology: CpuTopology { sockets: 1, cores: 2, threads: 1 },
//! #     envelope: Envelope {
//! #         overhead_model: OverheadModel::default(), guest_memory_bytes: 128 << 20,
//! #         overhead_bytes: 0, overhead_terms: BTreeMap::new(), memory_request_bytes: 0,
//! #         memory_limit_bytes: None, cpus: 2.0, dedicated_cpus: 2, hugepages: vec![],
//! #     },
//! #     vcpus: vec![vcpu(0, 0), vcpu(1, 1)], floating_cpus: vec![],
//! #     emulator: EmulatorPlacement { host_cpus: vec![], isolated: false },
//! #     guest_cells: vec![cell(0, vec![0]), cell(1, vec![1])], backing: Backing::Anonymous,
//! #     boot: BootSpec::Payload { payload: Payload::Touch }, realtime: None, distances: Default::default(), notes: vec![],
//! #     devices: Default::default(),
//! # };
//! // A plan with two vCPUs in two guest cells of 64 MiB each.
//! let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap();
//! let tables = build_acpi(&plan, &layout, ACPI_START).unwrap();
//!
//! assert_eq!(tables.rsdp_addr(), ACPI_START);
//! assert_eq!(&tables.rsdp.bytes[..8], b"RSD PTR ");
//! for (file, table) in tables.files() {
//!     let sum = table.bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b));
//!     assert_eq!(sum, 0, "{file} checksum");
//! }
//! // The XSDT points at FACP, APIC, SRAT and SLIT; the FADT at the DSDT.
//! let xsdt_entry = u64::from_le_bytes(tables.xsdt.bytes[36..44].try_into().unwrap());
//! assert_eq!(xsdt_entry, tables.fadt.addr);
//! assert_eq!(&tables.slit.bytes[44..48], &[10, 21, 21, 10]);
//! ```

mod cpus;
mod devices;
mod numa;
pub mod virtio;

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError};
use vmhost_memory::GuestLayout;
use vmhost_plan::{GuestCell, Plan};

pub use crate::addrs::{ACPI_END, ACPI_START};
pub use cpus::{IOAPIC_ADDR, IOAPIC_ID, LAPIC_ADDR};
pub use devices::{
    COM1_GSI, COM1_PORT, GED_GSI, PVPANIC_CRASH_LOADED, PVPANIC_PANICKED, PVPANIC_PORT,
};
pub use numa::{LOCAL_DISTANCE, MAX_DISTANCE};

/// OEM ID in every table header.
pub const OEM_ID: [u8; 6] = *b"VMHOST";
/// OEM table ID in every table header.
pub const OEM_TABLE_ID: [u8; 8] = *b"VMHOSTVM";
/// OEM revision in every table header.
pub const OEM_REVISION: u32 = 1;
/// Most vCPUs the tables describe (DSDT processor names carry three hex digits).
pub const MAX_ACPI_VCPUS: usize = 0x1000;

/// I/O port of the FADT's `SLEEP_CONTROL_REG` (hardware-reduced ACPI): the guest powers off by
/// writing `SLP_TYP << 2 | SLP_EN` here, with `SLP_TYP` = [`S5_SLEEP_TYPE`].
pub const SLEEP_CONTROL_PORT: u16 = 0x600;
/// I/O port of the FADT's `SLEEP_STATUS_REG` (the guest writes `WAK_STS` there before sleeping).
pub const SLEEP_STATUS_PORT: u16 = 0x601;
/// I/O port of the FADT's `RESET_REG`: the guest reboots by writing [`RESET_VALUE`] here.
pub const RESET_PORT: u16 = 0x602;
/// The FADT's `RESET_VALUE`.
pub const RESET_VALUE: u8 = 0x01;
/// `SLP_TYP` of S5 (soft off), as the DSDT's `\_S5_` package gives it.
pub const S5_SLEEP_TYPE: u8 = 5;
/// `SLP_EN` bit of the sleep control register.
pub const SLP_EN: u8 = 1 << 5;
/// Bits of `SLP_TYP` in the sleep control register.
pub const SLP_TYP_MASK: u8 = 0x7 << 2;

/// Tables are placed on this alignment (the RSDP must be 16-byte aligned to be found by a scan).
const TABLE_ALIGN: u64 = 16;
/// FADT IA-PC boot architecture flags: no VGA, no MSI, no CMOS RTC (the VMM emulates none).
const IAPC_BOOT_ARCH: u16 = (1 << 2) | IAPC_NO_MSI | (1 << 5);
/// The "no MSI" flag, left out when the guest has virtio-pci functions (their interrupts
/// are MSI-X messages).
const IAPC_NO_MSI: u16 = 1 << 3;
/// FADT hypervisor vendor identity.
const HYPERVISOR_VENDOR: [u8; 8] = *b"VMHOSTVM";

/// Why the ACPI tables cannot be built or written.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// The plan has no vCPUs to describe.
    #[error("the plan has no vCPUs: the MADT needs at least one")]
    NoVcpus,
    /// More vCPUs than the tables can name.
    #[error("{count} vCPUs: the ACPI tables describe at most {max}")]
    TooManyVcpus {
        /// vCPUs in the plan.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// Guest cells are not numbered 0, 1, ... (proximity domains index the SLIT).
    #[error("guest cell at position {index} is numbered {cell}: cells must be numbered 0..n")]
    CellNumbering {
        /// Position in cell order.
        index: usize,
        /// Its number.
        cell: u32,
    },
    /// A vCPU names a guest cell that does not exist.
    #[error("vCPU {vcpu} is in guest cell {cell}, but the plan has {cells} cells")]
    VcpuCell {
        /// vCPU index.
        vcpu: u32,
        /// Its cell.
        cell: u32,
        /// Cells in the plan.
        cells: usize,
    },
    /// A cell's distance row does not have one entry per cell.
    #[error("guest cell {cell} has {len} distances, expected {cells}")]
    DistanceRow {
        /// Cell number.
        cell: u32,
        /// Entries in its row.
        len: usize,
        /// Cells in the plan.
        cells: usize,
    },
    /// A distance is outside the SLIT's 10..=255.
    #[error("distance {distance} from guest cell {from} to {to} is outside 10..=255")]
    Distance {
        /// Source cell.
        from: u32,
        /// Target cell.
        to: usize,
        /// The distance.
        distance: u32,
    },
    /// The base address is not 16-byte aligned.
    #[error("ACPI base address {base:#x} is not 16-byte aligned")]
    Misaligned {
        /// The base.
        base: u64,
    },
    /// The tables would run out of the BIOS area into the kernel's memory.
    #[error("ACPI tables of {size:#x} bytes at {base:#x} cross {limit:#x}")]
    TooLarge {
        /// The base.
        base: u64,
        /// Total size.
        size: u64,
        /// The address they must stay below.
        limit: u64,
    },
    /// Copying a table into guest memory failed.
    #[error("cannot write the {table} table to guest memory at {addr:#x}")]
    WriteGuest {
        /// Table file name (`srat.dat`).
        table: &'static str,
        /// Its guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: GuestMemoryError,
    },
    /// The output directory cannot be created.
    #[error("cannot create directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A table file cannot be written.
    #[error("cannot write {path}")]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// One table and where it sits in guest-physical memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Guest-physical address.
    pub addr: u64,
    /// The table, checksum included.
    pub bytes: Vec<u8>,
}

impl Table {
    /// `addr..addr + len`.
    pub fn range(&self) -> Range<u64> {
        self.addr..self.addr + self.bytes.len() as u64
    }
}

/// The guest's ACPI tables, laid out in guest-physical memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiTables {
    /// Root System Description Pointer (ACPI 2.0+, 36 bytes), at the base address.
    pub rsdp: Table,
    /// Extended System Description Table: FACP, APIC, SRAT, SLIT.
    pub xsdt: Table,
    /// Fixed ACPI Description Table ("FACP"), hardware-reduced.
    pub fadt: Table,
    /// Differentiated System Description Table: processor devices.
    pub dsdt: Table,
    /// Multiple APIC Description Table ("APIC").
    pub madt: Table,
    /// System Resource Affinity Table.
    pub srat: Table,
    /// System Locality Information Table.
    pub slit: Table,
}

impl AcpiTables {
    /// Guest-physical address of the RSDP (what boot parameters point the kernel at).
    pub fn rsdp_addr(&self) -> u64 {
        self.rsdp.addr
    }

    /// Every table with its file name, in address order.
    pub fn files(&self) -> [(&'static str, &Table); 7] {
        [
            ("rsdp.dat", &self.rsdp),
            ("xsdt.dat", &self.xsdt),
            ("facp.dat", &self.fadt),
            ("dsdt.dat", &self.dsdt),
            ("apic.dat", &self.madt),
            ("srat.dat", &self.srat),
            ("slit.dat", &self.slit),
        ]
    }

    /// The guest-physical range the tables occupy (to keep out of usable RAM).
    pub fn range(&self) -> Range<u64> {
        self.rsdp.addr..self.slit.range().end
    }

    /// Copies every table into guest memory at its address.
    pub fn write_to<M: GuestMemoryBackend>(&self, mem: &M) -> Result<(), AcpiError> {
        for (table, t) in self.files() {
            mem.write_slice(&t.bytes, GuestAddress(t.addr))
                .map_err(|source| AcpiError::WriteGuest {
                    table,
                    addr: t.addr,
                    source,
                })?;
        }
        Ok(())
    }
}

/// Builds the ACPI tables of `plan` with guest RAM as in `layout`, laid out from `base_addr`.
///
/// The RSDP sits at `base_addr` (16-byte aligned), then XSDT, FACP, DSDT, APIC, SRAT and SLIT,
/// each 16-byte aligned. Tables that start below [`ACPI_END`] must end there too.
pub fn build_acpi(
    plan: &Plan,
    layout: &GuestLayout,
    base_addr: u64,
) -> Result<AcpiTables, AcpiError> {
    if base_addr % TABLE_ALIGN != 0 {
        return Err(AcpiError::Misaligned { base: base_addr });
    }
    let cells = check_plan(plan)?;
    let dsdt = cpus::dsdt(plan);
    let madt = cpus::madt(plan);
    let srat = numa::srat(plan, layout);
    let slit = numa::slit(&cells)?;

    let mut next = base_addr;
    let mut place = |len: usize| {
        let addr = next;
        next = align_up(addr + len as u64, TABLE_ALIGN);
        addr
    };
    let rsdp_addr = place(Rsdp::len());
    let xsdt_addr = place(36 + 8 * 4);
    let fadt_addr = place(acpi_tables::fadt::FADT::len());
    let dsdt_addr = place(dsdt.len());
    let madt_addr = place(madt.len());
    let srat_addr = place(srat.len());
    let slit_addr = place(slit.len());
    let end = slit_addr + slit.len() as u64;
    if base_addr < ACPI_END && end > ACPI_END {
        return Err(AcpiError::TooLarge {
            base: base_addr,
            size: end - base_addr,
            limit: ACPI_END,
        });
    }

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for addr in [fadt_addr, madt_addr, srat_addr, slit_addr] {
        xsdt.add_entry(addr);
    }
    let table = |addr: u64, bytes: Vec<u8>| Table { addr, bytes };
    Ok(AcpiTables {
        rsdp: table(rsdp_addr, aml_bytes(&Rsdp::new(OEM_ID, xsdt_addr))),
        xsdt: table(xsdt_addr, aml_bytes(&xsdt)),
        fadt: table(fadt_addr, fadt(dsdt_addr, plan.virtio_pci())),
        dsdt: table(dsdt_addr, dsdt),
        madt: table(madt_addr, madt),
        srat: table(srat_addr, srat),
        slit: table(slit_addr, slit),
    })
}

/// Writes each table to `dir` as `rsdp.dat`, `xsdt.dat`, `facp.dat`, `dsdt.dat`, `apic.dat`,
/// `srat.dat` and `slit.dat` (creating `dir`), and returns the paths written.
pub fn write_tables(tables: &AcpiTables, dir: &Path) -> Result<Vec<PathBuf>, AcpiError> {
    fs::create_dir_all(dir).map_err(|source| AcpiError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::new();
    for (name, t) in tables.files() {
        let path = dir.join(name);
        fs::write(&path, &t.bytes).map_err(|source| AcpiError::WriteFile {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    Ok(written)
}

/// Checks what the tables index by, and returns the cells in proximity-domain order.
fn check_plan(plan: &Plan) -> Result<Vec<&GuestCell>, AcpiError> {
    if plan.vcpus.is_empty() {
        return Err(AcpiError::NoVcpus);
    }
    if plan.vcpus.len() > MAX_ACPI_VCPUS
        || plan.vcpus.iter().any(|v| v.vcpu as usize >= MAX_ACPI_VCPUS)
    {
        return Err(AcpiError::TooManyVcpus {
            count: plan.vcpus.len(),
            max: MAX_ACPI_VCPUS,
        });
    }
    let mut cells: Vec<&GuestCell> = plan.guest_cells.iter().collect();
    cells.sort_by_key(|c| c.cell);
    for (index, c) in cells.iter().enumerate() {
        if c.cell as usize != index {
            return Err(AcpiError::CellNumbering {
                index,
                cell: c.cell,
            });
        }
    }
    if let Some(v) = plan
        .vcpus
        .iter()
        .find(|v| v.guest_cell as usize >= cells.len())
    {
        return Err(AcpiError::VcpuCell {
            vcpu: v.vcpu,
            cell: v.guest_cell,
            cells: cells.len(),
        });
    }
    Ok(cells)
}

/// A one-byte register in I/O space.
fn io_byte(port: u16) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(port),
    )
}

/// A hardware-reduced FADT pointing at the DSDT, with the sleep control/status registers (the
/// guest's way to power off, with the DSDT's `\_S5_`) and a reset register (its way to reboot)
/// in I/O space.
fn fadt(dsdt_addr: u64, msi: bool) -> Vec<u8> {
    let mut b = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    let arch = if msi {
        IAPC_BOOT_ARCH & !IAPC_NO_MSI
    } else {
        IAPC_BOOT_ARCH
    };
    b.iapc_boot_arch = arch.into();
    b.sleep_control_reg = io_byte(SLEEP_CONTROL_PORT);
    b.sleep_status_reg = io_byte(SLEEP_STATUS_PORT);
    b.reset_reg = io_byte(RESET_PORT);
    b.reset_value = RESET_VALUE;
    b.hypervisor_vendor_identity = u64::from_le_bytes(HYPERVISOR_VENDOR).into();
    aml_bytes(&b.finalize())
}

/// The bytes of an `acpi_tables` object.
fn aml_bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

#[cfg(test)]
mod tests;
