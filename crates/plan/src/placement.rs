//! Dedicated CPU placement: vCPUs → host PUs, and the emulator thread's PU.
//!
//! Rules, in order of priority:
//! 1. vCPUs are pinned one-to-one to allowed, free PUs.
//! 2. A guest core's threads (`threads > 1`) land on sibling PUs of one host core whenever a
//!    core has that many free PUs.
//! 3. Whole free cores before fragmented ones (a core is fragmented when some of its PUs are
//!    not allowed or already held); the core being filled is finished before a new one opens.
//! 4. Which nodes, and how many guest cores each, is [`crate::nodeset`]'s choice. Without NUMA
//!    passthrough a guest core may straddle nodes; with it, it may not.
//! 5. The isolated emulator thread gets a PU of its own on vCPU 0's node: a PU left over in a
//!    fragmented core first, then one that breaks a whole core (KubeVirt's order); a second
//!    PU for even parity is the first one's sibling when it is free.

use std::collections::BTreeSet;

use vmhost_topology::HostTopology;

/// Free PUs of one host core.
#[derive(Debug, Clone)]
struct FreeCore {
    node: u32,
    whole: bool,
    free: Vec<u32>,
    /// Every PU of the core.
    all: Vec<u32>,
}

impl FreeCore {
    /// True when `pu` belongs to this core (it was taken from it).
    fn has_sibling(&self, pu: Option<u32>) -> bool {
        pu.is_some_and(|p| self.all.contains(&p))
    }
}

/// The host PUs a plan may take, by node and core.
#[derive(Debug, Clone)]
pub struct FreePus {
    cores: Vec<FreeCore>,
}

impl FreePus {
    /// Allowed PUs of `host` minus `held` (PUs other VMs hold).
    pub fn new(host: &HostTopology, held: &BTreeSet<u32>) -> Self {
        let allowed: BTreeSet<u32> = host.allowed_cpus.iter().copied().collect();
        let mut cores = Vec::new();
        for c in &host.cores {
            let free: Vec<u32> = c
                .pus
                .iter()
                .copied()
                .filter(|p| allowed.contains(p) && !held.contains(p))
                .collect();
            if !free.is_empty() {
                cores.push(FreeCore {
                    node: c.node,
                    whole: free.len() == c.pus.len(),
                    free,
                    all: c.pus.clone(),
                });
            }
        }
        FreePus { cores }
    }

    /// Free PU count per node, in host node order.
    pub fn per_node(&self, host: &HostTopology) -> Vec<(u32, u32)> {
        host.nodes
            .iter()
            .map(|n| (n.os_index, self.count(n.os_index)))
            .filter(|&(_, c)| c > 0)
            .collect()
    }

    fn count(&self, node: u32) -> u32 {
        let n: usize = self
            .cores
            .iter()
            .filter(|c| c.node == node)
            .map(|c| c.free.len())
            .sum();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The free PUs, ascending.
    pub fn remaining(&self) -> Vec<u32> {
        let mut pus: Vec<u32> = self.cores.iter().flat_map(|c| c.free.clone()).collect();
        pus.sort_unstable();
        pus
    }

    /// All free PUs.
    pub fn total(&self) -> u32 {
        u32::try_from(self.cores.iter().map(|c| c.free.len()).sum::<usize>()).unwrap_or(u32::MAX)
    }

    /// Core indexes of `node`, whole cores first, each group in host order.
    fn order(&self, node: u32) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.cores.len())
            .filter(|&i| self.cores[i].node == node)
            .collect();
        idx.sort_by_key(|&i| !self.cores[i].whole);
        idx
    }

    /// Takes `groups` guest cores of `threads` PUs each from `node`. Returns the PUs in vCPU
    /// order and whether some guest core had to straddle host cores. `None` when the node
    /// has too few free PUs.
    pub fn take_groups(
        &mut self,
        node: u32,
        groups: u32,
        threads: u32,
    ) -> Option<(Vec<u32>, bool)> {
        if self.count(node) < groups * threads {
            return None;
        }
        let order = self.order(node);
        let t = threads as usize;
        let mut out = Vec::new();
        let mut straddled = false;
        let mut current: Option<usize> = None;
        for _ in 0..groups {
            let pick = current
                .filter(|&i| self.cores[i].free.len() >= t)
                .or_else(|| {
                    order
                        .iter()
                        .copied()
                        .find(|&i| self.cores[i].free.len() >= t)
                });
            match pick {
                Some(i) => {
                    out.extend(self.cores[i].free.drain(..t));
                    self.cores[i].whole = false;
                    current = Some(i);
                }
                None => {
                    straddled = true;
                    let mut need = t;
                    for &i in &order {
                        while need > 0 && !self.cores[i].free.is_empty() {
                            out.push(self.cores[i].free.remove(0));
                            self.cores[i].whole = false;
                            need -= 1;
                        }
                    }
                    current = None;
                }
            }
        }
        Some((out, straddled))
    }

    /// Guest cores of `threads` PUs that fit whole on one host core each, on `node`.
    pub fn whole_groups(&self, node: u32, threads: u32) -> u32 {
        let t = threads.max(1) as usize;
        let n: usize = self
            .cores
            .iter()
            .filter(|c| c.node == node)
            .map(|c| c.free.len() / t)
            .sum();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Takes one PU for the emulator from `node`: a sibling of `near` (the emulator's first
    /// PU, when it gets two) first, then fragmented cores, then whole ones.
    pub fn take_emulator(&mut self, node: u32, near: Option<u32>) -> Option<u32> {
        let mut idx: Vec<usize> = (0..self.cores.len())
            .filter(|&i| self.cores[i].node == node && !self.cores[i].free.is_empty())
            .collect();
        // A core is fragmented for this purpose when it is not whole any more: partly held
        // before planning, or partly taken by this VM's vCPUs.
        idx.sort_by_key(|&i| (!self.cores[i].has_sibling(near), self.cores[i].whole));
        let i = *idx.first()?;
        self.cores[i].whole = false;
        Some(self.cores[i].free.remove(0))
    }
}
