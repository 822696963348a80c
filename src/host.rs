//! Building the host topology from the command line.

use anyhow::{bail, Context, Result};
use vmhost_topology::{
    apply_hugepages, cpulist, discover, load_synthetic, load_xml, parse_hugepages_arg,
    restrict_allowed, HostTopology,
};

use crate::cli::HostArgs;

/// Loads the host named by `--topology` (this host when absent), then applies `--hugepages`
/// and `--allowed-cpus`.
pub fn load(args: &HostArgs) -> Result<HostTopology> {
    load_source(args.topology.as_deref(), args)
}

/// Like [`load`], with the topology source given separately.
pub fn load_source(topology: Option<&str>, args: &HostArgs) -> Result<HostTopology> {
    let mut host = match topology {
        None => discover().context("discovering this host's topology")?,
        Some(t) => match t.strip_prefix("synthetic:") {
            Some(desc) => load_synthetic(desc.trim_matches('"'))
                .with_context(|| format!("loading --topology {t}"))?,
            None => load_xml(std::path::Path::new(t))
                .with_context(|| format!("loading --topology {t}"))?,
        },
    };
    if !args.hugepages.is_empty() {
        if topology.is_none() {
            bail!("--hugepages describes a loaded host; this host's pools are read from sysfs (drop --hugepages or add --topology)");
        }
        for arg in &args.hugepages {
            let pools = parse_hugepages_arg(arg).context("--hugepages")?;
            apply_hugepages(&mut host, &pools).context("--hugepages")?;
        }
    }
    if let Some(list) = &args.allowed_cpus {
        let cpus = cpulist::parse(list).with_context(|| format!("--allowed-cpus {list}"))?;
        restrict_allowed(&mut host, &cpus).with_context(|| format!("--allowed-cpus {list}"))?;
    }
    Ok(host)
}
