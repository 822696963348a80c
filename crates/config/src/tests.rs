use super::*;

fn toml_err(text: &str) -> Vec<SpecError> {
    match from_toml_str(text, "t.toml") {
        Err(ConfigError::Invalid(e)) => e,
        other => panic!("expected validation errors, got {other:?}"),
    }
}

#[test]
fn full_toml_resolves() {
    let text = r#"
name = "db-1"
[cpu]
sockets = 2
cores = 4
threads = 2
dedicated_cpu_placement = true
isolate_emulator_thread = true
numa = { guest_mapping_passthrough = true }
model = "host-passthrough"
[memory]
guest = "16Gi"
hugepages = { page_size = "1Gi" }
reserved_overhead = { added_overhead = "64Mi" }
[resources.requests]
memory = "16Gi"
[boot]
payload = "numa-bench"
"#;
    let s = from_toml_str(text, "t.toml").unwrap().spec;
    assert_eq!(s.name, "db-1");
    assert_eq!(
        s.cpu.topology,
        CpuTopology {
            sockets: 2,
            cores: 4,
            threads: 2
        }
    );
    assert_eq!(s.vcpus(), 16);
    assert!(
        s.cpu.dedicated_cpu_placement && s.cpu.isolate_emulator_thread && s.cpu.numa_passthrough
    );
    assert_eq!(s.memory.guest_bytes, 16 << 30);
    assert_eq!(
        s.memory.hugepages.as_ref().unwrap().page_size_bytes,
        1 << 30
    );
    assert_eq!(s.memory.added_overhead_bytes, 64 << 20);
    assert_eq!(s.resources.requests.memory_bytes, Some(16 << 30));
    assert_eq!(
        s.boot,
        BootSpec::Payload {
            payload: Payload::NumaBench
        }
    );
    assert!(s.autoattach_graphics_device);
}

#[test]
fn vcpus_from_cpu_resources_when_no_topology() {
    let s = from_toml_str(
        "[memory]\nguest=\"1Gi\"\n[resources.limits]\ncpu=\"2500m\"\nmemory=\"1Gi\"\n",
        "t",
    )
    .unwrap()
    .spec;
    assert_eq!(
        s.cpu.topology,
        CpuTopology {
            sockets: 3,
            cores: 1,
            threads: 1
        }
    );
    assert!(!s.cpu.topology_given);
    let s = from_toml_str(
        "[memory]\nguest=\"1Gi\"\n[resources.requests]\ncpu=\"100m\"\n",
        "t",
    )
    .unwrap()
    .spec;
    assert_eq!(s.vcpus(), 1);
}

#[test]
fn guest_memory_falls_back_to_limits_then_requests() {
    let s = from_toml_str("[resources.requests]\nmemory=\"512Mi\"\n", "t")
        .unwrap()
        .spec;
    assert_eq!(s.memory.guest_bytes, 512 << 20);
    let s = from_toml_str(
        "[resources.requests]\nmemory=\"512Mi\"\n[resources.limits]\nmemory=\"1Gi\"\n",
        "t",
    )
    .unwrap()
    .spec;
    assert_eq!(s.memory.guest_bytes, 1 << 30);
}

#[test]
fn unknown_key_names_line_and_column() {
    let e = from_toml_str("[memory]\nguest = \"1Gi\"\nguets = 3\n", "vm.toml").unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("vm.toml"), "{msg}");
    assert!(msg.contains("guets"), "{msg}");
    assert!(msg.contains("line 3"), "{msg}");
    assert!(msg.contains("column 1"), "{msg}");
}

#[test]
fn memory_not_multiple_of_page_size() {
    let e = toml_err("[memory]\nguest = \"1500Mi\"\nhugepages = { page_size = \"1Gi\" }\n");
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].field, "memory.guest");
    assert_eq!(e[0].value, "1500Mi");
    assert!(
        e[0].rule.contains("multiple of the hugepage size 1Gi"),
        "{}",
        e[0]
    );
    assert!(e[0].fix.contains("2Gi"), "{}", e[0]);
}

#[test]
fn page_size_must_exist_on_x86_64() {
    let e = toml_err("[memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"4Mi\" }\n");
    assert_eq!(e[0].field, "memory.hugepages.page_size");
    assert_eq!(e[0].value, "4Mi");
    assert!(e[0].fix.contains("\"2Mi\" or \"1Gi\""));
}

#[test]
fn passthrough_needs_dedicated_and_hugepages() {
    let e = toml_err("[memory]\nguest = \"1Gi\"\n[cpu.numa]\nguest_mapping_passthrough = true\n");
    let fields: Vec<_> = e.iter().map(|e| e.rule.as_str()).collect();
    assert!(
        fields.contains(&"NUMA passthrough needs dedicated CPU placement"),
        "{fields:?}"
    );
    assert!(
        fields.contains(&"NUMA passthrough needs hugepage-backed memory"),
        "{fields:?}"
    );
}

#[test]
fn isolate_emulator_needs_dedicated() {
    let e = toml_err("[memory]\nguest = \"1Gi\"\n[cpu]\nisolate_emulator_thread = true\n");
    assert_eq!(e[0].field, "cpu.isolate_emulator_thread");
}

#[test]
fn zero_topology_is_rejected() {
    let e = toml_err("[memory]\nguest = \"1Gi\"\n[cpu]\nsockets = 0\ncores = 0\nthreads = 0\n");
    assert!(e[0].rule.contains("at least 1"), "{}", e[0]);
}

#[test]
fn too_many_vcpus() {
    let e = toml_err("[memory]\nguest = \"1Gi\"\n[cpu]\nsockets = 64\ncores = 32\n");
    assert!(e[0].value.contains("2048"), "{}", e[0]);
}

#[test]
fn missing_memory() {
    let e = toml_err("name = \"x\"\n");
    assert_eq!(e[0].field, "memory.guest");
    assert_eq!(e[0].value, "(absent)");
}

#[test]
fn bad_name_and_bad_payload_reported_together() {
    let e =
        toml_err("name = \"Bad_Name\"\n[memory]\nguest = \"1Gi\"\n[boot]\npayload = \"doom\"\n");
    assert_eq!(e.len(), 2);
    assert_eq!(e[0].field, "name");
    assert_eq!(e[1].field, "boot.payload");
    assert!(e[1].fix.contains("touch, numa-bench, halt, idle"));
}

#[test]
fn request_above_limit() {
    let e = toml_err("[resources.requests]\nmemory=\"2Gi\"\n[resources.limits]\nmemory=\"1Gi\"\n");
    assert_eq!(e[0].field, "resources.requests.memory");
}

#[test]
fn bad_quantity_is_a_toml_error_with_position() {
    let e = from_toml_str("[memory]\nguest = \"16GB\"\n", "vm.toml").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("\"16GB\" is not a Kubernetes quantity"),
        "{msg}"
    );
    assert!(msg.contains("line 2"), "{msg}");
}

const VMI: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: numa-vm
  labels: {app: db}
spec:
  terminationGracePeriodSeconds: 0
  domain:
    cpu:
      sockets: 1
      cores: 4
      threads: 1
      dedicatedCpuPlacement: true
      isolateEmulatorThread: true
      numa:
        guestMappingPassthrough: {}
    memory:
      guest: 4Gi
      hugepages:
        pageSize: 1Gi
    resources:
      requests:
        memory: 4Gi
    devices:
      autoattachGraphicsDevice: false
      disks:
        - name: cloudinitdisk
          disk: {bus: virtio}
          bootOrder: 1
  volumes:
    - name: cloudinitdisk
      cloudInitNoCloud: {userData: "hello"}
"#;

#[test]
fn kubevirt_vmi_maps_onto_the_spec() {
    let l = from_yaml_str(VMI, "vmi.yaml").unwrap();
    let s = l.spec;
    assert_eq!(s.name, "numa-vm");
    assert_eq!(s.vcpus(), 4);
    assert!(s.cpu.numa_passthrough && s.cpu.isolate_emulator_thread);
    assert_eq!(s.memory.hugepages.unwrap().page_size_bytes, 1 << 30);
    assert!(!s.autoattach_graphics_device);
    assert_eq!(s.termination_grace, std::time::Duration::ZERO);
    assert_eq!(l.warnings.len(), 1);
    let w = &l.warnings[0];
    assert!(w.contains("spec.domain.devices.disks[0].bootOrder"), "{w}");
    assert!(!w.contains("terminationGracePeriodSeconds"), "{w}");
    assert!(!w.contains("metadata"), "{w}");
}

/// KubeVirt's `terminationGracePeriodSeconds` and the TOML field are the shutdown grace: 30 s
/// unless written, at most a day; a refusal names the field as the user wrote it.
#[test]
fn the_termination_grace_is_read_defaulted_and_bounded() {
    let toml = |extra: &str| {
        from_toml_str(
            &format!("{extra}[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n"),
            "vm.toml",
        )
    };
    let secs = |extra: &str| toml(extra).unwrap().spec.termination_grace.as_secs();
    assert_eq!(secs(""), 30);
    assert_eq!(secs("termination_grace_period_seconds = 5\n"), 5);
    assert_eq!(secs("termination_grace_period_seconds = 86400\n"), 86_400);
    let err = toml("termination_grace_period_seconds = 86401\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("termination_grace_period_seconds") && err.contains("86401"),
        "{err}"
    );
    let yaml = |grace: &str| {
        from_yaml_str(
            &VMI.replace(
                "terminationGracePeriodSeconds: 0",
                &format!("terminationGracePeriodSeconds: {grace}"),
            ),
            "vmi.yaml",
        )
    };
    assert_eq!(yaml("45").unwrap().spec.termination_grace.as_secs(), 45);
    for bad in ["-1", "ten"] {
        let err = yaml(bad).unwrap_err().to_string();
        assert!(
            err.contains("spec.terminationGracePeriodSeconds"),
            "{bad}: {err}"
        );
    }
    let err = yaml("90000").unwrap_err().to_string();
    assert!(err.contains("spec.terminationGracePeriodSeconds"), "{err}");
}

#[test]
fn kubevirt_vm_template_is_read() {
    let vm = VMI
        .replace("kind: VirtualMachineInstance", "kind: VirtualMachine")
        .replace(
            "\nspec:\n",
            "\nspec:\n  running: true\n  template:\n    spec:\n",
        );
    // Re-indent the VMI spec body under template.spec.
    let mut out = String::new();
    let mut inside = false;
    for line in vm.lines() {
        if line.starts_with("    spec:") {
            inside = true;
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if inside
            && line.starts_with("  ")
            && !line.starts_with("  running")
            && !line.starts_with("  template")
        {
            out.push_str("    ");
        }
        out.push_str(line);
        out.push('\n');
    }
    let l = from_yaml_str(&out, "vm.yaml").unwrap();
    assert_eq!(l.spec.vcpus(), 4);
    assert!(l.warnings[0].contains("spec.running"), "{}", l.warnings[0]);
    assert!(
        l.warnings[0].contains("spec.template.spec.domain.devices.disks[0].bootOrder"),
        "{}",
        l.warnings[0]
    );
}

#[test]
fn kubevirt_errors_use_yaml_paths() {
    let bad = VMI.replace("guest: 4Gi", "guest: 3500Mi");
    match from_yaml_str(&bad, "vmi.yaml").unwrap_err() {
        ConfigError::Invalid(e) => {
            assert_eq!(e[0].field, "spec.domain.memory.guest");
            assert!(e[0].rule.contains("memory.hugepages.page_size") || e[0].rule.contains("1Gi"));
        }
        other => panic!("{other:?}"),
    }
    let bad = VMI.replace(
        "dedicatedCpuPlacement: true",
        "dedicatedCpuPlacement: false",
    );
    match from_yaml_str(&bad, "vmi.yaml").unwrap_err() {
        ConfigError::Invalid(e) => {
            assert!(
                e.iter()
                    .any(|e| e.field == "spec.domain.cpu.isolateEmulatorThread"),
                "{e:?}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn kubevirt_unsupported_resource_fields_are_errors() {
    let bad = VMI.replace(
        "      disks:\n",
        "      gpus:\n        - name: g\n          deviceName: nvidia.com/A100\n      disks:\n",
    );
    let e = from_yaml_str(&bad, "vmi.yaml").unwrap_err().to_string();
    assert!(e.contains("spec.domain.devices.gpus"), "{e}");
    assert!(e.contains("does not support"), "{e}");
    let bad = VMI.replace(
        "      requests:\n        memory: 4Gi",
        "      requests:\n        memory: 4Gi\n        hugepages-1Gi: 4Gi",
    );
    let e = from_yaml_str(&bad, "vmi.yaml").unwrap_err().to_string();
    assert!(
        e.contains("spec.domain.resources.requests.hugepages-1Gi"),
        "{e}"
    );
}

#[test]
fn kubevirt_wrong_kind_or_api() {
    let e = from_yaml_str("apiVersion: v1\nkind: Pod\n", "p.yaml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("apiVersion"), "{e}");
    let e = from_yaml_str("apiVersion: kubevirt.io/v1\nkind: DataVolume\n", "p.yaml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("VirtualMachineInstance or VirtualMachine"),
        "{e}"
    );
}

#[test]
fn virtio_transport_annotation_chooses_pci_or_mmio_and_names_a_bad_value() {
    let with = |annotation: &str| {
        VMI.replace(
            "  labels: {app: db}\n",
            &format!("  labels: {{app: db}}\n{annotation}"),
        )
        .replace(
            "    memory:\n      guest: 4Gi",
            "    firmware:\n      kernelBoot:\n        container:\n          \
             kernelPath: /boot/vmlinux\n    memory:\n      guest: 4Gi",
        )
    };
    let announce = |annotation: &str| match from_yaml_str(&with(annotation), "vmi.yaml") {
        Ok(l) => match l.spec.boot {
            BootSpec::Kernel {
                virtio_announce, ..
            } => Ok(virtio_announce),
            other => panic!("{other:?}"),
        },
        Err(e) => Err(e.to_string()),
    };
    let value = |v: &str| format!("  annotations:\n    vmhost.io/virtio-transport: {v}\n");
    assert_eq!(announce(&value("pci")), Ok(crate::VirtioAnnounce::Pci));
    assert_eq!(announce(&value("mmio")), Ok(crate::VirtioAnnounce::Acpi));
    assert_eq!(
        announce(""),
        Ok(crate::VirtioAnnounce::Acpi),
        "absent: the default"
    );
    let e = announce(&value("usb")).unwrap_err();
    assert!(
        e.contains("metadata.annotations.vmhost.io/virtio-transport") && e.contains("\"pci\""),
        "{e}"
    );
}

#[test]
fn irqchip_defaults_to_kernel_and_split_is_chosen_by_field_or_annotation() {
    let base = "[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"/k\"\n";
    let irqchip = |extra: &str| match from_toml_str(&format!("{base}{extra}"), "t.toml")
        .unwrap()
        .spec
        .boot
    {
        BootSpec::Kernel { irqchip, .. } => irqchip,
        other => panic!("{other:?}"),
    };
    assert_eq!(irqchip(""), crate::Irqchip::Kernel);
    assert_eq!(irqchip("irqchip = \"kernel\"\n"), crate::Irqchip::Kernel);
    assert_eq!(irqchip("irqchip = \"split\"\n"), crate::Irqchip::Split);
    let e = toml_err(&format!("{base}irqchip = \"userspace\"\n"));
    assert_eq!(e[0].field, "boot.irqchip");
    assert_eq!(e[0].value, "\"userspace\"");
    assert!(e[0].fix.contains("kernel, split"), "{}", e[0]);
    // A built-in payload has KVM's irqchip: the field needs a kernel.
    let e = toml_err("[memory]\nguest = \"64Mi\"\n[boot]\nirqchip = \"split\"\n");
    assert_eq!(e[0].field, "boot.irqchip");
    assert!(e[0].to_string().contains("needs boot.kernel"), "{}", e[0]);

    let with = |annotation: &str| {
        VMI.replace(
            "  labels: {app: db}\n",
            &format!(
                "  labels: {{app: db}}\n  annotations:\n    vmhost.io/irqchip: {annotation}\n"
            ),
        )
        .replace(
            "    memory:\n      guest: 4Gi",
            "    firmware:\n      kernelBoot:\n        container:\n          \
             kernelPath: /boot/vmlinux\n    memory:\n      guest: 4Gi",
        )
    };
    let chip = |a: &str| match from_yaml_str(&with(a), "vmi.yaml") {
        Ok(l) => match l.spec.boot {
            BootSpec::Kernel { irqchip, .. } => Ok(irqchip),
            other => panic!("{other:?}"),
        },
        Err(e) => Err(e.to_string()),
    };
    assert_eq!(chip("split"), Ok(crate::Irqchip::Split));
    assert_eq!(chip("kernel"), Ok(crate::Irqchip::Kernel));
    let e = chip("pic").unwrap_err();
    assert!(
        e.contains("metadata.annotations.vmhost.io/irqchip") && e.contains("\"split\""),
        "{e}"
    );
}

#[test]
fn even_parity_annotation_is_honoured_and_others_are_listed() {
    let vmi = VMI.replace(
        "  labels: {app: db}\n",
        "  labels: {app: db}\n  annotations:\n    alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity: \"\"\n    example.com/note: hi\n",
    );
    let l = from_yaml_str(&vmi, "vmi.yaml").unwrap();
    assert!(l.spec.cpu.emulator_even_parity);
    assert_eq!(
        l.spec.cpu.emulator_pus(),
        2,
        "4 vCPUs: even, so 2 emulator PUs"
    );
    assert!(
        l.warnings[0].contains("metadata.annotations.example.com/note"),
        "{:?}",
        l.warnings
    );
    let plain = from_yaml_str(VMI, "vmi.yaml").unwrap();
    assert_eq!(plain.spec.cpu.emulator_pus(), 1);
}

#[test]
fn kubevirt_realtime_mask_is_mapped_and_needs_an_isolated_emulator() {
    let vmi = VMI.replace(
        "      isolateEmulatorThread: true\n",
        "      isolateEmulatorThread: true\n      realtime:\n        mask: \"0-3,^1\"\n",
    );
    let s = from_yaml_str(&vmi, "vmi.yaml").unwrap().spec;
    assert_eq!(s.cpu.realtime_vcpus, Some(vec![0, 2, 3]));
    let no_iso = vmi.replace("      isolateEmulatorThread: true\n", "");
    let err = from_yaml_str(&no_iso, "vmi.yaml").unwrap_err().to_string();
    assert!(err.contains("spec.domain.cpu.realtime"), "{err}");
    assert!(err.contains("isolated emulator thread"), "{err}");
    let bad = vmi.replace("0-3,^1", "7");
    let err = from_yaml_str(&bad, "vmi.yaml").unwrap_err().to_string();
    assert!(err.contains("spec.domain.cpu.realtime.mask"), "{err}");
    assert!(err.contains("vCPU 7 does not exist"), "{err}");
}

#[test]
fn memory_quantities_that_are_not_whole_pages_are_accepted() {
    for (q, exact) in [
        ("1G", 1_000_000_000u64),
        ("1000M", 1_000_000_000),
        ("1234567890", 1_234_567_890),
    ] {
        let s = from_toml_str(&format!("[memory]\nguest = \"{q}\"\n"), "t.toml")
            .unwrap()
            .spec;
        assert_eq!(s.memory.guest_bytes, exact);
        assert_eq!(s.memory.guest_ram_bytes(), exact.div_ceil(4096) * 4096);
    }
    // Hugepage-backed guests keep KubeVirt's rule.
    let e = from_toml_str(
        "[memory]\nguest = \"1G\"\nhugepages = { page_size = \"2Mi\" }\n",
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("multiple of the hugepage size 2Mi"), "{e}");
}

#[test]
fn relative_kernel_and_initrd_paths_resolve_against_the_spec_file() {
    let dir = std::env::temp_dir().join(format!("vmhost-config-rel-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("specs")).unwrap();
    let spec = dir.join("specs/vm.toml");
    std::fs::write(
        &spec,
        "[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"../k/vmlinux\"\ninitrd = \"/abs/initrd\"\n",
    )
    .unwrap();
    let loaded = crate::load(&spec).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let BootSpec::Kernel { kernel, initrd, .. } = loaded.spec.boot else {
        panic!("{:?}", loaded.spec.boot)
    };
    assert_eq!(kernel, dir.join("specs/../k/vmlinux"));
    assert_eq!(initrd, Some(std::path::PathBuf::from("/abs/initrd")));
}

#[test]
fn virtio_announce_defaults_to_acpi_and_names_its_choices() {
    let base = "[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"/k\"\n";
    let announce = |extra: &str| match from_toml_str(&format!("{base}{extra}"), "t.toml")
        .unwrap()
        .spec
        .boot
    {
        BootSpec::Kernel {
            virtio_announce, ..
        } => virtio_announce,
        other => panic!("{other:?}"),
    };
    assert_eq!(announce(""), crate::VirtioAnnounce::Acpi);
    assert_eq!(
        announce("virtio_announce = \"cmdline\"\n"),
        crate::VirtioAnnounce::Cmdline
    );
    assert_eq!(
        announce("virtio_announce = \"pci\"\n"),
        crate::VirtioAnnounce::Pci
    );
    let e = toml_err(&format!("{base}virtio_announce = \"dsdt\"\n"));
    assert_eq!(e[0].field, "boot.virtio_announce");
    assert_eq!(e[0].value, "\"dsdt\"");
    assert!(e[0].fix.contains("acpi, cmdline, pci"), "{}", e[0]);
    let e = toml_err("[memory]\nguest = \"64Mi\"\n[boot]\nvirtio_announce = \"acpi\"\n");
    assert_eq!(e[0].field, "boot.virtio_announce");
}

#[test]
fn kubevirt_kernel_boot_reads_the_container_paths_on_this_host() {
    let vmi = VMI.replace(
        "    memory:\n      guest: 4Gi",
        "    firmware:\n      kernelBoot:\n        kernelArgs: console=ttyS0 quiet\n        \
         container:\n          image: quay.io/x/kernel:1\n          kernelPath: /boot/vmlinux\n          \
         initrdPath: /boot/initrd.cpio\n    memory:\n      guest: 4Gi",
    );
    let l = from_yaml_str(&vmi, "vmi.yaml").unwrap();
    assert_eq!(
        l.spec.boot,
        BootSpec::Kernel {
            kernel: "/boot/vmlinux".into(),
            initrd: Some("/boot/initrd.cpio".into()),
            cmdline: "console=ttyS0 quiet".into(),
            virtio_announce: crate::VirtioAnnounce::Acpi,
            irqchip: crate::Irqchip::Kernel,
        }
    );
    let warned = l.warnings.join(" ");
    assert!(
        warned.contains("spec.domain.firmware.kernelBoot.container.image"),
        "{warned}"
    );
    let bad = VMI.replace(
        "    memory:\n      guest: 4Gi",
        "    firmware:\n      kernelBoot:\n        container:\n          kernelPath: 7\n    memory:\n      guest: 4Gi",
    );
    let e = from_yaml_str(&bad, "vmi.yaml").unwrap_err().to_string();
    assert!(
        e.contains("spec.domain.firmware.kernelBoot.container.kernelPath"),
        "{e}"
    );
}

#[test]
fn hugepage_fallback_values_are_checked() {
    let ok = |v: &str| {
        from_toml_str(
            &format!("[memory]\nguest = \"64Mi\"\nhugepages = {{ page_size = \"2Mi\", fallback = \"{v}\" }}\n"),
            "t.toml",
        )
        .unwrap()
        .spec
        .memory
        .hugepages
        .unwrap()
        .fallback_to_normal_pages
    };
    assert!(ok("normal-pages"));
    assert!(!ok("refuse"));
    let e = toml_err(
        "[memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\", fallback = \"4Ki\" }\n",
    );
    assert_eq!(e[0].field, "memory.hugepages.fallback");
    assert_eq!(e[0].value, "4Ki");
    assert!(e[0].fix.contains("\"normal-pages\""), "{}", e[0]);
}

#[test]
fn numa_passthrough_cannot_fall_back_to_normal_pages() {
    let e = toml_err(
        "[cpu]\ncores = 2\ndedicated_cpu_placement = true\nnuma = { guest_mapping_passthrough = true }\n\
         [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\", fallback = \"normal-pages\" }\n",
    );
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(e[0].field, "memory.hugepages.fallback");
    assert!(e[0].rule.contains("NUMA passthrough"), "{}", e[0]);
}
