//! Node-set selection for dedicated placement: which host nodes hold a VM's vCPUs, how many
//! guest cores each takes, and (with NUMA passthrough) whether each node's share of the memory
//! fits its free pages.
//!
//! Candidates are ranked, best first, by (docs/placement.md, "Choosing the nodes"):
//! 1. guest cores that get a whole sibling group (a host core with `threads` free PUs);
//! 2. the fewest nodes;
//! 3. memory on the vCPUs' nodes (without passthrough: pages that would spill elsewhere);
//! 4. the closest nodes (sum of the distances between them);
//! 5. guest sockets kept whole on one node;
//! 6. the isolated emulator on vCPU 0's node;
//! 7. host order.
//!
//! With NUMA passthrough a node can take `g` guest cores only when its share of the memory,
//! split in proportion to vCPUs, fits its free pages; that makes a set feasible exactly when
//! the per-node caps add up to the guest cores, so trying, for every set size, the set of the
//! largest caps finds a feasible set whenever one exists. Small hosts are searched
//! exhaustively; large ones per size from every node with its nearest neighbours, plus the
//! largest-caps set.

use std::cmp::Reverse;

use vmhost_topology::HostTopology;

/// Enumerate every node set of a size when there are at most this many.
const EXHAUSTIVE: u64 = 2000;

/// What one host node offers this VM.
#[derive(Debug, Clone)]
pub struct NodeStat {
    /// Host node OS index.
    pub node: u32,
    /// Free PUs.
    pub free: u32,
    /// Guest cores that fit whole on one host core each (`Σ ⌊free PUs of a core / threads⌋`).
    pub whole: u32,
    /// Free pages of the VM's page size (4 KiB units for anonymous memory; `u64::MAX` when
    /// unknown).
    pub pages: u64,
}

/// What the VM asks for.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// Guest cores (groups of `threads` vCPUs).
    pub groups: u32,
    /// Threads per guest core.
    pub threads: u32,
    /// Guest cores per socket.
    pub cores_per_socket: u32,
    /// PUs of the isolated emulator (0, 1 or 2).
    pub emulator: u32,
    /// Guest memory in pages.
    pub pages: u64,
    /// Guest cells follow host nodes: a node's memory share must fit its pages, and a guest
    /// core may not straddle nodes.
    pub passthrough: bool,
}

impl Request {
    fn vcpus(&self) -> u64 {
        u64::from(self.groups) * u64::from(self.threads)
    }

    /// Guest cores `s` can take with its memory share in proportion (passthrough), else its
    /// free PUs in whole guest cores.
    pub(crate) fn cap(&self, s: &NodeStat) -> u32 {
        self.cap_with(s, false)
    }

    /// [`Request::cap`]; `loose`: the most guest cores whose share can fit when it is rounded
    /// down (`⌊P·g·t / n⌋ ≤ pages`) rather than up (`⌈P·g·t / n⌉ ≤ pages`, always safe).
    fn cap_with(&self, s: &NodeStat, loose: bool) -> u32 {
        let cpu = s.free / self.threads.max(1);
        if !self.passthrough || self.pages == 0 || s.pages == u64::MAX {
            return cpu;
        }
        let den = u128::from(self.pages) * u128::from(self.threads.max(1));
        let mem = if loose {
            // P·g·t / n < pages + 1  ⇔  g < (pages + 1)·n / (P·t).
            (u128::from(s.pages) + 1) * u128::from(self.vcpus()) - 1
        } else {
            u128::from(s.pages) * u128::from(self.vcpus())
        } / den;
        cpu.min(u32::try_from(mem).unwrap_or(u32::MAX))
    }
}

/// A chosen node set: guest cores per node, in host order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// (node, guest cores taken whole from it) in host order, every count > 0.
    pub take: Vec<(u32, u32)>,
    /// Guest cores that straddle nodes (without passthrough only).
    pub straddling: u32,
}

type Score = (u32, usize, u64, u64, u32, bool, Vec<u32>);

/// Picks the best node set, or `None` when no set of nodes can hold the VM.
pub fn choose(stats: &[NodeStat], host: &HostTopology, req: &Request) -> Option<Choice> {
    let n = stats.len();
    let caps: Vec<u32> = stats.iter().map(|s| req.cap(s)).collect();
    // Feasibility bounds use the loose caps (a share may round down).
    let bound: Vec<u32> = stats.iter().map(|s| req.cap_with(s, true)).collect();
    // The k nodes of the largest capacities: feasible when any k-set is.
    let mut by_cap: Vec<usize> = (0..n).collect();
    if req.passthrough {
        by_cap.sort_by_key(|&i| {
            (
                Reverse(bound[i]),
                Reverse(caps[i]),
                Reverse(stats[i].free),
                i,
            )
        });
    } else {
        by_cap.sort_by_key(|&i| (Reverse(stats[i].free), Reverse(caps[i]), i));
    }
    let mut best: Option<(Score, Choice)> = None;
    for k in 1..=n {
        if best.as_ref().is_some_and(|(s, _)| s.0 == 0) {
            break; // every guest core already whole: more nodes cannot rank higher
        }
        let top: Vec<usize> = by_cap[..k].to_vec();
        if !could_hold(stats, &bound, &top, req) {
            continue;
        }
        let mut consider = |set: &[usize]| {
            let mut sorted = set.to_vec();
            sorted.sort_unstable();
            if let Some(c) = evaluate(stats, &caps, &sorted, host, req) {
                if best.as_ref().is_none_or(|(s, _)| c.0 < *s) {
                    best = Some(c);
                }
            }
        };
        consider(&top);
        if binomial(n as u64, k as u64) <= EXHAUSTIVE {
            for_each_subset(n, k, &mut consider);
        } else {
            for seed in 0..n {
                consider(&nearest(stats, &caps, host, seed, k));
            }
        }
    }
    best.map(|(_, c)| c)
}

/// Whether the nodes `set` could hold the vCPUs at all (ignoring the ranking).
fn could_hold(stats: &[NodeStat], caps: &[u32], set: &[usize], req: &Request) -> bool {
    if req.passthrough {
        set.iter().map(|&i| u64::from(caps[i])).sum::<u64>() >= u64::from(req.groups)
    } else {
        set.iter().map(|&i| u64::from(stats[i].free)).sum::<u64>() >= req.vcpus()
    }
}

/// `seed` and its `k - 1` nearest nodes (then the largest caps, then host order).
fn nearest(
    stats: &[NodeStat],
    caps: &[u32],
    host: &HostTopology,
    seed: usize,
    k: usize,
) -> Vec<usize> {
    let mut others: Vec<usize> = (0..stats.len()).filter(|&i| i != seed).collect();
    others.sort_by_key(|&i| {
        (
            host.distance(stats[seed].node, stats[i].node),
            Reverse(caps[i]),
            i,
        )
    });
    let mut set = vec![seed];
    set.extend(others.into_iter().take(k - 1));
    set
}

/// Calls `f` with every `k`-subset of `0..n`, ascending.
fn for_each_subset(n: usize, k: usize, f: &mut impl FnMut(&[usize])) {
    let mut idx: Vec<usize> = (0..k).collect();
    loop {
        f(&idx);
        let Some(i) = (0..k).rev().find(|&i| idx[i] != i + n - k) else {
            return;
        };
        idx[i] += 1;
        for j in i + 1..k {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

fn binomial(n: u64, k: u64) -> u64 {
    let k = k.min(n - k);
    let mut r: u64 = 1;
    for i in 0..k {
        r = r.saturating_mul(n - i) / (i + 1);
        if r > EXHAUSTIVE {
            return r;
        }
    }
    r
}

/// Distributes the guest cores over `set` (host order) and scores the result.
fn evaluate(
    stats: &[NodeStat],
    caps: &[u32],
    set: &[usize],
    host: &HostTopology,
    req: &Request,
) -> Option<(Score, Choice)> {
    let loose: Vec<u32> = stats.iter().map(|s| req.cap_with(s, true)).collect();
    if !could_hold(stats, &loose, set, req) {
        // Too few free PUs in the set: its guest cores would be left without PUs.
        return None;
    }
    let mut candidates = Vec::new();
    for caps in [caps, &loose] {
        for sockets_first in [true, false] {
            candidates.push(distribute(stats, caps, set, req, sockets_first));
        }
        candidates.push(round_robin(caps, set, req));
    }
    let fitting = |g: &Vec<u32>| memory_fits(stats, set, g, req);
    if req.passthrough && !candidates.iter().any(fitting) {
        // Filling nodes in order can give one node more than its pages while a spread would
        // fit (6 vCPUs, 4 pages, one page per node: 2+2+1+1 fits, 2+2+2 does not).
        candidates.extend(any_fitting(stats, &loose, set, req));
    }
    candidates
        .iter()
        .filter(|g| fitting(g))
        .map(|g| score(stats, set, g, host, req))
        .min_by(|a, b| a.0.cmp(&b.0))
}

/// One guest core to each node of `set` in turn (host order), within `caps`.
fn round_robin(caps: &[u32], set: &[usize], req: &Request) -> Vec<u32> {
    let mut g = vec![0u32; set.len()];
    let mut left = req.groups;
    while left > 0 {
        let mut placed = false;
        for (j, &i) in set.iter().enumerate() {
            if left > 0 && g[j] < caps[i] {
                g[j] += 1;
                left -= 1;
                placed = true;
            }
        }
        if !placed {
            break;
        }
    }
    g
}

/// Most distributions an exhaustive search over a node set tries.
const EXHAUSTIVE_SPLITS: u64 = 20_000;

/// Some distribution of every guest core over `set` within `caps` whose memory shares fit,
/// searched exhaustively when the set is small enough ([`EXHAUSTIVE_SPLITS`]).
fn any_fitting(stats: &[NodeStat], caps: &[u32], set: &[usize], req: &Request) -> Option<Vec<u32>> {
    set.iter()
        .map(|&i| u64::from(caps[i]) + 1)
        .try_fold(1u64, |acc, c| {
            acc.checked_mul(c).filter(|&v| v <= EXHAUSTIVE_SPLITS)
        })?;
    fn rec(
        j: usize,
        left: u32,
        g: &mut Vec<u32>,
        bounds: &[u32],
        ok: &mut dyn FnMut(&[u32]) -> bool,
    ) -> bool {
        if j == bounds.len() {
            return left == 0 && ok(g);
        }
        for x in (0..=bounds[j].min(left)).rev() {
            g.push(x);
            if rec(j + 1, left - x, g, bounds, ok) {
                return true;
            }
            g.pop();
        }
        false
    }
    let bounds: Vec<u32> = set.iter().map(|&i| caps[i]).collect();
    let mut g = Vec::with_capacity(set.len());
    rec(0, req.groups, &mut g, &bounds, &mut |g| {
        memory_fits(stats, set, g, req)
    })
    .then_some(g)
}

/// With passthrough: every guest core placed, and each node's share of the memory (split in
/// proportion to its vCPUs) within its free pages.
fn memory_fits(stats: &[NodeStat], set: &[usize], g: &[u32], req: &Request) -> bool {
    if !req.passthrough {
        return true;
    }
    if g.iter().sum::<u32>() != req.groups {
        return false;
    }
    let used: Vec<(usize, u64)> = set
        .iter()
        .zip(g)
        .filter(|&(_, &gi)| gi > 0)
        .map(|(&i, &gi)| (i, u64::from(gi) * u64::from(req.threads)))
        .collect();
    if used.len() > 1 && req.pages < used.len() as u64 {
        return false;
    }
    let weights: Vec<u64> = used.iter().map(|&(_, v)| v).collect();
    split_pages(req.pages, &weights)
        .iter()
        .zip(&used)
        .all(|(&p, &(i, _))| p <= stats[i].pages)
}

/// Guest cores per node of `set`: whole guest sockets first (when `sockets_first`), then
/// whole sibling groups, then any room, each pass in host order.
fn distribute(
    stats: &[NodeStat],
    caps: &[u32],
    set: &[usize],
    req: &Request,
    sockets_first: bool,
) -> Vec<u32> {
    let mut g = vec![0u32; set.len()];
    let mut left = req.groups;
    let per_socket = req.cores_per_socket.max(1);
    if sockets_first && req.groups > per_socket {
        for (j, &i) in set.iter().enumerate() {
            let sockets = (caps[i] / per_socket).min(left / per_socket);
            g[j] = sockets * per_socket;
            left -= g[j];
        }
    }
    for whole_pass in [true, false] {
        for (j, &i) in set.iter().enumerate() {
            let room = if whole_pass {
                stats[i].whole.min(caps[i])
            } else {
                caps[i]
            };
            let add = room.saturating_sub(g[j]).min(left);
            g[j] += add;
            left -= add;
        }
    }
    g
}

fn score(
    stats: &[NodeStat],
    set: &[usize],
    g: &[u32],
    host: &HostTopology,
    req: &Request,
) -> (Score, Choice) {
    let placed: u32 = g.iter().sum();
    let straddling = req.groups - placed;
    let whole: u32 = set
        .iter()
        .zip(g)
        .map(|(&i, &gi)| gi.min(stats[i].whole))
        .sum();
    let used: Vec<usize> = set
        .iter()
        .zip(g)
        .filter(|&(_, &gi)| gi > 0)
        .map(|(&i, _)| i)
        .collect();
    // Without passthrough, leftover PUs of the set take the straddling guest cores.
    let used = if straddling > 0 { set.to_vec() } else { used };
    let local_pages: u64 = used
        .iter()
        .map(|&i| stats[i].pages)
        .fold(0, u64::saturating_add);
    let spill = req.pages.saturating_sub(local_pages);
    let mut distance = 0u64;
    for (a, &i) in used.iter().enumerate() {
        for &j in &used[a + 1..] {
            distance += u64::from(host.distance(stats[i].node, stats[j].node));
        }
    }
    // Guest sockets whole: vCPUs go node by node in host order.
    let per_socket = req.cores_per_socket.max(1);
    let mut broken = 0u32;
    let mut start = 0u32;
    for &gi in g.iter().filter(|&&gi| gi > 0) {
        let end = start + gi;
        if start % per_socket != 0 || (end % per_socket != 0 && end != req.groups) {
            broken += 1;
        }
        start = end;
    }
    let emu_remote = used.first().is_some_and(|&i| {
        let j = set.iter().position(|&s| s == i).unwrap_or(0);
        stats[i].free < g[j] * req.threads + req.emulator
    });
    let nodes: Vec<u32> = used.iter().map(|&i| stats[i].node).collect();
    let take = set
        .iter()
        .zip(g)
        .filter(|&(_, &gi)| gi > 0 || straddling > 0)
        .map(|(&i, &gi)| (stats[i].node, gi))
        .collect();
    (
        (
            req.groups - whole,
            used.len(),
            spill,
            distance,
            broken,
            emu_remote,
            nodes,
        ),
        Choice { take, straddling },
    )
}

/// Splits `pages` in proportion to `weights`, in whole pages: each share is the floor or the
/// ceiling of its exact value; the pages left after the floors go to the largest fractions,
/// the lower index first on ties (so equal weights give KubeVirt's even split: the first
/// cells get one page more). A non-zero weight never gets zero pages while another share has
/// more than one.
pub fn split_pages(pages: u64, weights: &[u64]) -> Vec<u64> {
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    if total == 0 {
        return vec![0; weights.len()];
    }
    let p = u128::from(pages);
    let mut shares: Vec<u64> = Vec::with_capacity(weights.len());
    let mut fractions: Vec<(u128, usize)> = Vec::with_capacity(weights.len());
    for (i, &w) in weights.iter().enumerate() {
        let exact = p * u128::from(w);
        shares.push(u64::try_from(exact / total).unwrap_or(u64::MAX));
        fractions.push((exact % total, i));
    }
    let mut left = pages - shares.iter().sum::<u64>();
    fractions.sort_by_key(|&(f, i)| (Reverse(f), i));
    for &(_, i) in &fractions {
        if left == 0 {
            break;
        }
        shares[i] += 1;
        left -= 1;
    }
    // Every weighted share gets a page when there are enough.
    for i in 0..shares.len() {
        if weights[i] > 0 && shares[i] == 0 {
            if let Some(big) = (0..shares.len()).max_by_key(|&j| (shares[j], Reverse(j))) {
                if shares[big] > 1 {
                    shares[big] -= 1;
                    shares[i] = 1;
                }
            }
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_kubevirt_even_for_equal_weights() {
        assert_eq!(split_pages(32, &[1, 1, 1]), vec![11, 11, 10]);
        assert_eq!(split_pages(8, &[2, 2]), vec![4, 4]);
    }

    #[test]
    fn split_follows_vcpus() {
        assert_eq!(split_pages(8, &[6, 2]), vec![6, 2]);
        assert_eq!(split_pages(10, &[6, 2]), vec![8, 2]);
        // 7.5 / 2.5: the larger fraction first, ties to the lower index.
        assert_eq!(split_pages(10, &[3, 1]), vec![8, 2]);
        assert_eq!(split_pages(2, &[7, 1]), vec![1, 1]);
        assert_eq!(split_pages(5, &[0, 1]), vec![0, 5]);
    }

    #[test]
    fn subsets_are_all_visited_once() {
        let mut seen = Vec::new();
        for_each_subset(5, 3, &mut |s: &[usize]| seen.push(s.to_vec()));
        assert_eq!(seen.len(), 10);
        assert_eq!(seen[0], vec![0, 1, 2]);
        assert_eq!(seen[9], vec![2, 3, 4]);
        assert!(
            binomial(16, 8) > EXHAUSTIVE,
            "stops counting past the budget"
        );
        assert_eq!(binomial(16, 2), 120);
        assert_eq!(binomial(16, 4), 1820);
    }
}
