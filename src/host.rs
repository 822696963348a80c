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

/// This host, discovered (no `--topology`, `--hugepages` or `--allowed-cpus`).
pub fn this_host() -> Result<HostTopology> {
    load(&HostArgs::default())
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

/// When this process may use fewer PUs than the host has online (a pod's cgroup cpuset, a
/// `taskset`, `--allowed-cpus`), a sentence naming what confines it, so a refusal says why the
/// host looks smaller than it is. `None` when every online PU is allowed.
pub fn confinement(host: &HostTopology) -> Option<String> {
    if host.allowed_cpus == host.online_cpus {
        return None;
    }
    let allowed = cpulist::format(&host.allowed_cpus);
    let by = cgroup_cpuset()
        .map(|(path, cpus, mems)| {
            format!(
                "the cpuset of cgroup {path} (cpuset.cpus.effective = {cpus}, cpuset.mems.effective = {mems})"
            )
        })
        .unwrap_or_else(|| "its CPU affinity (taskset, --allowed-cpus or a parent's cpuset)".into());
    Some(format!(
        "this process may use only PUs {allowed} of the host's {}, confined by {by}",
        cpulist::format(&host.online_cpus)
    ))
}

/// This process's cgroup v2 path and its effective cpuset (`cpus`, `mems`), when the unified
/// hierarchy restricts it.
fn cgroup_cpuset() -> Option<(String, String, String)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim()
        .to_string();
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let cpus = read("cpuset.cpus.effective")?;
    let mems = read("cpuset.mems.effective")?;
    Some((path, cpus, mems))
}
