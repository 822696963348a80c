//! Links the release `vmhost` binary with the functions a VM start runs first in its text.
//!
//! The kernel maps an executable's text 64 KiB at a time around each page a process runs, so a
//! running VMM's resident memory follows how spread out the code its start ran is.
//! `src/text-order.txt` (written by `scripts/text-order.py` from valgrind profiles of vmhost's
//! starts) names those functions; LLD, rustc's default linker for this target since Rust 1.90,
//! places them together (`--symbol-ordering-file`). Names it no longer finds are skipped
//! silently: a stale list costs memory, never correctness. Debug builds keep the compiler's
//! order. Every build packs its relative relocations (`-z pack-relative-relocs`).
//! docs/benchmarks.md ("Resident memory") has the effect.

use std::path::Path;

fn main() {
    let order = Path::new(&std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default())
        .join("src")
        .join("text-order.txt");
    println!("cargo:rerun-if-changed=src/text-order.txt");
    println!("cargo:rerun-if-changed=build.rs");
    let linux_gnu = std::env::var("TARGET").is_ok_and(|t| t == "x86_64-unknown-linux-gnu");
    if !linux_gnu || !rustc_links_with_lld() {
        return;
    }
    // Relative relocations packed as a bitmap (DT_RELR): 2.5 KB instead of 222 KB of `.rela.dyn`
    // that the static-pie start-up reads in full. The static libc applies them itself, which
    // glibc does from 2.36 on; an older one would start with every pointer unrelocated. In every
    // profile, so that the tests' (debug) binary starts the way the release binary does.
    if glibc_at_least(2, 36) {
        println!("cargo:rustc-link-arg-bin=vmhost=-Wl,-z,pack-relative-relocs");
    }
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    if release && order.is_file() {
        println!(
            "cargo:rustc-link-arg-bin=vmhost=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bin=vmhost=-Wl,--no-warn-symbol-ordering");
    }
}

/// Is the C library vmhost links statically (the build host's) glibc `major.minor` or later?
fn glibc_at_least(major: u32, minor: u32) -> bool {
    let Ok(out) = std::process::Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
    else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(version) = text.trim().strip_prefix("glibc ") else {
        return false;
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
}

/// Does this rustc link x86_64 Linux binaries with LLD by default (1.90 and later)? An older
/// one uses the system's `ld`, which has no `--symbol-ordering-file`.
fn rustc_links_with_lld() -> bool {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Ok(out) = std::process::Command::new(rustc).arg("-vV").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(release) = text.lines().find_map(|l| l.strip_prefix("release: ")) else {
        return false;
    };
    let mut parts = release
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 90)
}
