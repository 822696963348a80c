//! The split irqchip (`boot.irqchip = "split"`: KVM's LAPICs, vmhost's I/O APIC, no PIC and no
//! PIT) under Linux, from the guest's and the host kernel's own accounts: the guest's 8259
//! probe (`testbed/guest/migrate.sh`, through `/dev/port`), its ttyS0 interrupt count (COM1's
//! irqfd through the I/O APIC's route), its ticks (time without a PIT), and the host kernel's
//! `kvm-pit/<pid>` threads.

use crate::migration_tests as mig;
use crate::vm::Env;
use crate::{ensure, Outcome};

/// Where the guest's interrupt controllers are, and what the host kernel shows of it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Irqchip {
    /// KVM's PIC, IOAPIC and PIT: the VMM has a `kvm-pit/<pid>` kernel thread.
    Kernel,
    /// `boot.irqchip = "split"`: KVM's LAPICs only, no `kvm-pit/<pid>` thread.
    Split,
}

/// [`crate::pci_tests::virtio_pci_linux_migration`] with a split irqchip (`boot.irqchip = "split"`): the
/// guest runs with vmhost's I/O APIC and no PIC or PIT on both sides. Its ticks (the LAPIC's
/// TSC-deadline timer and kvmclock, there is no PIT) and its console lines (user-space writes
/// to ttyS0, which wait on COM1's interrupt through the I/O APIC's MSI route) go on across the
/// switch, where the I/O APIC's redirection entries were restored and their routes installed
/// again; and the emulated host's kernel has no PIT thread (`kvm-pit/<pid>`) for either VMM,
/// which [`crate::pci_tests::virtio_pci_linux_migration`] checks it has with KVM's irqchip.
pub fn split_irqchip_linux_migration(env: &Env) -> Outcome {
    crate::pci_tests::pci_migration(env, Irqchip::Split)
}

/// Fails unless the host kernel has a `kvm-pit/<pid>` thread exactly with KVM's irqchip.
pub(crate) fn check_pit(who: &str, pid: u32, irqchip: Irqchip) -> Outcome {
    let pit = vmhost_testsupport::has_kvm_pit(pid);
    println!("  {who} (pid {pid}): kvm-pit thread {pit}");
    ensure!(
        pit == (irqchip == Irqchip::Kernel),
        "{who} (pid {pid}) with irqchip {irqchip:?}: the host kernel has {} kvm-pit/{pid} thread",
        if pit { "a" } else { "no" }
    );
    Ok(())
}

/// The migration guest with its virtio-mmio disk and NIC (the default transport, their
/// interrupts on GSIs of the I/O APIC) and a split irqchip, on node 0 of the 2-node host: it
/// boots without a PIC or PIT, and its disk reader (a request in flight nearly always, each
/// completion an interrupt through the I/O APIC's route for the disk's GSI) and its ttyS0
/// interrupts go on over four ticks; the host kernel has no `kvm-pit` thread for the VMM.
pub fn split_irqchip_mmio_linux_guest(env: &Env) -> Outcome {
    crate::host::set_2m_pools(&[64, 0])?;
    let disk = mig::make_disk(env)?;
    let spec = mig::spec_with(env, &disk, (1, 1), "", "irqchip = \"split\"\n")?;
    let spec = spec.to_string_lossy().into_owned();
    let vm = env.start("splitmmio", env.command(&["--config", &spec]), 1)?;
    let first = mig::wait_tick_past(env, &["splitmmio"], 0)?;
    check_pit("the VMM", vm.pid, Irqchip::Split)?;
    let later = mig::wait_tick_past(env, &["splitmmio"], first.n + 4)?;
    println!("  split irqchip, virtio-mmio: {}", progress(&first, &later));
    env.signal(vm.pid, libc::SIGTERM)?;
    let code = env.wait(vm.pid)?;
    ensure!(
        later.nopic == Some(true),
        "the guest's 8259 probe found a PIC: {:?}",
        later.nopic
    );
    ensure!(
        later.reads > first.reads && later.serial_irqs > first.serial_irqs,
        "the disk reader ({} -> {} passes) or ttyS0 ({} -> {} interrupts) stopped: a \
         virtio-mmio or COM1 interrupt does not reach the guest through the I/O APIC",
        first.reads,
        later.reads,
        first.serial_irqs,
        later.serial_irqs
    );
    ensure!(code == 130, "the VMM after SIGTERM: exit {code}, want 130");
    Ok(())
}

/// What went on between two ticks: the ticks, the disk reader's passes, the ttyS0 interrupts
/// and the guest's PIC probe.
pub(crate) fn progress(from: &mig::Tick, to: &mig::Tick) -> String {
    format!(
        "ticks {} -> {}, reader passes {} -> {}, ttyS0 interrupts {} -> {}, no PIC {:?}",
        from.n, to.n, from.reads, to.reads, from.serial_irqs, to.serial_irqs, to.nopic
    )
}
