//! Which host node holds each cell of a saved guest ([`crate::plan_for_guest`]).
//!
//! Every cell goes to one node with room for its vCPUs (free PUs) and, together with the other
//! cells placed there, its memory (free pages of the guest's page size). Among the assignments
//! that fit, the best is, in order:
//! 1. the fewest ordered cell pairs whose host distance differs from the guest's;
//! 2. the smallest sum of those differences;
//! 3. the fewest cells sharing a node with another;
//! 4. host order (the earliest nodes for the earliest cells).
//!
//! The search is a depth-first walk over cells in order and nodes in host order, cut where a
//! partial assignment already ranks below the best one, and stopped at the first perfect one
//! (the walk's order makes it the best). It visits at most [`BUDGET`] partial assignments.

use vmhost_topology::HostTopology;

/// Most partial assignments the search visits.
const BUDGET: u32 = 200_000;

/// What one cell needs on its node.
#[derive(Debug, Clone)]
pub struct Demand {
    /// PUs (its vCPUs).
    pub pus: u32,
    /// Memory in pages of the guest's page size.
    pub pages: u64,
    /// The distances the guest was given from this cell to every cell.
    pub distances: Vec<u32>,
}

/// What one host node offers.
#[derive(Debug, Clone)]
pub struct Room {
    /// Node OS index.
    pub node: u32,
    /// Free PUs.
    pub pus: u32,
    /// Free pages (`u64::MAX`: unknown, taken as unlimited).
    pub pages: u64,
}

/// (differing pairs, sum of differences, shared cells).
type Score = (u32, u64, u32);

struct Search<'a> {
    demand: &'a [Demand],
    rooms: &'a [Room],
    host: &'a HostTopology,
    pus: Vec<u32>,
    pages: Vec<u64>,
    pick: Vec<usize>,
    best: Option<(Score, Vec<usize>)>,
    steps: u32,
}

/// The node (OS index) of each cell, or `None` when no assignment fits.
pub fn choose(demand: &[Demand], rooms: &[Room], host: &HostTopology) -> Option<Vec<u32>> {
    let mut s = Search {
        demand,
        rooms,
        host,
        pus: rooms.iter().map(|r| r.pus).collect(),
        pages: rooms.iter().map(|r| r.pages).collect(),
        pick: Vec::with_capacity(demand.len()),
        best: None,
        steps: 0,
    };
    s.walk((0, 0, 0));
    s.best
        .map(|(_, pick)| pick.iter().map(|&r| rooms[r].node).collect())
}

impl Search<'_> {
    fn done(&self) -> bool {
        self.steps >= BUDGET || self.best.as_ref().is_some_and(|(s, _)| *s == (0, 0, 0))
    }

    fn walk(&mut self, score: Score) {
        if self.done() {
            return;
        }
        self.steps += 1;
        if self.best.as_ref().is_some_and(|(b, _)| score >= *b) {
            return;
        }
        let cell = self.pick.len();
        let Some(d) = self.demand.get(cell) else {
            self.best = Some((score, self.pick.clone()));
            return;
        };
        for r in 0..self.rooms.len() {
            if self.pus[r] < d.pus || self.pages[r] < d.pages {
                continue;
            }
            let next = self.add(score, cell, r);
            self.pus[r] -= d.pus;
            if self.pages[r] != u64::MAX {
                self.pages[r] -= d.pages;
            }
            self.pick.push(r);
            self.walk(next);
            self.pick.pop();
            self.pus[r] += d.pus;
            if self.pages[r] != u64::MAX {
                self.pages[r] += d.pages;
            }
            if self.done() {
                return;
            }
        }
    }

    /// The score after cell `cell` goes to room `r`: the pairs it forms with the cells placed.
    fn add(&self, mut score: Score, cell: usize, r: usize) -> Score {
        let node = self.rooms[r].node;
        let mut shared = false;
        for (other, &o) in self.pick.iter().enumerate() {
            let onode = self.rooms[o].node;
            shared |= o == r;
            for (from, to, a, b) in [(cell, other, node, onode), (other, cell, onode, node)] {
                let guest = self.demand[from].distances.get(to).copied().unwrap_or(10);
                let h = self.host.distance(a, b);
                if guest != h {
                    score.0 += 1;
                    score.1 += u64::from(guest.abs_diff(h));
                }
            }
        }
        score.2 += u32::from(shared);
        score
    }
}
