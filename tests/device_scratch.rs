//! End to end: a Linux guest's scratch images (an empty disk, a cloud-init NoCloud seed) are
//! made in vmhost's run directory while the VM runs — never under a predictable name in the
//! world-writable `/tmp` — and removed when it stops.
//!
//! The guest is the test kernel (`crates/boot/scripts/fetch-test-kernel.sh`); it only has to
//! be started. Skipped with `VMHOST_SKIP_KERNEL_TESTS=1` or `VMHOST_SKIP_KVM_TESTS=1`.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn scratch_images_live_in_the_run_directory_and_go_at_stop() {
    let test = "scratch_images_live_in_the_run_directory_and_go_at_stop";
    let Some(kernel) = vmhost_testsupport::test_kernel_file("vmlinux") else {
        return;
    };
    if !vmhost_testsupport::need_kvm(test) {
        return;
    }
    let _cpus = vmhost_testsupport::lock_cpus();
    let dir = std::env::temp_dir().join(format!("vmhost-scratch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    let spec = dir.join("vm.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"scratchy\"\n[cpu]\ncores = 1\n[memory]\nguest = \"128Mi\"\n\
             [boot]\nkernel = \"{}\"\ncmdline = \"console=ttyS0\"\n\
             [[devices.disks]]\nname = \"scratch\"\n[[volumes]]\nname = \"scratch\"\n\
             empty_disk = {{ capacity = \"8Mi\" }}\n\
             [[devices.disks]]\nname = \"seed\"\nbus = \"cdrom\"\n[[volumes]]\nname = \"seed\"\n\
             cloud_init_no_cloud = {{ user_data = \"#cloud-config\\n\" }}\n",
            kernel.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--config", spec.to_str().unwrap(), "--run-dir"])
        .arg(&run)
        .current_dir(common::root())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let empty = run.join("scratchy-scratch.empty.img");
    let seed = run.join("scratchy-seed.cidata.img");
    let t0 = Instant::now();
    while !(empty.exists() && seed.exists()) && t0.elapsed() < Duration::from_secs(60) {
        assert!(child.try_wait().unwrap().is_none(), "vmhost ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    let made = (empty.exists(), seed.exists());
    let in_tmp = ["scratchy-scratch.empty.img", "scratchy-seed.cidata.img"]
        .iter()
        .any(|f| Path::new("/tmp").join(f).exists());
    let empty_len = std::fs::metadata(&empty).map(|m| m.len()).unwrap_or(0);
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: `pid` is our own child, not yet waited for, so it names that process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let left = (empty.exists(), seed.exists());
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        made,
        (true, true),
        "scratch images in {}: {stderr}",
        run.display()
    );
    assert!(!in_tmp, "a scratch image was made in /tmp");
    assert_eq!(empty_len, 8 << 20, "the empty disk has its capacity");
    assert_eq!(status.code(), Some(130), "stopped by SIGTERM: {stderr}");
    assert_eq!(left, (false, false), "scratch images removed at stop");
}
