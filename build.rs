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
    command_output("getconf", &["GNU_LIBC_VERSION"])
        .and_then(|text| version_of(&text, "glibc "))
        .is_some_and(|v| v >= (major, minor))
}

/// Does this rustc link x86_64 Linux binaries with LLD by default (1.90 and later)? An older
/// one uses the system's `ld`, which has no `--symbol-ordering-file`.
fn rustc_links_with_lld() -> bool {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    command_output(&rustc, &["-vV"])
        .and_then(|text| version_of(&text, "release: "))
        .is_some_and(|v| v >= (1, 90))
}

/// What `program args` printed on stdout, if it ran.
fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `(major, minor)` of the version after `prefix` on a line of `text` (`glibc 2.36`,
/// `release: 1.95.0-nightly`); a part that is not a number counts as 0.
fn version_of(text: &str, prefix: &str) -> Option<(u32, u32)> {
    let version = text.lines().find_map(|l| l.trim().strip_prefix(prefix))?;
    let mut parts = version
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    Some((parts.next().unwrap_or(0), parts.next().unwrap_or(0)))
}
