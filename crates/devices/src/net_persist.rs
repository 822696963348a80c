//! virtio-net's state that moves with the VM: the MAC and whether the device offers the
//! tap's offloads (what the guest negotiated is in the transport's state). The tap is not
//! state: the target opens its own from the spec, and the device built there sets the
//! guest's offloads on it when the restored transport activates it.
//!
//! Receive chains the device took from the queue and holds for a frame that has not come
//! (`VIRTIO_NET_F_MRG_RXBUF`) are given back on save: the saved `next_avail` is before them,
//! so the restored device takes them again (and so does this one, if the VM resumes here).
//!
//! After a restore the device announces the guest's MAC on the new tap, as QEMU's
//! `qemu_announce_self` does: one broadcast RARP frame from the MAC (it needs no IP address,
//! which vmhost does not know), so switches and bridges learn the port the guest is behind
//! now. The guest itself is not asked to announce (`VIRTIO_NET_F_GUEST_ANNOUNCE` needs a
//! control queue, which the device does not have).

use std::num::Wrapping;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;

use std::io::Write;

use tracing::warn;

use super::{Net, RX, VNET_HDR_LEN};
use crate::persist::{DeviceState, StateError};

/// Ethertype of RARP.
const ETH_P_RARP: u16 = 0x8035;

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

    /// The RARP announcement of the guest's MAC, with its (zero) virtio-net header.
    pub(super) fn announcement(&self) -> Vec<u8> {
        let mut f = vec![0u8; VNET_HDR_LEN];
        f.extend_from_slice(&[0xff; 6]); // broadcast
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&ETH_P_RARP.to_be_bytes());
        // htype Ethernet, ptype IPv4, hlen 6, plen 4, op 3 (reverse request).
        f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 3]);
        f.extend_from_slice(&self.mac); // sender MAC
        f.extend_from_slice(&[0; 4]); // sender IP: unknown
        f.extend_from_slice(&self.mac); // target MAC
        f.extend_from_slice(&[0; 4]); // target IP
                                      // Padded to the minimum Ethernet frame (60 bytes without the FCS).
        f.resize(VNET_HDR_LEN + 60, 0);
        f
    }

    /// Sends [`Net::announcement`] on the backend; a failure is logged, not fatal (the guest's
    /// own traffic teaches the switches too).
    pub(super) fn announce(&mut self) {
        let frame = self.announcement();
        match (&self.backend).write(&frame) {
            Ok(n) if n == frame.len() => {}
            Ok(_) => warn!("virtio-net: the MAC announcement was cut short"),
            Err(e) => self.log_backend_error("announce (RARP)", &e),
        }
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
