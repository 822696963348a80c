//! Hugepage pools given on the command line for loaded (XML or synthetic) hosts:
//! `node0:2Mi=512,node1:1Gi=8` → [`HugepageArg`]s → [`apply_hugepages`].

use std::str::FromStr;

use crate::{
    error::TopologyError,
    model::{HostTopology, HugepagePool},
};

/// One hugepage pool for one node: `node0:2Mi=512` = 512 free 2 MiB pages on node 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HugepageArg {
    /// OS index of the node.
    pub node: u32,
    /// Page size in bytes.
    pub page_size_bytes: u64,
    /// Pages in the pool (all free).
    pub free: u64,
}

impl FromStr for HugepageArg {
    type Err = TopologyError;

    /// Parse one `nodeN:SIZE=COUNT` item; SIZE is a number with a binary unit
    /// (`2Mi`, `2M`, `2048kB`, `1Gi`, `1G`, `1048576kB`, ...).
    fn from_str(item: &str) -> Result<Self, Self::Err> {
        let err = |reason: String| TopologyError::ParseHugepages {
            arg: item.to_owned(),
            reason,
        };
        let trimmed = item.trim();
        let (pool, count) = trimmed
            .split_once('=')
            .ok_or_else(|| err("missing '=' before the page count".to_owned()))?;
        let (node, size) = pool
            .split_once(':')
            .ok_or_else(|| err("missing ':' between the node and the page size".to_owned()))?;
        let node = node
            .trim()
            .strip_prefix("node")
            .and_then(parse_decimal::<u32>)
            .ok_or_else(|| {
                err(format!(
                    "{:?} is not a node; write node0, node1, ...",
                    node.trim()
                ))
            })?;
        let page_size_bytes = parse_page_size(size.trim()).map_err(err)?;
        let free = parse_decimal::<u64>(count.trim())
            .ok_or_else(|| err(format!("{:?} is not a page count", count.trim())))?;
        Ok(Self {
            node,
            page_size_bytes,
            free,
        })
    }
}

/// Parse a comma-separated list of pools, `node0:2Mi=512,node1:1Gi=8`. An empty list or an
/// empty item is an error.
pub fn parse_hugepages_arg(s: &str) -> Result<Vec<HugepageArg>, TopologyError> {
    if s.trim().is_empty() {
        return Err(TopologyError::ParseHugepages {
            arg: s.to_owned(),
            reason: "no pool given".to_owned(),
        });
    }
    s.split(',')
        .map(|item| {
            if item.trim().is_empty() {
                Err(TopologyError::ParseHugepages {
                    arg: s.to_owned(),
                    reason: "empty item between commas".to_owned(),
                })
            } else {
                item.parse()
            }
        })
        .collect()
}

/// Set the hugepage pools of a topology: for each argument, node `node` gets `free` pages of
/// `page_size_bytes`, all free (total = free). A repeated node and size: the last one wins.
///
/// Nothing changes unless every argument names an existing node and a size in
/// [`HostTopology::hugepage_sizes`].
pub fn apply_hugepages(topo: &mut HostTopology, args: &[HugepageArg]) -> Result<(), TopologyError> {
    for arg in args {
        if topo.node(arg.node).is_none() {
            let nodes: Vec<u32> = topo.nodes.iter().map(|n| n.os_index).collect();
            return Err(TopologyError::HugepageNode {
                node: arg.node,
                available: crate::cpulist::format(&nodes),
            });
        }
        if !topo.hugepage_sizes.contains(&arg.page_size_bytes) {
            let supported: Vec<String> =
                topo.hugepage_sizes.iter().map(|&s| size_label(s)).collect();
            return Err(TopologyError::HugepageSize {
                node: arg.node,
                page_size_bytes: arg.page_size_bytes,
                supported: if supported.is_empty() {
                    "none".to_owned()
                } else {
                    supported.join(", ")
                },
            });
        }
    }
    for arg in args {
        let Some(node) = topo.nodes.iter_mut().find(|n| n.os_index == arg.node) else {
            continue; // checked above
        };
        let pool = HugepagePool {
            page_size_bytes: arg.page_size_bytes,
            total: arg.free,
            free: arg.free,
        };
        match node
            .hugepages
            .iter_mut()
            .find(|p| p.page_size_bytes == arg.page_size_bytes)
        {
            Some(existing) => *existing = pool,
            None => node.hugepages.push(pool),
        }
        node.hugepages.sort_by_key(|p| p.page_size_bytes);
    }
    Ok(())
}

/// Binary unit suffixes accepted in page sizes, with their multipliers.
const UNITS: [(&str, u64); 10] = [
    ("KiB", 1 << 10),
    ("Ki", 1 << 10),
    ("kB", 1 << 10),
    ("K", 1 << 10),
    ("MiB", 1 << 20),
    ("Mi", 1 << 20),
    ("M", 1 << 20),
    ("GiB", 1 << 30),
    ("Gi", 1 << 30),
    ("G", 1 << 30),
];

/// Parse a page size such as `2Mi`, `2M`, `2048kB`, `1Gi`, `1G` or `1048576kB` into bytes.
fn parse_page_size(text: &str) -> Result<u64, String> {
    let bad =
        || format!("{text:?} is not a page size; write 2Mi, 2M, 2048kB, 1Gi, 1G or 1048576kB");
    let (digits, multiplier) = UNITS
        .iter()
        .find_map(|&(unit, mult)| text.strip_suffix(unit).map(|d| (d, mult)))
        .ok_or_else(bad)?;
    let n = parse_decimal::<u64>(digits).ok_or_else(bad)?;
    match n.checked_mul(multiplier) {
        Some(bytes) if bytes > 0 => Ok(bytes),
        _ => Err(bad()),
    }
}

/// A plain decimal number (digits only: no sign, no space).
fn parse_decimal<T: FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// A page size for people: `2Mi`, `1Gi`, `64Ki`, or bytes when it is not a whole unit.
pub(crate) fn size_label(bytes: u64) -> String {
    match bytes {
        0 => "0".to_owned(),
        b if b % (1 << 30) == 0 => format!("{}Gi", b >> 30),
        b if b % (1 << 20) == 0 => format!("{}Mi", b >> 20),
        b if b % (1 << 10) == 0 => format!("{}Ki", b >> 10),
        b => format!("{b}B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI2: u64 = 2 << 20;
    const GI1: u64 = 1 << 30;

    #[test]
    fn parses_all_documented_sizes() {
        for (text, bytes) in [
            ("2Mi", MI2),
            ("2M", MI2),
            ("2048kB", MI2),
            ("1Gi", GI1),
            ("1G", GI1),
            ("1048576kB", GI1),
        ] {
            let arg: HugepageArg = format!("node3:{text}=7").parse().unwrap();
            assert_eq!(
                arg,
                HugepageArg {
                    node: 3,
                    page_size_bytes: bytes,
                    free: 7
                },
                "{text}"
            );
        }
    }

    #[test]
    fn parses_lists() {
        let args = parse_hugepages_arg("node0:2Mi=512, node1:1Gi=8").unwrap();
        assert_eq!(
            args,
            [
                HugepageArg {
                    node: 0,
                    page_size_bytes: MI2,
                    free: 512
                },
                HugepageArg {
                    node: 1,
                    page_size_bytes: GI1,
                    free: 8
                }
            ]
        );
    }

    #[test]
    fn errors_name_the_item_and_the_form() {
        let cases = [
            ("node0:2Mi", "missing '='"),
            ("node0=512", "missing ':'"),
            ("nodeX:2Mi=1", "\"nodeX\" is not a node"),
            ("0:2Mi=1", "\"0\" is not a node"),
            ("node0:2Qi=1", "\"2Qi\" is not a page size"),
            ("node0:2048=1", "\"2048\" is not a page size"),
            ("node0:0Mi=1", "\"0Mi\" is not a page size"),
            ("node0:2Mi=-1", "\"-1\" is not a page count"),
            ("node0:2Mi=", "\"\" is not a page count"),
        ];
        for (text, reason) in cases {
            let e = text.parse::<HugepageArg>().unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(&format!("{text:?}")), "{msg}");
            assert!(msg.contains(reason), "{text}: {msg}");
            assert!(msg.contains("expected nodeN:SIZE=COUNT"), "{msg}");
        }
        let e = parse_hugepages_arg("node0:2Mi=1,,node1:2Mi=1").unwrap_err();
        assert!(e.to_string().contains("empty item"), "{e}");
        let e = parse_hugepages_arg(" ").unwrap_err();
        assert!(e.to_string().contains("no pool given"), "{e}");
        let e = parse_hugepages_arg("node0:2Mi=1,node1:2Mi").unwrap_err();
        assert!(e.to_string().contains("\"node1:2Mi\""), "{e}");
    }

    #[test]
    fn size_labels() {
        assert_eq!(size_label(MI2), "2Mi");
        assert_eq!(size_label(GI1), "1Gi");
        assert_eq!(size_label(64 << 10), "64Ki");
        assert_eq!(size_label(1000), "1000B");
    }
}
