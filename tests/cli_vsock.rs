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
