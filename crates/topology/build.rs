//! Static builds (`-C target-feature=+crt-static`, set in `.cargo/config.toml`): hwloc's
//! `pkg-config --static` link line names `-ludev`, and Debian ships no static libudev. vmhost
//! never asks hwloc for I/O objects, the only thing hwloc uses libudev for, so the crate
//! provides the five libudev entry points hwloc references itself (`src/udev.rs`: "no udev",
//! which hwloc handles) and this script satisfies `-ludev` with an empty archive.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    if !features.split(',').any(|f| f == "crt-static") {
        return;
    }
    let Some(out) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo did not set OUT_DIR for the vmhost-topology build script");
    };
    // An ar archive with no members: its global header alone.
    if let Err(e) = std::fs::write(out.join("libudev.a"), b"!<arch>\n") {
        panic!("cannot write {}: {e}", out.join("libudev.a").display());
    }
    println!("cargo:rustc-link-search=native={}", out.display());
}
