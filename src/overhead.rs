//! Measured overhead: what the VMM costs the host beyond guest RAM, at the end of a run (the
//! peak, since guest RAM and KVM's tables are fully populated then).
//!
//! `overhead = RssAnon + VmPTE + ΔSecPageTables`:
//! - `RssAnon` is the VMM's private memory (heap, stacks, KVM's `kvm_run` pages); guest RAM is
//!   shared memory (`RssShmem`) or hugetlb and is not part of it. File-backed pages (the
//!   binary's and libraries' text, `RssFile`) are page cache shared by every vmhost process on
//!   the host and charged once, so they are reported (`rss_file_bytes`) but not counted per VM;
//! - `VmPTE` is the VMM's own page tables (mapping guest RAM costs 8 bytes per 4 KiB page);
//! - `SecPageTables` (`/proc/meminfo`, host-wide) is KVM's second-level page tables; its growth
//!   since the VMM started is this VM's (runs that measure it do not overlap).

use serde::Serialize;
use vmhost_plan::{Backing, Plan};

/// A `kB` field of a `/proc` file such as `status` or `meminfo` (`"VmRSS:"`), in bytes; 0 when
/// absent.
pub fn kib(text: &str, field: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// KVM's second-level page tables on the host now (bytes).
pub fn sec_page_tables() -> u64 {
    kib(
        &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
        "SecPageTables:",
    )
}

/// The measurement.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MeasuredOverhead {
    /// Peak resident set (`VmHWM`), guest RAM included when it is anonymous.
    pub peak_rss_bytes: u64,
    /// Resident set beyond guest RAM now (`VmRSS` minus anonymous guest RAM).
    pub rss_beyond_guest_bytes: u64,
    /// Private anonymous memory (`RssAnon`).
    pub rss_anon_bytes: u64,
    /// File-backed resident pages (`RssFile`): shared text of the binary and libraries.
    pub rss_file_bytes: u64,
    /// The VMM's page tables (`VmPTE`).
    pub vmm_page_tables_bytes: u64,
    /// Growth of KVM's second-level page tables since start.
    pub kvm_page_tables_bytes: u64,
    /// The overhead: private memory + both page tables.
    pub overhead_bytes: u64,
    /// What the plan's model said.
    pub model_bytes: u64,
}

/// Measures now; `sec_at_start` is [`sec_page_tables`] read when the VMM started.
pub fn measure(plan: &Plan, sec_at_start: u64) -> MeasuredOverhead {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let guest_in_rss = match plan.backing {
        Backing::Anonymous => kib(&status, "RssShmem:").min(plan.envelope.guest_memory_bytes),
        Backing::Hugetlb { .. } => 0,
    };
    let anon = kib(&status, "RssAnon:");
    let pte = kib(&status, "VmPTE:");
    let kvm = sec_page_tables().saturating_sub(sec_at_start);
    MeasuredOverhead {
        peak_rss_bytes: kib(&status, "VmHWM:"),
        rss_beyond_guest_bytes: kib(&status, "VmRSS:").saturating_sub(guest_in_rss),
        rss_anon_bytes: anon,
        rss_file_bytes: kib(&status, "RssFile:"),
        vmm_page_tables_bytes: pte,
        kvm_page_tables_bytes: kvm,
        overhead_bytes: anon + pte + kvm,
        model_bytes: plan.envelope.overhead_bytes
            - plan
                .envelope
                .overhead_terms
                .get("added_overhead")
                .copied()
                .unwrap_or(0),
    }
}
