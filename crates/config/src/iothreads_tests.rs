use crate::{from_toml_str, from_yaml_str, ConfigError, IoThreadsPolicy, SpecError};

fn errors(text: &str, yaml: bool) -> Vec<SpecError> {
    let r = if yaml {
        from_yaml_str(text, "vmi.yaml")
    } else {
        from_toml_str(text, "vm.toml")
    };
    match r {
        Err(ConfigError::Invalid(e)) => e,
        other => panic!("expected validation errors, got {other:?}"),
    }
}

fn has(errs: &[SpecError], field: &str, value: &str, rule_part: &str) -> bool {
    errs.iter()
        .any(|e| e.field == field && e.value == value && e.rule.contains(rule_part))
}

/// Two empty disks (the second one `extra`), rng, and `head` at the top.
fn toml(head: &str, extra: &str) -> String {
    format!(
        r#"{head}
[memory]
guest = "256Mi"
[devices]
rng = {{}}
[[devices.disks]]
name = "a"
[[devices.disks]]
name = "b"
{extra}
[[volumes]]
name = "a"
empty_disk = {{ capacity = "1Mi" }}
[[volumes]]
name = "b"
empty_disk = {{ capacity = "1Mi" }}
"#
    )
}

#[test]
fn toml_policies_and_dedicated_disks_resolve() {
    let s = from_toml_str(&toml("", ""), "t").unwrap().spec;
    assert_eq!(s.io_threads.policy, None);
    assert!(s.io_threads.dedicated_disks.is_empty());
    for (word, policy) in [
        ("shared", IoThreadsPolicy::Shared),
        ("auto", IoThreadsPolicy::Auto),
    ] {
        let text = toml(
            &format!("io_threads_policy = \"{word}\""),
            "dedicated_io_thread = true",
        );
        let s = from_toml_str(&text, "t").unwrap().spec;
        assert_eq!(s.io_threads.policy, Some(policy));
        assert_eq!(s.io_threads.supplemental_pool_thread_count, 0);
        assert_eq!(s.io_threads.dedicated_disks, ["b"]);
        assert!(s.io_threads.is_dedicated("b") && !s.io_threads.is_dedicated("a"));
    }
    let text = toml(
        "io_threads_policy = \"supplementalPool\"\nio_threads = { supplemental_pool_thread_count = 3 }",
        "",
    );
    let s = from_toml_str(&text, "t").unwrap().spec;
    assert_eq!(s.io_threads.policy, Some(IoThreadsPolicy::SupplementalPool));
    assert_eq!(s.io_threads.supplemental_pus(), 3);
}

#[test]
fn toml_io_thread_errors_name_the_field() {
    let e = errors(&toml("io_threads_policy = \"supplementalPool\"", ""), false);
    assert!(
        has(
            &e,
            "io_threads.supplemental_pool_thread_count",
            "(absent)",
            "needs the number of its threads"
        ),
        "{e:?}"
    );
    let e = errors(
        &toml(
            "io_threads_policy = \"supplementalPool\"\nio_threads = { supplemental_pool_thread_count = 0 }",
            "",
        ),
        false,
    );
    assert!(
        has(
            &e,
            "io_threads.supplemental_pool_thread_count",
            "0",
            "at least one thread"
        ),
        "{e:?}"
    );
    let e = errors(&toml("io_threads_policy = \"dedicated\"", ""), false);
    assert!(
        has(
            &e,
            "io_threads_policy",
            "\"dedicated\"",
            "not an I/O thread policy"
        ),
        "{e:?}"
    );
    assert!(e[0].fix.contains("supplementalPool"), "{e:?}");
    let e = errors(
        &toml("io_threads = { supplemental_pool_thread_count = 2 }", ""),
        false,
    );
    assert!(
        has(
            &e,
            "io_threads.supplemental_pool_thread_count",
            "2",
            "only to the supplementalPool policy"
        ),
        "{e:?}"
    );
    let e = errors(
        &toml("", "bus = \"cdrom\"\ndedicated_io_thread = true"),
        false,
    );
    assert!(
        has(
            &e,
            "devices.disks[1].dedicated_io_thread",
            "true",
            "not supported for disks on a cdrom bus"
        ),
        "{e:?}"
    );
    assert_eq!(e.len(), 1, "{e:?}");
}

const VMI: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: io}
spec:
  domain:
    POLICY
    cpu: {cores: 1, dedicatedCpuPlacement: true, isolateEmulatorThread: true}
    memory: {guest: 256Mi}
    devices:
      rng: {}
      disks:
        - name: a
          disk: {bus: virtio}
        - name: b
          DEDICATED
          disk: {bus: virtio}
  volumes:
    - {name: a, emptyDisk: {capacity: 1Mi}}
    - {name: b, emptyDisk: {capacity: 1Mi}}
"#;

fn vmi(policy: &str, dedicated: &str) -> String {
    VMI.replace("POLICY", policy)
        .replace("DEDICATED", dedicated)
}

#[test]
fn kubevirt_manifest_maps_io_threads() {
    let text = vmi("ioThreadsPolicy: auto", "dedicatedIOThread: true");
    let loaded = from_yaml_str(&text, "vmi.yaml").unwrap();
    let s = loaded.spec;
    assert_eq!(s.io_threads.policy, Some(IoThreadsPolicy::Auto));
    assert_eq!(s.io_threads.dedicated_disks, ["b"]);
    assert!(
        loaded.warnings.iter().all(|w| !w.contains("IOThread")),
        "{:?}",
        loaded.warnings
    );
    let text = vmi(
        "ioThreadsPolicy: supplementalPool\n    ioThreads: {supplementalPoolThreadCount: 2}",
        "",
    );
    let s = from_yaml_str(&text, "vmi.yaml").unwrap().spec;
    assert_eq!(s.io_threads.policy, Some(IoThreadsPolicy::SupplementalPool));
    assert_eq!(s.io_threads.supplemental_pool_thread_count, 2);
}

#[test]
fn kubevirt_io_thread_errors_use_kubevirt_field_names() {
    let e = errors(&vmi("ioThreadsPolicy: supplementalPool", ""), true);
    assert!(
        has(
            &e,
            "spec.domain.ioThreads.supplementalPoolThreadCount",
            "(absent)",
            "needs the number"
        ),
        "{e:?}"
    );
    let text = vmi("", "dedicatedIOThread: true")
        .replace(
            "        - name: b\n",
            "        - name: b\n          cdrom: {}\n",
        )
        .replace("          disk: {bus: virtio}\n  volumes", "  volumes");
    let e = errors(&text, true);
    assert!(
        has(
            &e,
            "spec.domain.devices.disks[1].dedicatedIOThread",
            "true",
            "cdrom bus"
        ),
        "{e:?}"
    );
    let e = errors(&vmi("ioThreadsPolicy: everything", ""), true);
    assert!(
        has(
            &e,
            "spec.domain.ioThreadsPolicy",
            "\"everything\"",
            "not an I/O thread policy"
        ),
        "{e:?}"
    );
}
