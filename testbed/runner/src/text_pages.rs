//! Which pages of the vmhost binary a VMM has mapped, for `scripts/text-order.py
//! --emulated-pages` (`VMHOST_BENCH_TEXT_PAGES=1` in the peers benchmark): with the emulated
//! host's fault-around set to one page (`/sys/kernel/debug/fault_around_bytes`), a page of
//! the binary is mapped only when the process touched it, so the pages mapped at the guest's
//! `/init` are the code and read-only data a Linux boot ran in this host, which the CI host's
//! profiles (a nested guest there does not get far) cannot see.

use std::io::{Read, Seek, SeekFrom};

const FAULT_AROUND: &str = "/sys/kernel/debug/fault_around_bytes";

/// Is the dump asked for (`VMHOST_BENCH_TEXT_PAGES=1`)?
pub fn wanted() -> bool {
    std::env::var("VMHOST_BENCH_TEXT_PAGES").is_ok_and(|v| v == "1")
}

/// Sets the kernel's fault-around to `bytes` (mounting debugfs when it is not); returns the
/// value it had.
pub fn set_fault_around(bytes: u64) -> Result<u64, String> {
    if !std::path::Path::new(FAULT_AROUND).exists() {
        let status = std::process::Command::new("mount")
            .args(["-t", "debugfs", "none", "/sys/kernel/debug"])
            .status()
            .map_err(|e| format!("mount debugfs: {e}"))?;
        crate::ensure!(status.success(), "mount debugfs: {status}");
    }
    let was = std::fs::read_to_string(FAULT_AROUND)
        .map_err(|e| format!("{FAULT_AROUND}: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("{FAULT_AROUND}: {e}"))?;
    std::fs::write(FAULT_AROUND, bytes.to_string())
        .map_err(|e| format!("write {FAULT_AROUND}: {e}"))?;
    Ok(was)
}

/// One line per mapping of `exe` in process `pid`: `text-pages PERMS OFFSET: N,N-M,…`, the
/// pages (their offsets in the file, in 4 KiB pages) that are present in its page table.
pub fn dump(pid: u32, exe: &std::path::Path) -> Result<Vec<String>, String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| format!("maps of {pid}: {e}"))?;
    let mut pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| format!("pagemap of {pid}: {e}"))?;
    let exe = exe.to_string_lossy();
    let mut lines = Vec::new();
    for m in maps.lines() {
        let f: Vec<&str> = m.split_whitespace().collect();
        if f.get(5) != Some(&exe.as_ref()) {
            continue;
        }
        let (lo, hi) = f[0].split_once('-').ok_or("maps line")?;
        let parse = |s: &str| u64::from_str_radix(s, 16).map_err(|e| e.to_string());
        let (lo, hi, off) = (parse(lo)?, parse(hi)?, parse(f[2])?);
        let pages = (hi - lo) / 4096;
        let mut raw = vec![0u8; usize::try_from(pages * 8).map_err(|e| e.to_string())?];
        pagemap
            .seek(SeekFrom::Start(lo / 4096 * 8))
            .and_then(|_| pagemap.read_exact(&mut raw))
            .map_err(|e| format!("pagemap of {pid}: {e}"))?;
        let present: Vec<u64> = raw
            .chunks_exact(8)
            .zip(0u64..)
            .filter(|(e, _)| e[7] & 0x80 != 0)
            .map(|(_, i)| off / 4096 + i)
            .collect();
        lines.push(format!(
            "text-pages {} {off:#x}: {}",
            f[1],
            ranges(&present)
        ));
    }
    Ok(lines)
}

/// `1,3-5,9` for `[1, 3, 4, 5, 9]`.
fn ranges(v: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_join_consecutive_pages() {
        assert_eq!(ranges(&[1, 3, 4, 5, 9]), "1,3-5,9");
        assert_eq!(ranges(&[]), "");
    }

    /// This test binary's own text: the page holding this function is present.
    #[test]
    fn the_running_code_is_among_the_present_pages() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let lines = dump(std::process::id(), &exe).unwrap();
        assert!(lines.iter().any(|l| l.contains("r-xp")), "{lines:?}");
    }
}
