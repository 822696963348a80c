//! The memory rules: the guest's size (as written, or from the memory resources), the added
//! overhead, the hugepage backing ([`ARCH_PAGE_SIZES`], its fallback) and whole hugepages; and
//! the resolved [`MemorySpec`].

use std::path::PathBuf;

use serde::Serialize;

use super::{Checker, Resources};
use crate::quantity::format_bytes;
use crate::spec::{RawHugepages, RawSpec};

/// Page sizes the host architecture has (x86_64: 2 MiB and 1 GiB).
pub const ARCH_PAGE_SIZES: [u64; 2] = [2 << 20, 1 << 30];

/// Resolved hugepage backing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HugepageSpec {
    /// Page size in bytes.
    pub page_size_bytes: u64,
    /// hugetlbfs mount to use instead of memfd.
    pub hugetlbfs: Option<PathBuf>,
    /// `fallback = "normal-pages"`: when the pools cannot hold the guest, the planner backs
    /// it with normal pages instead of refusing it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fallback_to_normal_pages: bool,
}

/// Resolved memory settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemorySpec {
    /// Memory the guest sees.
    pub guest_bytes: u64,
    /// Hugepage backing, if any.
    pub hugepages: Option<HugepageSpec>,
    /// `reserved_overhead.added_overhead` (0 when absent).
    pub added_overhead_bytes: u64,
}

impl MemorySpec {
    /// Guest RAM as allocated: `guest_bytes` rounded up to whole 4 KiB pages (hugepage-backed
    /// guests are already whole pages). Quantities such as `1G` (10^9 bytes) are valid, as in
    /// KubeVirt; the overhead is computed from the exact `guest_bytes`.
    ///
    /// ```
    /// let s = vmhost_config::from_toml_str("[memory]\nguest = \"1G\"\n", "t.toml").unwrap().spec;
    /// assert_eq!(s.memory.guest_bytes, 1_000_000_000);
    /// assert_eq!(s.memory.guest_ram_bytes(), 1_000_001_536);
    /// ```
    pub fn guest_ram_bytes(&self) -> u64 {
        self.guest_bytes
            .checked_next_multiple_of(4096)
            .unwrap_or(self.guest_bytes & !4095)
    }
}

/// Guest memory: its size (`memory.guest`, else the memory limit, else the request), the
/// added overhead and the hugepage backing; `None` when the size is missing or unreadable.
pub(super) fn check_memory(
    c: &mut Checker<'_>,
    raw: &RawSpec,
    res: &Resources,
) -> Option<MemorySpec> {
    let m = &raw.memory;
    let explicit = c.bytes("memory.guest", m.guest.as_ref());
    if m.guest.is_some() && explicit.is_none() {
        return None; // reported by `bytes`
    }
    let guest = explicit
        .or(res.limits.memory_bytes)
        .or(res.requests.memory_bytes);
    let added = m
        .reserved_overhead
        .as_ref()
        .and_then(|r| {
            c.bytes(
                "memory.reserved_overhead.added_overhead",
                Some(&r.added_overhead),
            )
        })
        .unwrap_or(0);
    let hugepages = m.hugepages.as_ref().and_then(|h| check_hugepages(c, h));
    let Some(guest) = guest else {
        c.fail(
            "memory.guest",
            "(absent)",
            "the guest needs memory: memory.guest, resources.limits.memory or resources.requests.memory",
            "add memory.guest, e.g. \"1Gi\"",
        );
        return None;
    };
    check_guest_size(c, guest, explicit, res, hugepages.as_ref());
    // Like KubeVirt, any byte count is accepted without hugepages; the guest gets whole 4 KiB
    // pages (MemorySpec::guest_ram_bytes) and the overhead uses the exact quantity.
    Some(MemorySpec {
        guest_bytes: guest,
        hugepages,
        added_overhead_bytes: added,
    })
}

/// `memory.hugepages`: a page size of the architecture and a fallback vmhost knows; `None`
/// when the page size is not one.
fn check_hugepages(c: &mut Checker<'_>, h: &RawHugepages) -> Option<HugepageSpec> {
    let size = h
        .page_size
        .to_bytes()
        .filter(|s| ARCH_PAGE_SIZES.contains(s));
    if size.is_none() {
        c.fail(
            "memory.hugepages.page_size",
            &h.page_size,
            "is not a hugepage size of x86_64",
            "use \"2Mi\" or \"1Gi\"",
        );
    }
    let fallback_to_normal_pages = match h.fallback.as_deref() {
        None | Some("refuse") => false,
        Some("normal-pages") => true,
        Some(other) => {
            c.fail(
                "memory.hugepages.fallback",
                other,
                "is not a fallback vmhost knows",
                "use \"refuse\" (the default) or \"normal-pages\"",
            );
            false
        }
    };
    size.map(|page_size_bytes| HugepageSpec {
        page_size_bytes,
        hugetlbfs: h.hugetlbfs.clone(),
        fallback_to_normal_pages,
    })
}

/// The guest's size: positive, within the memory limit when `memory.guest` gives it
/// (`explicit`), and whole hugepages.
fn check_guest_size(
    c: &mut Checker<'_>,
    guest: u64,
    explicit: Option<u64>,
    res: &Resources,
    hugepages: Option<&HugepageSpec>,
) {
    let field = if explicit.is_some() {
        "memory.guest"
    } else {
        "resources.requests.memory"
    };
    if guest == 0 {
        c.fail(
            field,
            0,
            "guest memory must be positive",
            "give the guest e.g. \"1Gi\"",
        );
    }
    if let (Some(lim), Some(_)) = (res.limits.memory_bytes, explicit) {
        if guest > lim {
            c.fail(
                "memory.guest",
                format_bytes(guest),
                &format!(
                    "must not exceed resources.limits.memory ({})",
                    format_bytes(lim)
                ),
                "lower memory.guest or raise the limit",
            );
        }
    }
    if let Some(h) = hugepages {
        if guest % h.page_size_bytes != 0 {
            let up = guest.div_ceil(h.page_size_bytes) * h.page_size_bytes;
            c.fail(
                field,
                format_bytes(guest),
                &format!(
                    "must be a multiple of the hugepage size {} (memory.hugepages.page_size)",
                    format_bytes(h.page_size_bytes)
                ),
                format!("use {} or a smaller page size", format_bytes(up)),
            );
        }
    }
}
