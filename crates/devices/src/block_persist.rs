//! virtio-blk's state that moves with the VM. A disk serves each request whole while its
//! transport is locked, so a quiesced disk has no request in flight and its state is only
//! what identifies it: the image the target reopens (the same path: shared storage or a
//! copy), its size and mode, and the serial the guest read. The data is in the image.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Block, ID_BYTES};
use crate::persist::{DeviceState, StateError};

/// A disk's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockState {
    /// The image.
    pub path: PathBuf,
    /// Made by vmhost for the run (an empty disk, a cloud-init seed): the target makes its
    /// own and the path is not looked for (an empty disk starts empty there).
    pub run_scratch: bool,
    /// Opened read-only (VIRTIO_BLK_F_RO offered).
    pub read_only: bool,
    /// Capacity in 512-byte sectors, as the guest was told.
    pub capacity_sectors: u64,
    /// What GET_ID answers (at most 20 bytes).
    pub serial: String,
}

impl Block {
    pub(super) fn state(&self) -> BlockState {
        let end = self.serial.iter().position(|&b| b == 0).unwrap_or(ID_BYTES);
        BlockState {
            path: self.path.clone(),
            run_scratch: self.run_scratch,
            read_only: self.read_only,
            capacity_sectors: self.capacity,
            serial: String::from_utf8_lossy(&self.serial[..end]).into_owned(),
        }
    }

    /// The saved disk must be this one: same image (unless vmhost makes it per run), size,
    /// mode and serial.
    pub(super) fn check_restore(&self, state: &DeviceState) -> Result<(), StateError> {
        let DeviceState::Block(saved) = state else {
            return Err(StateError::Kind {
                saved: state.kind().to_string(),
                built: "block".to_string(),
            });
        };
        let here = self.state();
        let differs = |field, saved: String, built: String| {
            Err(StateError::Mismatch {
                field,
                saved,
                built,
            })
        };
        if !saved.run_scratch && saved.path != here.path {
            return differs(
                "disk image path",
                saved.path.display().to_string(),
                here.path.display().to_string(),
            );
        }
        if saved.capacity_sectors != here.capacity_sectors {
            return differs(
                "disk capacity (sectors)",
                saved.capacity_sectors.to_string(),
                here.capacity_sectors.to_string(),
            );
        }
        if saved.read_only != here.read_only {
            return differs(
                "disk read_only",
                saved.read_only.to_string(),
                here.read_only.to_string(),
            );
        }
        if saved.serial != here.serial {
            return differs("disk serial", saved.serial.clone(), here.serial);
        }
        Ok(())
    }
}
