//! Runs the NUMA locality benchmark the way `vmhost bench numa` does, before the CLI has it.
//!
//! ```text
//! cargo run --release -p vmhost-bench --example numa -- SPEC.toml [--repeat N] [--svg OUT.svg] [--json OUT.json]
//! cargo run --release -p vmhost-bench --example numa -- --host-only [--repeat N] [--svg OUT.svg]
//! ```

use std::path::Path;
use std::process::ExitCode;

use vmhost_bench::{host_only, run, write_svg, BenchArgs, HostOnlyArgs};
use vmhost_plan::{plan, PlanOptions};

fn main() -> ExitCode {
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("error: {e}");
            let mut src = e.source();
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}

fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(String::as_str)
}

fn bench() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let repeat: Option<u32> = value(&args, "--repeat").map(str::parse).transpose()?;
    let host = vmhost_topology::discover()?;
    if args.iter().any(|a| a == "--host-only") {
        let mut opts = HostOnlyArgs::new(host);
        opts.repeat = repeat.unwrap_or(opts.repeat);
        let report = host_only(&opts)?;
        println!("{report}");
        if let Some(svg) = value(&args, "--svg") {
            write_svg(&report, Path::new(svg))?;
        }
        return Ok(());
    }
    let path = args
        .first()
        .ok_or("usage: numa SPEC.toml [--repeat N] [--svg OUT] [--json OUT]")?;
    let spec = vmhost_config::load(Path::new(path))?.spec;
    let plan = plan(&spec, &host, &PlanOptions::default()).into_result()?;
    let mut opts = BenchArgs::new(plan, host);
    opts.repeat = repeat.unwrap_or(opts.repeat);
    let report = run(&opts)?;
    println!("{report}");
    if let Some(svg) = value(&args, "--svg") {
        write_svg(&report, Path::new(svg))?;
    }
    if let Some(json) = value(&args, "--json") {
        std::fs::write(json, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
