//! How big the benchmark's working set is: at least 4× the host's last-level cache (read from
//! sysfs), in whole backing pages; and whether each guest cell holds it in one piece.

use std::path::Path;

use vmhost_config::format_bytes;
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_plan::Plan;

use crate::BenchError;

/// Where the CPU caches of PU 0 are described.
pub const CACHE_DIR: &str = "/sys/devices/system/cpu/cpu0/cache";
/// Working set per cell as a multiple of the last-level cache.
pub const LLC_MULTIPLE: u64 = 4;
/// The LLC size assumed when sysfs does not say.
pub const FALLBACK_LLC_BYTES: u64 = 32 << 20;

/// Parses a sysfs cache size (`32768K`, `32M`, `1G`, or bytes).
pub fn parse_cache_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, shift) = match t.as_bytes().last()? {
        b'K' | b'k' => (&t[..t.len() - 1], 10),
        b'M' | b'm' => (&t[..t.len() - 1], 20),
        b'G' | b'g' => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// The last-level cache size from a sysfs cache directory (`index*/level`, `index*/size`):
/// the level-3 cache when there is one, else the largest cache.
pub fn llc_bytes_in(dir: &Path) -> Option<u64> {
    let mut caches: Vec<(u32, u64)> = Vec::new();
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |f: &str| std::fs::read_to_string(entry.path().join(f)).ok();
        let level = read("level").and_then(|l| l.trim().parse::<u32>().ok());
        let size = read("size").as_deref().and_then(parse_cache_size);
        if let (Some(level), Some(size)) = (level, size) {
            caches.push((level, size));
        }
    }
    let l3 = caches.iter().filter(|c| c.0 == 3).map(|c| c.1).max();
    l3.or_else(|| caches.iter().map(|c| c.1).max())
}

/// The host's last-level cache size (see [`llc_bytes_in`]).
pub fn llc_bytes() -> Option<u64> {
    llc_bytes_in(Path::new(CACHE_DIR))
}

/// `bytes` rounded up to a whole number of `page` bytes.
pub fn round_up(bytes: u64, page: u64) -> u64 {
    bytes.div_ceil(page.max(1)).saturating_mul(page.max(1))
}

/// The working set per cell: `requested`, else [`LLC_MULTIPLE`] × the LLC; in whole pages.
pub fn working_set(requested: Option<u64>, llc: Option<u64>, page: u64) -> u64 {
    let want = requested.unwrap_or_else(|| LLC_MULTIPLE * llc.unwrap_or(FALLBACK_LLC_BYTES));
    round_up(want.max(1), page)
}

/// Checks that every guest cell of `plan` has `ws` bytes of RAM in one piece.
pub fn check_cells(plan: &Plan, ws: u64, llc: Option<u64>) -> Result<(), BenchError> {
    let layout = GuestLayout::from_plan(plan, MMIO_HOLE_START..MMIO_HOLE_END)
        .map_err(|source| BenchError::Layout { source })?;
    for c in &plan.guest_cells {
        let largest = layout
            .cell_regions(c.cell)
            .map(|r| r.size_bytes)
            .max()
            .unwrap_or(0);
        if largest < ws {
            let cells = plan.guest_cells.len() as u64;
            return Err(BenchError::CellTooSmall {
                cell: c.cell,
                largest,
                working_set: ws,
                llc: llc.map_or_else(|| "unknown".to_string(), format_bytes),
                guest_needed: format_bytes(ws.saturating_mul(cells.max(1))),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("x"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    fn cache_dir(entries: &[(u32, &str)]) -> tempdir::Dir {
        let d = tempdir::Dir::new();
        for (i, (level, size)) in entries.iter().enumerate() {
            let idx = d.path.join(format!("index{i}"));
            std::fs::create_dir_all(&idx).unwrap();
            std::fs::write(idx.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(idx.join("size"), format!("{size}\n")).unwrap();
        }
        d
    }

    mod tempdir {
        pub struct Dir {
            pub path: std::path::PathBuf,
        }
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let path = std::env::temp_dir().join(format!(
                    "vmhost-bench-cache-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&path).unwrap();
                Dir { path }
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }

    #[test]
    fn level_three_wins_else_the_largest() {
        let d = cache_dir(&[(1, "32K"), (1, "32K"), (2, "1024K"), (3, "32768K")]);
        assert_eq!(llc_bytes_in(&d.path), Some(32 << 20));
        // A bigger level-2 cache does not beat an existing level 3.
        let d = cache_dir(&[(2, "64M"), (3, "16M")]);
        assert_eq!(llc_bytes_in(&d.path), Some(16 << 20));
        let d = cache_dir(&[(1, "48K"), (2, "2048K")]);
        assert_eq!(llc_bytes_in(&d.path), Some(2 << 20));
        assert_eq!(llc_bytes_in(Path::new("/no/such/dir")), None);
    }

    #[test]
    fn working_set_is_four_llcs_in_whole_pages() {
        assert_eq!(working_set(None, Some(32 << 20), 2 << 20), 128 << 20);
        assert_eq!(working_set(None, Some(3 << 20), 2 << 20), 12 << 20);
        assert_eq!(working_set(None, Some(5 << 19), 2 << 20), 10 << 20);
        assert_eq!(working_set(None, Some(1 << 20), 1 << 30), 1 << 30);
        assert_eq!(working_set(Some(5 << 20), Some(32 << 20), 2 << 20), 6 << 20);
        assert_eq!(working_set(None, None, 4096), 128 << 20);
    }
}
