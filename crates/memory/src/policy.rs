//! Memory-policy overrides: a policy applied to every cell instead of the plan's
//! `MPOL_BIND` to the cell's node, for experiments such as the NUMA benchmark's `interleave`
//! scenario.
//!
//! This module owns the override type, its spelling as `/proc/self/numa_maps` prints it, and
//! the parsing of that spelling (numa_maps prints node lists as ranges: `interleave:0-1`).

use serde::Serialize;

use crate::sys;

/// A memory policy used instead of `MPOL_BIND` to each cell's host node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "nodes", rename_all = "snake_case")]
pub enum PolicyOverride {
    /// `MPOL_INTERLEAVE` over these host nodes: pages are placed round-robin, page by page.
    Interleave(Vec<u32>),
}

impl PolicyOverride {
    /// The `MPOL_*` mode.
    pub fn mode(&self) -> i32 {
        match self {
            PolicyOverride::Interleave(_) => sys::MPOL_INTERLEAVE,
        }
    }

    /// The nodes of the policy, ascending and without duplicates.
    pub fn nodes(&self) -> Vec<u32> {
        let PolicyOverride::Interleave(nodes) = self;
        let mut nodes = nodes.clone();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// The policy as the audit spells it (`interleave:0,1`), see [`policy_string`].
    pub fn policy_string(&self) -> String {
        policy_string(self.mode(), &self.nodes())
    }
}

/// Formats a policy like `numa_maps` does, with the node list spelled out (`bind:0`,
/// `interleave:0,1`, `default`), where `numa_maps` itself would print ranges (`0-1`).
pub fn policy_string(mode: i32, nodes: &[u32]) -> String {
    let name = sys::policy_name(mode);
    if nodes.is_empty() || mode == sys::MPOL_DEFAULT || mode == sys::MPOL_LOCAL {
        return name.to_string();
    }
    let list: Vec<String> = nodes.iter().map(u32::to_string).collect();
    format!("{name}:{}", list.join(","))
}

/// Rewrites a policy as `numa_maps` prints it (`interleave:0-2,5`, `bind=static:1`) into the
/// spelling of [`policy_string`] (`interleave:0,1,2,5`, `bind=static:1`), so the two compare.
/// Text that is not a node list is returned as it is.
pub fn normalize_numa_maps_policy(text: &str) -> String {
    let Some((mode, list)) = text.split_once(':') else {
        return text.to_string();
    };
    let mut nodes = Vec::new();
    for part in list.split(',') {
        let range = match part.split_once('-') {
            Some((a, b)) => a.parse::<u32>().ok().zip(b.parse::<u32>().ok()),
            None => part.parse::<u32>().ok().map(|n| (n, n)),
        };
        match range {
            Some((a, b)) if a <= b => nodes.extend(a..=b),
            _ => return text.to_string(),
        }
    }
    let list: Vec<String> = nodes.iter().map(u32::to_string).collect();
    format!("{mode}:{}", list.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_is_spelled_like_numa_maps() {
        let p = PolicyOverride::Interleave(vec![1, 0, 1]);
        assert_eq!(p.mode(), sys::MPOL_INTERLEAVE);
        assert_eq!(p.nodes(), vec![0, 1]);
        assert_eq!(p.policy_string(), "interleave:0,1");
        assert_eq!(policy_string(sys::MPOL_BIND, &[0]), "bind:0");
        assert_eq!(policy_string(sys::MPOL_DEFAULT, &[]), "default");
    }

    #[test]
    fn numa_maps_ranges_are_expanded() {
        assert_eq!(
            normalize_numa_maps_policy("interleave:0-1"),
            "interleave:0,1"
        );
        assert_eq!(normalize_numa_maps_policy("bind:0-2,5"), "bind:0,1,2,5");
        assert_eq!(normalize_numa_maps_policy("interleave:0"), "interleave:0");
        assert_eq!(normalize_numa_maps_policy("default"), "default");
        assert_eq!(normalize_numa_maps_policy("bind:x"), "bind:x");
        assert_eq!(normalize_numa_maps_policy("bind:3-1"), "bind:3-1");
    }

    #[test]
    fn serializes_with_its_nodes() {
        let json = serde_json::to_string(&PolicyOverride::Interleave(vec![0, 1])).unwrap();
        assert_eq!(json, r#"{"kind":"interleave","nodes":[0,1]}"#);
    }
}
