//! What the runner prints when a test finds a guest or a vmhost stuck: each vmhost thread's
//! state and where it sleeps, what its threads and its vCPUs did over one second (CPU ticks by
//! user, system and guest time; KVM's per-vCPU statistics; the host's VM exits by reason),
//! and every rewrite of the emulated host's kernel text during a test (QEMU 7.2's TCG
//! mishandles code cross-modified while other CPUs run it: `static_keys.rs`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Each thread of process `pid`: `name)STATE@wchan` (where it sleeps in the kernel).
pub(crate) fn threads(pid: u32) -> String {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .map(|t| {
                    let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                    let wchan = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
                    // "tid (comm) S ...": the name and the state, and where it sleeps.
                    let (name, rest) = stat.rsplit_once(')').unwrap_or((&stat, ""));
                    format!(
                        "{}){}@{wchan}",
                        name.split_once('(').map_or("", |(_, n)| n),
                        rest.split_whitespace().next().unwrap_or("?")
                    )
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|e| e.to_string())
}

/// CPU ticks of each thread of `pid` by name: (user, system, guest); `utime` includes the
/// guest's time (proc(5)).
fn task_ticks(pid: u32) -> std::collections::BTreeMap<String, [u64; 3]> {
    let mut out = std::collections::BTreeMap::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let name = head.split_once('(').map_or("", |(_, n)| n);
        // After the name: field 3 (state) is index 0, utime (14) 11, stime (15) 12, guest_time
        // (43) 40.
        let f: Vec<u64> = rest
            .split_whitespace()
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        if f.len() > 40 {
            out.insert(name.to_string(), [f[11], f[12], f[40]]);
        }
    }
    out
}

/// Each KVM debugfs statistic of `pid`'s VMs' vCPUs (`/sys/kernel/debug/kvm/PID-FD/vcpuN/`),
/// debugfs mounted first when it is not.
fn kvm_vcpu_stats(pid: u32) -> std::collections::BTreeMap<String, u64> {
    let root = Path::new("/sys/kernel/debug/kvm");
    if !root.exists() {
        let _ = Command::new("mount")
            .args(["-t", "debugfs", "debugfs", "/sys/kernel/debug"])
            .status();
    }
    let mut out = std::collections::BTreeMap::new();
    let prefix = format!("{pid}-");
    for vm in std::fs::read_dir(root).into_iter().flatten().flatten() {
        if !vm.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        for vcpu in std::fs::read_dir(vm.path()).into_iter().flatten().flatten() {
            let v = vcpu.file_name().to_string_lossy().to_string();
            if !v.starts_with("vcpu") {
                continue;
            }
            for stat in std::fs::read_dir(vcpu.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let value = std::fs::read_to_string(stat.path()).unwrap_or_default();
                if let Ok(n) = value.trim().parse::<u64>() {
                    out.insert(format!("{v}.{}", stat.file_name().to_string_lossy()), n);
                }
            }
        }
    }
    out
}

/// What `pid`'s threads and its vCPUs did over one second: each busy thread's user, system
/// and guest CPU ticks (a vCPU spinning in its guest, in KVM or in vmhost), and every KVM
/// vCPU statistic that moved (exits by kind, page faults fixed or spurious, halts).
fn activity(pid: u32) -> String {
    // The host's exits by reason over the same second (every VM's: the failing test's).
    let counter = crate::kvm_exits::ExitCounter::attach();
    if let Ok(c) = &counter {
        let _ = c.clear();
    }
    let (t0, k0) = (task_ticks(pid), kvm_vcpu_stats(pid));
    std::thread::sleep(Duration::from_secs(1));
    let (t1, k1) = (task_ticks(pid), kvm_vcpu_stats(pid));
    let reasons = match counter.and_then(|c| c.read()) {
        Ok(r) => format!("{r:?}"),
        Err(e) => e,
    };
    let busy: Vec<String> = t1
        .iter()
        .filter_map(|(name, b)| {
            let a = t0.get(name)?;
            let d = [
                b[0] - a[0].min(b[0]),
                b[1] - a[1].min(b[1]),
                b[2] - a[2].min(b[2]),
            ];
            (d.iter().any(|&x| x > 0))
                .then(|| format!("{name} user {} sys {} guest {}", d[0], d[1], d[2]))
        })
        .collect();
    let moved: Vec<String> = k1
        .iter()
        .filter_map(|(k, b)| {
            let d = b - k0.get(k).copied().unwrap_or(0).min(*b);
            (d > 0).then(|| format!("{k} +{d}"))
        })
        .collect();
    format!(
        "in 1 s, CPU ticks: [{}]; KVM vCPU stats that moved: [{}]{}; the host's VM exits by \
         reason: {reasons}",
        busy.join(", "),
        moved.join(", "),
        if k1.is_empty() {
            " (no KVM debugfs stats)"
        } else {
            ""
        }
    )
}

/// [`threads`] and [`activity`] of every process named `vmhost`.
pub(crate) fn vmhost_threads() -> String {
    let pids = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| c.trim_end() == "vmhost")
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    pids.iter()
        .map(|pid| format!("pid {pid}: {}; {}", threads(*pid), activity(*pid)))
        .collect::<Vec<_>>()
        .join("; ")
}

use crate::kvm_exits::TRACEFS;
/// The kprobe event on the host kernel's text rewrites (jump labels and static keys queue
/// every site through `text_poke_queue`).
const POKE_EVENT: &str = "p:tbpoke text_poke_queue site=%di:symbol";

/// Records, from [`TextPokes::start`] until dropped, every rewrite of the emulated host's
/// kernel text with the kernel stack that asked for it (a kprobe with a `stacktrace` trigger,
/// in the trace ring buffer). Kprobe optimisation is turned off first: an optimised kprobe
/// rewrites text again itself, later.
pub(crate) struct TextPokes {
    on: bool,
}

impl TextPokes {
    /// Starts recording; a host where the kprobe cannot be set records nothing and says so in
    /// [`TextPokes::report`].
    pub(crate) fn start() -> TextPokes {
        if !Path::new(TRACEFS).join("kprobe_events").exists() {
            let _ = crate::kvm_exits::mount_tracefs();
        }
        let _ = std::fs::write("/proc/sys/debug/kprobes-optimization", "0");
        let event = Path::new(TRACEFS).join("events/kprobes/tbpoke");
        let on = append(&Path::new(TRACEFS).join("kprobe_events"), POKE_EVENT).is_ok()
            && std::fs::write(event.join("trigger"), "stacktrace").is_ok()
            && std::fs::write(Path::new(TRACEFS).join("trace"), "").is_ok()
            && std::fs::write(event.join("enable"), "1").is_ok();
        TextPokes { on }
    }

    /// How many rewrites were recorded so far (`None` when nothing is recorded).
    pub(crate) fn count(&self) -> Option<usize> {
        self.on.then(|| {
            std::fs::read_to_string(Path::new(TRACEFS).join("trace"))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("tbpoke:"))
                .count()
        })
    }

    /// The recorded rewrites by site and task: `N× site (task)`, the site being the kernel
    /// function whose code was rewritten (a static key's branch; a deferred key is flipped by
    /// a kworker, so the site says more than the stack).
    pub(crate) fn summary(&self) -> String {
        let trace = std::fs::read_to_string(Path::new(TRACEFS).join("trace")).unwrap_or_default();
        let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
        for l in trace.lines().filter(|l| l.contains("tbpoke:")) {
            let task = l.split_whitespace().next().unwrap_or("?");
            let task = task.rsplit_once('-').map_or(task, |(name, _pid)| name);
            let site = l
                .split_once("site=")
                .map_or("?", |(_, r)| r.split_whitespace().next().unwrap_or("?"));
            let site = site.split('/').next().unwrap_or(site);
            *counts.entry(format!("{site} ({task})")).or_default() += 1;
        }
        counts
            .iter()
            .map(|(k, n)| format!("{n}x {k}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The rewrites recorded so far: their trace lines (time since boot, task, CPU) and the
    /// stacks, the last 80 lines.
    pub(crate) fn report(&self) -> String {
        if !self.on {
            return "(not recorded: the kprobe on text_poke_queue could not be set)".into();
        }
        let trace = std::fs::read_to_string(Path::new(TRACEFS).join("trace")).unwrap_or_default();
        let lines: Vec<&str> = trace.lines().filter(|l| !l.starts_with('#')).collect();
        if lines.is_empty() {
            return "none".into();
        }
        lines[lines.len().saturating_sub(80)..].join("\n")
    }
}

impl Drop for TextPokes {
    fn drop(&mut self) {
        let event = Path::new(TRACEFS).join("events/kprobes/tbpoke");
        let _ = std::fs::write(event.join("enable"), "0");
        let _ = std::fs::write(event.join("trigger"), "!stacktrace");
        let _ = append(&Path::new(TRACEFS).join("kprobe_events"), "-:tbpoke");
    }
}

/// Appends `line` to a tracefs control file (a plain write would replace its definitions).
fn append(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
    f.write_all(line.as_bytes())
}
