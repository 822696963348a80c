//! The live migration protocol's messages: what the source and the target say to each other
//! on the control stream, an authenticated container ([`crate::auth`], [`crate::container`])
//! in each direction. Pure data (JSON records); the VMM decides what they mean.
//!
//! The order (docs/migration.md, "Live migration"), on the control connection:
//!
//! ```text
//! source → target   MIG_HELLO   Hello { protocol, spec, identity, tsc_khz, cpu_vendor, … }
//! target → source   MIG_ANSWER  Answer::Accepted { placement } | Answer::Refused { reason }
//!                   (then one more connection per guest cell, see below)
//! source → target   VM_STATE    (the vCPU crate's SavedVm, JSON: every final round came first)
//! target → source   MIG_COMMIT  Commit { … }   (the commit point)
//! either way        MIG_CANCEL  Cancel { reason } (before the commit point only)
//! ```
//!
//! and on each cell's connection (authenticated on its own):
//!
//! ```text
//! source → target   MIG_CELL    CellStream { cell }
//! source → target   per round:  MIG_ROUND Round, PAGES…, MIG_ROUND_END RoundEnd
//!                   (the stream ends after the round with `last`)
//! ```

use serde::{Deserialize, Serialize};

use crate::container::RecordKind;

/// The protocol version of [`Hello::protocol`]. A target refuses any other.
pub const PROTOCOL_VERSION: u32 = 1;

/// The record kinds the target reads on the control stream.
pub const TARGET_READS: [RecordKind; 3] = [
    RecordKind::MIG_HELLO,
    RecordKind::VM_STATE,
    RecordKind::MIG_CANCEL,
];

/// The record kinds the target reads on a cell's page stream.
pub const CELL_READS: [RecordKind; 5] = [
    RecordKind::MIG_CELL,
    RecordKind::MIG_ROUND,
    RecordKind::PAGES,
    RecordKind::MIG_ROUND_END,
    RecordKind::MIG_CANCEL,
];

/// The record kinds the source reads on the control stream.
pub const SOURCE_READS: [RecordKind; 3] = [
    RecordKind::MIG_ANSWER,
    RecordKind::MIG_COMMIT,
    RecordKind::MIG_CANCEL,
];

/// The source's opening message: enough for the target to plan and check before any memory
/// moves and before it opens `/dev/kvm`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the source.
    pub protocol: u32,
    /// The source's vmhost version.
    pub vmhost_version: String,
    /// The spec as written (the binary's `SpecSource`, JSON).
    pub spec: serde_json::Value,
    /// The guest's identity on the source (`vmhost_plan::GuestIdentity`, JSON).
    pub identity: serde_json::Value,
    /// The source's plan (JSON), for the reports' side-by-side placement.
    pub source_plan: serde_json::Value,
    /// The guest's TSC frequency on the source, kHz (0: unknown).
    pub tsc_khz: u32,
    /// The source host's CPU vendor string (CPUID leaf 0).
    pub cpu_vendor: String,
    /// The target must give the guest the same NUMA distances (`--same-distances` of either
    /// side).
    pub same_distances: bool,
}

/// The target's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Answer {
    /// The target admitted the VM; memory may move.
    Accepted {
        /// The target's plan (JSON): its placement.
        placement: serde_json::Value,
    },
    /// The target cannot take the VM; nothing moves and the source runs on.
    Refused {
        /// Why, naming the field/resource and the fix.
        reason: String,
    },
}

/// A pre-copy round of one guest cell begins; its page runs follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Round {
    /// The round: 0 sends every resident non-zero page, later ones the pages dirtied since.
    pub round: u32,
    /// The guest cell.
    pub cell: u32,
    /// Whether the guest is paused for this round (the final round).
    pub last: bool,
}

/// The opening of a cell's page stream: which guest cell it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellStream {
    /// The guest cell.
    pub cell: u32,
}

/// The end of a [`Round`]'s page runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundEnd {
    /// The round.
    pub round: u32,
    /// The cell.
    pub cell: u32,
    /// Bytes of pages the round sent for the cell (the target checks its count).
    pub bytes: u64,
}

/// The target loaded the state and resumes the guest: from here the source never resumes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Commit {
    /// Bytes of guest memory the target wrote.
    pub bytes_received: u64,
    /// The target's residency audit (JSON), for the source's report.
    pub audit: serde_json::Value,
}

/// A side gives up before the commit point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cancel {
    /// Why.
    pub reason: String,
}

/// Encodes a message as its record payload.
pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    // A struct of strings, numbers and JSON values always serializes.
    serde_json::to_vec(message).unwrap_or_default()
}

/// Decodes a record payload as a message, naming `what` in the error.
pub fn decode<'a, T: Deserialize<'a>>(what: &str, payload: &'a [u8]) -> Result<T, String> {
    serde_json::from_slice(payload).map_err(|e| format!("the {what} record is not valid: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_unknown_fields_are_refused() {
        let a = Answer::Refused {
            reason: "no room".into(),
        };
        let back: Answer = decode("answer", &encode(&a)).unwrap();
        assert_eq!(back, a);
        let r = Round {
            round: 2,
            cell: 1,
            last: true,
        };
        assert_eq!(decode::<Round>("round", &encode(&r)).unwrap(), r);
        let bad = br#"{"round": 1, "cell": 0, "last": false, "extra": 1}"#;
        assert!(decode::<Round>("round", bad).is_err());
    }
}
