//! vmhost's syscall filters: one seccomp allow-list per kind of thread ([`ThreadKind`]),
//! compiled with rust-vmm's `seccompiler` and installed by each thread on itself
//! ([`install`]), once the thread has done what needs wider system calls (opening files,
//! mapping guest memory, creating its vCPU). Filters are per thread: a thread's filter also
//! binds the threads it starts afterwards, which then add their own (the kernel applies the
//! strictest answer of all the filters a thread carries).
//!
//! A system call outside the list:
//! - [`SeccompMode::On`] (the default): the kernel stops it with `SIGSYS`; vmhost's handler
//!   writes the thread's name, its id and the call's name and number to stderr with a raw
//!   `write(2)`, then makes the same call again with `SIGSYS` blocked, which makes the kernel
//!   kill the whole process with `SIGSYS` (the status a parent sees) and a core dump.
//! - [`SeccompMode::Log`]: the call proceeds and the kernel logs it (audit or `dmesg`:
//!   `type=1326 ... comm="vcpu0" syscall=41`): for finding what a list misses.
//! - [`SeccompMode::Off`]: no filter at all.
//!
//! A panic on a filtered thread prints its message without a backtrace (resolving one reads
//! the executable's debug information, which no list allows; `--seccomp off` for that).
//!
//! The process-wide mode is set once by the binary (`--seccomp`), else read from the
//! `VMHOST_SECCOMP` environment variable (`on`, `log`, `off`), else `On`; library users and
//! tests get the filters too. Debug builds honour `VMHOST_SECCOMP_SELFTEST=<kind>` (e.g.
//! `vcpu`): right after installing that kind's filter the thread makes a forbidden call
//! (`socket`), which proves the trap end to end.

mod filters;
mod names;
mod trap;

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub use filters::Rule;

/// A kind of vmhost thread, each with its own allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ThreadKind {
    /// The main thread (`vmhost`) once the VM is set up: waits for the emulator thread, then
    /// tears the VM down, releases the cgroup and the ledger entry and prints the report.
    Vmm,
    /// A vCPU thread (`vcpu<N>`) once its vCPU is configured: `KVM_RUN` and the exits it
    /// serves (serial, ACPI power-off and reset, pvpanic, the debug port, virtio-mmio).
    Vcpu,
    /// The emulator thread (`vmhost-emu`) once every vCPU thread is started.
    Emulator,
    /// The control API thread (`vmhost-api`, a tokio current-thread runtime).
    Api,
    /// The stop-signal thread (`vmhost-sig`).
    Signal,
    /// A guest RAM prefault worker (`prefault-c<cell>-<i>`).
    Prefault,
    /// The serial output writer (`vmhost-serial`).
    Serial,
    /// The diagnostics writer (`vmhost-diag`): drains the bounded buffer of `tracing` lines
    /// into stderr.
    Diag,
    /// The serial console input reader (`vmhost-stdin`).
    Stdin,
    /// The cgroup memory limit watcher (`oom-watch`).
    OomWatch,
    /// The thread that moves KVM's worker threads off the vCPU PUs (`vmhost-kvmpin`).
    KvmPin,
    /// The ACPI power button grace timer (`vmhost-grace`).
    Grace,
    /// The final report writer (`vmhost-out`).
    Output,
    /// The virtio device I/O thread (`vmhost-io`).
    DeviceIo,
    /// The cgroup v2 supervisor process, outside the VM's cgroup.
    Supervisor,
    /// The background prefault's coordinator (`vmhost-prefault`, `--prefault background`)
    /// once its workers are done: the residency audit, its report and the cpuset narrowing.
    PrefaultAudit,
    /// The snapshot job (`vmhost-snap`): pauses and resumes the vCPUs, captures the VM's
    /// state, writes the snapshot directory (or removes an unfinished one) and, with `stop`,
    /// ends the VM.
    Snapshot,
    /// A restore's guest memory loader (`load-c<cell>`): reads its cell's memory file into
    /// guest RAM.
    Loader,
    /// A live migration's sender (`vmhost-mig`): pauses and resumes the vCPUs, reads and
    /// clears the dirty page log (`KVM_GET_DIRTY_LOG`, memslots registered again with or
    /// without `KVM_MEM_LOG_DIRTY_PAGES`), reads resident guest pages, captures the VM's
    /// state, and talks to the target over its Unix or TCP connection.
    Migration,
    /// A live migration target's page receiver (`recv-c<cell>`): reads its cell's page
    /// stream (already open) into guest RAM, pinned to the cell's node before its filter.
    Receiver,
}

impl ThreadKind {
    /// Every kind, in the order of the published table.
    pub const ALL: [ThreadKind; 20] = [
        ThreadKind::Vcpu,
        ThreadKind::Vmm,
        ThreadKind::Emulator,
        ThreadKind::Api,
        ThreadKind::DeviceIo,
        ThreadKind::Signal,
        ThreadKind::Serial,
        ThreadKind::Diag,
        ThreadKind::Stdin,
        ThreadKind::Prefault,
        ThreadKind::OomWatch,
        ThreadKind::KvmPin,
        ThreadKind::Grace,
        ThreadKind::Output,
        ThreadKind::Supervisor,
        ThreadKind::PrefaultAudit,
        ThreadKind::Snapshot,
        ThreadKind::Loader,
        ThreadKind::Migration,
        ThreadKind::Receiver,
    ];

    /// Whether vmhost starts threads of this kind from a thread that runs under its own
    /// filter already (the final report's writer, started by the filtered main thread; the
    /// others are started before their creator's filter: docs/security.md, "Order of
    /// installation").
    pub fn started_by_a_filtered_thread(self) -> bool {
        matches!(self, ThreadKind::Output)
    }

    /// The kind's name (`VMHOST_SECCOMP_SELFTEST`, messages, docs).
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Emulator => "emulator",
            ThreadKind::Api => "api",
            ThreadKind::Signal => "signal",
            ThreadKind::Prefault => "prefault",
            ThreadKind::Serial => "serial",
            ThreadKind::Diag => "diag",
            ThreadKind::Stdin => "stdin",
            ThreadKind::OomWatch => "oom-watch",
            ThreadKind::KvmPin => "kvmpin",
            ThreadKind::Grace => "grace",
            ThreadKind::Output => "output",
            ThreadKind::DeviceIo => "device-io",
            ThreadKind::Supervisor => "supervisor",
            ThreadKind::PrefaultAudit => "prefault-audit",
            ThreadKind::Snapshot => "snapshot",
            ThreadKind::Loader => "loader",
            ThreadKind::Migration => "migration",
            ThreadKind::Receiver => "receiver",
        }
    }

    /// The system calls this kind may make, with their argument rules.
    pub fn rules(self) -> &'static [(i64, Rule)] {
        filters::rules(self)
    }

    /// The names of the allowed system calls, sorted.
    pub fn allowed_syscalls(self) -> Vec<&'static str> {
        let mut v: Vec<_> = self
            .rules()
            .iter()
            .map(|(nr, _)| syscall_name(*nr))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// What a filter does with a system call outside its list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeccompMode {
    /// Kill the process with `SIGSYS`, after naming the thread and the call on stderr.
    On,
    /// Let the call through and have the kernel log it.
    Log,
    /// Install no filter.
    Off,
}

impl FromStr for SeccompMode {
    type Err = SeccompError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(SeccompMode::On),
            "log" => Ok(SeccompMode::Log),
            "off" => Ok(SeccompMode::Off),
            other => Err(SeccompError::BadMode {
                value: other.to_owned(),
            }),
        }
    }
}

impl std::fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SeccompMode::On => "on",
            SeccompMode::Log => "log",
            SeccompMode::Off => "off",
        })
    }
}

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// A mode that is not `on`, `log` or `off`.
    #[error("seccomp mode = {value:?}: not a mode; use on, log or off")]
    BadMode {
        /// What was given.
        value: String,
    },
    /// `VMHOST_SECCOMP` holds something else than `on`, `log` or `off`.
    #[error(
        "VMHOST_SECCOMP = {value:?}: not a seccomp mode; set it to on, log or off, or unset it"
    )]
    BadEnv {
        /// What it holds.
        value: String,
    },
    /// seccompiler refused the allow-list (a bug in `filters`).
    #[error("the {kind} thread's syscall filter cannot be compiled")]
    Compile {
        /// The thread kind.
        kind: &'static str,
        /// The cause.
        #[source]
        source: seccompiler::BackendError,
    },
    /// The kernel refused the filter (no seccomp support?).
    #[error("the {kind} thread's syscall filter cannot be installed (does the kernel have CONFIG_SECCOMP_FILTER?)")]
    Install {
        /// The thread kind.
        kind: &'static str,
        /// The cause.
        #[source]
        source: seccompiler::Error,
    },
    /// The `SIGSYS` handler cannot be installed.
    #[error("cannot install the SIGSYS handler that reports forbidden system calls")]
    Handler(#[source] std::io::Error),
}

const MODE_UNSET: u8 = 0;
static MODE: AtomicU8 = AtomicU8::new(MODE_UNSET);

fn encode(mode: SeccompMode) -> u8 {
    match mode {
        SeccompMode::On => 1,
        SeccompMode::Log => 2,
        SeccompMode::Off => 3,
    }
}

/// Sets the process-wide mode that [`install_current`] uses (the binary's `--seccomp`).
pub fn set_mode(mode: SeccompMode) {
    MODE.store(encode(mode), Ordering::SeqCst);
}

/// `VMHOST_SECCOMP` when it is set: `Err` names the variable, its value and the choices (the
/// binary refuses to start with it; [`mode`] treats it as `On`, so that a typo never turns
/// the filters off).
pub fn mode_from_env() -> Result<Option<SeccompMode>, SeccompError> {
    match std::env::var("VMHOST_SECCOMP") {
        Ok(v) => v
            .parse()
            .map(Some)
            .map_err(|_| SeccompError::BadEnv { value: v }),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(SeccompError::BadEnv {
            value: v.to_string_lossy().into_owned(),
        }),
    }
}

/// The process-wide mode: the one [`set_mode`] set, else `VMHOST_SECCOMP`, else `On`. An
/// unreadable `VMHOST_SECCOMP` is `On` (a typo must not turn the filters off).
pub fn mode() -> SeccompMode {
    match MODE.load(Ordering::SeqCst) {
        1 => SeccompMode::On,
        2 => SeccompMode::Log,
        3 => SeccompMode::Off,
        _ => {
            let mode = mode_from_env().ok().flatten().unwrap_or(SeccompMode::On);
            // Another thread may have raced us to the same answer; both store the same value.
            let _ =
                MODE.compare_exchange(MODE_UNSET, encode(mode), Ordering::SeqCst, Ordering::SeqCst);
            mode
        }
    }
}

/// Set only in the build `scripts/text-order.py` runs under valgrind, which has no seccomp(2):
/// there, a filter the kernel was never given is taken as installed, so that the run goes on
/// through the code a normal start runs (the text-order profile, docs/benchmarks.md). A binary
/// built without `VMHOST_BUILD_FOR_VALGRIND` in the environment (every other build) has `false`
/// here and the match arm that reads it compiled out.
const BUILT_FOR_VALGRIND: bool = option_env!("VMHOST_BUILD_FOR_VALGRIND").is_some();

/// Installs `kind`'s filter on the calling thread in the process-wide [`mode`].
pub fn install_current(kind: ThreadKind) -> Result<(), SeccompError> {
    install(kind, mode())
}

/// [`install_current`] for a thread that has nobody to hand an error to: a filter that cannot
/// be installed is reported on stderr and aborts the process rather than letting the thread
/// run unfiltered. (Once the first filter of the process is in, the kernel has no reason left
/// to refuse one: this does not happen in practice.)
pub fn install_current_or_abort(kind: ThreadKind) {
    if let Err(e) = install_current(kind) {
        let mut msg = format!("vmhost: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            msg.push_str(&format!(": {s}"));
            source = s.source();
        }
        eprintln!("{msg}");
        std::process::abort();
    }
}

/// Installs `kind`'s filter on the calling thread (nothing when `mode` is `Off`). Every
/// system call the thread makes from now on must be on the list.
pub fn install(kind: ThreadKind, mode: SeccompMode) -> Result<(), SeccompError> {
    let mismatch = match mode {
        SeccompMode::Off => return Ok(()),
        SeccompMode::On => SeccompAction::Trap,
        SeccompMode::Log => SeccompAction::Log,
    };
    let program = program(kind, mode, mismatch)?;
    trap::install_handler().map_err(SeccompError::Handler)?;
    trap::install_panic_hook();
    trap::remember_thread(kind);
    // std draws a thread's HashMap seeds from getrandom(2) at its first HashMap: draw them now,
    // so that no list needs getrandom for that. A thread already in filter mode may run under
    // an outer filter (a container runtime's default profile, systemd's SystemCallFilter=),
    // which let the process start and lets it draw them too; but not under a vmhost filter
    // it inherited from its creator, which may not allow getrandom (`prctl` is on every list
    // of a thread that starts threads).
    // SAFETY: PR_GET_SECCOMP takes no pointer and returns the thread's mode.
    let filtered = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) } != 0;
    if !filtered || !kind.started_by_a_filtered_thread() {
        let _ = std::collections::hash_map::RandomState::new();
    }
    let selftest = selftest_requested(kind);
    match seccompiler::apply_filter(&program) {
        Ok(()) => {}
        Err(seccompiler::Error::Seccomp(e))
            if BUILT_FOR_VALGRIND && e.raw_os_error() == Some(libc::ENOSYS) => {}
        Err(source) => {
            return Err(SeccompError::Install {
                kind: kind.name(),
                source,
            })
        }
    }
    if selftest {
        trap::forbidden_call();
    }
    Ok(())
}

/// The compiled programs, by kind and mode: a kind installed on many threads (vCPUs, loaders,
/// receivers) is compiled once per process, and [`precompile`] takes the compiling off a path
/// that must be short (a migration target's, between its commit and the guest's release).
type Programs = Vec<(ThreadKind, SeccompMode, Arc<BpfProgram>)>;
static PROGRAMS: Mutex<Programs> = Mutex::new(Vec::new());

/// `kind`'s program in `mode`, compiled at its first use.
fn program(
    kind: ThreadKind,
    mode: SeccompMode,
    mismatch: SeccompAction,
) -> Result<Arc<BpfProgram>, SeccompError> {
    let cached = |programs: &Programs| {
        programs
            .iter()
            .find(|(k, m, _)| (*k, *m) == (kind, mode))
            .map(|(.., p)| Arc::clone(p))
    };
    if let Some(p) = cached(&PROGRAMS.lock().unwrap_or_else(PoisonError::into_inner)) {
        return Ok(p);
    }
    let compiled = Arc::new(compile(kind, mismatch)?);
    let mut programs = PROGRAMS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(p) = cached(&programs) {
        return Ok(p);
    }
    programs.push((kind, mode, Arc::clone(&compiled)));
    Ok(compiled)
}

/// Compiles every kind's filter in the process-wide [`mode`] now, so that the threads started
/// later only install theirs (nothing when the mode is `Off`).
pub fn precompile() -> Result<(), SeccompError> {
    let (mode, mismatch) = match mode() {
        SeccompMode::Off => return Ok(()),
        SeccompMode::On => (SeccompMode::On, SeccompAction::Trap),
        SeccompMode::Log => (SeccompMode::Log, SeccompAction::Log),
    };
    for kind in ThreadKind::ALL {
        program(kind, mode, mismatch.clone())?;
    }
    Ok(())
}

/// The BPF program of `kind` with `mismatch` for calls outside the list.
fn compile(kind: ThreadKind, mismatch: SeccompAction) -> Result<BpfProgram, SeccompError> {
    let err = |source| SeccompError::Compile {
        kind: kind.name(),
        source,
    };
    let mut rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> = BTreeMap::new();
    for (nr, rule) in kind.rules() {
        rules.insert(*nr, rule.compile().map_err(err)?);
    }
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(err)?;
    filter.try_into().map_err(err)
}

/// Debug builds: `VMHOST_SECCOMP_SELFTEST` names this kind.
fn selftest_requested(kind: ThreadKind) -> bool {
    cfg!(debug_assertions)
        && std::env::var("VMHOST_SECCOMP_SELFTEST").is_ok_and(|v| v == kind.name())
}

/// The name of x86-64 system call `nr` (`"?"` when there is none).
pub fn syscall_name(nr: i64) -> &'static str {
    usize::try_from(nr)
        .ok()
        .and_then(|i| names::NAMES.get(i))
        .copied()
        .unwrap_or("?")
}

/// The published table (docs/security.md): one row per thread kind with its count.
pub fn counts_table() -> String {
    let mut s = String::from("| thread | name | allowed system calls |\n|---|---|---|\n");
    for kind in ThreadKind::ALL {
        s.push_str(&format!(
            "| {} | `{}` | {} |\n",
            kind.name(),
            thread_names(kind),
            kind.allowed_syscalls().len()
        ));
    }
    s
}

/// Each kind's allowed calls, one line per kind (docs/security.md, checked by a test);
/// `ioctl(...)` lists its requests, `fcntl(F_GETFD)` and `kill(...)` their allowed values,
/// `mmap`/`mprotect` are without `PROT_EXEC`.
pub fn lists_text() -> String {
    let mut s = String::new();
    for kind in ThreadKind::ALL {
        let calls: Vec<String> = kind
            .rules()
            .iter()
            .map(|(nr, rule)| {
                let name = syscall_name(*nr);
                match rule {
                    Rule::Any | Rule::NoExec { .. } => name.to_owned(),
                    Rule::OneOf { values, .. } if *nr == libc::SYS_fcntl => {
                        debug_assert_eq!(*values, &[libc::F_GETFD as u64]);
                        "fcntl(F_GETFD)".to_owned()
                    }
                    Rule::OneOf { values, .. } => {
                        let v: Vec<String> = values.iter().map(|v| format!("{v:#x}")).collect();
                        format!("{name}({})", v.join("|"))
                    }
                }
            })
            .collect();
        s.push_str(&format!("{}: {}\n", kind.name(), calls.join(" ")));
    }
    s
}

/// The thread names a kind runs under (for the table).
fn thread_names(kind: ThreadKind) -> &'static str {
    match kind {
        ThreadKind::Vmm => "vmhost",
        ThreadKind::Vcpu => "vcpu<N>",
        ThreadKind::Emulator => "vmhost-emu",
        ThreadKind::Api => "vmhost-api",
        ThreadKind::Signal => "vmhost-sig",
        ThreadKind::Prefault => "prefault-c<C>-<I>",
        ThreadKind::Serial => "vmhost-serial",
        ThreadKind::Diag => "vmhost-diag",
        ThreadKind::Stdin => "vmhost-stdin",
        ThreadKind::OomWatch => "oom-watch",
        ThreadKind::KvmPin => "vmhost-kvmpin",
        ThreadKind::Grace => "vmhost-grace",
        ThreadKind::Output => "vmhost-out",
        ThreadKind::DeviceIo => "vmhost-io-<N>",
        ThreadKind::Supervisor => "vmhost (supervisor)",
        ThreadKind::PrefaultAudit => "vmhost-prefault",
        ThreadKind::Snapshot => "vmhost-snap",
        ThreadKind::Loader => "load-c<C>",
        ThreadKind::Migration => "vmhost-mig",
        ThreadKind::Receiver => "recv-c<C>",
    }
}

#[cfg(test)]
mod tests;
