//! Allocates, binds, prefaults, audits and releases one cell of guest memory on node 0 and
//! prints the report as text and JSON: `vmhost memory` without a spec file.
//!
//! `cargo run -p vmhost-memory --example report -- [MiB] [2M|1G|anon]` (default: 64 2M).

use vmhost_memory::{run_report, MemoryOptions};
use vmhost_plan::{Backing, GuestCell, Plan};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(64);
    let backing = match args.get(1).map(String::as_str) {
        Some("anon") => Backing::Anonymous,
        Some("1G") => Backing::Hugetlb {
            page_size_bytes: 1 << 30,
            hugetlbfs: None,
        },
        _ => Backing::Hugetlb {
            page_size_bytes: 2 << 20,
            hugetlbfs: None,
        },
    };
    let bytes = mib << 20;
    let cpus = vmhost_memory::sys::current_affinity().unwrap_or_default();
    let plan = Plan::memory_only(
        "example",
        vec![GuestCell {
            cell: 0,
            host_node: Some(0),
            vcpus: vec![0],
            memory_bytes: bytes,
            prefault_cpus: cpus,
            distances: vec![10],
            spans: vec![],
        }],
        backing,
    );
    match run_report(&plan, &MemoryOptions::default()) {
        Ok(report) => {
            println!("{report}");
            match serde_json::to_string_pretty(&report) {
                Ok(json) => println!("{json}"),
                Err(e) => eprintln!("cannot serialize the report: {e}"),
            }
        }
        Err(e) => {
            let mut msg = format!("error: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!("\n  caused by: {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            std::process::exit(1);
        }
    }
}
