//! The VM's state: the in-kernel irqchip (both PICs and the IOAPIC), the PIT and kvmclock.
//! With a split irqchip there is no PIC, in-kernel IOAPIC or PIT: their fields are empty, and
//! the user-space I/O APIC's state is a device's (`DevicesState::ioapic`).

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};
use vmhost_config::Irqchip;

use super::raw::{from_bytes, to_bytes};
use super::{ioctl, PersistError};

/// A VM's device state in KVM. Raw KVM structs are held as their bytes (see `persist`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmState {
    /// `kvm_irqchip` of the master PIC (empty with a split irqchip, as are the slave PIC, the
    /// IOAPIC and the PIT).
    pub pic_master: Vec<u8>,
    /// `kvm_irqchip` of the slave PIC.
    pub pic_slave: Vec<u8>,
    /// `kvm_irqchip` of the IOAPIC.
    pub ioapic: Vec<u8>,
    /// `kvm_pit_state2`.
    pub pit: Vec<u8>,
    /// kvmclock in nanoseconds when saved (`kvm_clock_data.clock`).
    pub clock_ns: u64,
    /// `kvm_clock_data.flags` when saved (`KVM_CLOCK_TSC_STABLE`, `KVM_CLOCK_REALTIME`, …), kept
    /// for the record; restore sets none of them (see [`VmState::restore`]).
    pub clock_flags: u32,
}

const CHIPS: [(&str, u32); 3] = [
    ("PIC master", KVM_IRQCHIP_PIC_MASTER),
    ("PIC slave", KVM_IRQCHIP_PIC_SLAVE),
    ("IOAPIC", KVM_IRQCHIP_IOAPIC),
];

fn get_chip(vm: &VmFd, (piece, chip_id): (&'static str, u32)) -> Result<Vec<u8>, PersistError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(ioctl(piece, "KVM_GET_IRQCHIP"))?;
    Ok(to_bytes(&chip))
}

impl VmState {
    /// Captures the state of `vm`, which has `irqchip`, with every vCPU out of `KVM_RUN`. The
    /// clock is read last, as close to the pause as possible.
    pub fn save(vm: &VmFd, irqchip: Irqchip) -> Result<Self, PersistError> {
        if irqchip == Irqchip::Split {
            let clock = vm.get_clock().map_err(ioctl("kvmclock", "KVM_GET_CLOCK"))?;
            return Ok(Self {
                pic_master: Vec::new(),
                pic_slave: Vec::new(),
                ioapic: Vec::new(),
                pit: Vec::new(),
                clock_ns: clock.clock,
                clock_flags: clock.flags,
            });
        }
        let [master, slave, ioapic] = CHIPS;
        let pic_master = get_chip(vm, master)?;
        let pic_slave = get_chip(vm, slave)?;
        let ioapic = get_chip(vm, ioapic)?;
        let pit = vm.get_pit2().map_err(ioctl("PIT", "KVM_GET_PIT2"))?;
        let clock = vm.get_clock().map_err(ioctl("kvmclock", "KVM_GET_CLOCK"))?;
        Ok(Self {
            pic_master,
            pic_slave,
            ioapic,
            pit: to_bytes(&pit),
            clock_ns: clock.clock,
            clock_flags: clock.flags,
        })
    }

    /// Loads the state into `vm`, which has its `irqchip` created (the in-kernel one with its
    /// PIT, or a split one), before any vCPU state is restored.
    ///
    /// kvmclock is set to the saved value with no flags: the guest's clock continues from
    /// where it stopped and neither jumps back nor forward by the time the VM was paused
    /// (`KVM_CLOCK_REALTIME` would advance it by the host's realtime elapsed since the save;
    /// `KVM_CLOCK_TSC_STABLE` is only reported by KVM and not an input). The saved TSC MSR does
    /// the same for the TSC.
    pub fn restore(&self, vm: &VmFd, irqchip: Irqchip) -> Result<(), PersistError> {
        let saved_in_kernel = !self.pic_master.is_empty();
        if saved_in_kernel != (irqchip == Irqchip::Kernel) {
            return Err(PersistError::Irqchip {
                saved_in_kernel,
                irqchip,
            });
        }
        if saved_in_kernel {
            self.restore_in_kernel(vm)?;
        }
        let clock = kvm_clock_data {
            clock: self.clock_ns,
            flags: 0,
            ..Default::default()
        };
        vm.set_clock(&clock)
            .map_err(ioctl("kvmclock", "KVM_SET_CLOCK"))
    }

    fn restore_in_kernel(&self, vm: &VmFd) -> Result<(), PersistError> {
        for ((piece, chip_id), bytes) in
            CHIPS
                .into_iter()
                .zip([&self.pic_master, &self.pic_slave, &self.ioapic])
        {
            let chip = from_bytes::<kvm_irqchip>(piece, bytes)?;
            if chip.chip_id != chip_id {
                return Err(PersistError::WrongChip {
                    piece,
                    found: chip.chip_id,
                });
            }
            vm.set_irqchip(&chip)
                .map_err(ioctl(piece, "KVM_SET_IRQCHIP"))?;
        }
        vm.set_pit2(&from_bytes::<kvm_pit_state2>("PIT", &self.pit)?)
            .map_err(ioctl("PIT", "KVM_SET_PIT2"))
    }
}
