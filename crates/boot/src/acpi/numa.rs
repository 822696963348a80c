//! SRAT and SLIT: the guest's NUMA cells.
//!
//! The proximity domain of a guest cell is its cell number. SRAT gets one processor affinity
//! entry per vCPU (type 0 Processor Local APIC/SAPIC Affinity for APIC IDs below 0xFF, else
//! type 2 Processor Local x2APIC Affinity) and one memory affinity entry per
//! [`GuestLayout`] region, so a cell split by the MMIO hole gets two. SLIT is the plan's guest
//! distance matrix, row by row.
//!
//! `acpi_tables` 0.2 has memory affinity but no x86 processor affinity structures, and its SLIT
//! can only set symmetric distances, so both tables are assembled here on its generic
//! [`Sdt`] builder (which keeps the checksum right).

use acpi_tables::sdt::Sdt;
use acpi_tables::srat::MemoryAffinity;
use vmhost_memory::GuestLayout;
use vmhost_plan::{GuestCell, Plan};

use super::cpus::fits_xapic;
use super::{aml_bytes, AcpiError, OEM_ID, OEM_REVISION, OEM_TABLE_ID};

/// SRAT revision 3 (ACPI 5.0+): 32-bit proximity domains everywhere.
const SRAT_REVISION: u8 = 3;
/// SLIT revision.
const SLIT_REVISION: u8 = 1;
/// SRAT structure type: Processor Local APIC/SAPIC Affinity.
const SRAT_LAPIC_AFFINITY: u8 = 0;
/// SRAT structure type: Processor Local x2APIC Affinity.
const SRAT_X2APIC_AFFINITY: u8 = 2;
/// Affinity flag: the entry is enabled.
const ENABLED: u32 = 1;
/// Smallest valid SLIT distance (a cell to itself).
pub const LOCAL_DISTANCE: u32 = 10;
/// Largest SLIT value (255 means unreachable).
pub const MAX_DISTANCE: u32 = 255;

/// The SRAT of the plan's vCPUs and the layout's memory.
pub(super) fn srat(plan: &Plan, layout: &GuestLayout) -> Vec<u8> {
    // 36-byte header, a reserved u32 that must be 1, 8 reserved bytes.
    let mut t = Sdt::new(
        *b"SRAT",
        48,
        SRAT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    t.write_u32(36, 1);
    for v in &plan.vcpus {
        if fits_xapic(v.vcpu, v.apic_id) {
            t.append_slice(&lapic_affinity(v.guest_cell, v.apic_id));
        } else {
            t.append_slice(&x2apic_affinity(v.guest_cell, v.apic_id));
        }
    }
    for r in &layout.regions {
        let entry = MemoryAffinity::new(r.cell, r.gpa, r.size_bytes).enabled();
        t.append_slice(&aml_bytes(&entry));
    }
    t.as_slice().to_vec()
}

/// Processor Local APIC/SAPIC Affinity (ACPI 6.5 §5.2.16.1), 16 bytes. `apic_id` < 0xFF.
fn lapic_affinity(domain: u32, apic_id: u32) -> [u8; 16] {
    let d = domain.to_le_bytes();
    let mut b = [0u8; 16];
    b[0] = SRAT_LAPIC_AFFINITY;
    b[1] = 16;
    b[2] = d[0]; // proximity domain bits 7:0
    b[3] = apic_id.to_le_bytes()[0];
    b[4..8].copy_from_slice(&ENABLED.to_le_bytes());
    // b[8]: local SAPIC EID (0)
    // proximity domain bits 31:8; b[12..16] is the clock domain (0)
    b[9..12].copy_from_slice(&d[1..4]);
    b
}

/// Processor Local x2APIC Affinity (ACPI 6.5 §5.2.16.3), 24 bytes.
fn x2apic_affinity(domain: u32, x2apic_id: u32) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[0] = SRAT_X2APIC_AFFINITY;
    b[1] = 24;
    b[4..8].copy_from_slice(&domain.to_le_bytes());
    b[8..12].copy_from_slice(&x2apic_id.to_le_bytes());
    b[12..16].copy_from_slice(&ENABLED.to_le_bytes());
    // b[16..20]: clock domain, b[20..24]: reserved
    b
}

/// The SLIT of `cells`, which the caller has checked are numbered `0..n` in order.
pub(super) fn slit(cells: &[&GuestCell]) -> Result<Vec<u8>, AcpiError> {
    let n = cells.len();
    let mut matrix = Vec::with_capacity(n * n);
    for c in cells {
        if c.distances.len() != n {
            return Err(AcpiError::DistanceRow {
                cell: c.cell,
                len: c.distances.len(),
                cells: n,
            });
        }
        for (to, &d) in c.distances.iter().enumerate() {
            let value = u8::try_from(d).ok().filter(|_| d >= LOCAL_DISTANCE).ok_or(
                AcpiError::Distance {
                    from: c.cell,
                    to,
                    distance: d,
                },
            )?;
            matrix.push(value);
        }
    }
    let mut t = Sdt::new(
        *b"SLIT",
        44,
        SLIT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    t.write_u64(36, n as u64);
    t.append_slice(&matrix);
    Ok(t.as_slice().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lapic_affinity_splits_the_domain() {
        let b = lapic_affinity(0x0102_0304, 7);
        assert_eq!(&b[..4], &[0, 16, 4, 7]);
        assert_eq!(&b[4..8], &[1, 0, 0, 0]);
        assert_eq!(&b[9..12], &[3, 2, 1]);
    }

    #[test]
    fn x2apic_affinity_layout() {
        let b = x2apic_affinity(3, 0x1234);
        assert_eq!(&b[..2], &[2, 24]);
        assert_eq!(&b[4..8], &[3, 0, 0, 0]);
        assert_eq!(&b[8..12], &[0x34, 0x12, 0, 0]);
        assert_eq!(&b[12..16], &[1, 0, 0, 0]);
    }
}
