//! virtio-net's state that moves with the VM: the MAC and whether the device offers the
//! tap's offloads (what the guest negotiated is in the transport's state). The tap is not
//! state: the target opens its own from the spec, and the device built there sets the
//! guest's offloads on it when the restored transport activates it.
//!
//! Receive chains the device took from the queue and holds for a frame that has not come
//! (`VIRTIO_NET_F_MRG_RXBUF`) are given back on save: the saved `next_avail` is before them,
//! so the restored device takes them again (and so does this one, if the VM resumes here).

use std::num::Wrapping;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;

use super::{Net, RX};
use crate::persist::{DeviceState, StateError};

/// A NIC's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {
    /// The MAC the guest was given.
    pub mac: [u8; 6],
    /// The device offers the tap's checksum and TSO offloads.
    pub offloads: bool,
}

impl Net {
    pub(super) fn state(&self) -> NetState {
        NetState {
            mac: self.mac,
            offloads: self.offloads,
        }
    }

    /// Puts the held receive chains back in the queue: they were the last ones taken, in
    /// order, and none is used.
    pub(super) fn give_back_held(&mut self, queues: &mut [virtio_queue::Queue]) {
        let held = u16::try_from(self.rx_held.len()).unwrap_or(u16::MAX);
        if let Some(rx) = queues.get_mut(RX) {
            rx.set_next_avail((Wrapping(rx.next_avail()) - Wrapping(held)).0);
        }
        self.forget_held();
    }

    pub(super) fn check_restore(&self, state: &DeviceState) -> Result<(), StateError> {
        let DeviceState::Net(saved) = state else {
            return Err(StateError::Kind {
                saved: state.kind().to_string(),
                built: "net".to_string(),
            });
        };
        let mac = |m: &[u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        if saved.mac != self.mac {
            return Err(StateError::Mismatch {
                field: "interface MAC",
                saved: mac(&saved.mac),
                built: mac(&self.mac),
            });
        }
        if saved.offloads != self.offloads {
            return Err(StateError::Mismatch {
                field: "interface offloads (tap backend)",
                saved: saved.offloads.to_string(),
                built: self.offloads.to_string(),
            });
        }
        Ok(())
    }
}
