//! KubeVirt `devices.{disks,interfaces,rng,autoattachVSOCK}`, `volumes` and `networks` → the raw spec's
//! device fields. Shapes vmhost cannot serve on a standalone host (`lun` disks, SR-IOV,
//! Multus, containerDisk, PVCs) are passed on or refused with the field named; validation
//! then reports them like TOML errors.

use serde_yaml_ng::{Mapping, Value};

use super::Walker;
use crate::spec::{
    RawCloudInit, RawDisk, RawEmpty, RawEmptyDisk, RawHostDisk, RawInterface, RawNetwork, RawSpec,
    RawVolume,
};
use crate::ConfigError;

/// `spec.domain.devices`.
pub(super) fn map_devices(
    w: &mut Walker,
    m: &Mapping,
    spec: &mut RawSpec,
) -> Result<(), ConfigError> {
    let known = [
        "autoattachGraphicsDevice",
        "autoattachVSOCK",
        "disks",
        "interfaces",
        "rng",
    ];
    for (key, v) in w.take(m, "devices.", &known) {
        let path = format!("devices.{key}");
        match key {
            "autoattachGraphicsDevice" => {
                spec.devices.autoattach_graphics_device = Some(w.bool(v, &path)?);
            }
            "autoattachVSOCK" => spec.devices.autoattach_vsock = Some(w.bool(v, &path)?),
            "disks" => {
                for (i, d) in w.seq(v, &path)?.iter().enumerate() {
                    let disk = map_disk(w, d, &format!("{path}[{i}]"))?;
                    spec.devices.disks.push(disk);
                }
            }
            "interfaces" => {
                for (i, f) in w.seq(v, &path)?.iter().enumerate() {
                    let iface = map_interface(w, f, &format!("{path}[{i}]"))?;
                    spec.devices.interfaces.push(iface);
                }
            }
            _ => {
                w.mapping(v, &path)?;
                spec.devices.rng = Some(RawEmpty {});
            }
        }
    }
    Ok(())
}

fn map_disk(w: &mut Walker, v: &Value, path: &str) -> Result<RawDisk, ConfigError> {
    let m = w.mapping(v, path)?;
    let mut disk = RawDisk::default();
    let known = [
        "name",
        "disk",
        "cdrom",
        "lun",
        "serial",
        "cache",
        "dedicatedIOThread",
    ];
    for (key, v) in w.take(m, &format!("{path}."), &known) {
        let field = format!("{path}.{key}");
        match key {
            "name" => disk.name = w.string(v, &field)?,
            "serial" => disk.serial = Some(w.string(v, &field)?),
            "cache" => disk.cache = Some(w.string(v, &field)?),
            "dedicatedIOThread" => disk.dedicated_io_thread = w.bool(v, &field)?,
            "lun" => return Err(w.err(
                &field,
                "is a SCSI LUN passthrough, which vmhost does not have; use disk: {bus: virtio}"
                    .into(),
            )),
            target => {
                let t = w.mapping(v, &field)?;
                let mut bus = None;
                for (k, v) in w.take(t, &format!("{field}."), &["bus", "readonly"]) {
                    match k {
                        "bus" => bus = Some(w.string(v, &format!("{field}.bus"))?),
                        _ => disk.read_only = w.bool(v, &format!("{field}.readonly"))?,
                    }
                }
                disk.bus = Some(if target == "cdrom" {
                    "cdrom".to_string()
                } else {
                    bus.unwrap_or_else(|| "virtio".to_string())
                });
            }
        }
    }
    Ok(disk)
}

fn map_interface(w: &mut Walker, v: &Value, path: &str) -> Result<RawInterface, ConfigError> {
    let m = w.mapping(v, path)?;
    let mut iface = RawInterface::default();
    for key in m.keys() {
        let key = key.as_str().unwrap_or("?");
        if ["sriov", "slirp", "passt", "binding", "macvtap"].contains(&key) {
            return Err(w.err(
                &format!("{path}.{key}"),
                "is a binding vmhost does not have; use bridge: {} (a tap on this host)".into(),
            ));
        }
    }
    let known = ["name", "bridge", "masquerade", "macAddress", "model"];
    for (key, v) in w.take(m, &format!("{path}."), &known) {
        let field = format!("{path}.{key}");
        match key {
            "name" => iface.name = w.string(v, &field)?,
            "bridge" => iface.bridge = Some(RawEmpty {}),
            "masquerade" => iface.masquerade = Some(RawEmpty {}),
            "macAddress" => iface.mac_address = Some(w.string(v, &field)?),
            _ => iface.model = Some(w.string(v, &field)?),
        }
    }
    Ok(iface)
}

/// `spec.volumes`.
pub(super) fn map_volumes(w: &mut Walker, v: &Value) -> Result<Vec<RawVolume>, ConfigError> {
    let mut out = Vec::new();
    for (i, item) in w.seq(v, "volumes")?.iter().enumerate() {
        let path = format!("volumes[{i}]");
        let m = w.mapping(item, &path)?;
        let mut vol = RawVolume::default();
        let known = [
            "name",
            "hostDisk",
            "cloudInitNoCloud",
            "emptyDisk",
            "containerDisk",
            "persistentVolumeClaim",
        ];
        for (key, v) in w.take(m, &format!("{path}."), &known) {
            let field = format!("{path}.{key}");
            match key {
                "name" => vol.name = w.string(v, &field)?,
                "hostDisk" => vol.host_disk = Some(map_host_disk(w, v, &field)?),
                "cloudInitNoCloud" => vol.cloud_init_no_cloud = Some(map_cloud_init(w, v, &field)?),
                "emptyDisk" => {
                    let e = w.mapping(v, &field)?;
                    let cap = e
                        .get("capacity")
                        .ok_or_else(|| w.err(&format!("{field}.capacity"), "is required".into()))?;
                    let capacity = w.quantity(cap, &format!("{field}.capacity"))?;
                    vol.empty_disk = Some(RawEmptyDisk { capacity });
                }
                "containerDisk" => vol.container_disk = Some(serde_json::Value::Null),
                _ => vol.persistent_volume_claim = Some(serde_json::Value::Null),
            }
        }
        out.push(vol);
    }
    Ok(out)
}

fn map_host_disk(w: &mut Walker, v: &Value, field: &str) -> Result<RawHostDisk, ConfigError> {
    let m = w.mapping(v, field)?;
    let mut h = RawHostDisk::default();
    for (key, v) in w.take(m, &format!("{field}."), &["path", "type", "capacity"]) {
        let f = format!("{field}.{key}");
        match key {
            "path" => h.path = w.string(v, &f)?.into(),
            "type" => h.kind = Some(w.string(v, &f)?),
            _ => h.capacity = Some(w.quantity(v, &f)?),
        }
    }
    Ok(h)
}

fn map_cloud_init(w: &mut Walker, v: &Value, field: &str) -> Result<RawCloudInit, ConfigError> {
    let m = w.mapping(v, field)?;
    for key in [
        "userDataBase64",
        "networkDataBase64",
        "secretRef",
        "networkDataSecretRef",
    ] {
        if m.contains_key(key) {
            return Err(w.err(
                &format!("{field}.{key}"),
                "is not supported on a standalone host; write the text in userData / networkData"
                    .into(),
            ));
        }
    }
    let mut ci = RawCloudInit::default();
    for (key, v) in w.take(m, &format!("{field}."), &["userData", "networkData"]) {
        let text = w.string(v, &format!("{field}.{key}"))?;
        if key == "userData" {
            ci.user_data = Some(text);
        } else {
            ci.network_data = Some(text);
        }
    }
    Ok(ci)
}

/// `spec.networks`.
pub(super) fn map_networks(w: &mut Walker, v: &Value) -> Result<Vec<RawNetwork>, ConfigError> {
    let mut out = Vec::new();
    for (i, item) in w.seq(v, "networks")?.iter().enumerate() {
        let path = format!("networks[{i}]");
        let m = w.mapping(item, &path)?;
        let mut net = RawNetwork::default();
        for (key, v) in w.take(m, &format!("{path}."), &["name", "pod", "multus"]) {
            let field = format!("{path}.{key}");
            match key {
                "name" => net.name = w.string(v, &field)?,
                "pod" => {
                    let p = w.mapping(v, &field)?;
                    // vmNetworkCIDR and friends configure KubeVirt's NAT, which vmhost lacks.
                    w.take(p, &format!("{field}."), &[]);
                    net.pod = Some(RawEmpty {});
                }
                _ => net.multus = Some(serde_json::Value::Null),
            }
        }
        out.push(net);
    }
    Ok(out)
}
