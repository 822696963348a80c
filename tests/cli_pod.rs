//! `vmhost pod`: the Pod and ConfigMap validate against the official Kubernetes v1 JSON schemas
//! (kubernetes-validate, installed by scripts/setup.sh), carry exactly the plan's envelope
//! (both overhead models, every example in configs/), follow the rules a schema cannot see
//! (requests = limits, whole CPUs, hugepage and device resource names), and specs that cannot
//! be a pod fail with exit 2 naming the field.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{root, stderr, stdout, vmhost};
use serde_json::Value;

/// A node big enough for every example: 2 nodes x 8 cores x 2 PUs, 2 MiB and 1 GiB pools.
const HOST: [&str; 4] = [
    "--topology",
    "synthetic:package:2 numa:1 core:8 pu:2",
    "--hugepages",
    "node0:2Mi=2048,node1:2Mi=2048,node0:1Gi=8,node1:1Gi=8",
];

/// Every example in configs/ and every KubeVirt manifest of the spec fuzz corpus.
fn examples() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = ["configs", "fuzz/corpus/spec_yaml"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root().join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("toml" | "yaml")
            )
        })
        .collect();
    v.sort();
    assert!(v.len() >= 9, "{v:?}");
    v
}

fn run(cmd: &str, config: &str, model: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec![cmd, "--json", "--config", config, "--overhead-model", model];
    args.extend(HOST);
    args.extend(extra);
    vmhost(&args)
}

fn json(o: &std::process::Output) -> Value {
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(o), stderr(o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Validates YAML with kubernetes-validate (strict: unknown fields are errors).
fn validate(yaml: &str, what: &str) {
    let o = kubernetes_validate(yaml);
    assert!(
        o.status.success(),
        "{what}: kubernetes-validate refused the objects:\n{}{}\n{yaml}",
        stdout(&o),
        stderr(&o)
    );
}

/// Runs kubernetes-validate on `yaml` against Kubernetes 1.30's schemas.
fn kubernetes_validate(yaml: &str) -> std::process::Output {
    let tool = root().join("target/k8s-venv/bin/kubernetes-validate");
    assert!(
        tool.is_file(),
        "{} is missing: run scripts/setup.sh (it installs kubernetes-validate)",
        tool.display()
    );
    // Tests run in parallel threads of one process: one file per call.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("vmhost-pod-{}-{n}.yaml", std::process::id()));
    std::fs::write(&file, yaml).unwrap();
    Command::new(&tool)
        .args(["--strict", "--kubernetes-version", "1.30.0"])
        .arg(&file)
        .output()
        .unwrap()
}

#[test]
fn the_validator_refuses_what_the_schema_forbids() {
    let mut args = vec!["pod", "--image", "img"];
    args.extend(HOST);
    let o = vmhost(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let yaml = stdout(&o);
    validate(&yaml, "the embedded quickstart");
    for (from, to) in [
        (
            "restartPolicy: Never",
            "restartPolicy: Never\n  hostNetworking: true",
        ),
        (
            "allowPrivilegeEscalation: false",
            "allowPrivilegeEscalation: 'no'",
        ),
    ] {
        assert!(yaml.contains(from), "{yaml}");
        let o = kubernetes_validate(&yaml.replace(from, to));
        assert!(!o.status.success(), "{to}: accepted:\n{}", stdout(&o));
    }
}

fn quantity(v: &Value) -> u64 {
    v.as_str().unwrap().parse().unwrap()
}

/// The pod's resources against the plan's envelope, and the rules a schema cannot check.
fn check_against_plan(pod: &Value, plan: &Value, what: &str) {
    let c = &pod["spec"]["containers"][0];
    let (req, lim) = (&c["resources"]["requests"], &c["resources"]["limits"]);
    let env = &plan["envelope"];
    let dedicated = env["dedicated_cpus"].as_u64().unwrap() > 0;
    assert_eq!(
        quantity(&req["memory"]),
        env["memory_request_bytes"].as_u64().unwrap(),
        "{what}"
    );
    if dedicated {
        assert_eq!(req, lim, "{what}: a Guaranteed pod has requests = limits");
        let cpu = req["cpu"].as_str().unwrap();
        assert!(
            cpu.bytes().all(|b| b.is_ascii_digit()),
            "{what}: cpu {cpu} is not whole cores"
        );
        assert_eq!(
            cpu.parse::<u64>().unwrap(),
            env["dedicated_cpus"].as_u64().unwrap(),
            "{what}"
        );
        assert_eq!(pod["spec"]["nodeSelector"]["cpumanager"], "true", "{what}");
    } else {
        let milli = (env["cpus"].as_f64().unwrap() * 1000.0).ceil().max(1.0);
        assert_eq!(req["cpu"], format!("{milli}m"), "{what}");
        assert!(
            lim.get("cpu").is_none(),
            "{what}: a shared VM's pod has no cpu limit"
        );
    }
    match env["memory_limit_bytes"].as_u64() {
        Some(l) => assert_eq!(quantity(&lim["memory"]), l, "{what}"),
        None => assert!(lim.get("memory").is_none(), "{what}"),
    }
    let mut pages = std::collections::BTreeMap::<String, u64>::new();
    for h in env["hugepages"].as_array().unwrap() {
        let size = h["page_size_bytes"].as_u64().unwrap();
        let name = match size {
            2097152 => "hugepages-2Mi",
            1073741824 => "hugepages-1Gi",
            _ => panic!("{what}: page size {size}"),
        };
        *pages.entry(name.into()).or_default() += size * h["count"].as_u64().unwrap();
    }
    let names: Vec<&String> = req.as_object().unwrap().keys().collect();
    for n in &names {
        let known = [
            "cpu",
            "memory",
            "devices.kubevirt.io/kvm",
            "devices.kubevirt.io/tun",
            "devices.kubevirt.io/vhost-net",
        ];
        assert!(
            known.contains(&n.as_str()) || pages.contains_key(*n),
            "{what}: unexpected resource {n}"
        );
    }
    for (name, bytes) in &pages {
        assert_eq!(quantity(&req[name]), *bytes, "{what}: {name}");
        assert_eq!(
            req[name], lim[name],
            "{what}: hugepages need requests = limits"
        );
    }
    let kvm = "devices.kubevirt.io/kvm";
    assert_eq!(
        (&req[kvm], &lim[kvm]),
        (&Value::from("1"), &Value::from("1")),
        "{what}"
    );
    let nics = plan["devices"].to_string().contains("\"mac\"");
    for dev in ["devices.kubevirt.io/tun", "devices.kubevirt.io/vhost-net"] {
        assert_eq!(req.get(dev).is_some(), nics, "{what}: {dev}");
    }
    let notes = &pod["metadata"]["annotations"];
    assert_eq!(
        quantity(&notes["vmhost.io/overhead-bytes"]),
        env["overhead_bytes"].as_u64().unwrap(),
        "{what}"
    );
    for (term, bytes) in env["overhead_terms"].as_object().unwrap() {
        let key = format!("vmhost.io/overhead-{}", term.replace('_', "-"));
        assert_eq!(
            quantity(&notes[&key]),
            bytes.as_u64().unwrap(),
            "{what}: {key}"
        );
    }
}

#[test]
fn every_example_validates_and_matches_its_plan_in_both_models() {
    for config in examples() {
        let config = config.to_str().unwrap();
        for model in ["vmhost", "kubevirt"] {
            let what = format!("{config} ({model})");
            let plan = run("plan", config, model, &[]);
            if plan.status.code() == Some(2) {
                // A manifest vmhost does not accept is no pod either.
                let pod = run("pod", config, model, &["--image", "img"]);
                assert_eq!(pod.status.code(), Some(2), "{what}: {}", stderr(&pod));
                assert!(pod.stdout.is_empty(), "{what}");
                continue;
            }
            let plan = json(&plan);
            let list = json(&run(
                "pod",
                config,
                model,
                &["--image", "registry.example/vmhost:1"],
            ));
            assert_eq!(list["kind"], "List", "{what}");
            let items = list["items"].as_array().unwrap();
            assert_eq!(items.len(), 2, "{what}");
            assert_eq!(items[0]["kind"], "ConfigMap");
            let pod = &items[1];
            assert_eq!(pod["kind"], "Pod");
            let text = std::fs::read_to_string(config).unwrap();
            let data = items[0]["data"].as_object().unwrap();
            assert_eq!(
                data.values().next().unwrap(),
                &Value::from(text),
                "{what}: the ConfigMap holds the spec"
            );
            check_against_plan(pod, &plan, &what);
            let yaml = run(
                "pod",
                config,
                model,
                &["--image", "registry.example/vmhost:1"],
            );
            let _ = yaml;
            let o = {
                let mut args = vec![
                    "pod",
                    "--config",
                    config,
                    "--overhead-model",
                    model,
                    "--image",
                    "registry.example/vmhost:1",
                ];
                args.extend(HOST);
                vmhost(&args)
            };
            assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
            validate(&stdout(&o), &what);
        }
    }
}

fn write(name: &str, text: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-pod-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn features_get_their_capabilities_volumes_and_devices() {
    let disk = write("root.img", "");
    let spec = write(
        "feat.toml",
        "name = \"feat-vm\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
         realtime = { mask = \"0\" }\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\", hugetlbfs = \"/dev/hugepages\" }\n\
         [[devices.disks]]\nname = \"root\"\n[[volumes]]\nname = \"root\"\nhost_disk = { path = \"DISK\" }\n\
         [[devices.interfaces]]\nname = \"default\"\nbridge = {}\n[[networks]]\nname = \"default\"\npod = {}\n"
            .replace("DISK", disk.to_str().unwrap())
            .as_str(),
    );
    let o = run(
        "pod",
        spec.to_str().unwrap(),
        "vmhost",
        &["--image", "img", "--name", "db"],
    );
    let list = json(&o);
    let pod = &list["items"][1];
    assert_eq!(pod["metadata"]["name"], "db");
    let c = &pod["spec"]["containers"][0];
    assert_eq!(
        c["securityContext"]["capabilities"]["add"],
        serde_json::json!(["NET_ADMIN", "SYS_NICE"])
    );
    assert_eq!(
        c["securityContext"]["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    let volumes = pod["spec"]["volumes"].to_string();
    assert!(
        volumes.contains("{\"emptyDir\":{\"medium\":\"HugePages-2Mi\"},\"name\":\"hugepages\"}"),
        "{volumes}"
    );
    let host_path =
        serde_json::json!({ "name": "disk-root", "hostPath": { "path": disk, "type": "File" } });
    assert!(
        pod["spec"]["volumes"]
            .as_array()
            .unwrap()
            .contains(&host_path),
        "{volumes}"
    );
    let mounts = c["volumeMounts"].to_string();
    assert!(
        mounts.contains("\"mountPath\":\"/dev/hugepages\""),
        "{mounts}"
    );
    assert!(
        mounts.contains(&format!("\"mountPath\":\"{}\"", disk.display())),
        "{mounts}"
    );
    assert_eq!(c["resources"]["limits"]["devices.kubevirt.io/tun"], "1");
    let o = {
        let mut args = vec!["pod", "--config", spec.to_str().unwrap(), "--image", "img"];
        args.extend(HOST);
        vmhost(&args)
    };
    validate(&stdout(&o), "feat.toml");
}

#[test]
fn specs_that_cannot_be_a_pod_exit_2_naming_the_field() {
    let cases = [
        (
            "proc.toml",
            "[memory]\nguest = \"64Mi\"\n[[devices.disks]]\nname = \"p\"\n[[volumes]]\nname = \"p\"\nhost_disk = { path = \"/proc/cpuinfo\" }\n",
            "disk \"p\": host disk path /proc/cpuinfo is under /proc",
        ),
        (
            "tap.toml",
            "[memory]\nguest = \"64Mi\"\n[[devices.interfaces]]\nname = \"n\"\nbridge = {}\ntap = \"tap0\"\n[[networks]]\nname = \"n\"\npod = {}\n",
            "interface \"n\": tap \"tap0\" is an existing tap of the host's network namespace",
        ),
    ];
    for (name, text, want) in cases {
        let spec = write(name, text);
        let mut args = vec!["pod", "--config", spec.to_str().unwrap(), "--image", "img"];
        args.extend(HOST);
        let o = vmhost(&args);
        assert_eq!(o.status.code(), Some(2), "{name}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{name}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{name}: printed {}", stdout(&o));
    }
}
