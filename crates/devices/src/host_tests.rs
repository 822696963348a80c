use std::os::unix::fs::MetadataExt;

use vmhost_config::{Binding, InterfaceSpec, MacAddress};

use super::*;

fn disk(name: &str, source: DiskSource) -> DiskSpec {
    DiskSpec {
        name: name.into(),
        source,
        read_only: false,
        cache: DiskCache::None,
        serial: name.into(),
    }
}

#[test]
fn prepares_disks_and_rng_and_removes_run_files_at_stop() {
    let dir = tempfile::tempdir().unwrap();
    let created = dir.path().join("data.img");
    let spec = DeviceSpec {
        disks: vec![
            disk(
                "data",
                DiskSource::Image {
                    path: created.clone(),
                    create_bytes: Some(8 << 20),
                },
            ),
            disk(
                "scratch",
                DiskSource::EmptyDisk {
                    capacity_bytes: 1_000_000,
                },
            ),
            disk(
                "seed",
                DiskSource::CloudInitNoCloud {
                    user_data: "#cloud-config\n".into(),
                    network_data: None,
                },
            ),
        ],
        interfaces: Vec::new(),
        rng: true,
        ..DeviceSpec::default()
    };
    let host = HostDevices::prepare(&spec, "web", dir.path()).unwrap();
    let types: Vec<u32> = host
        .devices
        .iter()
        .map(|d| d.device.device_type())
        .collect();
    assert_eq!(types, [2, 2, 2, 4]);
    let meta = std::fs::metadata(&created).unwrap();
    assert_eq!(meta.len(), 8 << 20);
    assert_eq!(meta.blocks(), 0, "DiskOrCreate makes a sparse file");
    let scratch = dir.path().join("web-scratch.empty.img");
    assert_eq!(
        std::fs::metadata(&scratch).unwrap().len(),
        1_003_520,
        "rounded up to 4 KiB"
    );
    let seed = dir.path().join("web-seed.cidata.img");
    assert!(seed.exists());
    assert_eq!(host.scratch_files(), [scratch.clone(), seed.clone()]);
    assert!(
        host.devices[0].describe.contains("data.img"),
        "{}",
        host.devices[0].describe
    );
    drop(host);
    assert!(!scratch.exists() && !seed.exists(), "run files go at stop");
    assert!(created.exists(), "a DiskOrCreate image stays");
}

#[test]
fn a_failure_half_way_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let created = dir.path().join("new.img");
    let spec = DeviceSpec {
        disks: vec![
            disk(
                "new",
                DiskSource::Image {
                    path: created.clone(),
                    create_bytes: Some(1 << 20),
                },
            ),
            disk(
                "scratch",
                DiskSource::EmptyDisk {
                    capacity_bytes: 1 << 20,
                },
            ),
            disk(
                "gone",
                DiskSource::Image {
                    path: dir.path().join("missing.img"),
                    create_bytes: None,
                },
            ),
        ],
        interfaces: Vec::new(),
        rng: false,

        ..DeviceSpec::default()
    };
    let err = HostDevices::prepare(&spec, "web", dir.path()).unwrap_err();
    assert!(
        matches!(&err, HostError::Block { disk, .. } if disk == "gone"),
        "{err:?}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn a_named_tap_must_exist_and_an_unnamed_one_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let iface = |tap: Option<&str>| InterfaceSpec {
        name: "default".into(),
        binding: Binding::Bridge,
        mac: MacAddress::generate("web", "default"),
        tap: tap.map(str::to_string),
    };
    let spec = DeviceSpec {
        interfaces: vec![iface(Some("vmhnotthere0"))],
        ..DeviceSpec::default()
    };
    let err = HostDevices::prepare(&spec, "web", dir.path()).unwrap_err();
    assert!(matches!(err, HostError::TapMissing { .. }), "{err:?}");
    assert!(err.to_string().contains("ip tuntap add"), "{err}");

    let spec = DeviceSpec {
        interfaces: vec![iface(None)],
        ..DeviceSpec::default()
    };
    let host = HostDevices::prepare(&spec, "web", dir.path())
        .expect("creating a tap needs root or CAP_NET_ADMIN and /dev/net/tun");
    let d = &host.devices[0];
    assert_eq!(d.device.device_type(), 1);
    assert_eq!(d.backend.map(|(_, q)| q), Some(0));
    assert!(d.describe.contains("created"), "{}", d.describe);
    assert_eq!(
        d.device.config()[..6],
        MacAddress::generate("web", "default").0
    );
}

#[test]
fn a_stale_empty_disk_from_a_killed_run_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("web-scratch.empty.img");
    std::fs::write(&stale, b"left over by a SIGKILLed vmhost").unwrap();
    let spec = DeviceSpec {
        disks: vec![disk(
            "scratch",
            DiskSource::EmptyDisk {
                capacity_bytes: 4096,
            },
        )],
        ..DeviceSpec::default()
    };
    let host = HostDevices::prepare(&spec, "web", dir.path()).unwrap();
    assert_eq!(
        std::fs::read(&stale).unwrap(),
        vec![0u8; 4096],
        "a fresh, empty disk"
    );
    drop(host);
    assert!(!stale.exists());
}

#[test]
fn vsock_listens_in_the_run_dir_and_its_socket_goes_at_stop() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let spec = DeviceSpec {
        vsock: Some(vmhost_config::VsockSpec {
            cid: 3,
            socket: None,
            backend: Default::default(),
        }),
        ..DeviceSpec::default()
    };
    let host = HostDevices::prepare(&spec, "web", dir.path()).unwrap();
    let sock = dir.path().join("web.vsock");
    assert_eq!(host.devices[0].device.device_type(), 19);
    assert!(
        host.devices[0].backend.is_some(),
        "the I/O thread watches it"
    );
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_ok());
    // A second VM on the same socket: a host error naming the field and the path.
    let err = HostDevices::prepare(&spec, "web", dir.path()).unwrap_err();
    assert!(matches!(err, HostError::Vsock { .. }), "{err:?}");
    assert!(err.to_string().contains("devices.vsock.socket"), "{err}");
    assert!(sock.exists(), "the running VM keeps its socket");
    drop(host);
    assert!(!sock.exists(), "removed at stop");
}

#[test]
fn the_vhost_backend_needs_the_kernels_vhost_vsock() {
    let dir = tempfile::tempdir().unwrap();
    let spec = DeviceSpec {
        vsock: Some(vmhost_config::VsockSpec {
            cid: 0x7654_3210,
            socket: None,
            backend: vmhost_config::VsockBackend::Vhost,
        }),
        ..DeviceSpec::default()
    };
    let got = HostDevices::prepare(&spec, "web", dir.path());
    if std::path::Path::new(crate::vsock::vhost::VHOST_VSOCK_PATH).exists() {
        // A host with vhost-vsock: the device claims the CID; no socket is made.
        let host = got.unwrap();
        assert_eq!(host.devices[0].device.device_type(), 19);
        assert!(!dir.path().join("web.vsock").exists());
    } else {
        let err = got.unwrap_err();
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(matches!(err, HostError::Vhost { .. }), "{err:?}");
        assert!(
            chain.contains("/dev/vhost-vsock") && chain.contains("backend = \"unix\""),
            "{chain}"
        );
    }
}
