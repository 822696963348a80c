//! Live migration (docs/migration.md, "Live migration"): [`source`] is the job behind
//! `PUT /vm/migrate` in the migrating VM's process, [`target`] is `vmhost receive`, [`wire`]
//! the transport, [`report`] what both print. The messages and their record kinds are in
//! `vmhost_persist::migration`.

pub mod report;
pub mod source;
pub mod streams;
pub mod target;
pub mod wire;

/// The peer's `MIG_CANCEL`, with its reason: on the target it says more than the broken
/// streams that follow it.
#[derive(Debug, thiserror::Error)]
#[error("the peer cancelled the migration: {0}")]
pub struct PeerCancelled(pub String);

/// The test hook variable: `round:N:source` or `round:N:target` kills that side (`SIGABRT`,
/// no clean-up, as a crash or a kill would) when round N begins.
pub const FAIL_AT_VAR: &str = "VMHOST_TEST_MIGRATION_FAIL_AT";

/// Ends this process at round `round` when [`FAIL_AT_VAR`] names it and `side`.
pub fn test_hook(round: u32, side: &str) {
    let Ok(v) = std::env::var(FAIL_AT_VAR) else {
        return;
    };
    if v == format!("round:{round}:{side}") {
        eprintln!("vmhost: {FAIL_AT_VAR}={v}: the {side} is killed now (test hook)");
        // A signal, not `exit`: no destructor, no ledger release, as a kill. Allowed by every
        // filter (`tgkill` of the process's own thread).
        std::process::abort();
    }
}

/// This host's CPU vendor (`vendor_id` of /proc/cpuinfo; empty when unreadable).
pub fn cpu_vendor() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("vendor_id")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_default()
}
