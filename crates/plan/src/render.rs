//! Human-readable rendering of an [`Outcome`].

use std::fmt::Write;

use vmhost_config::{format_bytes, DiskSource, DiskSpec, VirtioAnnounce, VsockSpec};
use vmhost_topology::cpulist;

use crate::devices::{DevicePlan, VirtioKind};
use crate::model::{Backing, EmulatorPlacement, Envelope, Plan, VcpuPlacement};
use crate::Outcome;

fn opt(v: Option<u32>) -> String {
    v.map_or_else(|| "-".to_string(), |x| x.to_string())
}

/// Renders the plan as tables: envelope terms, vCPU → PU → node, emulator, guest cells.
pub fn render_text(o: &Outcome) -> String {
    let p = &o.plan;
    let mut s = String::new();
    render_header(&mut s, p);
    render_envelope(&mut s, &p.envelope);
    render_vcpus(&mut s, &p.vcpus);
    render_emulator(&mut s, &p.emulator);
    render_cells(&mut s, p);
    render_realtime_and_irqchip(&mut s, p);
    render_devices(&mut s, &p.devices, p.virtio_announce());
    crate::iothreads::render(&mut s, &p.devices);
    render_verdict(&mut s, o);
    s
}

/// The first line: the VM's name, vCPUs and topology, guest memory and its backing.
fn render_header(s: &mut String, p: &Plan) {
    let t = p.guest_topology;
    let _ = writeln!(
        s,
        "VM {}: {} vCPUs ({} sockets x {} cores x {} threads), {} guest memory, {}",
        p.name,
        p.vcpus.len(),
        t.sockets,
        t.cores,
        t.threads,
        format_bytes(p.envelope.guest_memory_bytes),
        backing_text(&p.backing)
    );
}

/// What backs guest memory, in words.
fn backing_text(backing: &Backing) -> String {
    match backing {
        Backing::Hugetlb {
            page_size_bytes,
            hugetlbfs: None,
        } => format!("{} hugepages (memfd)", format_bytes(*page_size_bytes)),
        Backing::Hugetlb {
            page_size_bytes,
            hugetlbfs: Some(dir),
        } => format!(
            "{} hugepages (hugetlbfs {})",
            format_bytes(*page_size_bytes),
            dir.display()
        ),
        Backing::Anonymous => "anonymous memory, transparent hugepages".to_string(),
    }
}

/// The envelope table: each overhead term, the totals, the hugepages and the CPUs.
fn render_envelope(s: &mut String, e: &Envelope) {
    let _ = writeln!(s, "\nEnvelope ({:?} overhead model):", e.overhead_model);
    for (name, bytes) in &e.overhead_terms {
        let _ = writeln!(s, "  {name:<34} {:>14} B  {:>10.1} MiB", bytes, mib(*bytes));
    }
    let _ = writeln!(
        s,
        "  {:<34} {:>14} B  {:>10.1} MiB",
        "overhead (total)",
        e.overhead_bytes,
        mib(e.overhead_bytes)
    );
    let _ = writeln!(
        s,
        "  {:<34} {:>14} B  {:>10.1} MiB",
        "memory request",
        e.memory_request_bytes,
        mib(e.memory_request_bytes)
    );
    if let Some(l) = e.memory_limit_bytes {
        let _ = writeln!(
            s,
            "  {:<34} {:>14} B  {:>10.1} MiB",
            "memory limit",
            l,
            mib(l)
        );
    }
    for h in &e.hugepages {
        let node = h
            .node
            .map_or_else(|| "any node".to_string(), |n| format!("node{n}"));
        let _ = writeln!(
            s,
            "  hugepages-{:<24} {:>14} pages on {node}",
            format_bytes(h.page_size_bytes),
            h.count
        );
    }
    let _ = writeln!(
        s,
        "  {:<34} {:>14} ({} dedicated)",
        "cpus", e.cpus, e.dedicated_cpus
    );
}

/// The vCPU table: each vCPU's place in the guest topology and on the host.
fn render_vcpus(s: &mut String, vcpus: &[VcpuPlacement]) {
    let _ = writeln!(
        s,
        "\n  vCPU  socket core thread  apic  cell  host PU  host node"
    );
    for v in vcpus {
        let _ = writeln!(
            s,
            "  {:>4}  {:>6} {:>4} {:>6}  {:>4}  {:>4}  {:>7}  {:>9}",
            v.vcpu,
            v.socket,
            v.core,
            v.thread,
            v.apic_id,
            v.guest_cell,
            v.host_cpu
                .map_or_else(|| "float".to_string(), |c| c.to_string()),
            opt(v.host_node)
        );
    }
}

/// The emulator thread's PUs, and whether they are its alone.
fn render_emulator(s: &mut String, emulator: &EmulatorPlacement) {
    let _ = writeln!(
        s,
        "\n  emulator thread: PUs {}{}",
        if emulator.host_cpus.is_empty() {
            "-".to_string()
        } else {
            cpulist::format(&emulator.host_cpus)
        },
        if emulator.isolated { " (isolated)" } else { "" }
    );
}

/// The guest cells table (a cell spread over host nodes has a line per part), then where the
/// host's distances differ from the guest's.
fn render_cells(s: &mut String, p: &Plan) {
    let _ = writeln!(
        s,
        "\n  cell  host node  vCPUs        memory      prefault PUs  distances"
    );
    for c in &p.guest_cells {
        let _ = writeln!(
            s,
            "  {:>4}  {:>9}  {:<11} {:>8}  {:>12}  {}",
            c.cell,
            opt(c.host_node),
            cpulist::format(&c.vcpus),
            format_bytes(c.memory_bytes),
            cpulist::format(&c.prefault_cpus),
            c.distances
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        );
        for span in &c.spans {
            let _ = writeln!(
                s,
                "        {:>9}  {:<11} {:>8}  {:>12}  (part of cell {})",
                span.host_node,
                "",
                format_bytes(span.memory_bytes),
                cpulist::format(&span.prefault_cpus),
                c.cell
            );
        }
    }
    for d in &p.distances.diff {
        let _ = writeln!(s, "  distance differs from the guest's: {d}");
    }
}

/// The realtime vCPUs and a split irqchip, when the plan has them.
fn render_realtime_and_irqchip(s: &mut String, p: &Plan) {
    if let Some(rt) = &p.realtime {
        let _ = writeln!(
            s,
            "
  realtime vCPUs: {} (SCHED_FIFO priority {})",
            cpulist::format(&rt.vcpus),
            rt.priority
        );
    }
    if p.irqchip() == vmhost_config::Irqchip::Split {
        let _ = writeln!(
            s,
            "\n  irqchip: split (KVM's local APICs, vmhost's I/O APIC, no PIC and no PIT)"
        );
    }
}

/// The planner's notes, then whether the VM fits and, when it does not, why.
fn render_verdict(s: &mut String, o: &Outcome) {
    for n in &o.plan.notes {
        let _ = writeln!(s, "  note: {n}");
    }
    if o.fits {
        let _ = writeln!(s, "\nfits: yes");
    } else {
        let _ = writeln!(s, "\nfits: NO");
        for r in &o.reasons {
            let _ = writeln!(s, "  - {r}");
        }
    }
}

#[allow(clippy::cast_precision_loss)]
fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// One line per virtio device: what it is and where the guest finds it.
fn render_devices(s: &mut String, d: &DevicePlan, announce: Option<VirtioAnnounce>) {
    if d.slots.is_empty() {
        return;
    }
    let how = match announce {
        Some(VirtioAnnounce::Acpi) => ", announced in the DSDT as LNRO0005 devices",
        Some(VirtioAnnounce::Cmdline) => ", announced with virtio_mmio.device= on the command line",
        Some(VirtioAnnounce::Pci) => ", virtio-pci functions with MSI-X on PCI bus 0",
        None => "",
    };
    let transport = if announce == Some(VirtioAnnounce::Pci) {
        "virtio-pci"
    } else {
        "virtio-mmio"
    };
    let _ = writeln!(s, "\n  virtio devices ({transport}{how}):");
    for slot in &d.slots {
        let what = match slot.device {
            VirtioKind::Disk(i) => disk_text(&d.spec.disks[i]),
            VirtioKind::Net(i) => {
                let n = &d.spec.interfaces[i];
                let tap = n.tap.as_deref().unwrap_or("a new tap");
                format!("interface {}: {tap}, MAC {}", n.name, n.mac)
            }
            VirtioKind::Rng => "rng: host getrandom".to_string(),
            VirtioKind::Vsock => vsock_text(d.spec.vsock.as_ref()),
        };
        let _ = writeln!(s, "    {what} at {:#x}, GSI {}", slot.base, slot.gsi);
    }
}

/// A disk device: its source, whether the guest may write it, and its cache mode.
fn disk_text(disk: &DiskSpec) -> String {
    let source = match &disk.source {
        DiskSource::Image {
            path,
            create_bytes: None,
        } => path.display().to_string(),
        DiskSource::Image {
            path,
            create_bytes: Some(b),
        } => {
            format!(
                "{} (created with {} if missing)",
                path.display(),
                format_bytes(*b)
            )
        }
        DiskSource::CloudInitNoCloud { .. } => "cloud-init NoCloud seed".to_string(),
        DiskSource::EmptyDisk { capacity_bytes } => {
            format!("empty disk of {}", format_bytes(*capacity_bytes))
        }
    };
    let mode = if disk.read_only {
        "read-only"
    } else {
        "read-write"
    };
    let cache = match disk.cache {
        vmhost_config::DiskCache::Auto => "auto (none if the file system takes O_DIRECT)",
        other => other.as_str(),
    };
    format!("disk {}: {source}, {mode}, cache {cache}", disk.name)
}

/// The vsock device: the guest's CID and the host side it reaches.
fn vsock_text(vsock: Option<&VsockSpec>) -> String {
    match vsock {
        Some(v) if v.backend == vmhost_config::VsockBackend::Vhost => format!(
            "vsock: guest CID {} on the kernel's vhost-vsock (host side AF_VSOCK)",
            v.cid
        ),
        Some(v) => format!(
            "vsock: guest CID {}, Unix socket {}",
            v.cid,
            v.socket
                .as_ref()
                .map_or("<run dir>/<vm>.vsock".to_string(), |p| p
                    .display()
                    .to_string())
        ),
        None => "vsock".to_string(),
    }
}
