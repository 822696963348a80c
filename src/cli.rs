//! Command-line interface (clap).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// vmhost: a KVM VM host manager that turns a VM spec into a pinned, NUMA-local host envelope.
#[derive(Debug, Parser)]
#[command(name = "vmhost", version, about, long_about = None)]
pub struct Cli {
    /// VM spec (TOML, or KubeVirt VirtualMachineInstance / VirtualMachine YAML). Without a
    /// subcommand, vmhost runs this VM on this host (the embedded quickstart when omitted).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Run directory of the host ledger (default: $VMHOST_RUN_DIR, else /run/vmhost).
    #[arg(long, global = true)]
    pub run_dir: Option<PathBuf>,
    /// Serve the control API (HTTP/JSON) on this Unix socket while the VM runs (mode 0600).
    #[arg(long, global = true)]
    pub api_socket: Option<PathBuf>,
    /// How the VM runs (also taken by `restore`, after it).
    #[command(flatten)]
    pub run: RunArgs,
    /// Syscall filters on every vmhost thread (docs/security.md): `on` (the default; a
    /// forbidden call kills vmhost with SIGSYS after naming the thread and the call), `log`
    /// (the kernel logs forbidden calls and lets them through) or `off`. For debugging only.
    /// Default: $VMHOST_SECCOMP, else `on`.
    #[arg(long, global = true, value_enum)]
    pub seccomp: Option<SeccompArg>,
    /// What to do.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The options of a VM run, shared by the normal start (`vmhost --config F`), `vmhost
/// restore` and (later) `vmhost receive`. The global options `--config`, `--json`,
/// `--run-dir`, `--api-socket` and `--seccomp` apply to all three as well.
#[derive(Debug, Args, Clone, PartialEq, Eq)]
pub struct RunArgs {
    /// Enforce the envelope in cgroup `vmhost/NAME`: cpuset = the plan's PUs and nodes,
    /// memory and hugetlb limits = the envelope (overrides `resources.cgroup`).
    #[arg(long)]
    pub cgroup: Option<String>,
    /// Testing aid: replace the cgroup's memory limit (bytes) to check what happens when the
    /// envelope is too small.
    #[arg(long, hide = true)]
    pub cgroup_memory_limit: Option<u64>,
    /// Hide CPU features (cx16, XSAVE, ...) from the guest that a nested KVM whose guest ring 0
    /// is emulated cannot run (for Linux guests on such hosts; see docs/host-facts).
    #[arg(long)]
    pub mask_nested_cpuid: bool,
    /// Keep the VM running when the guest touches an unknown I/O port or unmapped memory
    /// (logged); by default such an access stops the VM.
    #[arg(long)]
    pub ignore_unknown_access: bool,
    /// When guest RAM is faulted in on its nodes: every page before the guest's first
    /// instruction (`before-start`, the default), or by the same pinned workers while the guest
    /// boots (`background`: a faster start; the audit is read when they are done).
    #[arg(long, value_enum, default_value_t = PrefaultArg::BeforeStart)]
    pub prefault: PrefaultArg,
}

impl Default for RunArgs {
    fn default() -> Self {
        RunArgs {
            cgroup: None,
            cgroup_memory_limit: None,
            mask_nested_cpuid: false,
            ignore_unknown_access: false,
            prefault: PrefaultArg::BeforeStart,
        }
    }
}

/// `vmhost restore`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// The snapshot directory (`vmhost ctl … snapshot DIR`).
    pub dir: PathBuf,
    /// Refuse to restore when the host nodes chosen for the guest's cells are not as far apart
    /// as the distances the guest was told (without it they are reported and accepted).
    #[arg(long)]
    pub same_distances: bool,
    /// How the restored VM runs.
    #[command(flatten)]
    pub run: RunArgs,
}

/// `vmhost ctl`.
#[derive(Debug, Args)]
pub struct CtlArgs {
    /// `info` (GET /vm), `placement`, `resources`, `pause`, `resume`, `shutdown`,
    /// `snapshot DIR [--stop]` or `migrate unix:PATH|tcp:ADDR:PORT --auth-key FILE` (jobs:
    /// polled until they end, progress on stderr, the report on stdout).
    #[arg(value_parser = ["info", "placement", "resources", "pause", "resume", "shutdown", "snapshot", "migrate"])]
    pub command: String,
    /// `snapshot`: the directory to create (it must not exist); `migrate`: where the target
    /// listens.
    pub dir: Option<PathBuf>,
    /// `snapshot`: end the VM after the snapshot instead of resuming it.
    #[arg(long)]
    pub stop: bool,
    /// `migrate`: the pre-shared key file (at least 32 bytes; the same on both sides).
    #[arg(long)]
    pub auth_key: Option<PathBuf>,
    /// `migrate`: the longest pause accepted for the final round, ms.
    #[arg(long, default_value_t = 300)]
    pub max_downtime: u64,
    /// `migrate`: give up pre-copy after this many seconds (the VM runs on here).
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

/// `vmhost receive`.
#[derive(Debug, Args)]
pub struct ReceiveArgs {
    /// Where to listen: `unix:PATH` (created 0600) or `tcp:ADDR:PORT` (that address only).
    #[arg(long)]
    pub listen: String,
    /// The pre-shared key file (the source's).
    #[arg(long)]
    pub auth_key: PathBuf,
    /// Refuse the VM unless the guest keeps the NUMA distances it was given.
    #[arg(long)]
    pub same_distances: bool,
    /// How the received VM runs.
    #[command(flatten)]
    pub run: RunArgs,
}

/// `--seccomp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SeccompArg {
    /// Filters on; a forbidden system call kills vmhost with SIGSYS.
    On,
    /// Filters on; forbidden calls are logged by the kernel and let through.
    Log,
    /// No filters.
    Off,
}

impl From<SeccompArg> for vmhost_seccomp::SeccompMode {
    fn from(a: SeccompArg) -> Self {
        match a {
            SeccompArg::On => vmhost_seccomp::SeccompMode::On,
            SeccompArg::Log => vmhost_seccomp::SeccompMode::Log,
            SeccompArg::Off => vmhost_seccomp::SeccompMode::Off,
        }
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the host topology (like `numactl -H` + `lstopo`).
    Topology(HostArgs),
    /// Plan a VM: envelope, vCPU → PU pinning, guest NUMA cells, hugepages; or why it does not fit.
    /// Exit status: 0 fits, 2 invalid spec, 3 does not fit.
    Plan(PlanArgs),
    /// Can a migration target host hold the same VM with the same guest topology?
    CheckTarget(CheckTargetArgs),
    /// Allocate, bind, prefault, audit and release the VM's guest memory on this host, timing
    /// each step (a check of the host before starting VMs). Exit 1 when the audit finds pages
    /// off their node.
    Memory(MemoryArgs),
    /// Write the guest's ACPI tables (RSDP, XSDT, FACP, DSDT, APIC, SRAT, SLIT) as .dat files,
    /// for `iasl -d` and other inspection.
    Acpi(AcpiArgs),
    /// The VMs running on this host: name, pid, state, vCPUs → PUs, emulator PUs, memory per
    /// node, API socket (from the host ledger, checked against /proc).
    Ps,
    /// Benchmarks.
    Bench {
        /// Which benchmark.
        #[command(subcommand)]
        which: BenchCommand,
    },
    /// Talk to a running VM's control API (`--api-socket PATH` of that VM).
    Ctl(CtlArgs),
    /// Start a VM again from a snapshot directory: checked whole before anything is
    /// allocated, re-planned on this host as it is now, memory loaded on the new plan's
    /// nodes, then run like a normal start. Without --config the snapshot's spec is used;
    /// with it, the two specs must be the same. Exit 2 for a damaged snapshot or a
    /// different spec.
    Restore(RestoreArgs),
    /// The target of a live migration: listen on `unix:PATH` or `tcp:ADDR:PORT`, authenticate
    /// the source with the pre-shared key, plan the same guest topology on this host, receive
    /// the memory and the state, then run the VM like a normal start (docs/migration.md).
    /// Exit non-zero when the migration fails before the guest runs here.
    Receive(ReceiveArgs),
    /// The Kubernetes objects (a ConfigMap with the spec and the Pod) that run this VM under
    /// vmhost: resources from the plan's envelope, devices, volumes and capabilities. YAML, or
    /// a JSON `v1 List` with --json.
    Pod(PodArgs),
    /// The host ledger's raw state; `vmhost ledger gc` reclaims entries of dead VMs.
    Ledger {
        /// `gc`: remove entries whose process is gone.
        #[arg(value_parser = ["gc"])]
        action: Option<String>,
    },
}

/// `vmhost acpi`.
#[derive(Debug, Args)]
pub struct AcpiArgs {
    /// Directory to write the tables into (created when missing).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// The host to plan on (default: this host).
    #[command(flatten)]
    pub plan: PlanArgs,
}

/// `vmhost memory`.
#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// Prefault workers per guest cell (default: one per usable CPU of the cell's node).
    #[arg(long)]
    pub prefault_threads: Option<usize>,
}

/// Which host to look at.
#[derive(Debug, Args, Clone, Default)]
pub struct HostArgs {
    /// Another host: an hwloc XML file (`lstopo --of xml`) or `synthetic:"package:2 numa:2 core:8 pu:2"`.
    #[arg(long)]
    pub topology: Option<String>,
    /// Free hugepages of a loaded host: `node0:2Mi=512,node1:1Gi=8` (repeatable).
    #[arg(long)]
    pub hugepages: Vec<String>,
    /// Restrict the PUs this VM may use (cpulist, e.g. `0-5,8`): a cpuset or offline CPUs.
    #[arg(long)]
    pub allowed_cpus: Option<String>,
}

/// Overhead models.
#[derive(Debug, Clone, Copy, ValueEnum, Default)]
pub enum ModelArg {
    /// vmhost's own VMM costs.
    #[default]
    Vmhost,
    /// KubeVirt's amd64 launcher-pod arithmetic.
    Kubevirt,
}

/// `vmhost plan`.
#[derive(Debug, Args, Clone, Default)]
pub struct PlanArgs {
    /// The host.
    #[command(flatten)]
    pub host: HostArgs,
    /// Overhead model.
    #[arg(long, value_enum, default_value_t)]
    pub overhead_model: ModelArg,
    /// KubeVirt's additionalGuestMemoryOverheadRatio (e.g. "1.2"), applied last.
    #[arg(long, value_parser = finite_ratio)]
    pub overhead_ratio: Option<f64>,
}

/// `vmhost check-target`.
/// `vmhost pod`.
#[derive(Debug, Args)]
pub struct PodArgs {
    /// The container image that holds the vmhost binary.
    #[arg(long)]
    pub image: String,
    /// Name of the Pod and the ConfigMap (default: the VM's name).
    #[arg(long)]
    pub name: Option<String>,
    #[command(flatten)]
    pub plan: PlanArgs,
}

#[derive(Debug, Args)]
pub struct CheckTargetArgs {
    /// The target host and planner settings.
    #[command(flatten)]
    pub plan: PlanArgs,
    /// The source host (default: this host).
    #[arg(long)]
    pub source_topology: Option<String>,
    /// Accept a target whose nodes are not as far apart as the guest's cells are told they
    /// are (the guest keeps its distances; the difference is reported in `target.distances`).
    /// By default such a target is refused.
    #[arg(long)]
    pub allow_distance_change: bool,
}

/// `vmhost bench …`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// NUMA locality from inside the guest: latency and bandwidth per vCPU × guest cell, next
    /// to the same kernels on host threads pinned to the same PUs over the same nodes.
    Numa(NumaBenchArgs),
}

/// `vmhost bench numa`.
#[derive(Debug, Args)]
pub struct NumaBenchArgs {
    /// Scenarios to run side by side (pinned, floating, remote, interleave).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pinned,floating,remote,interleave"
    )]
    pub scenarios: Vec<String>,
    /// Runs per scenario (medians, min and max are reported).
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Write an SVG heatmap per matrix to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Only the host-side baseline: every allowed PU × every node (no VM).
    #[arg(long)]
    pub host_only: bool,
    /// Working set per guest cell in MiB (default: 4× the last-level cache, in whole pages).
    /// Smaller sets run faster but measure caches rather than memory.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub working_set_mib: Option<u64>,
    /// Passes of the bandwidth stream over the working set (default 16).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub stream_passes: Option<u32>,
}

/// Parses `--overhead-ratio`: a finite number (an infinite or NaN ratio has no envelope).
fn finite_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number ({e}); write e.g. 1.2"))?;
    if r.is_finite() {
        Ok(r)
    } else {
        Err(format!("{s:?} is not a finite number; write e.g. 1.2"))
    }
}

/// `--prefault`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefaultArg {
    /// Every page before the guest starts.
    BeforeStart,
    /// While the guest boots.
    Background,
}

impl From<PrefaultArg> for vmhost_memory::PrefaultTiming {
    fn from(arg: PrefaultArg) -> Self {
        match arg {
            PrefaultArg::BeforeStart => vmhost_memory::PrefaultTiming::BeforeStart,
            PrefaultArg::Background => vmhost_memory::PrefaultTiming::Background,
        }
    }
}
