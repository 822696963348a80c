//! The vsock device through the real binary: the socket path the VMM derives from its run
//! directory (`[devices.vsock]` without `socket`, KubeVirt's `autoattachVSOCK`), as the plan
//! shows it.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{stdout, vmhost, vmhost_json};

/// A fresh directory for one test's spec and run directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vmhost-cli-vsock-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_vsock_without_a_socket_gets_one_named_after_the_vm_in_the_run_dir() {
    let dir = scratch("toml");
    let spec = dir.join("agent.toml");
    std::fs::write(
        &spec,
        "name = \"agent\"\n[memory]\nguest = \"256Mi\"\n[devices.vsock]\n",
    )
    .unwrap();
    let run = dir.join("run");
    let (run_s, spec_s) = (run.to_string_lossy(), spec.to_string_lossy());
    let (code, j) = vmhost_json(&["--run-dir", &run_s, "plan", "--json", "--config", &spec_s]);
    assert_eq!(code, 0, "{j}");
    let want = run.join("agent.vsock");
    assert_eq!(j["devices"]["spec"]["vsock"]["cid"], 3);
    assert_eq!(
        j["devices"]["spec"]["vsock"]["socket"],
        want.to_string_lossy().as_ref()
    );
    assert_eq!(j["devices"]["slots"][0]["device"]["kind"], "vsock");
    let text = stdout(&vmhost(&["--run-dir", &run_s, "plan", "--config", &spec_s]));
    assert!(
        text.contains(&format!(
            "vsock: guest CID 3, Unix socket {}",
            want.display()
        )),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kubevirt_autoattach_vsock_plans_the_device_with_cid_3() {
    let dir = scratch("yaml");
    let spec = dir.join("vmi.yaml");
    std::fs::write(
        &spec,
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: agent-vmi\n\
         spec:\n  domain:\n    memory:\n      guest: 256Mi\n    devices:\n      autoattachVSOCK: true\n",
    )
    .unwrap();
    let run = dir.join("run");
    let (run_s, spec_s) = (run.to_string_lossy(), spec.to_string_lossy());
    let (code, j) = vmhost_json(&["--run-dir", &run_s, "plan", "--json", "--config", &spec_s]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["devices"]["spec"]["vsock"]["cid"], 3);
    assert_eq!(
        j["devices"]["spec"]["vsock"]["socket"],
        run.join("agent-vmi.vsock").to_string_lossy().as_ref()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Linux guest (a tiny PVH "kernel" that halts) with a vsock device: its socket answers while
/// the VM runs; a second VM asking for the same socket is refused with a host error naming the
/// field (exit 1) and leaves the first one's socket alone; SIGTERM stops the first (exit 130)
/// and its socket is gone.
#[test]
fn the_socket_lives_with_the_vm_and_a_second_vm_cannot_take_it() {
    use std::os::unix::net::UnixStream;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    use vmhost_testsupport::pvh::pvh_elf;
    use vmhost_testsupport::{lock_cpus, need_kvm};
    if !need_kvm("vsock_socket_lifecycle") {
        return;
    }
    let _cpus = lock_cpus();
    let dir = scratch("life");
    // hlt; jmp back: the vCPU sleeps until vmhost stops it.
    std::fs::write(dir.join("kernel.elf"), pvh_elf(&[0xf4, 0xeb, 0xfd])).unwrap();
    let sock = dir.join("vm.vsock");
    let spec = |name: &str| {
        let path = dir.join(format!("{name}.toml"));
        let text = format!(
            "name = \"{name}\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n\
             [boot]\nkernel = \"kernel.elf\"\n[devices.vsock]\nsocket = \"{}\"\n",
            sock.display()
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let run = dir.join("run");
    let (first, second) = (spec("vsock-a"), spec("vsock-b"));
    let mut vm = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            run.to_str().unwrap(),
            "--config",
            first.to_str().unwrap(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("a.err")).unwrap())
        .spawn()
        .unwrap();
    // A bound so a broken start fails instead of hanging, not a timing assertion.
    let deadline = Instant::now() + Duration::from_secs(60);
    while UnixStream::connect(&sock).is_err() {
        assert!(vm.try_wait().unwrap().is_none(), "vmhost ended early");
        assert!(Instant::now() < deadline, "the vsock socket never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = vmhost(&[
        "--run-dir",
        run.to_str().unwrap(),
        "--config",
        second.to_str().unwrap(),
    ]);
    let err = common::stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("devices.vsock.socket") && err.contains("in use"),
        "{err}"
    );
    assert!(
        UnixStream::connect(&sock).is_ok(),
        "the first VM keeps its socket"
    );
    // SAFETY: kill only sends a signal to our child, which has not been reaped.
    assert_eq!(unsafe { libc::kill(vm.id() as i32, libc::SIGTERM) }, 0);
    let status = vm.wait().unwrap();
    let err = std::fs::read_to_string(dir.join("a.err")).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(
        !sock.exists(),
        "the socket is removed when the VM stops: {err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
