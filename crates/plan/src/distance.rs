//! The distances between guest cells as the guest is told them (its SLIT) and as the host has
//! them between the nodes that back the cells.
//!
//! A fresh plan tells the guest the host's distances, so the two agree. A plan that keeps a
//! saved guest ([`crate::plan_for_guest`]) tells the guest what it was told before; the
//! report here says where the host now differs.

use std::fmt;

use serde::{Deserialize, Serialize};
use vmhost_topology::HostTopology;

use crate::model::GuestCell;

/// One ordered pair of guest cells whose host distance differs from the guest's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DistanceDiff {
    /// Guest cells (from, to).
    pub cells: [u32; 2],
    /// Their host nodes (from, to).
    pub host_nodes: [u32; 2],
    /// The distance the guest is given.
    pub guest: u32,
    /// The host's distance between the two nodes.
    pub host: u32,
}

impl fmt::Display for DistanceDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "guest cells {}→{} are {} apart, their host nodes node{}→node{} {}",
            self.cells[0],
            self.cells[1],
            self.guest,
            self.host_nodes[0],
            self.host_nodes[1],
            self.host
        )
    }
}

/// The host's distances between the guest cells' nodes and how they compare with the guest's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellDistances {
    /// `host[i][j]`: the host's distance from cell i's node to cell j's node; `None` when a
    /// cell is not bound to one node (unbound, or its memory spans nodes).
    pub host: Vec<Vec<Option<u32>>>,
    /// Every ordered pair of distinct cells whose host distance differs from the guest's,
    /// row by row.
    pub diff: Vec<DistanceDiff>,
}

impl CellDistances {
    /// Compares the guest's distances (`cells[i].distances`) with `host`'s between the cells'
    /// nodes.
    pub fn of(host: &HostTopology, cells: &[GuestCell]) -> CellDistances {
        let mut out = CellDistances::default();
        for a in cells {
            let mut row = Vec::with_capacity(cells.len());
            for (j, b) in cells.iter().enumerate() {
                let d = match (a.host_node, b.host_node) {
                    (Some(x), Some(y)) => Some((x, y, host.distance(x, y))),
                    _ => None,
                };
                row.push(d.map(|(_, _, d)| d));
                let guest = a.distances.get(j).copied();
                if let (Some((x, y, h)), Some(g)) = (d, guest) {
                    if a.cell != b.cell && g != h {
                        out.diff.push(DistanceDiff {
                            cells: [a.cell, b.cell],
                            host_nodes: [x, y],
                            guest: g,
                            host: h,
                        });
                    }
                }
            }
            out.host.push(row);
        }
        out
    }
}
