//! Residency audit: where guest RAM really sits after prefaulting.
//!
//! This module owns the read-back of placement from the kernel. For each mapped region it
//! asks `move_pages` (a pure query: no target nodes) for the node of every backing page,
//! reads the policy in force with `get_mempolicy(MPOL_F_ADDR)`, and cross-checks both with the
//! region's lines in `/proc/self/numa_maps` (policy, `huge`, `N<node>=<pages>`,
//! `kernelpagesize_kB`). Anything that disagrees with the plan is a [`Violation`]: pages off
//! the bound node, pages not present, another policy, another page size, or `numa_maps` not
//! agreeing with `move_pages`.

use std::collections::BTreeMap;
use std::fmt;
use std::io;

use serde::Serialize;
use vmhost_config::format_bytes;

use crate::backing::MappedRegion;
use crate::policy::{normalize_numa_maps_policy, policy_string, PolicyOverride};
use crate::sys;

/// Why the audit could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// `get_mempolicy(MPOL_F_ADDR)` failed.
    #[error("cannot read the memory policy of guest cell {cell} at GPA {gpa:#x}")]
    Policy {
        /// Cell number.
        cell: u32,
        /// Guest-physical start of the region.
        gpa: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `move_pages` (query) failed.
    #[error("cannot query the nodes of guest cell {cell} pages at GPA {gpa:#x}")]
    QueryPages {
        /// Cell number.
        cell: u32,
        /// Guest-physical address of the first page of the failed batch.
        gpa: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `/proc/self/numa_maps` could not be read.
    #[error("cannot read /proc/self/numa_maps")]
    NumaMaps {
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// What `numa_maps` says about a region.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NumaMapsEntry {
    /// Policy as `numa_maps` prints it (`bind:0`, `default`, ...).
    pub policy: String,
    /// The `huge` flag (hugetlb mapping).
    pub huge: bool,
    /// `kernelpagesize_kB` in bytes.
    pub kernel_page_size_bytes: u64,
    /// `N<node>=<pages>`, pages of `kernel_page_size_bytes`.
    pub pages_by_node: BTreeMap<u32, u64>,
}

/// A disagreement between the plan and the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Violation {
    /// Pages sit on a node other than the bound one.
    PagesOffNode {
        /// The node they sit on.
        node: u32,
        /// How many.
        pages: u64,
    },
    /// Pages are not faulted in.
    NotPresent {
        /// How many.
        pages: u64,
    },
    /// The policy in force is not the planned one.
    Policy {
        /// Planned, e.g. `bind:0`.
        expected: String,
        /// In force.
        found: String,
    },
    /// The kernel maps the region with another page size.
    PageSize {
        /// Planned.
        expected_bytes: u64,
        /// Per `numa_maps`.
        found_bytes: u64,
    },
    /// `numa_maps` has no line for the region.
    NumaMapsMissing,
    /// `numa_maps` shows another policy than `get_mempolicy`.
    NumaMapsPolicy {
        /// Per `get_mempolicy`.
        policy: String,
        /// Per `numa_maps`.
        numa_maps: String,
    },
    /// `numa_maps` counts other bytes per node than `move_pages`.
    NumaMapsDisagree {
        /// Bytes per node per `move_pages`.
        move_pages_bytes: BTreeMap<u32, u64>,
        /// Bytes per node per `numa_maps`.
        numa_maps_bytes: BTreeMap<u32, u64>,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::PagesOffNode { node, pages } => write!(f, "{pages} pages on node{node}, off the bound node"),
            Violation::NotPresent { pages } => write!(f, "{pages} pages not faulted in"),
            Violation::Policy { expected, found } => write!(f, "policy {found}, planned {expected}"),
            Violation::PageSize { expected_bytes, found_bytes } => write!(
                f,
                "kernel page size {}, planned {}",
                format_bytes(*found_bytes),
                format_bytes(*expected_bytes)
            ),
            Violation::NumaMapsMissing => f.write_str("no line in /proc/self/numa_maps"),
            Violation::NumaMapsPolicy { policy, numa_maps } => {
                write!(f, "numa_maps shows policy {numa_maps}, get_mempolicy {policy}")
            }
            Violation::NumaMapsDisagree { move_pages_bytes, numa_maps_bytes } => write!(
                f,
                "numa_maps counts {numa_maps_bytes:?} bytes per node, move_pages {move_pages_bytes:?}"
            ),
        }
    }
}

/// Residency of one region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionAudit {
    /// Guest cell.
    pub cell: u32,
    /// Guest-physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub size_bytes: u64,
    /// Host virtual address (as in `numa_maps`).
    pub host_addr: u64,
    /// Backing page size.
    pub page_size_bytes: u64,
    /// The node the plan binds it to.
    pub expected_node: Option<u32>,
    /// The policy the audit expects, as `numa_maps` spells it (`bind:0`, or the override's,
    /// such as `interleave:0,1`).
    pub expected_policy: String,
    /// Nodes its pages may sit on (empty: any).
    pub allowed_nodes: Vec<u32>,
    /// Policy in force, as `numa_maps` would print it (`bind:0`).
    pub policy: String,
    /// Pages of `page_size_bytes` in the region.
    pub pages: u64,
    /// Present pages per host node (per `move_pages`).
    pub pages_by_node: BTreeMap<u32, u64>,
    /// Pages not faulted in.
    pub pages_not_present: u64,
    /// The region's `numa_maps` entry.
    pub numa_maps: Option<NumaMapsEntry>,
    /// What disagrees with the plan; empty when all is well.
    pub violations: Vec<Violation>,
}

impl RegionAudit {
    /// Share of the region's pages on its allowed nodes (the bound node, or the nodes of a
    /// policy override; 1.0 when unbound and fully present).
    pub fn fraction_on_node(&self) -> f64 {
        let on: u64 = self
            .pages_by_node
            .iter()
            .filter(|(n, _)| self.allowed_nodes.is_empty() || self.allowed_nodes.contains(n))
            .map(|(_, p)| p)
            .sum();
        if self.pages == 0 {
            return 1.0;
        }
        on as f64 / self.pages as f64
    }
}

/// Residency of all regions of guest RAM.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Audit {
    /// One entry per region, in guest-physical order.
    pub regions: Vec<RegionAudit>,
}

impl Audit {
    /// True when no region has a violation.
    pub fn is_clean(&self) -> bool {
        self.regions.iter().all(|r| r.violations.is_empty())
    }

    /// Every violation with the cell and GPA of its region.
    pub fn violations(&self) -> impl Iterator<Item = (u32, u64, &Violation)> {
        self.regions
            .iter()
            .flat_map(|r| r.violations.iter().map(move |v| (r.cell, r.gpa, v)))
    }
}

/// Parses the `numa_maps` lines whose start address lies in `[start, end)` and merges them.
pub fn parse_numa_maps(text: &str, start: u64, end: u64) -> Option<NumaMapsEntry> {
    let mut merged: Option<NumaMapsEntry> = None;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let Some(addr) = fields.next().and_then(|a| u64::from_str_radix(a, 16).ok()) else {
            continue;
        };
        if addr < start || addr >= end {
            continue;
        }
        let entry = merged.get_or_insert_with(|| NumaMapsEntry {
            policy: String::new(),
            kernel_page_size_bytes: 0,
            ..NumaMapsEntry::default()
        });
        if let Some(policy) = fields.next() {
            if entry.policy.is_empty() {
                entry.policy = policy.to_string();
            }
        }
        for field in fields {
            if field == "huge" {
                entry.huge = true;
            } else if let Some(kb) = field.strip_prefix("kernelpagesize_kB=") {
                entry.kernel_page_size_bytes = kb.parse::<u64>().unwrap_or(0) * 1024;
            } else if let Some((node, pages)) =
                field.strip_prefix('N').and_then(|f| f.split_once('='))
            {
                if let (Ok(node), Ok(pages)) = (node.parse::<u32>(), pages.parse::<u64>()) {
                    *entry.pages_by_node.entry(node).or_default() += pages;
                }
            }
        }
    }
    merged
}

/// Node of every page of `region`, counted: `(pages per node, pages not present)`.
fn count_pages(region: &MappedRegion) -> Result<(BTreeMap<u32, u64>, u64), AuditError> {
    const BATCH: usize = 1 << 16;
    let page = usize::try_from(region.page_size_bytes)
        .unwrap_or(4096)
        .max(1);
    let pages = region.len() / page;
    let mut by_node = BTreeMap::new();
    let mut absent = 0u64;
    let mut ptrs = Vec::with_capacity(pages.min(BATCH));
    let mut status = Vec::with_capacity(pages.min(BATCH));
    for first in (0..pages).step_by(BATCH) {
        let n = BATCH.min(pages - first);
        ptrs.clear();
        // SAFETY: (first + i) * page < pages * page <= region.len(): the pointers stay inside
        // the mapping and are only passed to the kernel, never dereferenced.
        ptrs.extend((first..first + n).map(|i| unsafe { region.host_addr().add(i * page) }));
        status.clear();
        status.resize(n, 0);
        sys::query_pages(&ptrs, &mut status).map_err(|source| AuditError::QueryPages {
            cell: region.layout.cell,
            gpa: region.layout.gpa + (first * page) as u64,
            source,
        })?;
        for s in &status {
            match u32::try_from(*s) {
                Ok(node) => *by_node.entry(node).or_default() += 1,
                Err(_) => absent += 1,
            }
        }
    }
    Ok((by_node, absent))
}

fn check_region(a: &mut RegionAudit, hugetlb: bool) {
    let mut v = Vec::new();
    if a.pages_not_present > 0 {
        v.push(Violation::NotPresent {
            pages: a.pages_not_present,
        });
    }
    if !a.allowed_nodes.is_empty() {
        for (&node, &pages) in &a.pages_by_node {
            if !a.allowed_nodes.contains(&node) {
                v.push(Violation::PagesOffNode { node, pages });
            }
        }
    }
    if a.policy != a.expected_policy {
        v.push(Violation::Policy {
            expected: a.expected_policy.clone(),
            found: a.policy.clone(),
        });
    }
    match &a.numa_maps {
        None => v.push(Violation::NumaMapsMissing),
        Some(nm) => {
            if normalize_numa_maps_policy(&nm.policy) != a.policy {
                v.push(Violation::NumaMapsPolicy {
                    policy: a.policy.clone(),
                    numa_maps: nm.policy.clone(),
                });
            }
            if hugetlb && (!nm.huge || nm.kernel_page_size_bytes != a.page_size_bytes) {
                v.push(Violation::PageSize {
                    expected_bytes: a.page_size_bytes,
                    found_bytes: nm.kernel_page_size_bytes,
                });
            }
            let move_pages_bytes: BTreeMap<u32, u64> = a
                .pages_by_node
                .iter()
                .map(|(n, p)| (*n, p * a.page_size_bytes))
                .collect();
            let numa_maps_bytes: BTreeMap<u32, u64> = nm
                .pages_by_node
                .iter()
                .map(|(n, p)| (*n, p * nm.kernel_page_size_bytes))
                .collect();
            if move_pages_bytes != numa_maps_bytes {
                v.push(Violation::NumaMapsDisagree {
                    move_pages_bytes,
                    numa_maps_bytes,
                });
            }
        }
    }
    a.violations = v;
}

/// Audits the residency of `regions` (hugetlb-backed when `hugetlb`), each bound to its
/// cell's node.
pub fn audit(regions: &[&MappedRegion], hugetlb: bool) -> Result<Audit, AuditError> {
    audit_with_policy(regions, hugetlb, None)
}

/// Audits the residency of `regions` under `policy` (`None`: each bound to its cell's node,
/// as [`audit`]).
pub fn audit_with_policy(
    regions: &[&MappedRegion],
    hugetlb: bool,
    policy: Option<&PolicyOverride>,
) -> Result<Audit, AuditError> {
    let mut out = Vec::with_capacity(regions.len());
    for region in regions {
        let l = &region.layout;
        let (mode, nodes) =
            sys::policy_at(region.host_addr()).map_err(|source| AuditError::Policy {
                cell: l.cell,
                gpa: l.gpa,
                source,
            })?;
        let (pages_by_node, pages_not_present) = count_pages(region)?;
        let (expected_policy, allowed_nodes) = match (policy, l.host_node) {
            (Some(p), _) => (p.policy_string(), p.nodes()),
            (None, Some(n)) => (policy_string(sys::MPOL_BIND, &[n]), vec![n]),
            (None, None) => (policy_string(sys::MPOL_DEFAULT, &[]), Vec::new()),
        };
        out.push(RegionAudit {
            cell: l.cell,
            gpa: l.gpa,
            size_bytes: l.size_bytes,
            host_addr: region.host_addr() as u64,
            page_size_bytes: region.page_size_bytes,
            expected_node: l.host_node,
            expected_policy,
            allowed_nodes,
            policy: policy_string(mode, &nodes),
            pages: region.len() as u64 / region.page_size_bytes.max(1),
            pages_by_node,
            pages_not_present,
            numa_maps: None,
            violations: Vec::new(),
        });
    }
    // Read numa_maps once, after all page queries, so its counts are as fresh as theirs.
    let maps = std::fs::read_to_string("/proc/self/numa_maps")
        .map_err(|source| AuditError::NumaMaps { source })?;
    for a in &mut out {
        a.numa_maps = parse_numa_maps(&maps, a.host_addr, a.host_addr + a.size_bytes);
        check_region(a, hugetlb);
    }
    Ok(Audit { regions: out })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
7f0000000000 bind:0 file=/memfd:vmhost:t:cell0\\040(deleted) huge dirty=4 N0=4 kernelpagesize_kB=2048
7f0000800000 default file=/usr/lib/libc.so.6 mapped=40 mapmax=3 N0=40 kernelpagesize_kB=4
7f0040000000 bind:0 file=/memfd:vmhost:t:cell1\\040(deleted) dirty=12 active=0 N0=10 N1=2 kernelpagesize_kB=4
";

    #[test]
    fn parses_a_hugetlb_line() {
        let e = parse_numa_maps(SAMPLE, 0x7f00_0000_0000, 0x7f00_0080_0000).unwrap();
        assert_eq!(e.policy, "bind:0");
        assert!(e.huge);
        assert_eq!(e.kernel_page_size_bytes, 2 << 20);
        assert_eq!(e.pages_by_node, BTreeMap::from([(0, 4)]));
    }

    #[test]
    fn parses_counts_on_several_nodes_and_misses_absent_ranges() {
        let e = parse_numa_maps(SAMPLE, 0x7f00_4000_0000, 0x7f00_8000_0000).unwrap();
        assert!(!e.huge);
        assert_eq!(e.pages_by_node, BTreeMap::from([(0, 10), (1, 2)]));
        assert!(parse_numa_maps(SAMPLE, 0x1000, 0x2000).is_none());
    }

    fn sample_audit(
        by_node: &[(u32, u64)],
        policy: &str,
        nm: Option<NumaMapsEntry>,
    ) -> RegionAudit {
        let mut a = RegionAudit {
            cell: 0,
            gpa: 0,
            size_bytes: 8 << 20,
            host_addr: 0,
            page_size_bytes: 2 << 20,
            expected_node: Some(0),
            expected_policy: "bind:0".to_string(),
            allowed_nodes: vec![0],
            policy: policy.to_string(),
            pages: 4,
            pages_by_node: by_node.iter().copied().collect(),
            pages_not_present: 4 - by_node.iter().map(|x| x.1).sum::<u64>(),
            numa_maps: nm,
            violations: Vec::new(),
        };
        check_region(&mut a, true);
        a
    }

    #[test]
    fn clean_region_has_no_violation() {
        let nm = parse_numa_maps(SAMPLE, 0x7f00_0000_0000, 0x7f00_0000_0001);
        let a = sample_audit(&[(0, 4)], "bind:0", nm);
        assert!(a.violations.is_empty(), "{:?}", a.violations);
        assert_eq!(a.fraction_on_node(), 1.0);
    }

    #[test]
    fn off_node_missing_and_mismatched_pages_are_violations() {
        let nm = NumaMapsEntry {
            policy: "default".into(),
            huge: false,
            kernel_page_size_bytes: 4096,
            pages_by_node: BTreeMap::from([(0, 512)]),
        };
        let a = sample_audit(&[(0, 2), (1, 1)], "default", Some(nm));
        let kinds: Vec<String> = a.violations.iter().map(|v| v.to_string()).collect();
        assert_eq!(a.violations.len(), 5, "{kinds:?}");
        assert!(a.violations.contains(&Violation::NotPresent { pages: 1 }));
        assert!(a
            .violations
            .contains(&Violation::PagesOffNode { node: 1, pages: 1 }));
        assert!(a.violations.contains(&Violation::Policy {
            expected: "bind:0".into(),
            found: "default".into()
        }));
        assert!(a.violations.contains(&Violation::PageSize {
            expected_bytes: 2 << 20,
            found_bytes: 4096
        }));
        assert!(matches!(
            a.violations[4],
            Violation::NumaMapsDisagree { .. }
        ));
        assert_eq!(a.fraction_on_node(), 0.5);
        let audit = Audit { regions: vec![a] };
        assert!(!audit.is_clean());
        assert_eq!(audit.violations().count(), 5);
        let missing = sample_audit(&[(0, 4)], "bind:0", None);
        assert_eq!(missing.violations, vec![Violation::NumaMapsMissing]);
    }

    #[test]
    fn interleaved_region_accepts_pages_on_every_policy_node() {
        let nm = NumaMapsEntry {
            policy: "interleave:0-1".into(),
            huge: true,
            kernel_page_size_bytes: 2 << 20,
            pages_by_node: BTreeMap::from([(0, 2), (1, 2)]),
        };
        let mut a = sample_audit(&[(0, 2), (1, 2)], "interleave:0,1", Some(nm));
        a.expected_policy = "interleave:0,1".into();
        a.allowed_nodes = vec![0, 1];
        check_region(&mut a, true);
        assert!(a.violations.is_empty(), "{:?}", a.violations);
        assert_eq!(a.fraction_on_node(), 1.0);
        // The same pages under the plan's bind to node 0: node 1 is off-node.
        a.expected_policy = "bind:0".into();
        a.allowed_nodes = vec![0];
        check_region(&mut a, true);
        assert!(a
            .violations
            .contains(&Violation::PagesOffNode { node: 1, pages: 2 }));
        assert_eq!(a.fraction_on_node(), 0.5);
    }

    #[test]
    fn policy_strings_match_numa_maps_spelling() {
        assert_eq!(policy_string(sys::MPOL_BIND, &[0]), "bind:0");
        assert_eq!(policy_string(sys::MPOL_DEFAULT, &[]), "default");
        assert_eq!(
            policy_string(sys::MPOL_INTERLEAVE, &[0, 1]),
            "interleave:0,1"
        );
    }
}
