//! TOML spec → validate → plan on several hosts: never a panic, a plan or reasons always.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

static HOSTS: OnceLock<Vec<vmhost_topology::HostTopology>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(loaded) = vmhost_config::from_toml_str(text, "fuzz.toml") {
        common::plan_everywhere(&loaded.spec, HOSTS.get_or_init(common::hosts));
    }
});
