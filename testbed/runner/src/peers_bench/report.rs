//! The peers benchmark's report: per VMM the medians of its boots, then the per-round ratios
//! vmhost / peer with their 95 % bootstrap intervals and verdicts (boot time, peak RSS and
//! peak mapped), where the time to `/init` goes, the `--json` timelines and the VM exits.

use vmhost_testsupport::stats::{bootstrap_ci, median, verdict, RESAMPLES};

use super::{scrubbing, Run, Vmm, BOOT_TARGET_PEER, BOOT_TARGET_QEMU, RSS_TARGET_MIB};
use crate::linux_bench::PHASES;

/// Prints the per-VMM medians, the ratios with their intervals and verdicts, and the exits.
pub(super) fn report(vmms: &[Vmm], runs: &[Vec<Run>], rounds: usize) {
    println!(
        "     {rounds} rounds, order rotated every round; 2 vCPUs, 256 MiB of 2 MiB hugepages; \
         spawn -> GUEST-INIT on the serial console; 95 % bootstrap CI ({RESAMPLES} resamples) \
         of the median of per-round ratios; {}",
        if scrubbing() {
            "every boot after a scrub of the hugepage pool's stale translations"
        } else {
            "no scrub (VMHOST_BENCH_SCRUB=0): each VMM pays for the stale pages earlier guests left"
        }
    );
    for (v, r) in vmms.iter().zip(runs) {
        let t: Vec<f64> = r.iter().map(|x| x.to_init).collect();
        let up: Vec<f64> = r.iter().map(|x| x.uptime).collect();
        let m: Vec<f64> = r.iter().map(|x| x.hwm_mib).collect();
        let parent: Vec<f64> = r.iter().filter_map(|x| x.parent_hwm_mib).collect();
        let sup = if parent.is_empty() {
            String::new()
        } else {
            format!(" (its supervisor process: {:.2} MiB)", median(&parent))
        };
        let anon: Vec<f64> = r.iter().map(|x| x.parts_mib.0).collect();
        let file: Vec<f64> = r.iter().map(|x| x.parts_mib.1).collect();
        let mapped: Vec<f64> = r.iter().map(|x| x.mapped_mib).collect();
        println!(
            "     {:<28} to /init {:>6.2} s {t:.2?}; guest uptime at /init {:.2} s; peak RSS \
             beyond guest RAM (VmHWM) {:.2} MiB {m:.2?}{sup}; at its largest VmRSS: anon \
             {:.2} MiB {anon:.2?}, files and shmem {:.2} MiB {file:.2?}; peak mapped \
             (smaps_rollup Rss) {:.2} MiB {mapped:.2?}",
            v.label(),
            median(&t),
            median(&up),
            median(&m),
            median(&anon),
            median(&file),
            median(&mapped),
        );
    }
    let at = |v: Vmm| vmms.iter().position(|x| *x == v);
    for ours in [Vmm::Vmhost, Vmm::VmhostBackground, Vmm::VmhostSplit] {
        for peer in [Vmm::CloudHypervisor, Vmm::Firecracker, Vmm::Qemu] {
            let (Some(a), Some(b)) = (at(ours), at(peer)) else {
                continue;
            };
            let target = if peer == Vmm::Qemu {
                BOOT_TARGET_QEMU
            } else {
                BOOT_TARGET_PEER
            };
            ratio_line(
                &format!("boot {} / {}", ours.label(), peer.label()),
                &runs[a],
                &runs[b],
                |r| r.to_init,
                target,
            );
        }
    }
    rss_lines(vmms, runs);
    split_lines(vmms, runs);
    exit_lines(vmms, runs);
}

/// Where each VMM's time to `/init` goes: spawn → the guest's first VM exit (the VMM's own
/// start), from there to the guest kernel's clock (`/init`'s time minus its uptime: the
/// guest's earliest boot, and the VMM's work while the guest already runs), then the guest's
/// uptime; and the VMM start per pair.
fn split_lines(vmms: &[Vmm], runs: &[Vec<Run>]) {
    println!(
        "     where the time to /init goes (medians): spawn -> the guest's first VM exit (the \
         VMM's own start) -> the guest kernel's clock (/init minus its uptime) -> /init"
    );
    for (v, r) in vmms.iter().zip(runs) {
        let start: Vec<f64> = r.iter().map(|x| x.first_exit).collect();
        let early: Vec<f64> = r
            .iter()
            .map(|x| x.to_init - x.uptime - x.first_exit)
            .collect();
        let up: Vec<f64> = r.iter().map(|x| x.uptime).collect();
        println!(
            "     {:<28} VMM start {:.3} s {start:.3?}; guest before its clock {:.3} s; guest \
             uptime {:.2} s",
            v.label(),
            median(&start),
            median(&early),
            median(&up)
        );
    }
    let at = |v: Vmm| vmms.iter().position(|x| *x == v);
    for ours in [Vmm::Vmhost, Vmm::VmhostBackground, Vmm::VmhostSplit] {
        for peer in [Vmm::CloudHypervisor, Vmm::Firecracker] {
            let (Some(a), Some(b)) = (at(ours), at(peer)) else {
                continue;
            };
            let ratios: Vec<f64> = runs[a]
                .iter()
                .zip(&runs[b])
                .map(|(x, y)| x.first_exit / y.first_exit)
                .collect();
            let ci = bootstrap_ci(&ratios);
            println!(
                "     {:<52} {:.3} [{:.3}, {:.3}]",
                format!("VMM start {} / {}", ours.label(), peer.label()),
                median(&ratios),
                ci.0,
                ci.1
            );
        }
    }
}

/// One ratio: the median of the per-round ratios `f(ours) / f(peer)`, its interval and its
/// verdict against `target` (at or below).
fn ratio_line(what: &str, ours: &[Run], peer: &[Run], f: impl Fn(&Run) -> f64, target: f64) {
    let ratios: Vec<f64> = ours.iter().zip(peer).map(|(a, b)| f(a) / f(b)).collect();
    let ci = bootstrap_ci(&ratios);
    println!(
        "     {what:<52} {:.3} [{:.3}, {:.3}]  target <= {target}: {}",
        median(&ratios),
        ci.0,
        ci.1,
        verdict(ci, target)
    );
}

/// One figure of a run.
type RunFigure = fn(&Run) -> f64;

/// vmhost's peak RSS against 3.5 MiB and against each peer's (per-round ratios): by the
/// kernel's counters (`VmHWM`) and by its page tables (the largest `smaps_rollup` `Rss`).
fn rss_lines(vmms: &[Vmm], runs: &[Vec<Run>]) {
    let Some(ours) = vmms.iter().position(|v| *v == Vmm::Vmhost) else {
        return;
    };
    let measures: [(&str, &str, RunFigure); 2] = [
        ("peak RSS beyond guest RAM", "peak RSS", |r| r.hwm_mib),
        ("peak mapped beyond guest RAM", "peak mapped", |r| {
            r.mapped_mib
        }),
    ];
    for (what, short, of) in measures {
        let m: Vec<f64> = runs[ours].iter().map(of).collect();
        let ci = bootstrap_ci(&m);
        println!(
            "     {:<52} {:.2} MiB [{:.2}, {:.2}]  target <= {RSS_TARGET_MIB} MiB: {}",
            format!("{what}, vmhost"),
            median(&m),
            ci.0,
            ci.1,
            verdict(ci, RSS_TARGET_MIB)
        );
        for (i, peer) in vmms.iter().enumerate() {
            if matches!(peer, Vmm::CloudHypervisor | Vmm::Firecracker | Vmm::Qemu) {
                let name = format!("{short} vmhost / {}", peer.label());
                ratio_line(&name, &runs[ours], &runs[i], of, 1.0);
            }
        }
    }
}

/// vmhost's `--json` boots: the split and the timeline of each.
pub(super) fn timeline_lines(timelines: &[(Vmm, Run)]) {
    for (v, r) in timelines {
        let steps: Vec<String> = PHASES
            .iter()
            .zip(&r.phases)
            .map(|((_, name), ms)| format!("{name} {ms:.0}"))
            .collect();
        println!(
            "     one more {} boot with --json: VMM start {:.3} s, /init at {:.2} s; its \
             timeline, ms after the spawn: {}",
            v.label(),
            r.first_exit,
            r.to_init,
            steps.join(", ")
        );
    }
}

/// Per VMM the median count of each exit reason over the rounds, and of their total.
fn exit_lines(vmms: &[Vmm], runs: &[Vec<Run>]) {
    println!("     VM exits per boot (kvm_exit, spawn -> VMM exit; median of the rounds):");
    for (v, r) in vmms.iter().zip(runs) {
        let mut reasons: Vec<&String> = r.iter().flat_map(|x| x.exits.keys()).collect();
        reasons.sort();
        reasons.dedup();
        let total: Vec<f64> = r
            .iter()
            .map(|x| x.exits.values().sum::<u64>() as f64)
            .collect();
        let mut per: Vec<(f64, &String)> = reasons
            .into_iter()
            .map(|reason| {
                let c: Vec<f64> = r
                    .iter()
                    .map(|x| x.exits.get(reason).copied().unwrap_or(0) as f64)
                    .collect();
                (median(&c), reason)
            })
            .filter(|(c, _)| *c > 0.0)
            .collect();
        per.sort_by(|a, b| b.0.total_cmp(&a.0));
        let list: Vec<String> = per.iter().map(|(c, n)| format!("{n} {c:.0}")).collect();
        println!(
            "     {:<28} total {:.0}: {}",
            v.label(),
            median(&total),
            list.join(", ")
        );
    }
}
