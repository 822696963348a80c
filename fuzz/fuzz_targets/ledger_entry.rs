//! Ledger entries as read back from disk: any file name and any content in a run directory's
//! `vms/`, read by `Ledger::list` (the scan every ledger operation makes). Invariants: a file
//! in entry form is listed exactly once, readable or not, and a foreign name is ignored; a
//! readable entry matches its file name; written again with the ledger's own encoder, under
//! its canonical name, it reads back as the same value, and encoding that is stable.
//!
//! Input: `file name\ncontent`.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmhost_ledger::{fuzz_encode_entry, Entry, Ledger, Snapshot};

/// A run directory of this fuzzing process.
fn run_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("vmhost-fuzz-ledger-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("vms")).expect("run directory");
        dir
    })
}

/// Lists a `vms/` that holds only `name` with `content`.
fn list_one(name: &str, content: &[u8]) -> Snapshot {
    let vms = run_dir().join("vms");
    for old in std::fs::read_dir(&vms).expect("read vms/") {
        std::fs::remove_file(old.expect("vms/ entry").path()).expect("clear vms/");
    }
    std::fs::write(vms.join(name), content).expect("write the entry file");
    Ledger::open_readonly(run_dir())
        .list()
        .expect("list the ledger")
}

/// `<name>.<pid>.<start>.json` split at its last two dots, numbers as written.
fn key(file_name: &str) -> Option<(&str, &str, &str)> {
    let stem = file_name.strip_suffix(".json")?;
    let (rest, start) = stem.rsplit_once('.')?;
    let (name, pid) = rest.rsplit_once('.')?;
    Some((name, pid, start))
}

fn check_readable(file_name: &str, entry: &Entry) {
    let (name, pid, start) = key(file_name).expect("a readable entry has an entry file name");
    assert_eq!(name, entry.name, "{file_name}");
    assert_eq!(pid.parse::<u32>().ok(), Some(entry.pid), "{file_name}");
    assert_eq!(
        start.parse::<u64>().ok(),
        Some(entry.proc_start_ticks),
        "{file_name}"
    );
    let text = fuzz_encode_entry(entry).expect("a read entry encodes");
    let canonical = format!(
        "{}.{}.{}.json",
        entry.name, entry.pid, entry.proc_start_ticks
    );
    let again = list_one(&canonical, text.as_bytes());
    assert!(
        again.unreadable.is_empty(),
        "re-written entry unreadable: {again:?}"
    );
    assert_eq!(again.entries.len(), 1);
    assert_eq!(
        &again.entries[0].entry, entry,
        "the entry changed on its round trip"
    );
    let text2 = fuzz_encode_entry(&again.entries[0].entry).expect("encodes");
    assert_eq!(text, text2, "encoding is not stable");
}

fuzz_target!(|data: &[u8]| {
    let at = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let Ok(file_name) = std::str::from_utf8(&data[..at]) else {
        return;
    };
    if file_name.is_empty()
        || file_name.len() > 255
        || file_name.contains(['/', '\0'])
        || Path::new(file_name).file_name().is_none()
    {
        return; // not a file name
    }
    let content = data.get(at + 1..).unwrap_or_default();
    let snapshot = list_one(file_name, content);
    let scanned = file_name.ends_with(".json")
        && !(file_name.starts_with('.') && file_name.ends_with(".tmp"));
    let listed = snapshot.entries.len() + snapshot.unreadable.len();
    assert_eq!(listed, usize::from(scanned), "{file_name:?}: {snapshot:?}");
    for u in &snapshot.unreadable {
        assert!(!u.detail.is_empty());
        if let Some(name) = &u.name {
            assert!(file_name.starts_with(name.as_str()), "{u:?}");
        }
    }
    if let Some(listed) = snapshot.entries.first() {
        check_readable(file_name, &listed.entry);
    }
});
