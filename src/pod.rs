//! `vmhost pod`: the Kubernetes objects that run a VM under vmhost, from its plan.
//!
//! The envelope is the pod's resource request (docs/kubernetes.md): dedicated placement gives a
//! Guaranteed pod (requests = limits, CPU in whole cores), shared placement the Burstable pod
//! KubeVirt would write (CPU request = vCPUs ÷ the allocation ratio). Hugepages are requested
//! per size, `/dev/kvm` (and `tun`/`vhost-net` with a NIC) through device-plugin resources, the
//! spec travels in a ConfigMap, host disks and boot files are `hostPath` volumes at their own
//! paths, and the container gets the capabilities its features need and no other.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde_json::{json, Map, Value};
use vmhost_config::{BootSpec, DiskSource, VmSpec};
use vmhost_plan::Plan;

use crate::{Exit, EXIT_INVALID};

/// Where the ConfigMap with the spec is mounted in the container.
pub const SPEC_DIR: &str = "/etc/vmhost";
/// The run directory (ledger, sockets) in the container.
pub const RUN_DIR: &str = "/run/vmhost";
/// Prefix of the annotations that carry the plan's overhead terms.
pub const ANNOTATION_PREFIX: &str = "vmhost.io";

/// What `vmhost pod` was asked for.
pub struct PodRequest<'a> {
    /// The container image holding the vmhost binary.
    pub image: &'a str,
    /// Object name (default: the VM's name).
    pub name: Option<&'a str>,
    /// The spec file's name and text, as they go into the ConfigMap.
    pub spec_file: (&'a str, &'a str),
}

/// The ConfigMap and the Pod, in the order `kubectl apply` should create them.
pub fn objects(spec: &VmSpec, plan: &Plan, req: &PodRequest<'_>) -> Result<Vec<Value>> {
    check_pod_spec(spec, req.spec_file.1)?;
    let name = dns_label(req.name.unwrap_or(&spec.name));
    let (file, text) = req.spec_file;
    let config_map = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": name, "labels": labels(spec) },
        "data": { file: text },
    });
    let (mounts, volumes) = volumes(spec, plan, &name);
    let mut container = json!({
        "name": "vmhost",
        "image": req.image,
        "command": ["vmhost", "--config", format!("{SPEC_DIR}/{file}"), "--run-dir", RUN_DIR],
        "resources": resources(spec, plan),
        "volumeMounts": mounts,
        "securityContext": {
            "capabilities": { "drop": ["ALL"], "add": capabilities(spec) },
            "allowPrivilegeEscalation": false,
        },
    });
    if capabilities(spec).is_empty() {
        container["securityContext"]["capabilities"] = json!({ "drop": ["ALL"] });
    }
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
    });
    if spec.cpu.dedicated_cpu_placement {
        // KubeVirt's virt-controller asks for a node whose kubelet runs the static CPU manager.
        pod_spec["nodeSelector"] = json!({ "cpumanager": "true" });
    }
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "labels": labels(spec), "annotations": annotations(plan) },
        "spec": pod_spec,
    });
    Ok(vec![config_map, pod])
}

/// Specs that cannot be a pod: exit 2 naming the field and what to do instead.
fn check_pod_spec(spec: &VmSpec, text: &str) -> Result<()> {
    let invalid = |message: String| {
        anyhow::Error::new(Exit {
            code: EXIT_INVALID,
            message,
        })
    };
    for d in &spec.devices.disks {
        if let DiskSource::Image { path, .. } = &d.source {
            if let Some(top) = ["/proc", "/sys", "/dev"]
                .into_iter()
                .find(|top| path.starts_with(top))
            {
                return Err(invalid(format!(
                    "disk {:?}: host disk path {} is under {top}, which a pod sees from its own namespaces, not the node's; put the image in a file on the node (a hostPath) or a volume",
                    d.name,
                    path.display()
                )));
            }
        }
    }
    for i in &spec.devices.interfaces {
        if let Some(tap) = &i.tap {
            return Err(invalid(format!(
                "interface {:?}: tap {tap:?} is an existing tap of the host's network namespace, which the pod does not see; drop `tap` so that vmhost creates one inside the pod",
                i.name
            )));
        }
    }
    if let BootSpec::Kernel { kernel, initrd, .. } = &spec.boot {
        for (field, path) in std::iter::once(("boot.kernel", kernel))
            .chain(initrd.as_ref().map(|p| ("boot.initrd", p)))
        {
            if !text.contains(&*path.to_string_lossy()) {
                return Err(invalid(format!(
                    "{field}: {} is relative to the spec file, which is {SPEC_DIR} in the pod; write the absolute path of the file on the node",
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

/// requests and limits from the envelope.
fn resources(spec: &VmSpec, plan: &Plan) -> Value {
    let e = &plan.envelope;
    let mut requests = Map::new();
    let mut limits = Map::new();
    if spec.cpu.dedicated_cpu_placement {
        let cpu = json!(e.dedicated_cpus.to_string());
        requests.insert("cpu".into(), cpu.clone());
        limits.insert("cpu".into(), cpu);
    } else {
        let milli = (e.cpus * 1000.0).ceil().max(1.0);
        requests.insert("cpu".into(), json!(format!("{milli}m")));
    }
    requests.insert("memory".into(), json!(e.memory_request_bytes.to_string()));
    if let Some(limit) = e.memory_limit_bytes {
        limits.insert("memory".into(), json!(limit.to_string()));
    }
    for (size, bytes) in hugepage_bytes(plan) {
        let key = format!("hugepages-{}", vmhost_config::format_bytes(size));
        requests.insert(key.clone(), json!(bytes.to_string()));
        limits.insert(key, json!(bytes.to_string()));
    }
    for device in devices(spec) {
        requests.insert(device.into(), json!("1"));
        limits.insert(device.into(), json!("1"));
    }
    json!({ "requests": requests, "limits": limits })
}

/// Bytes of hugepages per page size, summed over nodes.
pub fn hugepage_bytes(plan: &Plan) -> BTreeMap<u64, u64> {
    let mut per = BTreeMap::new();
    for h in &plan.envelope.hugepages {
        *per.entry(h.page_size_bytes).or_default() += h.count * h.page_size_bytes;
    }
    per
}

/// The device-plugin resources the VM needs, as KubeVirt's launcher asks for them.
fn devices(spec: &VmSpec) -> Vec<&'static str> {
    let mut d = vec!["devices.kubevirt.io/kvm"];
    if !spec.devices.interfaces.is_empty() {
        d.extend(["devices.kubevirt.io/tun", "devices.kubevirt.io/vhost-net"]);
    }
    d
}

/// The capabilities the spec's features need: `SYS_NICE` for realtime vCPUs (SCHED_FIFO),
/// `NET_ADMIN` for the taps vmhost creates.
fn capabilities(spec: &VmSpec) -> Vec<&'static str> {
    let mut caps = Vec::new();
    if !spec.devices.interfaces.is_empty() {
        caps.push("NET_ADMIN");
    }
    if spec.cpu.realtime_vcpus.is_some() {
        caps.push("SYS_NICE");
    }
    caps
}

/// The container's mounts and the pod's volumes: the spec, the run directory, the hugepages
/// emptyDir at the spec's hugetlbfs, and every host file at its own path.
fn volumes(spec: &VmSpec, plan: &Plan, name: &str) -> (Vec<Value>, Vec<Value>) {
    let mut mounts = vec![
        json!({ "name": "spec", "mountPath": SPEC_DIR, "readOnly": true }),
        json!({ "name": "run", "mountPath": RUN_DIR }),
    ];
    let mut volumes = vec![
        json!({ "name": "spec", "configMap": { "name": name } }),
        json!({ "name": "run", "emptyDir": {} }),
    ];
    if let Some(h) = &spec.memory.hugepages {
        if let Some(dir) = &h.hugetlbfs {
            let medium = format!(
                "HugePages-{}",
                vmhost_config::format_bytes(h.page_size_bytes)
            );
            mounts.push(json!({ "name": "hugepages", "mountPath": dir.display().to_string() }));
            volumes.push(json!({ "name": "hugepages", "emptyDir": { "medium": medium } }));
        }
    }
    let mut host_files: Vec<(String, &Path, &str, bool)> = Vec::new();
    for d in &spec.devices.disks {
        if let DiskSource::Image { path, create_bytes } = &d.source {
            let kind = if create_bytes.is_some() {
                "FileOrCreate"
            } else {
                "File"
            };
            host_files.push((format!("disk-{}", d.name), path, kind, d.read_only));
        }
    }
    if let BootSpec::Kernel { kernel, initrd, .. } = &plan.boot {
        host_files.push(("boot-kernel".into(), kernel, "File", true));
        if let Some(i) = initrd {
            host_files.push(("boot-initrd".into(), i, "File", true));
        }
    }
    for (label, path, kind, read_only) in host_files {
        let vol = dns_label(&label);
        let path = path.display().to_string();
        mounts.push(json!({ "name": vol, "mountPath": path, "readOnly": read_only }));
        volumes.push(json!({ "name": vol, "hostPath": { "path": path, "type": kind } }));
    }
    (mounts, volumes)
}

/// The plan's overhead terms and totals as annotations.
fn annotations(plan: &Plan) -> Map<String, Value> {
    let e = &plan.envelope;
    let mut a = Map::new();
    let key = |k: &str| format!("{ANNOTATION_PREFIX}/{k}");
    a.insert(
        key("overhead-model"),
        json!(format!("{:?}", e.overhead_model).to_lowercase()),
    );
    a.insert(key("overhead-bytes"), json!(e.overhead_bytes.to_string()));
    a.insert(
        key("guest-memory-bytes"),
        json!(e.guest_memory_bytes.to_string()),
    );
    for (term, bytes) in &e.overhead_terms {
        a.insert(
            key(&format!("overhead-{}", term.replace('_', "-"))),
            json!(bytes.to_string()),
        );
    }
    a
}

fn labels(spec: &VmSpec) -> Value {
    json!({ "app.kubernetes.io/managed-by": "vmhost", "vmhost.io/vm": dns_label(&spec.name) })
}

/// A DNS-1123 label: lowercase alphanumerics and `-`, at most 63, alphanumeric at both ends.
pub fn dns_label(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let trimmed: String = mapped.trim_matches('-').chars().take(63).collect();
    let trimmed = trimmed.trim_end_matches('-').to_string();
    if trimmed.is_empty() {
        "vm".to_string()
    } else {
        trimmed
    }
}

/// The objects as YAML documents (`---` between them) or as one JSON `v1 List`.
pub fn render(objects: Vec<Value>, json: bool) -> Result<String> {
    if json {
        let list = json!({ "apiVersion": "v1", "kind": "List", "items": objects });
        return Ok(serde_json::to_string_pretty(&list)? + "\n");
    }
    let mut out = String::new();
    for o in &objects {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(o)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels() {
        assert_eq!(dns_label("Fedora_Pinned.1"), "fedora-pinned-1");
        assert_eq!(dns_label("--x--"), "x");
        assert_eq!(dns_label("__"), "vm");
        assert_eq!(dns_label(&"a".repeat(80)).len(), 63);
    }
}
