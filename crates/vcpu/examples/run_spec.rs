//! Runs a spec's payload or kernel the way the `vmhost` binary does, and prints the report.
//! A kernel's serial console is this process's stdout (and stdin, on a terminal).
//!
//! ```text
//! cargo run -p vmhost-vcpu --example run_spec -- vm.toml [--ignore-unknown] [--bench-mib N] \
//!     [--mask-nested]
//! ```
//!
//! `--mask-nested` clears the CPUID features an emulated guest ring 0 cannot run (nested
//! hosts; see `VmOptions::mask_for_nested_emulation`).
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
        .ok_or("usage: run_spec SPEC.toml [--ignore-unknown] [--bench-mib N] [--mask-nested]")?;
    let mut options = VmOptions {
        mask_for_nested_emulation: args.iter().any(|a| a == "--mask-nested"),
        ..Default::default()
    };
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
