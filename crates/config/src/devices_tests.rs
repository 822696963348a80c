use std::path::{Path, PathBuf};

use super::*;

fn errors(r: Result<LoadedSpec, ConfigError>) -> Vec<SpecError> {
    match r {
        Err(ConfigError::Invalid(e)) => e,
        other => panic!("expected validation errors, got {other:?}"),
    }
}

fn has(errs: &[SpecError], field: &str, rule_part: &str) -> bool {
    errs.iter()
        .any(|e| e.field == field && e.rule.contains(rule_part))
}

/// A 1 MiB image in a fresh temporary directory.
fn image() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("root.img");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    (dir, path)
}

fn disk_toml(path: &Path, extra_disk: &str) -> String {
    format!(
        r#"
name = "web"
[memory]
guest = "1Gi"
[[devices.disks]]
name = "root"
{extra_disk}
[[volumes]]
name = "root"
host_disk = {{ path = "{}", type = "Disk" }}
"#,
        path.display()
    )
}

#[test]
fn full_device_spec_resolves() {
    let (_dir, path) = image();
    let text = format!(
        r##"{}
[[devices.disks]]
name = "seed"
bus = "cdrom"
[[volumes]]
name = "seed"
cloud_init_no_cloud = {{ user_data = "#cloud-config\n", network_data = "version: 2\n" }}
[[devices.disks]]
name = "scratch"
cache = "writeback"
serial = "s1"
[[volumes]]
name = "scratch"
empty_disk = {{ capacity = "1Gi" }}
[[devices.interfaces]]
name = "default"
bridge = {{}}
[[networks]]
name = "default"
pod = {{}}
[devices.rng]
"##,
        disk_toml(&path, "")
    );
    let d = from_toml_str(&text, "t.toml").unwrap().spec.devices;
    assert!(d.rng);
    assert_eq!(d.disks.len(), 3);
    assert_eq!(
        d.disks[0],
        DiskSpec {
            name: "root".into(),
            source: DiskSource::Image {
                path: path.clone(),
                create_bytes: None
            },
            read_only: false,
            cache: DiskCache::Auto,
            serial: "root".into(),
        }
    );
    assert!(d.disks[1].read_only, "a cdrom is read-only");
    assert_eq!(
        d.disks[1].source,
        DiskSource::CloudInitNoCloud {
            user_data: "#cloud-config\n".into(),
            network_data: Some("version: 2\n".into())
        }
    );
    assert_eq!(
        d.disks[2].source,
        DiskSource::EmptyDisk {
            capacity_bytes: 1 << 30
        }
    );
    assert_eq!(
        (d.disks[2].cache, d.disks[2].serial.as_str()),
        (DiskCache::Writeback, "s1")
    );
    assert_eq!(d.interfaces.len(), 1);
    assert_eq!(d.interfaces[0].binding, Binding::Bridge);
    assert_eq!(d.interfaces[0].mac, MacAddress::generate("web", "default"));
    assert_eq!(d.interfaces[0].tap, None);
}

#[test]
fn duplicate_disk_names_are_refused() {
    let (_dir, path) = image();
    let text = format!(
        "{}\n[[devices.disks]]\nname = \"root\"\n",
        disk_toml(&path, "")
    );
    let e = errors(from_toml_str(&text, "t.toml"));
    assert!(has(&e, "devices.disks[1].name", "duplicate"), "{e:?}");
}

#[test]
fn a_disk_without_a_volume_and_a_volume_without_a_disk_are_refused() {
    let text = r#"
[memory]
guest = "1Gi"
[[devices.disks]]
name = "data"
[[volumes]]
name = "other"
empty_disk = { capacity = "1Gi" }
"#;
    let e = errors(from_toml_str(text, "t.toml"));
    assert!(has(&e, "devices.disks[0].name", "no volume"), "{e:?}");
    assert!(has(&e, "volumes[0].name", "not used by any disk"), "{e:?}");
}

#[test]
fn a_missing_image_a_directory_and_a_fifo_are_spec_errors() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0);
    for (path, rule) in [
        (dir.path().join("missing.img"), "cannot be used"),
        (dir.path().to_path_buf(), "is a directory"),
        (fifo, "is a FIFO"),
    ] {
        let e = errors(from_toml_str(&disk_toml(&path, ""), "t.toml"));
        assert!(
            has(&e, "volumes[0].host_disk.path", rule),
            "{path:?}: {e:?}"
        );
    }
    assert!(
        std::fs::read_dir(dir.path()).unwrap().count() == 1,
        "validation creates nothing"
    );
}

extern "C" {
    #[link_name = "mkfifo"]
    fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
}

/// `cache = "none"` on a file system without O_DIRECT (procfs here; tmpfs before Linux 6.6)
/// is a spec error naming the field; left out, the cache is decided at open.
#[test]
fn cache_none_on_a_file_system_without_o_direct_is_refused() {
    let path = Path::new("/proc/version");
    let e = errors(from_toml_str(
        &disk_toml(path, "cache = \"none\""),
        "t.toml",
    ));
    assert!(
        has(&e, "devices.disks[0].cache", "does not support O_DIRECT"),
        "{e:?}"
    );
    assert!(e.iter().any(|e| e.fix.contains("leave cache out")), "{e:?}");
    assert!(from_toml_str(&disk_toml(path, ""), "t.toml").is_ok());
}

#[test]
fn cache_none_needs_an_image_of_whole_4k_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.img");
    std::fs::write(&path, vec![0u8; 1000]).unwrap();
    let e = errors(from_toml_str(
        &disk_toml(&path, "cache = \"none\""),
        "t.toml",
    ));
    assert!(
        has(&e, "devices.disks[0].cache", "whole 4 KiB blocks"),
        "{e:?}"
    );
    let ok = from_toml_str(&disk_toml(&path, "cache = \"writeback\""), "t.toml");
    assert!(ok.is_ok(), "{ok:?}");
    // Left out, the cache is decided when the image is opened (the page cache here).
    let auto = from_toml_str(&disk_toml(&path, ""), "t.toml").unwrap();
    assert_eq!(auto.spec.devices.disks[0].cache, DiskCache::Auto);
}

#[test]
fn disk_or_create_needs_a_capacity_and_an_existing_directory() {
    let text = r#"
[memory]
guest = "1Gi"
[[devices.disks]]
name = "d"
[[volumes]]
name = "d"
host_disk = { path = "/nonexistent-vmhost-dir/d.img", type = "DiskOrCreate" }
"#;
    let e = errors(from_toml_str(text, "t.toml"));
    assert!(
        has(&e, "volumes[0].host_disk.capacity", "DiskOrCreate"),
        "{e:?}"
    );
    assert!(
        has(&e, "volumes[0].host_disk.path", "directory does not exist"),
        "{e:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.img");
    let text = text
        .replace("/nonexistent-vmhost-dir/d.img", path.to_str().unwrap())
        .replace("\"DiskOrCreate\"", "\"DiskOrCreate\", capacity = \"64Mi\"");
    let d = from_toml_str(&text, "t.toml").unwrap().spec.devices;
    assert_eq!(
        d.disks[0].source,
        DiskSource::Image {
            path: path.clone(),
            create_bytes: Some(64 << 20)
        }
    );
    assert!(
        !path.exists(),
        "the image is created at start, not while validating"
    );
}

#[test]
fn bad_bus_cache_and_serial_are_named() {
    let (_dir, path) = image();
    let extra = "bus = \"sata\"\ncache = \"writethrough\"\nserial = \"0123456789abcdefghijk\"";
    let e = errors(from_toml_str(&disk_toml(&path, extra), "t.toml"));
    assert!(has(&e, "devices.disks[0].bus", "only virtio"), "{e:?}");
    assert!(has(&e, "devices.disks[0].cache", "cache mode"), "{e:?}");
    assert!(has(&e, "devices.disks[0].serial", "20 bytes"), "{e:?}");
}

#[test]
fn interfaces_need_a_network_one_binding_and_a_unicast_mac() {
    let text = r#"
[memory]
guest = "1Gi"
[[devices.interfaces]]
name = "a"
bridge = {}
mac_address = "03:00:00:00:00:01"
[[devices.interfaces]]
name = "b"
[[networks]]
name = "b"
pod = {}
[[networks]]
name = "c"
multus = { networkName = "x" }
"#;
    let e = errors(from_toml_str(text, "t.toml"));
    assert!(has(&e, "devices.interfaces[0].name", "no network"), "{e:?}");
    assert!(
        has(&e, "devices.interfaces[0].mac_address", "multicast"),
        "{e:?}"
    );
    assert!(
        has(&e, "devices.interfaces[1].bridge", "exactly one binding"),
        "{e:?}"
    );
    assert!(has(&e, "networks[1].multus", "cluster"), "{e:?}");
    assert!(
        has(&e, "networks[1].name", "not used by any interface"),
        "{e:?}"
    );
}

#[test]
fn a_given_mac_and_tap_are_kept() {
    let text = r#"
[memory]
guest = "1Gi"
[[devices.interfaces]]
name = "default"
masquerade = {}
mac_address = "02:AA:bb:00:00:01"
tap = "tap7"
[[networks]]
name = "default"
pod = {}
"#;
    let i = &from_toml_str(text, "t.toml")
        .unwrap()
        .spec
        .devices
        .interfaces[0];
    assert_eq!(i.mac.to_string(), "02:aa:bb:00:00:01");
    assert_eq!(i.binding, Binding::Masquerade);
    assert_eq!(i.tap.as_deref(), Some("tap7"));
}

#[test]
fn generated_macs_differ_per_vm_and_interface() {
    let a = MacAddress::generate("web", "default");
    assert_ne!(a, MacAddress::generate("web", "second"));
    assert_ne!(a, MacAddress::generate("db", "default"));
    for m in [a, MacAddress::generate("", "")] {
        assert!(m.is_unicast() && m.is_locally_administered(), "{m}");
    }
}

const VMI: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: vmi-fedora
spec:
  domain:
    resources:
      requests:
        memory: 1Gi
    devices:
      rng: {}
      disks:
        - name: containerdisk
          disk:
            bus: virtio
        - name: cloudinitdisk
          disk:
            bus: virtio
      interfaces:
        - name: default
          masquerade: {}
  networks:
    - name: default
      pod: {}
  volumes:
    - name: containerdisk
      hostDisk:
        path: IMAGE
        type: Disk
    - name: cloudinitdisk
      cloudInitNoCloud:
        userData: |-
          #cloud-config
          password: fedora
"#;

#[test]
fn kubevirt_devices_volumes_and_networks_are_mapped() {
    let (_dir, path) = image();
    let text = VMI.replace("IMAGE", path.to_str().unwrap());
    let loaded = from_yaml_str(&text, "vmi.yaml").unwrap();
    let d = &loaded.spec.devices;
    assert!(d.rng);
    assert_eq!(d.disks.len(), 2);
    assert_eq!(
        d.disks[0].source,
        DiskSource::Image {
            path,
            create_bytes: None
        }
    );
    assert_eq!(
        d.disks[1].source,
        DiskSource::CloudInitNoCloud {
            user_data: "#cloud-config\npassword: fedora".into(),
            network_data: None
        }
    );
    assert_eq!(d.interfaces[0].binding, Binding::Masquerade);
    assert_eq!(
        d.interfaces[0].mac,
        MacAddress::generate("vmi-fedora", "default")
    );
    assert!(
        loaded
            .warnings
            .iter()
            .all(|w| !w.contains("disks") && !w.contains("volumes")),
        "{:?}",
        loaded.warnings
    );
}

#[test]
fn kubevirt_container_disk_and_pvc_are_refused_naming_the_field() {
    let text = VMI.replace(
        "      hostDisk:\n        path: IMAGE\n        type: Disk",
        "      containerDisk:\n        image: quay.io/containerdisks/fedora:latest",
    );
    let e = errors(from_yaml_str(&text, "vmi.yaml"));
    let hit = e
        .iter()
        .find(|e| e.field == "spec.volumes[0].containerDisk")
        .unwrap();
    assert!(hit.fix.contains("hostDisk"), "{hit}");
    let text = VMI.replace(
        "      hostDisk:\n        path: IMAGE\n        type: Disk",
        "      persistentVolumeClaim:\n        claimName: fedora",
    );
    let e = errors(from_yaml_str(&text, "vmi.yaml"));
    assert!(
        has(&e, "spec.volumes[0].persistentVolumeClaim", "cluster"),
        "{e:?}"
    );
}

#[test]
fn kubevirt_cdrom_is_read_only_and_sata_is_refused() {
    let (_dir, path) = image();
    let text = VMI.replace("IMAGE", path.to_str().unwrap()).replace(
        "        - name: cloudinitdisk\n          disk:\n            bus: virtio",
        "        - name: cloudinitdisk\n          cdrom:\n            bus: sata",
    );
    let d = from_yaml_str(&text, "vmi.yaml").unwrap().spec.devices;
    assert!(d.disks[1].read_only);
    let text = VMI
        .replace("IMAGE", path.to_str().unwrap())
        .replacen("bus: virtio", "bus: sata", 1);
    let e = errors(from_yaml_str(&text, "vmi.yaml"));
    assert!(
        has(&e, "spec.domain.devices.disks[0].bus", "only virtio"),
        "{e:?}"
    );
}

#[test]
fn kubevirt_sriov_is_refused() {
    let text = VMI.replace("          masquerade: {}", "          sriov: {}");
    match from_yaml_str(&text, "vmi.yaml") {
        Err(ConfigError::Manifest { field, .. }) => {
            assert_eq!(field, "spec.domain.devices.interfaces[0].sriov");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn more_than_eight_devices_are_refused() {
    let mut text = String::from("[memory]\nguest = \"1Gi\"\n[devices.rng]\n");
    for i in 0..8 {
        text.push_str(&format!(
            "[[devices.disks]]\nname = \"d{i}\"\n[[volumes]]\nname = \"d{i}\"\nempty_disk = {{ capacity = \"1Mi\" }}\n"
        ));
    }
    let e = errors(from_toml_str(&text, "t.toml"));
    assert!(has(&e, "devices", "at most 8"), "{e:?}");
}

#[test]
fn disk_names_that_are_not_dns_labels_are_refused() {
    for bad in ["../../etc/evil", "Data", "a/b", "-x", "x-", &"d".repeat(64)] {
        let text = format!(
            r#"
[memory]
guest = "1Gi"
[[devices.disks]]
name = {bad:?}
[[volumes]]
name = {bad:?}
empty_disk = {{ capacity = "1Gi" }}
"#
        );
        let e = errors(from_toml_str(&text, "t.toml"));
        let err = e
            .iter()
            .find(|e| e.field == "devices.disks[0].name")
            .unwrap_or_else(|| panic!("{bad:?} accepted: {e:?}"));
        let msg = err.to_string();
        assert!(msg.contains(&format!("{bad:?}")), "{msg}");
        assert!(msg.contains("DNS label"), "{msg}");
        assert!(msg.contains("rename the disk"), "{msg}");
    }
    let (_dir, path) = image();
    from_toml_str(&disk_toml(&path, ""), "t.toml").unwrap();
}
