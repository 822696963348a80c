//! The user-space I/O APIC of a VM with a split irqchip (`boot.irqchip = "split"`): the guest's
//! accesses to its window at [`IOAPIC_ADDR`] reach vmhost as MMIO exits, and every change to a
//! redirection entry's message or mask installs the chip's MSI routes with
//! `KVM_SET_GSI_ROUTING` on a descriptor of the VM's own (see
//! [`vmhost_devices::ioapic`]). The irqfds on its pins (COM1's) and the power button's
//! `KVM_IRQ_LINE` then reach the LAPICs through those routes without an exit.

use std::os::fd::OwnedFd;
use std::sync::Mutex;

use vmhost_boot::IOAPIC_ADDR;
use vmhost_devices::ioapic::{Ioapic, IoapicState, IoapicStateError, IOAPIC_WINDOW};

use crate::control::lock;

/// The chip and the descriptor its routes are installed on.
#[derive(Debug)]
pub struct UserIoapic {
    chip: Mutex<Ioapic>,
    vm: OwnedFd,
}

/// Why the I/O APIC could not be built or restored.
#[derive(Debug, thiserror::Error)]
pub enum IoapicError {
    /// The VM descriptor could not be duplicated.
    #[error("cannot duplicate the VM descriptor for the I/O APIC")]
    Dup(#[source] std::io::Error),
    /// The saved state is not an I/O APIC's.
    #[error("the saved I/O APIC state")]
    State(#[source] IoapicStateError),
    /// KVM refused the routes.
    #[error("KVM_SET_GSI_ROUTING for the I/O APIC's {routes} routes failed")]
    Routes {
        /// How many routes.
        routes: usize,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl UserIoapic {
    /// The chip after reset (every pin masked, so no route) for the VM `vm`.
    pub fn new(vm: &impl std::os::fd::AsRawFd) -> Result<Self, IoapicError> {
        Ok(UserIoapic {
            chip: Mutex::new(Ioapic::new()),
            vm: crate::sys::dup_vm_fd(vm).map_err(IoapicError::Dup)?,
        })
    }

    /// The chip as `state` left it, its routes installed.
    pub fn restore(
        vm: &impl std::os::fd::AsRawFd,
        state: &IoapicState,
    ) -> Result<Self, IoapicError> {
        let chip = Ioapic::restore(state).map_err(IoapicError::State)?;
        let ioapic = Self::new(vm)?;
        *lock(&ioapic.chip) = chip;
        ioapic.install(&lock(&ioapic.chip))?;
        Ok(ioapic)
    }

    /// The state that moves with the VM.
    pub fn save(&self) -> IoapicState {
        lock(&self.chip).save()
    }

    /// Whether `gpa` is in the chip's window.
    pub fn claims(gpa: u64) -> bool {
        let base = u64::from(IOAPIC_ADDR);
        (base..base + IOAPIC_WINDOW).contains(&gpa)
    }

    /// A guest read in the window: 32-bit registers; other widths read as zeros.
    pub fn read(&self, gpa: u64, data: &mut [u8]) {
        let offset = gpa - u64::from(IOAPIC_ADDR);
        let value = match data.len() {
            4 => lock(&self.chip).read(offset),
            _ => 0,
        };
        data.fill(0);
        let n = data.len().min(4);
        data[..n].copy_from_slice(&value.to_le_bytes()[..n]);
    }

    /// A guest write in the window; a changed entry installs the routes again. A refusal by
    /// KVM is logged (the guest's interrupt on that pin is then lost, not the VM).
    pub fn write(&self, gpa: u64, data: &[u8]) {
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return;
        };
        let offset = gpa - u64::from(IOAPIC_ADDR);
        let chip = &mut *lock(&self.chip);
        if chip.write(offset, u32::from_le_bytes(bytes)) {
            if let Err(e) = self.install(chip) {
                tracing::warn!(error = %e, "I/O APIC routes not installed");
            }
        }
    }

    fn install(&self, chip: &Ioapic) -> Result<(), IoapicError> {
        let routes: Vec<(u32, u64, u32)> = chip
            .routes()
            .iter()
            .map(|r| (r.gsi, r.address, r.data))
            .collect();
        crate::sys::set_msi_routes(&self.vm, &routes).map_err(|source| IoapicError::Routes {
            routes: routes.len(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::serial::SerialConsole;
    use crate::devices::LinuxDevices;
    use kvm_bindings::{kvm_irqchip, kvm_lapic_state, kvm_pit_config, KVM_IRQCHIP_IOAPIC};
    use kvm_ioctls::{Kvm, VcpuFd, VmFd};
    use vmhost_config::Irqchip;
    use vmhost_devices::ioapic::{IOREGSEL, IOWIN};

    fn split_vm(kvm: &Kvm) -> (VmFd, VcpuFd) {
        let vm = kvm.create_vm().unwrap();
        crate::setup::create_irqchip(&vm, Irqchip::Split).unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let mut lapic = vcpu.get_lapic().unwrap();
        lapic.regs[0xf1] |= 1; // SVR bit 8: the LAPIC is software-enabled
        vcpu.set_lapic(&lapic).unwrap();
        (vm, vcpu)
    }

    fn irr_has(lapic: &kvm_lapic_state, vector: u32) -> bool {
        let at = 0x200 + (vector / 32) as usize * 0x10;
        let word = u32::from_le_bytes(std::array::from_fn(|i| lapic.regs[at + i] as u8));
        word & (1 << (vector % 32)) != 0
    }

    /// Programs pin `pin` (vector, physical destination APIC 0, edge) through the guest's
    /// MMIO path of `devices`.
    fn program(devices: &LinuxDevices, pin: u32, low: u32) {
        let base = u64::from(IOAPIC_ADDR);
        let never = || false;
        for (reg, value) in [(0x11 + 2 * pin, 0u32), (0x10 + 2 * pin, low)] {
            let w = |off: u64, v: u32| devices.mmio_write(base + off, &v.to_le_bytes(), &never);
            assert_eq!(w(IOREGSEL, reg), vmhost_devices::bus::Access::Done);
            assert_eq!(w(IOWIN, value), vmhost_devices::bus::Access::Done);
        }
    }

    /// A split irqchip on real KVM: no in-kernel IOAPIC and no PIT exist; a pin is dropped
    /// while its redirection entry is masked, and once the guest (an MMIO write through
    /// `LinuxDevices`) unmasks it, `KVM_IRQ_LINE` and an irqfd on its GSI land in the LAPIC's
    /// IRR. The entries saved and restored into a second VM route there too.
    #[test]
    fn ioapic_entries_route_pins_to_the_lapic_on_a_split_irqchip() {
        if !vmhost_testsupport::need_kvm(
            "ioapic_entries_route_pins_to_the_lapic_on_a_split_irqchip",
        ) {
            return;
        }
        let kvm = Kvm::new().unwrap();
        let (vm, vcpu) = split_vm(&kvm);
        let mut chip = kvm_irqchip {
            chip_id: KVM_IRQCHIP_IOAPIC,
            ..Default::default()
        };
        assert!(vm.get_irqchip(&mut chip).is_err(), "no in-kernel IOAPIC");
        assert!(
            vm.create_pit2(kvm_pit_config::default()).is_err(),
            "no PIT without KVM's PIC"
        );
        let serial = SerialConsole::new(None).unwrap();
        let devices = LinuxDevices::new(serial).with_ioapic(UserIoapic::new(&vm).unwrap());
        // Masked at reset: the pulse is dropped.
        vm.set_irq_line(4, true).unwrap();
        vm.set_irq_line(4, false).unwrap();
        assert!(!irr_has(&vcpu.get_lapic().unwrap(), 0x34));
        program(&devices, 4, 0x34);
        let mut v = [0u8; 4];
        let never = || false;
        devices.mmio_read(u64::from(IOAPIC_ADDR) + IOWIN, &mut v, &never);
        assert_eq!(u32::from_le_bytes(v), 0x34, "the entry reads back");
        vm.set_irq_line(4, true).unwrap();
        vm.set_irq_line(4, false).unwrap();
        assert!(irr_has(&vcpu.get_lapic().unwrap(), 0x34), "pin 4 delivered");
        // An irqfd on pin 5 (as COM1's on pin 4) is delivered by the kernel through the route.
        let irq = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
        vm.register_irqfd(&irq, 5).unwrap();
        program(&devices, 5, 0x35);
        irq.write(1).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !irr_has(&vcpu.get_lapic().unwrap(), 0x35) {
            assert!(
                std::time::Instant::now() < deadline,
                "irqfd on pin 5 not delivered"
            );
            std::thread::yield_now();
        }
        // Masked again: dropped again.
        program(&devices, 4, 0x44 | (1 << 16));
        vm.set_irq_line(4, true).unwrap();
        assert!(!irr_has(&vcpu.get_lapic().unwrap(), 0x44));

        let state = devices.ioapic().unwrap().save();
        let (vm2, vcpu2) = split_vm(&kvm);
        let _restored = UserIoapic::restore(&vm2, &state).unwrap();
        vm2.set_irq_line(5, true).unwrap();
        assert!(irr_has(&vcpu2.get_lapic().unwrap(), 0x35), "restored route");
        vm2.set_irq_line(4, true).unwrap();
        assert!(!irr_has(&vcpu2.get_lapic().unwrap(), 0x44), "restored mask");
    }
}
