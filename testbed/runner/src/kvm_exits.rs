//! VM exits per exit reason, counted by the emulated host's own kernel: a histogram trigger on
//! the `kvm/kvm_exit` tracepoint (`hist:keys=exit_reason`), in tracefs. The kernel aggregates
//! in place, so nothing goes through the trace ring buffer and no event is lost however many
//! exits a boot makes. The trigger counts every vCPU of every VM on the host: the benchmarks
//! run one VMM at a time (the runner's own static-key VMs never run a vCPU, `static_keys.rs`).
//!
//! The trigger stays attached for the whole benchmark and is cleared before each run
//! (`:clear`): attaching it enables the tracepoint, which rewrites kernel text, and the
//! emulated host's CPUs are best left alone while a VM runs (docs/testing.md, static keys).
//! The exit reasons are named with the tracepoint's own table (the `__print_symbolic` of its
//! `format` file that has SVM's `npf`: the emulated host is AMD).

use std::collections::BTreeMap;
use std::path::Path;

/// Where tracefs is (mounted by [`mount_tracefs`] when it is not).
pub(crate) const TRACEFS: &str = "/sys/kernel/tracing";
const EVENT: &str = "/sys/kernel/tracing/events/kvm/kvm_exit";
/// The trigger; `:clear` and a leading `!` must repeat it exactly.
const TRIGGER: &str = "hist:keys=exit_reason:vals=hitcount:size=256";

/// The attached trigger; detached when dropped.
pub struct ExitCounter {
    names: BTreeMap<u64, String>,
}

impl ExitCounter {
    /// Mounts tracefs if it is not mounted yet and attaches the trigger.
    pub fn attach() -> Result<ExitCounter, String> {
        if !Path::new(EVENT).exists() {
            mount_tracefs()?;
        }
        let format = crate::host::read(&format!("{EVENT}/format"))?;
        let names = svm_reason_names(&format);
        write_trigger(TRIGGER)?;
        Ok(ExitCounter { names })
    }

    /// Zeroes the counts.
    pub fn clear(&self) -> Result<(), String> {
        write_trigger(&format!("{TRIGGER}:clear"))
    }

    /// The counts since the last [`ExitCounter::clear`], by reason name (`0x..` for a reason
    /// the format file does not name).
    pub fn read(&self) -> Result<BTreeMap<String, u64>, String> {
        let hist = crate::host::read(&format!("{EVENT}/hist"))?;
        let mut out = BTreeMap::new();
        for line in hist.lines() {
            let Some(rest) = line.trim().strip_prefix("{ exit_reason:") else {
                continue;
            };
            let mut parts = rest.split('}');
            let (Some(code), Some(count)) = (parts.next(), parts.next()) else {
                continue;
            };
            let code: u64 = code
                .trim()
                .parse()
                .map_err(|e| format!("kvm_exit hist line {line:?}: {e}"))?;
            let count: u64 = count
                .trim()
                .strip_prefix("hitcount:")
                .and_then(|c| c.trim().parse().ok())
                .ok_or_else(|| format!("kvm_exit hist line {line:?}: no hitcount"))?;
            let name = self
                .names
                .get(&code)
                .cloned()
                .unwrap_or_else(|| format!("{code:#x}"));
            *out.entry(name).or_insert(0) += count;
        }
        Ok(out)
    }
}

impl Drop for ExitCounter {
    fn drop(&mut self) {
        let _ = write_trigger(&format!("!{TRIGGER}"));
    }
}

/// Appends `cmd` to the event's trigger file (a write there adds or changes one trigger).
fn write_trigger(cmd: &str) -> Result<(), String> {
    use std::io::Write;
    let path = format!("{EVENT}/trigger");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .map_err(|e| format!("open {path}: {e}"))?;
    f.write_all(cmd.as_bytes()).map_err(|e| {
        let log = std::fs::read_to_string(format!("{TRACEFS}/error_log")).unwrap_or_default();
        format!("write {cmd:?} to {path}: {e}; tracefs error_log: {log}")
    })
}

/// The `{ code, "name" }` pairs of the `__print_symbolic` table in `format` that names SVM's
/// nested page fault (`npf`); empty when there is none.
fn svm_reason_names(format: &str) -> BTreeMap<u64, String> {
    format
        .split("__print_symbolic(")
        .skip(1)
        .map(symbolic_pairs)
        .find(|t| t.values().any(|n| n == "npf"))
        .unwrap_or_default()
}

/// The pairs `{ 0x078, "hlt" }` (or decimal codes) of one `__print_symbolic` table.
fn symbolic_pairs(table: &str) -> BTreeMap<u64, String> {
    table
        .split('{')
        .skip(1)
        .filter_map(|pair| {
            let (code, rest) = pair.split_once(',')?;
            let name = rest.split('"').nth(1)?;
            let code = code.trim();
            let code = match code.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok()?,
                None => code.parse().ok()?,
            };
            Some((code, name.to_string()))
        })
        .collect()
}

/// A tracefs instance of the runner's own (`instances/NAME`: a ring buffer and event switches
/// apart from the global ones), created on [`Instance::create`] with `events` enabled and
/// removed, events disabled, when dropped.
pub(crate) struct Instance {
    dir: std::path::PathBuf,
    events: &'static [&'static str],
}

impl Instance {
    /// Mounts tracefs if needed, creates the instance, writes each `(file, value)` of
    /// `settings` (before any event runs), then enables `events` and turns tracing on.
    pub(crate) fn create(
        name: &str,
        settings: &[(&str, &str)],
        events: &'static [&'static str],
    ) -> Result<Instance, String> {
        if !Path::new(TRACEFS).join("instances").exists() {
            mount_tracefs()?;
        }
        let dir = Path::new(TRACEFS).join("instances").join(name);
        if !dir.exists() {
            std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        }
        let instance = Instance { dir, events };
        for (file, value) in settings {
            instance.write(file, value)?;
        }
        for event in events {
            instance.write(&format!("events/{event}/enable"), "1")?;
        }
        instance.write("tracing_on", "1")?;
        Ok(instance)
    }

    /// The path of one of the instance's files.
    pub(crate) fn path(&self, file: &str) -> String {
        self.dir.join(file).to_string_lossy().into_owned()
    }

    /// Writes one of the instance's files.
    pub(crate) fn write(&self, file: &str, value: &str) -> Result<(), String> {
        crate::host::write(&self.path(file), value)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        for event in self.events {
            let _ = self.write(&format!("events/{event}/enable"), "0");
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Mounts tracefs at [`TRACEFS`] (the emulated host's init does not).
pub(crate) fn mount_tracefs() -> Result<(), String> {
    crate::host::run_tool(&["mount", "-t", "tracefs", "nodev", TRACEFS])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_svm_table() {
        let format = r#"print fmt: "reason %s", (REC->isa == 1) ? __print_symbolic(REC->exit_reason & 0xffff, { 12, "HLT" }, { 30, "IO_INSTRUCTION" }) : __print_symbolic(REC->exit_reason, { 0x078, "hlt" }, { 0x07b, "io" }, { 0x400, "npf" })"#;
        let names = svm_reason_names(format);
        assert_eq!(names.get(&0x78).map(String::as_str), Some("hlt"));
        assert_eq!(names.get(&0x400).map(String::as_str), Some("npf"));
        assert_eq!(names.get(&12), None);
    }
}
