use std::os::unix::net::UnixListener;

use crate::{from_toml_str, from_yaml_str, ConfigError, LoadedSpec, SpecError};

use super::*;

fn errors(r: Result<LoadedSpec, ConfigError>) -> Vec<SpecError> {
    match r {
        Err(ConfigError::Invalid(e)) => e,
        other => panic!("expected validation errors, got {other:?}"),
    }
}

fn toml(vsock: &str) -> String {
    format!("name = \"agent\"\n[memory]\nguest = \"256Mi\"\n{vsock}\n")
}

#[test]
fn a_vsock_table_resolves_with_its_cid_and_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.vsock");
    let text = toml(&format!(
        "[devices.vsock]\ncid = 42\nsocket = \"{}\"",
        sock.display()
    ));
    let spec = from_toml_str(&text, "t.toml").unwrap().spec;
    let v = spec.devices.vsock.unwrap();
    assert_eq!(v.cid, 42);
    assert_eq!(v.socket.as_deref(), Some(sock.as_path()));
    assert_eq!(v.socket_in(Path::new("/run/vmhost"), "agent"), sock);
}

#[test]
fn defaults_are_cid_3_and_a_socket_named_after_the_vm_in_the_run_dir() {
    let spec = from_toml_str(&toml("[devices.vsock]"), "t.toml")
        .unwrap()
        .spec;
    let v = spec.devices.vsock.unwrap();
    assert_eq!((v.cid, v.socket.clone()), (3, None));
    assert_eq!(
        v.socket_in(Path::new("/run/vmhost"), "agent"),
        Path::new("/run/vmhost/agent.vsock")
    );
    let spec = from_toml_str(&toml("[devices]\nautoattach_vsock = true"), "t.toml")
        .unwrap()
        .spec;
    assert_eq!(spec.devices.vsock.unwrap().cid, 3);
    let spec = from_toml_str(&toml(""), "t.toml").unwrap().spec;
    assert!(spec.devices.vsock.is_none(), "no vsock unless asked for");
}

#[test]
fn kubevirt_autoattach_vsock_adds_the_device() {
    let yaml = "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: agent\nspec:\n  domain:\n    memory:\n      guest: 256Mi\n    devices:\n      autoattachVSOCK: true\n";
    let spec = from_yaml_str(yaml, "vmi.yaml").unwrap().spec;
    assert_eq!(
        spec.devices.vsock,
        Some(VsockSpec {
            cid: 3,
            socket: None,
            backend: VsockBackend::Unix,
        })
    );
    let off = yaml.replace("autoattachVSOCK: true", "autoattachVSOCK: false");
    assert!(from_yaml_str(&off, "vmi.yaml")
        .unwrap()
        .spec
        .devices
        .vsock
        .is_none());
}

#[test]
fn reserved_cids_are_refused_naming_the_field() {
    for cid in [0u64, 1, 2, 4_294_967_295] {
        let errs = errors(from_toml_str(
            &toml(&format!("[devices.vsock]\ncid = {cid}")),
            "t.toml",
        ));
        assert!(
            errs.iter()
                .any(|e| e.field == "devices.vsock.cid" && e.value == cid.to_string()),
            "{cid}: {errs:?}"
        );
    }
}

#[test]
fn bad_socket_paths_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let long = format!("/tmp/{}", "s".repeat(MAX_SOCKET_PATH));
    let cases = [
        ("relative.vsock".to_string(), "absolute"),
        (
            "/no/such/dir/vm.vsock".to_string(),
            "directory does not exist",
        ),
        (file.display().to_string(), "not a socket"),
        (long, "longer than"),
    ];
    for (path, rule) in cases {
        let errs = errors(from_toml_str(
            &toml(&format!("[devices.vsock]\nsocket = \"{path}\"")),
            "t.toml",
        ));
        assert!(
            errs.iter()
                .any(|e| e.field == "devices.vsock.socket" && e.rule.contains(rule)),
            "{path}: {errs:?}"
        );
    }
    // An existing socket passes validation: whether it is live is checked at start.
    let sock = dir.path().join("live.vsock");
    let _l = UnixListener::bind(&sock).unwrap();
    let text = toml(&format!("[devices.vsock]\nsocket = \"{}\"", sock.display()));
    assert!(from_toml_str(&text, "t.toml").is_ok());
}

#[test]
fn autoattach_false_with_a_vsock_table_contradicts() {
    let errs = errors(from_toml_str(
        &toml("[devices]\nautoattach_vsock = false\n[devices.vsock]\ncid = 5"),
        "t.toml",
    ));
    assert!(
        errs.iter().any(|e| e.field == "devices.autoattach_vsock"),
        "{errs:?}"
    );
}

#[test]
fn unknown_vsock_keys_are_errors() {
    let r = from_toml_str(&toml("[devices.vsock]\nport = 5"), "t.toml");
    assert!(matches!(r, Err(ConfigError::Toml { .. })), "{r:?}");
}

#[test]
fn the_vhost_backend_resolves_and_has_no_socket() {
    let spec = from_toml_str(
        &toml("[devices.vsock]\ncid = 7\nbackend = \"vhost\""),
        "t.toml",
    )
    .unwrap()
    .spec;
    let v = spec.devices.vsock.unwrap();
    assert_eq!((v.cid, v.backend, v.socket), (7, VsockBackend::Vhost, None));
    let errs = errors(from_toml_str(
        &toml("[devices.vsock]\nbackend = \"vhost\"\nsocket = \"/tmp/x.vsock\""),
        "t.toml",
    ));
    assert!(
        errs.iter()
            .any(|e| e.field == "devices.vsock.socket" && e.rule.contains("AF_VSOCK")),
        "{errs:?}"
    );
    let errs = errors(from_toml_str(
        &toml("[devices.vsock]\nbackend = \"qemu\""),
        "t.toml",
    ));
    assert!(
        errs.iter().any(|e| e.field == "devices.vsock.backend"),
        "{errs:?}"
    );
}
