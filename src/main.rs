//! The `vmhost` binary: CLI and orchestration of spec → plan → apply → run → audit.

mod background;
mod cli;
mod control;
mod ctl;
mod enforce;
mod host;
mod iothreads;
mod jobs;
mod logging;
mod migrate;
mod output;
mod overhead;
mod pod;
mod restore;
mod run;
mod signals;
mod snapshot;
mod supervise;
mod sys;
mod timeline;
mod vms;
mod vmstate;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use vmhost_config::{ConfigError, LoadedSpec};
use vmhost_plan::{
    check_target, check_target_identity, plan, render_text, source_identity, OverheadModel,
    PlanOptions,
};

use crate::cli::{AcpiArgs, Cli, Command, MemoryArgs, ModelArg, PlanArgs, RunArgs};
use crate::snapshot::SpecSource;
use crate::vms::Arrival;

/// The default spec, embedded so `vmhost` runs without any file.
const QUICKSTART: &str = include_str!("../configs/quickstart.toml");

/// Exit status for an invalid spec.
pub(crate) const EXIT_INVALID: u8 = 2;
/// Exit status when the host cannot hold the VM.
const EXIT_NO_FIT: u8 = 3;

/// The stack of every thread vmhost starts without naming a size (all of its own, and tokio's):
/// 1 MiB instead of std's 2 MiB. On a host whose transparent huge pages are `always` (the
/// default of Debian's kernel), a 2 MiB stack that the kernel happens to place 2 MiB-aligned
/// (right under the hugetlb guest RAM, say) is backed by one huge page as soon as glibc writes
/// the thread's descriptor at its top: 2 MiB resident for a thread that uses tens of KiB, and
/// the VMM's resident memory then depends on where its stacks landed (docs/benchmarks.md,
/// "Linux boot beside Cloud Hypervisor and Firecracker"). A stack under 2 MiB never holds a
/// huge page. A `RUST_MIN_STACK` the user set is kept.
const THREAD_STACK: usize = 1 << 20;

/// Sets [`THREAD_STACK`] as std's default (`RUST_MIN_STACK`, read at the first spawn). Call it
/// before any thread exists: setting an environment variable is only sound while no other
/// thread can read the environment.
fn default_thread_stack() {
    if std::env::var_os("RUST_MIN_STACK").is_none() {
        std::env::set_var("RUST_MIN_STACK", THREAD_STACK.to_string());
    }
}

/// An error that maps to a specific exit status.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct Exit {
    code: u8,
    message: String,
}

fn main() -> ExitCode {
    // First of all: a stop signal from here on gets the orderly stop (see `signals`).
    if let Err(e) = signals::block_at_start() {
        eprintln!("vmhost: error: cannot block the stop signals: {e}");
        return ExitCode::from(1);
    }
    timeline::mark_main();
    // Before any thread exists (they set environment variables).
    vmhost_topology::skip_unneeded_hwloc_plugins();
    default_thread_stack();
    sys::single_malloc_arena();
    logging::init();
    let cli = Cli::parse();
    if cli.command.is_some() {
        if let Err(e) = signals::unblock_for_other_commands() {
            eprintln!("vmhost: error: cannot unblock the stop signals: {e}");
            return ExitCode::from(1);
        }
    }
    match (cli.seccomp, vmhost_seccomp::mode_from_env()) {
        (Some(mode), _) => vmhost_seccomp::set_mode(mode.into()),
        (None, Ok(mode)) => {
            vmhost_seccomp::set_mode(mode.unwrap_or(vmhost_seccomp::SeccompMode::On))
        }
        (None, Err(e)) => {
            eprintln!("vmhost: {e}");
            return ExitCode::from(EXIT_INVALID);
        }
    }
    let result = run(&cli);
    // The buffered diagnostics first; the final lines below go to stderr directly.
    logging::finish();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if let Some(exit) = e.downcast_ref::<Exit>() {
                eprintln!("vmhost: {}", exit.message);
                return ExitCode::from(exit.code);
            }
            let code = if e.chain().any(|c| c.downcast_ref::<ConfigError>().is_some()) {
                EXIT_INVALID
            } else {
                1
            };
            eprintln!("vmhost: error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(code)
        }
    }
}

fn run(cli: &Cli) -> Result<u8> {
    match &cli.command {
        None => cmd_run(cli),
        Some(Command::Ctl(args)) => cmd_ctl(cli, args),
        Some(Command::Restore(args)) => cmd_restore(cli, args),
        Some(Command::Receive(args)) => cmd_receive(cli, args),
        Some(Command::Bench {
            which: cli::BenchCommand::Numa(args),
        }) => cmd_bench_numa(cli, args),
        Some(Command::Ps) => vms::ps(&vms::run_dir(cli.run_dir.as_deref()), cli.json),
        Some(Command::Ledger { action }) => vms::ledger(
            &vms::run_dir(cli.run_dir.as_deref()),
            action.is_some(),
            cli.json,
        ),
        Some(Command::Plan(args)) => cmd_plan(cli, args),
        Some(Command::Topology(args)) => {
            let host = host::load(args)?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&host)?);
            } else {
                print!("{}", vmhost_topology::render_text(&host));
            }
            Ok(0)
        }
        Some(Command::Pod(args)) => cmd_pod(cli, args),
        Some(Command::Memory(args)) => cmd_memory(cli, args),
        Some(Command::Acpi(args)) => cmd_acpi(cli, args),
        Some(Command::CheckTarget(args)) => {
            let spec = load_spec(cli)?;
            let target = host::load(&args.plan.host)?;
            let source = host::load_source(args.source_topology.as_deref(), &Default::default())?;
            let opts = plan_options(&args.plan);
            let check = if args.allow_distance_change {
                let identity = source_identity(&spec.spec, &source, &opts);
                check_target_identity(&spec.spec, &identity, &target, &opts)
            } else {
                check_target(&spec.spec, &source, &target, &opts)
            };
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&check)?);
            } else {
                print!("{}", render_text(&check.target));
                println!(
                    "\nmigration target: {}",
                    if check.fits {
                        "can hold the VM with the same guest topology"
                    } else {
                        "CANNOT hold the VM"
                    }
                );
                for r in &check.reasons {
                    println!("  - {r}");
                }
            }
            Ok(if check.fits {
                0
            } else if check.target.invalid_input() {
                EXIT_INVALID
            } else {
                EXIT_NO_FIT
            })
        }
    }
}

fn plan_options(args: &PlanArgs) -> PlanOptions {
    PlanOptions {
        overhead_model: match args.overhead_model {
            ModelArg::Vmhost => OverheadModel::Vmhost,
            ModelArg::Kubevirt => OverheadModel::Kubevirt,
        },
        overhead_ratio: args.overhead_ratio,
        held_cpus: Default::default(),
        same_distances: false,
    }
}

/// Loads `--config`, or the embedded quickstart; prints the warnings.
fn load_spec(cli: &Cli) -> Result<LoadedSpec> {
    let loaded = match &cli.config {
        Some(path) => vmhost_config::load(Path::new(path))?,
        None => vmhost_config::from_toml_str(QUICKSTART, "configs/quickstart.toml (embedded)")?,
    };
    for w in &loaded.warnings {
        eprintln!("{w}");
    }
    Ok(loaded)
}

fn cmd_plan(cli: &Cli, args: &PlanArgs) -> Result<u8> {
    let mut spec = load_spec(cli)?;
    resolve_vsock_socket(&mut spec.spec, &vms::run_dir(cli.run_dir.as_deref()));
    let host = host::load(&args.host).context("loading the host topology")?;
    let mut opts = plan_options(args);
    if args.host.topology.is_none() {
        // This host: plan against the PUs that running VMs hold.
        opts.held_cpus = vms::held_cpus(&vms::run_dir(cli.run_dir.as_deref()))?;
    }
    let outcome = plan(&spec.spec, &host, &opts);
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
    } else {
        print!("{}", render_text(&outcome));
    }
    Ok(if outcome.fits {
        0
    } else if outcome.invalid_input() {
        EXIT_INVALID
    } else {
        EXIT_NO_FIT
    })
}

/// Plans on this host and fails with exit status 3 and the reasons when the VM does not fit.
fn plan_here(cli: &Cli, args: &PlanArgs) -> Result<vmhost_plan::Plan> {
    plan_loaded(&load_spec(cli)?, args)
}

/// [`plan_here`] for a spec loaded already.
fn plan_loaded(spec: &LoadedSpec, args: &PlanArgs) -> Result<vmhost_plan::Plan> {
    let host = host::load(&args.host).context("loading the host topology")?;
    plan(&spec.spec, &host, &plan_options(args))
        .into_result()
        .map_err(|r| {
            anyhow::Error::new(Exit {
                code: rejection_code(&r),
                message: vms::with_confinement(r.to_string(), &host),
            })
        })
}

/// Exit status of a plan that was rejected: 2 for invalid input (a size overflow), else 3.
fn rejection_code(r: &vmhost_plan::Rejection) -> u8 {
    if r.invalid_input() {
        EXIT_INVALID
    } else {
        EXIT_NO_FIT
    }
}

/// `vmhost pod`: the ConfigMap and Pod that run this VM (exit 3 when the host given with
/// --topology, or this one, cannot hold it).
fn cmd_pod(cli: &Cli, args: &cli::PodArgs) -> Result<u8> {
    let spec = load_spec(cli)?;
    let plan = plan_loaded(&spec, &args.plan)?;
    let (file, text) = match &cli.config {
        Some(path) => {
            let yaml = matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            );
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --config {}", path.display()))?;
            (if yaml { "vm.yaml" } else { "vm.toml" }, text)
        }
        None => ("vm.toml", QUICKSTART.to_string()),
    };
    let req = pod::PodRequest {
        image: &args.image,
        name: args.name.as_deref(),
        spec_file: (file, &text),
    };
    print!(
        "{}",
        pod::render(pod::objects(&spec.spec, &plan, &req)?, cli.json)?
    );
    Ok(0)
}

fn cmd_memory(cli: &Cli, args: &MemoryArgs) -> Result<u8> {
    let plan = plan_here(cli, &PlanArgs::default())?;
    let mut opts = vmhost_memory::MemoryOptions::default();
    opts.prefault.threads_per_cell = args.prefault_threads;
    let report = vmhost_memory::run_report(&plan, &opts)?;
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(if report.clean { 0 } else { 1 })
}

fn cmd_acpi(cli: &Cli, args: &AcpiArgs) -> Result<u8> {
    use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
    let plan = plan_here(cli, &args.plan)?;
    let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END)?;
    let tables = vmhost_boot::build_acpi(&plan, &layout, vmhost_boot::addrs::ACPI_START)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating --out {}", args.out.display()))?;
    let files = vmhost_boot::write_tables(&tables, &args.out)?;
    for f in &files {
        println!("{}", f.display());
    }
    Ok(0)
}

/// A vsock device on a Unix socket without a path gets `<run dir>/<vm name>.vsock` (KubeVirt's
/// `autoattachVSOCK`, or `[devices.vsock]` without `socket`); vhost has no socket.
fn resolve_vsock_socket(spec: &mut vmhost_config::VmSpec, run_dir: &std::path::Path) {
    let name = spec.name.clone();
    if let Some(v) = spec.devices.vsock.as_mut() {
        if v.backend == vmhost_config::VsockBackend::Unix {
            v.socket = Some(v.socket_in(run_dir, &name));
        }
    }
}

/// The main job: admit the VM through the host ledger, then run it.
fn cmd_run(cli: &Cli) -> Result<u8> {
    let timeline = timeline::Timeline::start();
    // Read once (a FIFO gives its text once), kept for snapshots.
    let source = spec_source(cli)?;
    let spec = source.load()?;
    for w in &spec.warnings {
        eprintln!("{w}");
    }
    start_vm(cli, &cli.run, spec, source, run::Start::Boot, timeline)
}

/// `vmhost restore DIR`: the snapshot checked whole, then the normal start path.
fn cmd_restore(cli: &Cli, args: &cli::RestoreArgs) -> Result<u8> {
    let timeline = timeline::Timeline::start();
    if cli.run != RunArgs::default() {
        return Err(Exit {
            code: EXIT_INVALID,
            message: "restore: give the run options after `restore DIR`".into(),
        }
        .into());
    }
    // The host's tree is discovered (hwloc) on another thread while the snapshot is checked;
    // a snapshot refused is the error even when the discovery failed too.
    let (prepared, host) = std::thread::scope(|scope| {
        let host = std::thread::Builder::new()
            .name("vmhost-host".into())
            .spawn_scoped(scope, host::this_host);
        let prepared = restore::prepare(&args.dir, cli.config.as_deref());
        let host = match host {
            Ok(h) => h
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("discovering this host panicked"))),
            Err(e) => Err(anyhow::Error::new(e).context("starting the host discovery thread")),
        };
        (prepared, host)
    });
    let (spec, source, restored) = prepared?;
    let host = host?;
    for w in &spec.warnings {
        eprintln!("{w}");
    }
    let start = run::Start::Restore {
        restored: Box::new(restored),
        same_distances: args.same_distances,
        steps: timeline::StepClock::start(),
    };
    start_vm_on(cli, &args.run, (spec, source), Some(host), start, timeline)
}

/// `vmhost receive`: an authenticated source's hello checked, then the normal start path.
fn cmd_receive(cli: &Cli, args: &cli::ReceiveArgs) -> Result<u8> {
    let timeline = timeline::Timeline::start();
    if cli.run != RunArgs::default() {
        return Err(Exit {
            code: EXIT_INVALID,
            message: "receive: give the run options after `receive`".into(),
        }
        .into());
    }
    // Every thread filter compiled now, while no source is connected: after the commit the
    // threads that start before the guest runs again only install theirs.
    vmhost_seccomp::precompile().context("compiling the seccomp filters")?;
    // The host's tree discovered now too, while no source is connected; its pools are read
    // again when the source says hello (`start_vm`).
    let host = host::this_host()?;
    let (spec, source, incoming) = migrate::target::accept(args)?;
    for w in &spec.warnings {
        eprintln!("{w}");
    }
    let start = run::Start::Incoming(Box::new(incoming));
    start_vm_on(cli, &args.run, (spec, source), Some(host), start, timeline)
}

/// The spec's text, kept for snapshots.
fn spec_source(cli: &Cli) -> Result<SpecSource> {
    match &cli.config {
        Some(path) => Ok(SpecSource::read(path)?),
        None => Ok(SpecSource::embedded(QUICKSTART)),
    }
}

/// Admits the VM of `spec` through the host ledger, then runs it (booted or restored) with
/// the run options `args`: the one path of `vmhost --config F`, `restore` and `receive`.
fn start_vm(
    cli: &Cli,
    args: &RunArgs,
    spec: LoadedSpec,
    source: SpecSource,
    start: run::Start,
    timeline: timeline::Timeline,
) -> Result<u8> {
    start_vm_on(cli, args, (spec, source), None, start, timeline)
}

/// [`start_vm`] on a host discovered ahead (`Some`: its pools are read again), or on this
/// host discovered now.
fn start_vm_on(
    cli: &Cli,
    args: &RunArgs,
    (mut spec, source): (LoadedSpec, SpecSource),
    host: Option<vmhost_topology::HostTopology>,
    mut start: run::Start,
    mut timeline: timeline::Timeline,
) -> Result<u8> {
    check_boot_inputs(&spec.spec.boot)?;
    signals::stop_if_requested("while the spec was read")?;
    timeline.spec_loaded_ns = timeline::now_ns();
    start.mark_step("boot inputs");
    let host = match host {
        Some(mut h) => {
            vmhost_topology::refresh_live(&mut h)
                .context("reading this host's hugepage pools again")?;
            h
        }
        None => host::this_host()?,
    };
    signals::stop_if_requested("while the host's topology was read")?;
    timeline.host_discovered_ns = timeline::now_ns();
    start.mark_step("pools");
    let run_dir = vms::run_dir(cli.run_dir.as_deref());
    resolve_vsock_socket(&mut spec.spec, &run_dir);
    let api = cli.api_socket.clone();
    let (plan, admission) = admit(&run_dir, &spec.spec, &host, api.clone(), &mut start)?;
    timeline.admitted_ns = timeline::now_ns();
    if let (run::Start::Restore { restored, .. }, false) = (&start, cli.json) {
        for line in restore::placement_report(&plan, restored) {
            eprintln!("vmhost: restore: {line}");
        }
    }
    if !cli.json {
        // A shared VM's summary says what dedicated placement would give it, among the PUs
        // other VMs hold (a read of the ledger a dedicated VM does not need).
        let alt = match spec.spec.cpu.dedicated_cpu_placement {
            true => None,
            false => {
                let held = PlanOptions {
                    held_cpus: vms::held_cpus(&run_dir)?,
                    ..plan_options(&PlanArgs::default())
                };
                output::dedicated_alternative(&spec.spec, &host, &held)
            }
        };
        print!("{}", output::plan_summary(&plan, &host, alt.as_ref()));
        start.mark_step("plan summary");
    }
    let run_opts = run::RunOptions {
        ignore_unknown: args.ignore_unknown_access,
        mask_nested_cpuid: args.mask_nested_cpuid,
        json: cli.json,
        api_socket: api,
        cgroup: args.cgroup.clone().or_else(|| spec.spec.cgroup.clone()),
        cgroup_memory_limit: args.cgroup_memory_limit,
        run_dir,
        prefault: args.prefault.into(),
        spec_source: Some(source),
    };
    run::run(&spec.spec, &plan, &admission, &run_opts, timeline, start)
}

/// Admits the VM through the ledger: a restore planned for the snapshot's guest identity; an
/// incoming migration as an incoming entry planned for the source's guest identity, answering
/// the source either way.
fn admit(
    run_dir: &Path,
    spec: &vmhost_config::VmSpec,
    host: &vmhost_topology::HostTopology,
    api: Option<std::path::PathBuf>,
    start: &mut run::Start,
) -> Result<(vmhost_plan::Plan, vms::Admission)> {
    let mut opts = plan_options(&PlanArgs::default());
    let incoming = match start {
        run::Start::Boot => return vms::admit(run_dir, spec, host, &opts, api, Arrival::Boot),
        run::Start::Restore {
            restored,
            same_distances,
            steps,
        } => {
            opts.same_distances = *same_distances;
            let arrival = Arrival::Restore(&restored.guest.identity);
            let admitted = vms::admit(run_dir, spec, host, &opts, api, arrival);
            steps.mark("admitted");
            return admitted;
        }
        run::Start::Incoming(incoming) => incoming,
    };
    opts.same_distances = incoming.same_distances();
    let arrival = Arrival::Incoming(incoming.identity());
    let admitted = vms::admit(run_dir, spec, host, &opts, api, arrival);
    match &admitted {
        Ok((plan, _)) => incoming
            .answer(Ok(plan))
            .context("accepting the source's page streams")?,
        Err(e) => incoming.answer(Err(&format!("{e:#}")))?,
    }
    admitted
}

/// A Linux guest's kernel, initramfs and command line, checked from their headers before the
/// VM is admitted, memory is allocated or `/dev/kvm` is opened: a bad one is an invalid spec
/// (exit 2) whose message names the file and the problem.
fn check_boot_inputs(boot: &vmhost_config::BootSpec) -> Result<()> {
    if let vmhost_config::BootSpec::Kernel {
        kernel,
        initrd,
        cmdline,
        ..
    } = boot
    {
        vmhost_boot::check_linux_inputs(kernel, initrd.as_deref(), cmdline).map_err(|e| {
            let mut message = format!("boot: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                message.push_str(&format!(": {s}"));
                source = s.source();
            }
            Exit {
                code: EXIT_INVALID,
                message,
            }
        })?;
    }
    Ok(())
}

/// `vmhost ctl`: one request to a running VM's control API, or a snapshot or migration job
/// followed to its end.
fn cmd_ctl(cli: &Cli, args: &cli::CtlArgs) -> Result<u8> {
    let socket = cli.api_socket.as_deref().ok_or_else(|| {
        anyhow::anyhow!("vmhost ctl needs --api-socket PATH (the socket the VM was started with)")
    })?;
    let command = args.command.as_str();
    let usage = |m: &str| Exit {
        code: EXIT_INVALID,
        message: m.into(),
    };
    if command == "snapshot" {
        let dir = args.dir.as_deref().ok_or_else(|| {
            usage("vmhost ctl snapshot needs the directory to create: snapshot DIR")
        })?;
        return ctl::snapshot(socket, dir, args.stop);
    }
    if command == "migrate" {
        let (Some(to), Some(key)) = (args.dir.as_deref(), args.auth_key.as_deref()) else {
            return Err(usage(
                "vmhost ctl migrate needs the target and the key: migrate unix:PATH|tcp:ADDR:PORT --auth-key FILE",
            )
            .into());
        };
        return ctl::migrate(
            socket,
            &to.to_string_lossy(),
            key,
            args.max_downtime,
            args.timeout,
            cli.json,
        );
    }
    if args.dir.is_some() || args.stop || args.auth_key.is_some() {
        return Err(usage(&format!(
            "vmhost ctl {command} takes no directory, endpoint, --stop or --auth-key"
        ))
        .into());
    }
    let (method, uri) = match command {
        "info" => ("GET", "/vm"),
        "placement" => ("GET", "/vm/placement"),
        "resources" => ("GET", "/vm/resources"),
        other => (
            "PUT",
            match other {
                "pause" => "/vm/pause",
                "resume" => "/vm/resume",
                _ => "/vm/shutdown",
            },
        ),
    };
    let resp = vmhost_api::request(socket, method, uri)?;
    println!("{}", serde_json::to_string_pretty(&resp.body)?);
    Ok(if resp.is_success() { 0 } else { 1 })
}

/// `vmhost bench numa`.
fn cmd_bench_numa(cli: &Cli, args: &cli::NumaBenchArgs) -> Result<u8> {
    let host = host::this_host()?;
    if args.host_only {
        let mut ha = vmhost_bench::HostOnlyArgs::new(host);
        ha.repeat = args.repeat;
        ha.working_set_bytes = args.working_set_mib.map(|m| m << 20);
        let report = vmhost_bench::host_only(&ha)?;
        return bench_output(cli, &report, args.plot.as_deref());
    }
    let plan = plan_here(cli, &PlanArgs::default())?;
    let mut ba = vmhost_bench::BenchArgs::new(plan, host);
    ba.repeat = args.repeat;
    ba.working_set_bytes = args.working_set_mib.map(|m| m << 20);
    if let Some(passes) = args.stream_passes {
        ba.stream_passes = passes;
    }
    ba.scenarios = args
        .scenarios
        .iter()
        .map(|s| s.parse::<vmhost_bench::Scenario>())
        .collect::<Result<_, _>>()
        .context("--scenarios")?;
    let report = vmhost_bench::run(&ba)?;
    bench_output(cli, &report, args.plot.as_deref())
}

fn bench_output<R>(cli: &Cli, report: &R, plot: Option<&Path>) -> Result<u8>
where
    R: serde::Serialize + std::fmt::Display + vmhost_bench::Matrices,
{
    if cli.json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    if let Some(path) = plot {
        vmhost_bench::write_svg(report, path)
            .with_context(|| format!("writing --plot {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(0)
}
