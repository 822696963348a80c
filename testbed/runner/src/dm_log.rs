//! `dm-log-writes`: a device-mapper target that passes writes to a device and logs them, in
//! the order they reached it, on a second device (the kernel's
//! `Documentation/admin-guide/device-mapper/log-writes.rst`). A write is logged only once a
//! FLUSH (or its own FUA) made it durable, ahead of that FLUSH; `dmsetup message NAME 0 mark
//! TEXT` adds a MARK entry at the current end of the log. So "every write the guest completed
//! before its flush was on the device before the flush completed" reads off the log as: the
//! writes are logged before a FLUSH that comes before the mark set after the guest's flush.
//!
//! The log: block 0 is the super block (`magic`, `version`, `nr_entries`, `sectorsize`, all
//! little endian); from block 1 on, one entry after the other, each one block of header
//! (`sector`, `nr_sectors`, `flags`, `data_len`; a MARK's text follows the header in the same
//! block) and then, for a write, its `nr_sectors` blocks of data. A block is `sectorsize`
//! bytes (the device's logical block size); `sector` and `nr_sectors` count blocks.

use std::path::Path;
use std::process::Command;

use crate::ensure;

/// The super block's magic.
const MAGIC: u64 = 0x006a_7366_7773_6872;
/// The log format version.
const VERSION: u64 = 1;
/// An entry's flags.
pub const FLUSH: u64 = 1 << 0;
/// Forced unit access.
pub const FUA: u64 = 1 << 1;
/// A discard (no data in the log).
pub const DISCARD: u64 = 1 << 2;
/// A mark (`dmsetup message ... mark TEXT`).
pub const MARK: u64 = 1 << 3;
const HEADER_LEN: usize = 32;

/// One log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// First block written.
    pub sector: u64,
    /// Blocks written.
    pub nr_sectors: u64,
    /// [`FLUSH`], [`FUA`], [`DISCARD`], [`MARK`].
    pub flags: u64,
    /// A mark's text.
    pub mark: Option<String>,
    /// A write's data (`nr_sectors` blocks).
    pub data: Vec<u8>,
}

/// A parsed log.
#[derive(Debug, Clone)]
pub struct Log {
    /// Bytes per block.
    pub block: u64,
    /// The entries, in log order.
    pub entries: Vec<Entry>,
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// Parses the log device's contents.
pub fn parse(dev: &[u8]) -> Result<Log, String> {
    ensure!(
        dev.len() >= 28,
        "log of {} bytes has no super block",
        dev.len()
    );
    ensure!(
        le64(dev, 0) == MAGIC && le64(dev, 8) == VERSION,
        "not a dm-log-writes log: magic {:#x}, version {}",
        le64(dev, 0),
        le64(dev, 8)
    );
    let count = le64(dev, 16);
    let block = u64::from(u32::from_le_bytes([dev[24], dev[25], dev[26], dev[27]]));
    ensure!(
        block >= 512 && block.is_power_of_two(),
        "log block size {block}"
    );
    let bs = usize::try_from(block).map_err(|e| e.to_string())?;
    let mut at = bs;
    let mut entries = Vec::new();
    for i in 0..count {
        ensure!(at + bs <= dev.len(), "entry {i} lies past the log's end");
        let h = &dev[at..at + bs];
        let (sector, nr_sectors, flags, data_len) =
            (le64(h, 0), le64(h, 8), le64(h, 16), le64(h, 24));
        at += bs;
        let mut e = Entry {
            sector,
            nr_sectors,
            flags,
            mark: None,
            data: Vec::new(),
        };
        if flags & MARK != 0 {
            let n = usize::try_from(data_len).unwrap_or(usize::MAX);
            ensure!(n <= bs - HEADER_LEN, "entry {i}: mark of {data_len} bytes");
            e.mark = Some(String::from_utf8_lossy(&h[HEADER_LEN..HEADER_LEN + n]).into_owned());
        } else if flags & DISCARD == 0 {
            ensure!(
                data_len == 0,
                "entry {i}: inline data is not supported here"
            );
            let n = usize::try_from(nr_sectors * block).map_err(|e| e.to_string())?;
            ensure!(
                at + n <= dev.len(),
                "entry {i}'s data lies past the log's end"
            );
            e.data = dev[at..at + n].to_vec();
            at += n;
        }
        entries.push(e);
    }
    Ok(Log { block, entries })
}

impl Log {
    /// The index of the first MARK entry with `text`.
    pub fn mark(&self, text: &str) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| e.flags & MARK != 0 && e.mark.as_deref() == Some(text))
    }

    /// `want` (at byte `offset` of the device) was on the device before a FLUSH that the log
    /// has ahead of the mark `text`: replaying the writes logged before the last such FLUSH
    /// gives exactly `want` there.
    pub fn flushed_before_mark(&self, text: &str, offset: u64, want: &[u8]) -> Result<(), String> {
        let m = self
            .mark(text)
            .ok_or_else(|| format!("no mark {text:?} in the log: {}", self.summary()))?;
        let f = self.entries[..m]
            .iter()
            .rposition(|e| e.flags & FLUSH != 0)
            .ok_or_else(|| {
                format!(
                    "no FLUSH reached the device before the guest's flush had completed \
                     (mark {text:?} is entry {m}): {}",
                    self.summary()
                )
            })?;
        let mut got = vec![None::<u8>; want.len()];
        for e in self.entries[..f]
            .iter()
            .filter(|e| e.flags & (MARK | DISCARD) == 0)
        {
            let start = e.sector * self.block;
            for (i, b) in e.data.iter().enumerate() {
                let pos = start + i as u64;
                if let Some(slot) = pos
                    .checked_sub(offset)
                    .and_then(|p| got.get_mut(usize::try_from(p).ok()?))
                {
                    *slot = Some(*b);
                }
            }
        }
        let missing = got.iter().filter(|b| b.is_none()).count();
        let differ = got
            .iter()
            .zip(want)
            .filter(|(g, w)| g.is_some_and(|g| g != **w))
            .count();
        ensure!(
            missing == 0 && differ == 0,
            "of the guest's {} bytes at {offset}, {missing} were not on the device and {differ} \
             differed before the last FLUSH ahead of mark {text:?} (entry {f}): {}",
            want.len(),
            self.summary()
        );
        Ok(())
    }

    /// A short account of the log for failure messages: writes, flushes, marks.
    pub fn summary(&self) -> String {
        let count = |flag: u64| self.entries.iter().filter(|e| e.flags & flag != 0).count();
        let writes = self
            .entries
            .iter()
            .filter(|e| e.flags & (MARK | DISCARD) == 0 && e.nr_sectors > 0)
            .count();
        let marks: Vec<String> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| Some(format!("{}@{i}", e.mark.as_deref()?)))
            .collect();
        format!(
            "{} entries: {writes} writes, {} FLUSH, {} FUA, marks {marks:?}",
            self.entries.len(),
            count(FLUSH),
            count(FUA)
        )
    }
}

fn dmsetup(args: &[&str]) -> Result<String, String> {
    let out = Command::new("dmsetup")
        .args(args)
        .output()
        .map_err(|e| format!("dmsetup {args:?}: {e} (is dmsetup in the image?)"))?;
    ensure!(
        out.status.success(),
        "dmsetup {args:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A device-mapper device, removed on drop.
pub struct DmDevice {
    name: String,
    /// Its block device node (`/dev/dm-N`, made by devtmpfs).
    pub dev: String,
}

impl DmDevice {
    /// `dmsetup create NAME` with one table line `0 SECTORS TARGET ARGS` (sectors of 512
    /// bytes), e.g. `log-writes /dev/loop0 /dev/loop1` or `linear /dev/loop0 0`.
    pub fn create(name: &str, sectors: u64, target: &str) -> Result<Self, String> {
        let table = format!("0 {sectors} {target}");
        dmsetup(&["create", "--noudevsync", name, "--table", &table])?;
        let minor = dmsetup(&["info", "-c", "--noheadings", "-o", "minor", name])?;
        let dev = format!("/dev/dm-{}", minor.trim());
        let d = DmDevice {
            name: name.to_string(),
            dev,
        };
        ensure!(
            Path::new(&d.dev).exists(),
            "dm device {name} has no node {}",
            d.dev
        );
        Ok(d)
    }

    /// `dmsetup message NAME 0 ARGS...`.
    pub fn message(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["message", self.name.as_str(), "0"];
        all.extend_from_slice(args);
        dmsetup(&all).map(drop)
    }

    /// `dmsetup suspend NAME` / `dmsetup resume NAME`.
    pub fn suspend(&self, on: bool) -> Result<(), String> {
        let op = if on { "suspend" } else { "resume" };
        dmsetup(&[op, "--noudevsync", &self.name]).map(drop)
    }

    /// Whether the kernel has the device suspended (`dmsetup info`'s State).
    pub fn suspended(&self) -> Result<bool, String> {
        let info = dmsetup(&["info", &self.name])?;
        Ok(info
            .lines()
            .any(|l| l.starts_with("State:") && l.contains("SUSPENDED")))
    }

    /// `dmsetup remove NAME` (a log-writes target logs what it still holds first).
    pub fn remove(&mut self) -> Result<(), String> {
        if self.name.is_empty() {
            return Ok(());
        }
        dmsetup(&["remove", "--noudevsync", &self.name])?;
        self.name.clear();
        Ok(())
    }
}

impl Drop for DmDevice {
    fn drop(&mut self) {
        if !self.name.is_empty() {
            let _ = dmsetup(&["resume", "--noudevsync", &self.name]);
            let _ = self.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(words: &[u64], tail: &[u8]) -> Vec<u8> {
        let mut b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        b.extend_from_slice(tail);
        b.resize(512, 0);
        b
    }

    /// A log as the kernel writes it: two writes, a FLUSH, a mark; the check passes only
    /// for the flushed data and fails when the FLUSH is missing.
    #[test]
    fn parses_and_checks_a_log() {
        let mut super_block = block(&[MAGIC, VERSION, 4], &[]);
        super_block[24..28].copy_from_slice(&512u32.to_le_bytes());
        let mut log = super_block;
        log.extend(block(&[8, 1, 0, 0], &[]));
        log.extend(vec![0xaa; 512]);
        log.extend(block(&[9, 1, 0, 0], &[]));
        log.extend(vec![0xbb; 512]);
        log.extend(block(&[0, 0, FLUSH, 0], &[]));
        log.extend(block(&[0, 0, MARK, 6], b"synced"));
        let parsed = parse(&log).unwrap();
        assert_eq!(parsed.entries.len(), 4);
        assert_eq!(parsed.mark("synced"), Some(3));
        let mut want = vec![0xaa; 512];
        want.extend(vec![0xbb; 512]);
        parsed
            .flushed_before_mark("synced", 8 * 512, &want)
            .unwrap();
        let err = parsed
            .flushed_before_mark("synced", 8 * 512, &vec![0xaa; 1024])
            .unwrap_err();
        assert!(err.contains("512 differed"), "{err}");
        let mut unflushed = parsed.clone();
        unflushed.entries.remove(2);
        let err = unflushed
            .flushed_before_mark("synced", 8 * 512, &want)
            .unwrap_err();
        assert!(err.contains("no FLUSH"), "{err}");
    }
}
