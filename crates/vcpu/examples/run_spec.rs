//! Runs a spec's payload the way the `vmhost` binary does, and prints the report.
//!
//! ```text
//! cargo run -p vmhost-vcpu --example run_spec -- vm.toml [--ignore-unknown] [--bench-mib N]
//! ```
//!
//! Order: plan on this host → pin the main thread to the emulator PUs → guest memory → VM →
//! SIGINT/SIGTERM stop the VM → run → report → exit code.

use std::process::ExitCode;

use vmhost_memory::{GuestMemory, MemoryOptions};
use vmhost_plan::{plan, PlanOptions};
use vmhost_vcpu::{
    pin_current_thread_to_emulator, stop_on_signals, BenchOptions, UnknownAccessPolicy, Vm,
    VmOptions,
};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let mut msg = format!("error: {e}");
            let mut src = e.source();
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            ExitCode::from(1)
        }
    }
}

fn run() -> Result<u8, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: run_spec SPEC.toml [--ignore-unknown] [--bench-mib N]")?;
    let mut options = VmOptions::default();
    if args.iter().any(|a| a == "--ignore-unknown") {
        options.unknown_access = UnknownAccessPolicy::Ignore;
    }
    if let Some(i) = args.iter().position(|a| a == "--bench-mib") {
        let mib: u64 = args.get(i + 1).ok_or("--bench-mib needs a size")?.parse()?;
        options.bench = BenchOptions {
            working_set_bytes: Some(mib << 20),
            ..Default::default()
        };
    }
    let spec = vmhost_config::load(std::path::Path::new(path))?.spec;
    let host = vmhost_topology::discover()?;
    let plan = plan(&spec, &host, &PlanOptions::default()).into_result()?;
    pin_current_thread_to_emulator(&plan)?;
    let memory = GuestMemory::new(&plan, &MemoryOptions::default())?;
    let mut vm = Vm::new(&plan, memory, options)?;
    stop_on_signals(vm.stop_handle())?;
    let report = vm.run()?;
    drop(vm);
    println!("{}", report.render_text());
    Ok(u8::try_from(report.exit_code()).unwrap_or(1))
}
