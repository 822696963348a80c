//! `devices.vsock` and KubeVirt's `devices.autoattachVSOCK`: a virtio-vsock device exposed on a
//! Unix socket (docs/spec.md, docs/devices.md).
//!
//! The guest's CID only has to be unique inside the guest: the host side is a Unix socket, not
//! the kernel's AF_VSOCK namespace, so every VM may use the default CID 3. The socket's
//! directory must exist and the path must not hold something other than a socket; whether
//! another process still listens on it is found out when the VM starts (a host error).

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::validate::Checker;

/// The CID a guest gets unless the spec names one (the first one not reserved).
pub const DEFAULT_GUEST_CID: u64 = 3;
/// Largest CID: `VMADDR_CID_ANY` (2^32 - 1) and above are not guest addresses.
pub const MAX_GUEST_CID: u64 = u32::MAX as u64 - 1;
/// Longest socket path: `sun_path` holds 108 bytes with the NUL, and guest-initiated
/// connections use `<socket>_<port>` (up to 11 more bytes).
pub const MAX_SOCKET_PATH: usize = 108 - 1 - 11;

/// `devices.vsock` as written (TOML only; KubeVirt has `autoattachVSOCK`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawVsock {
    /// The guest's context ID (default 3).
    pub cid: Option<u64>,
    /// The Unix socket (default `<run dir>/<vm name>.vsock`).
    pub socket: Option<PathBuf>,
    /// `unix` (default: vmhost's device on a Unix socket) or `vhost` (the kernel's
    /// vhost-vsock, host side `AF_VSOCK`).
    pub backend: Option<String>,
}

/// Where the host side of the vsock device lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VsockBackend {
    /// vmhost's device, exposed on a Unix socket (Firecracker's hybrid vsock).
    #[default]
    Unix,
    /// The kernel's vhost-vsock: host programs use `AF_VSOCK`; the CID is host-wide.
    Vhost,
}

/// A resolved virtio-vsock device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VsockSpec {
    /// The guest's context ID.
    pub cid: u64,
    /// The Unix socket; `None`: `<run dir>/<vm name>.vsock`, filled in by the VMM, which
    /// knows its run directory ([`VsockSpec::socket_in`]). Always `None` with vhost.
    pub socket: Option<PathBuf>,
    /// The back end.
    pub backend: VsockBackend,
}

impl VsockSpec {
    /// The socket path, with `run_dir` for a derived one.
    /// (Meaningless with the vhost back end, which has no socket.)
    pub fn socket_in(&self, run_dir: &Path, vm: &str) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(|| run_dir.join(format!("{vm}.vsock")))
    }
}

/// Checks `devices.vsock` and `devices.autoattach_vsock`.
pub(crate) fn check_vsock(
    c: &mut Checker<'_>,
    raw: Option<&RawVsock>,
    autoattach: Option<bool>,
) -> Option<VsockSpec> {
    if autoattach == Some(false) && raw.is_some() {
        c.fail(
            "devices.autoattach_vsock",
            false,
            "contradicts the devices.vsock table",
            "remove autoattach_vsock = false or the [devices.vsock] table",
        );
        return None;
    }
    if raw.is_none() && autoattach != Some(true) {
        return None;
    }
    let raw = raw.cloned().unwrap_or_default();
    let cid = raw.cid.unwrap_or(DEFAULT_GUEST_CID);
    if !(DEFAULT_GUEST_CID..=MAX_GUEST_CID).contains(&cid) {
        c.fail(
            "devices.vsock.cid",
            cid,
            "0-2 are reserved (hypervisor, local, host) and 4294967295 is VMADDR_CID_ANY",
            "use a CID from 3 to 4294967294, e.g. 3",
        );
    }
    let backend = match raw.backend.as_deref().unwrap_or("unix") {
        "unix" => VsockBackend::Unix,
        "vhost" => VsockBackend::Vhost,
        other => {
            c.fail(
                "devices.vsock.backend",
                format!("{other:?}"),
                "is not a vsock back end",
                "use \"unix\" (a Unix socket, the default) or \"vhost\" (the kernel's vhost-vsock)",
            );
            VsockBackend::Unix
        }
    };
    if let Some(path) = &raw.socket {
        if backend == VsockBackend::Vhost {
            c.fail(
                "devices.vsock.socket",
                format!("{:?}", path.display().to_string()),
                "the kernel's vhost-vsock has no Unix socket: host programs connect with AF_VSOCK to (cid, port)",
                "remove socket, or use backend = \"unix\"",
            );
        } else {
            check_socket_path(c, path);
        }
    }
    Some(VsockSpec {
        cid,
        socket: raw.socket,
        backend,
    })
}

fn check_socket_path(c: &mut Checker<'_>, path: &Path) {
    let field = "devices.vsock.socket";
    let shown = format!("{:?}", path.display().to_string());
    if !path.is_absolute() {
        c.fail(
            field,
            &shown,
            "must be an absolute path",
            "write the socket's full path, e.g. \"/run/vmhost/vm.vsock\"",
        );
        return;
    }
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        c.fail(
            field,
            &shown,
            &format!("is longer than {MAX_SOCKET_PATH} bytes (a Unix socket path holds 107, and guest connections add _<port>)"),
            "choose a shorter path",
        );
    }
    if !path.parent().is_some_and(Path::is_dir) {
        c.fail(
            field,
            &shown,
            "its directory does not exist",
            "create the directory first",
        );
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            c.fail(
                field,
                &shown,
                "exists and is not a socket",
                "remove the file or choose another path",
            );
        }
    }
}

#[cfg(test)]
#[path = "vsock_tests.rs"]
mod tests;
