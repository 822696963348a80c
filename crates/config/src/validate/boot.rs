//! The boot rules: a built-in payload or a Linux kernel (its initrd, command line, how it
//! learns the virtio devices and where its interrupt controllers are), never both; and the
//! resolved [`BootSpec`].

use std::path::PathBuf;

use serde::Serialize;

use super::Checker;
use crate::devices::{check_announce, check_irqchip, Irqchip, VirtioAnnounce};
use crate::spec::RawSpec;

/// A built-in guest payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Payload {
    /// Every vCPU writes every page of its guest cell.
    Touch,
    /// NUMA locality benchmark kernels.
    NumaBench,
    /// Start, report, halt.
    Halt,
    /// vCPUs wait halted until told to stop.
    Idle,
}

impl Payload {
    /// All payload names, for messages.
    pub const NAMES: [&'static str; 4] = ["touch", "numa-bench", "halt", "idle"];

    fn parse(s: &str) -> Option<Self> {
        match s {
            "touch" => Some(Payload::Touch),
            "numa-bench" => Some(Payload::NumaBench),
            "halt" => Some(Payload::Halt),
            "idle" => Some(Payload::Idle),
            _ => None,
        }
    }
}

/// What the VM boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BootSpec {
    /// A built-in payload.
    Payload {
        /// Which one.
        payload: Payload,
    },
    /// A Linux kernel.
    Kernel {
        /// Kernel image.
        kernel: PathBuf,
        /// Initial ramdisk.
        initrd: Option<PathBuf>,
        /// Command line.
        cmdline: String,
        /// How the kernel learns the virtio devices.
        virtio_announce: VirtioAnnounce,
        /// Where the interrupt controllers are emulated.
        irqchip: Irqchip,
    },
}

impl BootSpec {
    /// Makes a relative kernel or initrd path relative to `dir` (the spec file's directory).
    pub fn resolve_paths(&mut self, dir: &std::path::Path) {
        if let BootSpec::Kernel { kernel, initrd, .. } = self {
            for p in std::iter::once(kernel).chain(initrd.as_mut()) {
                if p.is_relative() {
                    *p = dir.join(&*p);
                }
            }
        }
    }
}

pub(super) fn check_boot(c: &mut Checker<'_>, raw: &RawSpec) -> Option<BootSpec> {
    let b = &raw.boot;
    match (&b.kernel, &b.payload) {
        (Some(_), Some(p)) => {
            c.fail(
                "boot.payload",
                format!("{p:?}"),
                "boot.payload and boot.kernel exclude each other",
                "keep one of them",
            );
            None
        }
        (Some(kernel), None) => Some(BootSpec::Kernel {
            kernel: kernel.clone(),
            initrd: b.initrd.clone(),
            cmdline: b
                .cmdline
                .clone()
                .unwrap_or_else(|| "console=ttyS0".to_string()),
            virtio_announce: check_announce(c, b.virtio_announce.as_deref()),
            irqchip: check_irqchip(c, b.irqchip.as_deref()),
        }),
        (None, p) => {
            let kernel_only = [
                ("boot.initrd", b.initrd.is_some()),
                ("boot.cmdline", b.cmdline.is_some()),
                ("boot.virtio_announce", b.virtio_announce.is_some()),
                ("boot.irqchip", b.irqchip.is_some()),
            ];
            if let Some((field, _)) = kernel_only.iter().find(|(_, set)| *set) {
                c.fail(
                    field,
                    "(set)",
                    "an initrd, command line, virtio_announce or irqchip needs boot.kernel",
                    "add boot.kernel or remove them",
                );
            }
            let name = p.as_deref().unwrap_or("touch");
            match Payload::parse(name) {
                Some(payload) => Some(BootSpec::Payload { payload }),
                None => {
                    c.fail(
                        "boot.payload",
                        format!("{name:?}"),
                        "is not a built-in payload",
                        format!("use one of {}", Payload::NAMES.join(", ")),
                    );
                    None
                }
            }
        }
    }
}
