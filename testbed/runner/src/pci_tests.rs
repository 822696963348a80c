//! virtio-pci under Linux's own drivers (`boot.virtio_announce = "pci"`): the device
//! benchmark's guest (`testbed/guest/iobench-run`: a disk and a NIC, 128 MiB written and read
//! back in 1 MiB requests, 4 KiB random reads for 5 s, 64 MiB over TCP each way) boots once
//! under vmhost with its devices as virtio-pci functions. Checked, from the guest's and the
//! host kernel's own accounts:
//!
//! - every virtio device's parent is a PCI function on bus 0 with virtio's vendor id and the
//!   modern device id of its type, bound to its driver, and every figure's work completed;
//! - the queues interrupt with MSI-X: every virtio line of the guest's `/proc/interrupts` is a
//!   `PCI-MSI` one (Linux 6.1's name for MSI and MSI-X alike; the functions have only the
//!   MSI-X capability), and the disk's request queue and the NIC's receive queue counted
//!   interrupts;
//! - the emulated host's kernel (`kvm_exit`, [`crate::kvm_exits`]) counted fewer than two
//!   nested page faults (`npf`, the MMIO exits) per random read: the doorbell only, where
//!   virtio-mmio takes three (docs/benchmarks.md).

use std::collections::BTreeMap;

use crate::device_bench::{nc_endpoints, run_guest, setup, Vmm, RANDREAD_SECONDS};
use crate::irqchip_tests::{check_pit, Irqchip};
use crate::kvm_exits::ExitCounter;
use crate::vm::Env;
use crate::{ensure, Outcome};

/// Most MMIO exits per random read for the test to pass: one is the doorbell, virtio-mmio's
/// interrupt status read and acknowledgement would make three.
const MAX_NPF_PER_READ: f64 = 2.0;

/// The test (2-node suite).
pub fn virtio_pci_linux_guest(env: &Env) -> Outcome {
    let mut s = setup(env, false)?;
    s.vmhost = env.vmhost().to_path_buf();
    crate::host::set_2m_pools(&[160, 0])?;
    let payload = env.work.join("iobench-to-guest.bin");
    std::fs::write(&payload, vec![0x5au8; 64 << 20]).map_err(|e| e.to_string())?;
    let _nc = nc_endpoints(&payload)?;
    let exits = ExitCounter::attach()?;
    let run = run_guest(&s, Vmm::VmhostPci, &exits)?;
    drop(exits);
    check_devices(&run.lines)?;
    check_msix(&run.lines)?;
    let (Some(before), Some(after)) = (run.exits_at.get("seqread"), run.exits_at.get("randread"))
    else {
        return Err(format!(
            "no exit counts at the read figures: {:?}",
            run.exits_at
        ));
    };
    let npf = (after.get("npf").copied().unwrap_or(0))
        .saturating_sub(before.get("npf").copied().unwrap_or(0));
    let reads = run.values["randread"] * RANDREAD_SECONDS;
    let per_read = npf as f64 / reads;
    println!("     randread: {reads:.0} reads, {npf} npf exits ({per_read:.2} per read)");
    let few = per_read < MAX_NPF_PER_READ;
    ensure!(
        few,
        "{per_read:.2} MMIO (npf) exits per random read, want < {MAX_NPF_PER_READ}: the \
         interrupts still cost register accesses"
    );
    Ok(())
}

/// Two virtio devices (blk, net), each on a PCI function `0000:00:NN.0` with vendor 0x1af4
/// and device 0x1040 + its type, and bound.
fn check_devices(lines: &[BTreeMap<String, String>]) -> Outcome {
    let devices: Vec<&BTreeMap<String, String>> =
        lines.iter().filter(|l| l.contains_key("virtio")).collect();
    ensure!(
        devices.len() == 2,
        "{} virtio devices, want 2: {lines:?}",
        devices.len()
    );
    for d in devices {
        let g = |k: &str| d.get(k).map(String::as_str).unwrap_or_default();
        let (device, parent, driver) = (g("device"), g("parent"), g("driver"));
        let want_driver = match device {
            "0x0001" => "virtio_net",
            "0x0002" => "virtio_blk",
            other => return Err(format!("unexpected virtio device id {other}: {d:?}")),
        };
        ensure!(driver == want_driver, "{device} bound to {driver:?}: {d:?}");
        ensure!(
            parent.starts_with("0000:00:") && parent.ends_with(".0"),
            "{device}'s parent is {parent}, not a function on PCI bus 0"
        );
        let id = u16::from_str_radix(device.trim_start_matches("0x"), 16).unwrap_or(0);
        ensure!(
            g("pci_vendor") == "0x1af4" && g("pci_device") == format!("0x{:04x}", 0x1040 + id),
            "{parent} has ids {}:{}, want 0x1af4:0x{:04x}",
            g("pci_vendor"),
            g("pci_device"),
            0x1040 + id
        );
    }
    Ok(())
}

/// The guest's `/proc/interrupts`: MSI-X lines for the virtio queues, with interrupts counted
/// on the disk's request queue and the NIC's receive queue.
fn check_msix(lines: &[BTreeMap<String, String>]) -> Outcome {
    let irqs: Vec<Vec<&str>> = lines
        .iter()
        .filter_map(|l| l.get("irq"))
        .map(|l| l.split('|').collect())
        .collect();
    ensure!(
        !irqs.is_empty(),
        "no virtio line in the guest's /proc/interrupts"
    );
    let mut counted = BTreeMap::new();
    for f in &irqs {
        let name = f.last().copied().unwrap_or_default();
        // Linux 6.1 names MSI and MSI-X alike (`PCI-MSI`); the function has only the MSI-X
        // capability, so a message interrupt is MSI-X.
        ensure!(
            f.iter().any(|x| x.starts_with("PCI-MSI")),
            "virtio interrupt {name} is not a PCI message interrupt: {f:?}"
        );
        let total: u64 = f.iter().skip(1).map_while(|x| x.parse::<u64>().ok()).sum();
        counted.insert(name.to_string(), total);
    }
    for queue in ["-req.0", "-input.0"] {
        let n: u64 = counted
            .iter()
            .filter(|(k, _)| k.ends_with(queue))
            .map(|(_, v)| v)
            .sum();
        ensure!(
            n > 0,
            "no MSI-X interrupt counted on a *{queue} vector: {counted:?}"
        );
    }
    Ok(())
}

/// The 2 MiB pages one guest of [`virtio_pci_linux_migration`] takes (128 MiB).
const MIGRATION_PAGES: u64 = 64;

/// A Linux guest with a virtio-pci disk and NIC moves live from node 0 to node 1 of the
/// 2-node host over a Unix socket: its ticks go on with the same boot id, its disk file stays
/// whole, its RAM check holds, and its background disk reader (`reads`: a read nearly always
/// in flight) goes on after the switch, so the disk's queue and its MSI-X vector work on the
/// target, where the function's state (configuration space, vector table, queue vectors) was
/// restored.
pub fn virtio_pci_linux_migration(env: &Env) -> Outcome {
    pci_migration(env, Irqchip::Kernel)
}

/// The pci migration with `irqchip` (see [`crate::irqchip_tests`]).
pub(crate) fn pci_migration(env: &Env, irqchip: Irqchip) -> Outcome {
    use crate::migration_tests as mig;
    crate::host::set_2m_pools(&[MIGRATION_PAGES, 0])?;
    let disk = mig::make_disk(env)?;
    let boot = match irqchip {
        Irqchip::Kernel => "virtio_announce = \"pci\"\n",
        Irqchip::Split => "virtio_announce = \"pci\"\nirqchip = \"split\"\n",
    };
    let spec = mig::spec_with(env, &disk, (1, 1), "", boot)?;
    let spec = spec.to_string_lossy().into_owned();
    let src = env.start("pcimigsrc", env.command(&["--config", &spec]), 1)?;
    let first = mig::wait_tick_past(env, &["pcimigsrc"], 0)?;
    check_pit("the source", src.pid, irqchip)?;
    // Only node 1 has room for the target.
    crate::host::set_2m_pools(&[MIGRATION_PAGES, MIGRATION_PAGES])?;
    let key = mig::key_file(env, "pcimig.key", 5)?;
    let listen = format!("unix:{}", env.work.join("pcimig.sock").display());
    let args = [
        "receive",
        "--listen",
        listen.as_str(),
        "--auth-key",
        key.as_str(),
    ];
    let dst = env.spawn("pcimigdst", env.command(&args))?;
    mig::wait_stderr(
        env,
        "pcimigdst",
        "listening on",
        std::time::Duration::from_secs(60),
    )?;
    let out = mig::migrate(env, &src, &listen, &key)?;
    ensure!(
        out.code == 0,
        "ctl migrate exited {}: {}",
        out.code,
        out.stderr
    );
    check_pit("the target", dst.pid, irqchip)?;
    let code = env.wait(src.pid)?;
    ensure!(code == 0, "the source exited {code} after the move, want 0");
    let names = ["pcimigsrc", "pcimigdst"];
    let at_switch = mig::ticks(&mig::console(env, &names[..1]))
        .last()
        .cloned()
        .unwrap_or(first.clone());
    let later = mig::wait_tick_past(env, &names, at_switch.n + 4)?;
    mig::check_tick_sequence(env, &names, &first.boot_id)?;
    let want_nopic = Some(irqchip == Irqchip::Split);
    ensure!(
        first.nopic == want_nopic && later.nopic == want_nopic,
        "with irqchip {irqchip:?} the guest's 8259 probe found no PIC: {:?} at boot, {:?} on \
         the target, want {want_nopic:?}",
        first.nopic,
        later.nopic
    );
    ensure!(
        later.serial_irqs > at_switch.serial_irqs && at_switch.serial_irqs > 0,
        "the guest's ttyS0 interrupts: {} at the switch, {} at tick {}: COM1's interrupt does \
         not reach the guest (through the I/O APIC's route)",
        at_switch.serial_irqs,
        later.serial_irqs,
        later.n
    );
    ensure!(
        later.reads > at_switch.reads,
        "the guest's disk reader made no pass on the target ({} at the switch, {} at tick {})",
        at_switch.reads,
        later.reads,
        later.n
    );
    println!(
        "  pci migration ({irqchip:?} irqchip): {}",
        crate::irqchip_tests::progress(&at_switch, &later)
    );
    env.signal(dst.pid, libc::SIGTERM)?;
    let code = env.wait(dst.pid)?;
    ensure!(
        code == 130,
        "the target after SIGTERM: exit {code}, want 130"
    );
    Ok(())
}
