//! `termination_grace_period_seconds` end to end on this host's real KVM: a tiny PVH guest
//! prints `R` and halts with interrupts off, so it never answers its ACPI power button.
//! `vmhost ctl shutdown` presses the button; the API answers with the spec's grace, and once
//! that has passed vmhost stops the VM itself (exit 130), saying so with the grace it waited.
//! KubeVirt's `terminationGracePeriodSeconds` maps onto the same field (`crates/config`).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use vmhost_testsupport::pvh::{out8, pvh_elf};
use vmhost_testsupport::{lock_cpus, need_kvm};

/// `R` to COM1, then `cli; hlt` forever: the power button's interrupt never runs.
fn guest() -> Vec<u8> {
    [out8(0x3f8, b'R'), vec![0xfa, 0xf4, 0xeb, 0xfd]].concat()
}

/// Runs the ignoring guest with `grace` (None: the field left out); returns vmhost's exit
/// status, its stderr and the API's answer to the shutdown.
fn run(d: &Path, grace: Option<u64>) -> (Option<i32>, String, serde_json::Value) {
    std::fs::create_dir_all(d).unwrap();
    std::fs::write(d.join("guest.elf"), pvh_elf(&guest())).unwrap();
    let field = grace.map_or_else(String::new, |g| {
        format!("termination_grace_period_seconds = {g}\n")
    });
    let spec = d.join("vm.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"grace\"\n{field}[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n\
             [boot]\nkernel = \"guest.elf\"\n"
        ),
    )
    .unwrap();
    let out = d.join("stdout");
    let (mut child, sock) = common::start_with_api(
        d,
        &spec,
        &[],
        Stdio::from(std::fs::File::create(&out).unwrap()),
    );
    let console = || std::fs::read_to_string(&out).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !console().contains('R') {
        assert!(Instant::now() < deadline, "the guest never got ready");
        assert!(child.try_wait().unwrap().is_none(), "vmhost ended early");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (code, answer) = common::ctl(&sock, "shutdown");
    assert_eq!(code, 0, "{answer}");
    let status = common::wait_exit(&mut child, 90, || {
        "vmhost did not stop the guest that ignored its power button".into()
    });
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        e.read_to_string(&mut err).unwrap();
    }
    (status.code(), common::plain(&err), answer)
}

#[test]
fn a_guest_that_ignores_its_power_button_is_stopped_after_the_specs_grace() {
    if !need_kvm("a_guest_that_ignores_its_power_button_is_stopped_after_the_specs_grace") {
        return;
    }
    let _cpus = lock_cpus();
    let base = std::env::temp_dir().join(format!("vmhost-grace-{}", std::process::id()));
    for (grace, want) in [(Some(1), "1s"), (Some(0), "0ns")] {
        let (code, err, answer) = run(&base.join(format!("{grace:?}")), grace);
        assert_eq!(answer["via"], "acpi_power_button", "{answer}");
        assert_eq!(answer["grace_seconds"], grace.unwrap(), "{answer}");
        assert_eq!(code, Some(130), "grace {grace:?}: {err}");
        assert!(
            err.contains("the guest did not power off after the power button: stopping it")
                && err.contains(&format!("grace={want}")),
            "grace {grace:?}: vmhost's own account of the stop: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}
