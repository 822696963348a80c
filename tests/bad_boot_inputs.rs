//! A Linux guest's bad kernel, initramfs or command line is refused from the files' headers
//! before anything else happens: exit 2 (invalid spec) with a message naming the file and the
//! problem. The specs ask for 1 TiB of guest memory, which no test host has: had vmhost planned,
//! admitted or allocated anything first, it would have refused with exit 3 instead.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

fn spec(kernel: &Path, initrd: Option<&Path>, cmdline: &str) -> String {
    let initrd = initrd.map_or(String::new(), |p| format!("initrd = \"{}\"\n", p.display()));
    format!(
        "name = \"bad\"\n[cpu]\ncores = 1\n[memory]\nguest = \"1Ti\"\n\
         [boot]\nkernel = \"{}\"\n{initrd}cmdline = \"{cmdline}\"\n",
        kernel.display()
    )
}

/// Runs the spec; returns (exit status, stderr) and checks nothing reached the ledger.
fn refused(dir: &Path, name: &str, toml: &str) -> (i32, String) {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, toml).unwrap();
    let run_dir = dir.join(format!("run-{name}"));
    let o = common::vmhost(&[
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--config",
        path.to_str().unwrap(),
    ]);
    let entries = std::fs::read_dir(&run_dir).map_or(0, |d| d.count());
    assert_eq!(entries, 0, "{name}: the ledger run directory got entries");
    assert!(
        common::stdout(&o).is_empty(),
        "{name}: {}",
        common::stdout(&o)
    );
    (o.status.code().unwrap(), common::stderr(&o))
}

#[test]
fn bad_kernels_initrds_and_command_lines_are_refused_before_anything_is_allocated() {
    let dir = std::env::temp_dir().join(format!("vmhost-bad-boot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let text = dir.join("not-a-kernel");
    std::fs::write(&text, b"#!/bin/sh\necho hello\n").unwrap();
    let (code, err) = refused(&dir, "text", &spec(&text, None, ""));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("not-a-kernel is neither an ELF vmlinux nor a bzImage"),
        "{err}"
    );

    let missing = dir.join("no-such-vmlinux");
    let (code, err) = refused(&dir, "missing", &spec(&missing, None, ""));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("cannot open kernel image") && err.contains("no-such-vmlinux"),
        "{err}"
    );

    let Some(bzimage) = vmhost_testsupport::test_kernel_file("bzImage") else {
        return;
    };
    let bytes = std::fs::read(&bzimage).unwrap();
    let cut = dir.join("truncated-bzImage");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let (code, err) = refused(&dir, "cut", &spec(&cut, None, ""));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("truncated-bzImage is truncated"), "{err}");

    let no_initrd = dir.join("no-initrd.cpio");
    let (code, err) = refused(&dir, "initrd", &spec(&bzimage, Some(&no_initrd), ""));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("cannot open initramfs") && err.contains("no-initrd.cpio"),
        "{err}"
    );

    let (code, err) = refused(&dir, "cmdline", &spec(&bzimage, None, &"x".repeat(5000)));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("command line is 5000 bytes"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
