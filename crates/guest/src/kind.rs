//! Which built-in program a VM runs.

use serde::{Deserialize, Serialize};

/// Test payloads that fault on purpose (hidden: for tests and diagnostics).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FaultPayload {
    /// Loads an empty IDT in ring 0, then executes `ud2` in ring 3: a triple fault.
    TripleFault,
    /// Writes port [`crate::abi::UNKNOWN_PORT`] from ring 3.
    UnknownPort,
    /// Writes GPA [`crate::abi::UNMAPPED_GPA`] (page-mapped, no memslot) from ring 3.
    UnmappedMemory,
    /// Writes an address no page table maps: a page fault delivered through the IDT.
    PageFault,
}

/// What the guest runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PayloadKind {
    /// Every vCPU writes every page of its own guest cell ([`crate::touch`]).
    Touch,
    /// Pointer chase and sequential read per guest cell ([`crate::bench`]).
    NumaBench,
    /// Start, report, halt.
    Halt,
    /// Wait halted until stopped, counting LAPIC timer ticks in its mailbox.
    Idle,
    /// A test payload.
    #[doc(hidden)]
    Fault(FaultPayload),
}

impl PayloadKind {
    /// Every kind, test payloads included, in [`PayloadKind::index`] order.
    pub const ALL: [PayloadKind; 8] = [
        PayloadKind::Touch,
        PayloadKind::NumaBench,
        PayloadKind::Halt,
        PayloadKind::Idle,
        PayloadKind::Fault(FaultPayload::TripleFault),
        PayloadKind::Fault(FaultPayload::UnknownPort),
        PayloadKind::Fault(FaultPayload::UnmappedMemory),
        PayloadKind::Fault(FaultPayload::PageFault),
    ];

    /// Position in [`PayloadKind::ALL`] (the index of its generated program).
    pub const fn index(self) -> usize {
        match self {
            PayloadKind::Touch => 0,
            PayloadKind::NumaBench => 1,
            PayloadKind::Halt => 2,
            PayloadKind::Idle => 3,
            PayloadKind::Fault(FaultPayload::TripleFault) => 4,
            PayloadKind::Fault(FaultPayload::UnknownPort) => 5,
            PayloadKind::Fault(FaultPayload::UnmappedMemory) => 6,
            PayloadKind::Fault(FaultPayload::PageFault) => 7,
        }
    }

    /// True when the guest runs with the in-kernel interrupt controller (and PIT): `idle` waits
    /// in HLT inside the kernel and takes LAPIC timer interrupts; `touch` has it so that it can
    /// be captured mid-run (a VM's saved state is its irqchip's, PIT's and clock's). Without it
    /// HLT exits to the VMM, which `halt` relies on; `numa-bench` writes its chains into guest
    /// RAM when the VM is built, so it is not restorable and keeps the plain VM.
    pub fn needs_irqchip(self) -> bool {
        matches!(self, PayloadKind::Idle | PayloadKind::Touch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_is_the_position_in_all() {
        for (i, k) in PayloadKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }

    #[test]
    fn idle_and_touch_run_with_the_irqchip_and_halt_without() {
        let with: Vec<PayloadKind> = PayloadKind::ALL
            .into_iter()
            .filter(|k| k.needs_irqchip())
            .collect();
        assert_eq!(with, vec![PayloadKind::Touch, PayloadKind::Idle]);
        assert!(!PayloadKind::Halt.needs_irqchip());
    }
}
