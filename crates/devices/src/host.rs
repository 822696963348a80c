//! The apply step of the devices: from the plan's resolved [`DeviceSpec`] to device objects,
//! making what the host needs on the way — a `DiskOrCreate` image, an empty disk, a
//! cloud-init seed, a tap, a vsock Unix socket (owned by the device, removed when it is
//! dropped). Files made only for this run (empty disks, seeds) are removed when
//! the [`HostDevices`] is dropped (VM stop); if preparing fails half-way, everything made so
//! far is removed too (a created `DiskOrCreate` image included), so a refused start leaves
//! nothing behind. Failures here are host errors (exit 1), not spec errors.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};

use tracing::warn;
use vmhost_config::{
    DeviceSpec, DiskCache, DiskSource, DiskSpec, InterfaceSpec, VsockBackend, VsockSpec,
};

use crate::block::{Block, BlockConfig, BlockError};
use crate::device::VirtioDevice;
use crate::disk::CacheMode;
use crate::net::{Net, NetError, Tap};
use crate::rng::Rng;
use crate::seed::{NoCloudSeed, SeedError};
use crate::vsock::vhost::{VhostError, VhostVsock};
use crate::vsock::{Vsock, VsockError};

/// Name pattern of the taps vmhost creates (the kernel fills in the number).
pub const TAP_PATTERN: &str = "vmhost%d";

/// Why the host side of a device could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// An image file could not be created or sized.
    #[error("disk {disk}: cannot create image {path}")]
    CreateImage {
        /// Disk name.
        disk: String,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The cloud-init seed could not be written.
    #[error("disk {disk}")]
    Seed {
        /// Disk name.
        disk: String,
        /// The cause.
        #[source]
        source: SeedError,
    },
    /// The image could not be opened as a virtio-blk device.
    #[error("disk {disk}")]
    Block {
        /// Disk name.
        disk: String,
        /// The cause.
        #[source]
        source: BlockError,
    },
    /// The tap named in the spec does not exist.
    #[error("interface {interface}: tap {tap} does not exist; create it (ip tuntap add {tap} mode tap) or leave `tap` out")]
    TapMissing {
        /// Interface name.
        interface: String,
        /// The tap.
        tap: String,
    },
    /// The tap could not be created or attached.
    #[error("interface {interface}")]
    Tap {
        /// Interface name.
        interface: String,
        /// The cause.
        #[source]
        source: NetError,
    },
    /// The kernel's vhost-vsock could not be set up.
    #[error("devices.vsock (backend vhost, CID {cid})")]
    Vhost {
        /// The guest CID.
        cid: u64,
        /// The cause.
        #[source]
        source: VhostError,
    },
    /// The vsock device's Unix socket could not be set up.
    #[error("devices.vsock.socket {path}")]
    Vsock {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: VsockError,
    },
}

/// One prepared device, in plan slot order.
pub struct PreparedDevice {
    /// The device, ready for a transport.
    pub device: Box<dyn VirtioDevice>,
    /// A backend fd to watch for readability (a tap), and the queue it feeds.
    pub backend: Option<(RawFd, usize)>,
    /// One line for the operator (`disk root: /var/lib/vm/root.img (read-write, cache none)`).
    pub describe: String,
}

impl std::fmt::Debug for PreparedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDevice")
            .field("describe", &self.describe)
            .finish_non_exhaustive()
    }
}

/// The devices of one VM and the files made for this run.
#[derive(Debug, Default)]
pub struct HostDevices {
    /// Disks, then NICs, then rng, then vsock: the order of the plan's slots.
    pub devices: Vec<PreparedDevice>,
    /// Removed on drop (VM stop).
    scratch: Vec<PathBuf>,
    /// Removed only if preparing fails.
    created: Vec<PathBuf>,
}

impl HostDevices {
    /// Prepares every device of `spec` for VM `vm`; run-time files go to `run_dir`, and so
    /// does a vsock socket whose path the spec left to the VMM (`<run_dir>/<vm>.vsock`).
    pub fn prepare(spec: &DeviceSpec, vm: &str, run_dir: &Path) -> Result<Self, HostError> {
        let mut out = HostDevices::default();
        match out.prepare_all(spec, vm, run_dir) {
            Ok(()) => {
                out.created.clear();
                Ok(out)
            }
            Err(e) => {
                for path in out.created.drain(..) {
                    remove(&path);
                }
                Err(e)
            }
        }
    }

    /// Files removed at stop.
    pub fn scratch_files(&self) -> &[PathBuf] {
        &self.scratch
    }

    fn prepare_all(
        &mut self,
        spec: &DeviceSpec,
        vm: &str,
        run_dir: &Path,
    ) -> Result<(), HostError> {
        for disk in &spec.disks {
            let path = self.disk_image(disk, vm, run_dir)?;
            let run_scratch = self.scratch.contains(&path);
            self.devices.push(open_block(disk, &path, run_scratch)?);
        }
        for iface in &spec.interfaces {
            let (net, describe) = open_nic(iface)?;
            let fd = net.backend().as_raw_fd();
            self.devices.push(PreparedDevice {
                device: Box::new(net),
                backend: Some((fd, 0)),
                describe,
            });
        }
        if spec.rng {
            self.devices.push(PreparedDevice {
                device: Box::new(Rng::new()),
                backend: None,
                describe: "rng: getrandom".into(),
            });
        }
        if let Some(v) = &spec.vsock {
            self.devices.push(open_vsock(v, vm, run_dir)?);
        }
        Ok(())
    }

    /// The image a disk opens, made first if the source says so.
    fn disk_image(
        &mut self,
        disk: &DiskSpec,
        vm: &str,
        run_dir: &Path,
    ) -> Result<PathBuf, HostError> {
        let create_err = |path: &Path| {
            let (disk, path) = (disk.name.clone(), path.to_path_buf());
            move |source| HostError::CreateImage { disk, path, source }
        };
        match &disk.source {
            DiskSource::Image { path, create_bytes } => {
                if let (Some(bytes), false) = (create_bytes, path.exists()) {
                    sparse_file(path, *bytes).map_err(create_err(path))?;
                    self.created.push(path.clone());
                }
                Ok(path.clone())
            }
            DiskSource::EmptyDisk { capacity_bytes } => {
                let path = run_dir.join(format!("{vm}-{}.empty.img", disk.name));
                // A run that was killed leaves its empty disk behind: it is ours, and empty
                // disks start empty.
                remove(&path);
                // Whole 4 KiB blocks, so that cache "none" can use it.
                sparse_file(&path, capacity_bytes.div_ceil(4096) * 4096)
                    .map_err(create_err(&path))?;
                self.keep_for_run(&path);
                Ok(path)
            }
            DiskSource::CloudInitNoCloud {
                user_data,
                network_data,
            } => {
                let path = run_dir.join(format!("{vm}-{}.cidata.img", disk.name));
                let seed = NoCloudSeed {
                    instance_id: vm.to_string(),
                    hostname: vm.to_string(),
                    user_data: user_data.clone(),
                    network_config: network_data.clone(),
                };
                seed.write_to(&path).map_err(|source| HostError::Seed {
                    disk: disk.name.clone(),
                    source,
                })?;
                self.keep_for_run(&path);
                Ok(path)
            }
        }
    }

    fn keep_for_run(&mut self, path: &Path) {
        self.scratch.push(path.to_path_buf());
        self.created.push(path.to_path_buf());
    }
}

impl Drop for HostDevices {
    fn drop(&mut self) {
        for path in self.scratch.drain(..) {
            remove(&path);
        }
    }
}

fn open_nic(iface: &InterfaceSpec) -> Result<(Net, String), HostError> {
    if let Some(tap) = &iface.tap {
        if !Path::new("/sys/class/net").join(tap).exists() {
            return Err(HostError::TapMissing {
                interface: iface.name.clone(),
                tap: tap.clone(),
            });
        }
    }
    let tap = Tap::open(iface.tap.as_deref().unwrap_or(TAP_PATTERN)).map_err(|source| {
        HostError::Tap {
            interface: iface.name.clone(),
            source,
        }
    })?;
    let describe = format!(
        "interface {}: tap {} ({}), MAC {}",
        iface.name,
        tap.name(),
        if tap.created() { "created" } else { "attached" },
        iface.mac
    );
    Ok((Net::with_offloads(tap.into_file(), iface.mac.0), describe))
}

/// A disk's image at `path` opened as a virtio-blk device; `run_scratch`: the image was made
/// for this run (an empty disk, a seed).
fn open_block(
    disk: &DiskSpec,
    path: &Path,
    run_scratch: bool,
) -> Result<PreparedDevice, HostError> {
    let config = BlockConfig {
        path: path.to_path_buf(),
        read_only: disk.read_only,
        cache: match disk.cache {
            DiskCache::None => CacheMode::None,
            DiskCache::Writeback => CacheMode::Writeback,
            DiskCache::Auto => CacheMode::Auto,
        },
        serial: disk.serial.clone(),
    };
    let mut block = Block::new(&config).map_err(|source| HostError::Block {
        disk: disk.name.clone(),
        source,
    })?;
    block.set_run_scratch(run_scratch);
    let describe = format!(
        "disk {}: {} ({}, cache {})",
        disk.name,
        path.display(),
        if disk.read_only {
            "read-only"
        } else {
            "read-write"
        },
        block.cache_mode()
    );
    Ok(PreparedDevice {
        device: Box::new(block),
        backend: None,
        describe,
    })
}

/// The vsock device: on the kernel's vhost-vsock, or on a Unix socket (its path from the spec
/// or `<run_dir>/<vm>.vsock`).
fn open_vsock(v: &VsockSpec, vm: &str, run_dir: &Path) -> Result<PreparedDevice, HostError> {
    if v.backend == VsockBackend::Vhost {
        let vhost =
            VhostVsock::new(v.cid).map_err(|source| HostError::Vhost { cid: v.cid, source })?;
        let fd = vhost.poll_fd();
        return Ok(PreparedDevice {
            device: Box::new(vhost),
            backend: Some((fd, crate::vsock::RX)),
            describe: format!(
                "vsock: guest CID {} on the kernel's vhost-vsock (host side AF_VSOCK)",
                v.cid
            ),
        });
    }
    // The device owns the socket and removes it when it is dropped (VM stop).
    let path = v.socket_in(run_dir, vm);
    let vsock = Vsock::new(v.cid, &path).map_err(|source| HostError::Vsock {
        path: path.clone(),
        source,
    })?;
    let fd = vsock.poll_fd();
    Ok(PreparedDevice {
        device: Box::new(vsock),
        backend: Some((fd, crate::vsock::RX)),
        describe: format!(
            "vsock: guest CID {}, Unix socket {} (host ports: {}_<port>)",
            v.cid,
            path.display(),
            path.display()
        ),
    })
}

/// Creates `path` (it must not exist) as a sparse file of `bytes`.
fn sparse_file(path: &Path, bytes: u64) -> std::io::Result<()> {
    let f = OpenOptions::new().write(true).create_new(true).open(path)?;
    f.set_len(bytes)
}

fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(path = %path.display(), error = %e, "cannot remove a device file");
        }
    }
}

#[cfg(test)]
#[path = "host_tests.rs"]
mod tests;
