//! One ledger entry: what a running VM holds, and its on-disk form (one JSON file per VM).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use vmhost_plan::Plan;

/// The `format` value of every entry file.
pub const FORMAT: &str = "vmhost-ledger-entry";
/// The entry file format version this crate reads and writes.
pub const VERSION: u32 = 1;

/// Lifecycle state of a VM, as its process last recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Admitted: PUs and hugepages are reserved, guest memory may not be allocated yet.
    Starting,
    /// Guest memory is allocated and the vCPUs run.
    Running,
    /// The vCPUs are paused.
    Paused,
    /// Shutting down; the entry is released when the process ends.
    Stopping,
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VmState::Starting => "starting",
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Stopping => "stopping",
        })
    }
}

/// What an entry stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryRole {
    /// The VM running under its name (the only role before migrations; not written).
    #[default]
    Vm,
    /// The target of a migration within this host: it reserves its own PUs and pages under
    /// the VM's name while the source's entry still holds the source's, until
    /// [`crate::Ledger::hand_over`] makes it the VM's entry (or it is aborted or reclaimed).
    Incoming,
}

impl EntryRole {
    /// True for [`EntryRole::Vm`].
    pub fn is_vm(&self) -> bool {
        *self == EntryRole::Vm
    }
}

/// Hugepages reserved from one node's pool (or from any node when `node` is `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HugepageReservation {
    /// Host node OS index; `None` when the memory is not bound to a node.
    pub node: Option<u32>,
    /// Page size in bytes.
    pub page_size_bytes: u64,
    /// Number of pages.
    pub count: u64,
}

/// Guest memory placed on one host node, in one page size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeMemory {
    /// Host node OS index; `None` when the memory is not bound to a node.
    pub node: Option<u32>,
    /// Page size backing it, in bytes (4096 for anonymous memory).
    pub page_size_bytes: u64,
    /// Guest memory on that node.
    pub bytes: u64,
}

/// What one VM holds on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// VM name, unique among the live VMs of the host.
    pub name: String,
    /// Process id of the VM's process.
    pub pid: u32,
    /// Start time of that process in clock ticks after boot (`/proc/PID/stat` field 22): tells
    /// the VM's process from a later process that reuses its pid.
    pub proc_start_ticks: u64,
    /// Wall-clock admission time, milliseconds since the Unix epoch.
    pub started_at_unix_ms: u64,
    /// Lifecycle state.
    pub state: VmState,
    /// What the entry stands for; left out of the file for [`EntryRole::Vm`], so entries of
    /// VMs read the same as before migrations existed.
    #[serde(default, skip_serializing_if = "EntryRole::is_vm")]
    pub role: EntryRole,
    /// Host PU of each vCPU, by vCPU index (`None`: the vCPU floats over `floating_cpus`).
    pub vcpu_pus: Vec<Option<u32>>,
    /// PUs that unpinned vCPUs float over (empty when dedicated).
    pub floating_cpus: Vec<u32>,
    /// PUs the emulator thread may run on.
    pub emulator_pus: Vec<u32>,
    /// True when `emulator_pus` are held for the emulator alone.
    pub emulator_isolated: bool,
    /// PUs held by the supplemental I/O thread pool (one per thread; dedicated placement).
    #[serde(default)]
    pub io_pool_pus: Vec<u32>,
    /// Hugepages reserved, per node and page size.
    pub hugepages: Vec<HugepageReservation>,
    /// Guest memory per host node and page size.
    pub memory: Vec<NodeMemory>,
    /// The VM's API socket, if it has one.
    pub api_socket: Option<PathBuf>,
}

impl Entry {
    /// Builds the entry for a VM admitted with `plan`, in state [`VmState::Starting`].
    pub fn from_plan(
        name: &str,
        pid: u32,
        proc_start_ticks: u64,
        started_at_unix_ms: u64,
        api_socket: Option<PathBuf>,
        plan: &Plan,
    ) -> Entry {
        let page_size_bytes = plan.backing.page_size_bytes();
        let mut per_node: BTreeMap<Option<u32>, u64> = BTreeMap::new();
        for cell in &plan.guest_cells {
            *per_node.entry(cell.host_node).or_default() += cell.memory_bytes;
        }
        Entry {
            name: name.to_owned(),
            pid,
            proc_start_ticks,
            started_at_unix_ms,
            state: VmState::Starting,
            role: EntryRole::Vm,
            vcpu_pus: plan.vcpus.iter().map(|v| v.host_cpu).collect(),
            floating_cpus: plan.floating_cpus.clone(),
            emulator_pus: plan.emulator.host_cpus.clone(),
            emulator_isolated: plan.emulator.isolated,
            io_pool_pus: plan
                .devices
                .io_threads
                .iter()
                .filter(|t| t.exclusive)
                .flat_map(|t| t.host_cpus.iter().copied())
                .collect(),
            hugepages: plan
                .envelope
                .hugepages
                .iter()
                .map(|h| HugepageReservation {
                    node: h.node,
                    page_size_bytes: h.page_size_bytes,
                    count: h.count,
                })
                .collect(),
            memory: per_node
                .into_iter()
                .map(|(node, bytes)| NodeMemory {
                    node,
                    page_size_bytes,
                    bytes,
                })
                .collect(),
            api_socket,
        }
    }

    /// The PUs this VM holds exclusively: its pinned vCPUs' PUs plus its isolated emulator PUs
    /// and its supplemental I/O pool's PUs. Empty for a shared (floating) VM.
    pub fn dedicated_pus(&self) -> BTreeSet<u32> {
        let mut pus: BTreeSet<u32> = self.vcpu_pus.iter().flatten().copied().collect();
        pus.extend(self.io_pool_pus.iter().copied());
        if self.emulator_isolated {
            pus.extend(self.emulator_pus.iter().copied());
        }
        pus
    }

    /// True when the VM's vCPUs float (no dedicated placement).
    pub fn is_floating(&self) -> bool {
        self.vcpu_pus.iter().any(Option::is_none)
    }

    /// The entry's file name: `<name>.<pid>.<proc_start_ticks>.json`.
    pub(crate) fn file_name(&self) -> String {
        FileKey {
            name: self.name.clone(),
            pid: self.pid,
            start_ticks: self.proc_start_ticks,
        }
        .file_name()
    }
}

/// The owner of an entry file, as its file name gives it (readable even when the content is
/// not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileKey {
    pub name: String,
    pub pid: u32,
    pub start_ticks: u64,
}

impl FileKey {
    pub fn file_name(&self) -> String {
        format!("{}.{}.{}.json", self.name, self.pid, self.start_ticks)
    }

    /// Parses `<name>.<pid>.<start>.json`; `None` when the name is not in that form.
    pub fn parse(file_name: &str) -> Option<FileKey> {
        let stem = file_name.strip_suffix(".json")?;
        let mut parts = stem.rsplitn(3, '.');
        let start_ticks = parts.next()?.parse().ok()?;
        let pid = parts.next()?.parse().ok()?;
        let name = parts.next()?;
        check_name(name).ok()?;
        Some(FileKey {
            name: name.to_owned(),
            pid,
            start_ticks,
        })
    }
}

/// Checks that `name` is a DNS label (lowercase letters, digits, '-', at most 63 characters,
/// no leading or trailing '-'), as vmhost VM names are; it becomes part of a file name.
pub(crate) fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 63 {
        return Err("a VM name has 1 to 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err("a VM name has only lowercase letters, digits and '-'");
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err("a VM name does not start or end with '-'");
    }
    Ok(())
}

/// The envelope of an entry file as read: the entry stays raw so that its checksum covers the
/// exact bytes written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRepr<'a> {
    format: String,
    version: u32,
    crc32: u32,
    #[serde(borrow)]
    entry: &'a RawValue,
}

/// Encodes an entry file.
pub(crate) fn encode(entry: &Entry) -> Result<String, serde_json::Error> {
    let body = serde_json::to_string_pretty(entry)?;
    let crc = crc32(body.as_bytes());
    Ok(format!(
        "{{\n\"format\": \"{FORMAT}\",\n\"version\": {VERSION},\n\"crc32\": {crc},\n\"entry\": {body}\n}}\n"
    ))
}

/// Decodes an entry file; the error says what is wrong, in words.
pub(crate) fn decode(text: &str) -> Result<Entry, String> {
    if text.trim().is_empty() {
        return Err("the file is empty".into());
    }
    let repr: FileRepr<'_> = serde_json::from_str(text)
        .map_err(|e| format!("not a complete ledger entry (truncated or garbage): {e}"))?;
    if repr.format != FORMAT {
        return Err(format!("format is {:?}, expected {FORMAT:?}", repr.format));
    }
    if repr.version != VERSION {
        return Err(format!(
            "format version {} (this vmhost reads version {VERSION})",
            repr.version
        ));
    }
    let actual = crc32(repr.entry.get().as_bytes());
    if actual != repr.crc32 {
        return Err(format!(
            "checksum mismatch (recorded crc32 {}, content has {actual}): the entry was altered",
            repr.crc32
        ));
    }
    serde_json::from_str(repr.entry.get()).map_err(|e| format!("invalid entry: {e}"))
}

/// CRC-32 (IEEE 802.3, reflected, as zlib computes it).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & 0u32.wrapping_sub(crc & 1));
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Entry {
        Entry {
            name: "web-1".into(),
            pid: 4242,
            proc_start_ticks: 987_654,
            started_at_unix_ms: 1_700_000_000_000,
            state: VmState::Running,
            role: EntryRole::Vm,
            vcpu_pus: vec![Some(2), Some(3)],
            floating_cpus: vec![],
            emulator_pus: vec![4],
            emulator_isolated: true,
            io_pool_pus: Vec::new(),
            hugepages: vec![HugepageReservation {
                node: Some(0),
                page_size_bytes: 1 << 30,
                count: 2,
            }],
            memory: vec![NodeMemory {
                node: Some(0),
                page_size_bytes: 1 << 30,
                bytes: 2 << 30,
            }],
            api_socket: Some("/run/vmhost/web-1.sock".into()),
        }
    }

    #[test]
    fn supplemental_io_pool_pus_are_held() {
        let mut e = sample();
        e.io_pool_pus = vec![5, 6];
        assert_eq!(e.dedicated_pus(), BTreeSet::from([2, 3, 4, 5, 6]));
        let text = encode(&e).expect("encode");
        assert_eq!(decode(&text), Ok(e));
    }

    #[test]
    fn the_role_is_written_for_incoming_entries_only() {
        let mut e = sample();
        let text = encode(&e).expect("encode");
        assert!(!text.contains("role"), "{text}");
        e.role = EntryRole::Incoming;
        let text = encode(&e).expect("encode");
        assert!(text.contains("\"role\": \"incoming\""), "{text}");
        assert_eq!(decode(&text), Ok(e));
    }

    #[test]
    fn crc32_matches_zlib() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn entry_round_trips_through_its_file_form() {
        let e = sample();
        let text = encode(&e).expect("encode");
        assert_eq!(decode(&text), Ok(e.clone()));
        assert_eq!(e.dedicated_pus(), BTreeSet::from([2, 3, 4]));
        assert!(!e.is_floating());
    }

    #[test]
    fn every_truncation_of_an_entry_file_is_detected() {
        let text = encode(&sample()).expect("encode");
        let end = text.trim_end().len();
        for cut in 0..end {
            assert!(decode(&text[..cut]).is_err(), "cut at {cut} decoded");
        }
    }

    #[test]
    fn an_altered_value_fails_the_checksum() {
        let text = encode(&sample())
            .expect("encode")
            .replace("\"pid\": 4242", "\"pid\": 4243");
        let err = decode(&text).expect_err("altered");
        assert!(err.contains("checksum mismatch"), "{err}");
    }

    #[test]
    fn a_newer_version_is_refused_by_number() {
        let text = encode(&sample())
            .expect("encode")
            .replace("\"version\": 1", "\"version\": 2");
        let err = decode(&text).expect_err("version");
        assert!(err.contains("format version 2"), "{err}");
    }

    #[test]
    fn file_keys_round_trip_and_reject_foreign_names() {
        let key = FileKey::parse("web-1.4242.987654.json").expect("key");
        assert_eq!(
            (key.name.as_str(), key.pid, key.start_ticks),
            ("web-1", 4242, 987_654)
        );
        assert_eq!(key.file_name(), "web-1.4242.987654.json");
        for bad in [
            "web-1.json",
            "web.1.x.json",
            "Web.1.2.json",
            "a.1.2.txt",
            ".1.2.json",
        ] {
            assert_eq!(FileKey::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn names_are_dns_labels() {
        assert!(check_name("vm-01").is_ok());
        for bad in ["", "-a", "a-", "A", "a.b", "../x", "a/b", &"x".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
