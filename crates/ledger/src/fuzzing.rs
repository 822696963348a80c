//! Fuzzing entry point (feature `fuzzing`, used by `fuzz/fuzz_targets/ledger_entry.rs`): the
//! writer's encoder, so that an entry [`crate::Ledger::list`] read back from disk can be written
//! again and read back once more.

use crate::entry::{encode, Entry};

/// The exact bytes the ledger writes for `entry` (its entry file's content).
pub fn fuzz_encode_entry(entry: &Entry) -> Result<String, serde_json::Error> {
    encode(entry)
}
