use std::process::Command;

use super::*;

#[test]
fn every_kind_compiles_in_every_mode() {
    for kind in ThreadKind::ALL {
        for action in [SeccompAction::Trap, SeccompAction::Log] {
            let program = compile(kind, action).unwrap();
            assert!(!program.is_empty(), "{kind:?}");
        }
        assert!(!kind.allowed_syscalls().contains(&"?"), "{kind:?}");
    }
}

#[test]
fn the_ioctl_numbers_are_linux_s() {
    // From <linux/kvm.h> and <asm-generic/ioctls.h>, as strace prints them.
    assert_eq!(filters::KVM_RUN, 0xae80);
    assert_eq!(filters::KVM_KVMCLOCK_CTRL, 0xaead);
    assert_eq!(filters::KVM_GET_REGS, 0x8090_ae81);
    assert_eq!(filters::KVM_TRANSLATE, 0xc018_ae85);
    assert_eq!(filters::KVM_GET_VCPU_EVENTS, 0x8040_ae9f);
    assert_eq!(filters::KVM_IRQ_LINE, 0x4008_ae61);
    assert_eq!(filters::KVM_SIGNAL_MSI, 0x4020_aea5);
    assert_eq!(filters::KVM_SET_GSI_ROUTING, 0x4008_ae6a);
    assert_eq!(
        filters::KVM_VCPU_STATE_GETS,
        [
            0x8004_ae98, // KVM_GET_MP_STATE
            0x8138_ae83, // KVM_GET_SREGS
            0x9000_aea4, // KVM_GET_XSAVE
            0x9000_aecf, // KVM_GET_XSAVE2
            0x8188_aea6, // KVM_GET_XCRS
            0x8080_aea1, // KVM_GET_DEBUGREGS
            0x8400_ae8e, // KVM_GET_LAPIC
            0xaea3,      // KVM_GET_TSC_KHZ
            0xc008_ae88, // KVM_GET_MSRS
        ]
    );
    assert_eq!(
        filters::KVM_VM_STATE_GETS,
        [
            0xc208_ae62, // KVM_GET_IRQCHIP
            0x8070_ae9f, // KVM_GET_PIT2
            0x8030_ae7c, // KVM_GET_CLOCK
        ]
    );
    assert_eq!(filters::KVM_GET_DIRTY_LOG, 0x4010_ae42);
    assert_eq!(filters::KVM_SET_USER_MEMORY_REGION, 0x4020_ae46);
    assert_eq!(filters::TCSETS_REQ, libc::TCSETS);
    assert_eq!(filters::TCGETS_REQ, libc::TCGETS);
}

#[test]
fn merged_lists_have_one_rule_per_call() {
    for kind in ThreadKind::ALL {
        let rules = kind.rules();
        let mut nrs: Vec<i64> = rules.iter().map(|(nr, _)| *nr).collect();
        nrs.dedup();
        assert_eq!(
            nrs.len(),
            rules.len(),
            "{kind:?} lists a call with two rules"
        );
    }
}

/// A panic on a filtered thread still says what panicked (and the process goes on).
#[test]
fn a_panic_on_a_filtered_thread_prints_its_message_without_dying() {
    if std::env::var(CHILD).is_ok() {
        let r = std::thread::Builder::new()
            .name("vmhost-api".into())
            .spawn(|| {
                install(ThreadKind::Api, SeccompMode::On).unwrap();
                panic!("a bug in a handler");
            })
            .unwrap()
            .join();
        assert!(r.is_err());
        std::process::exit(0);
    }
    let out = run_child(
        "tests::a_panic_on_a_filtered_thread_prints_its_message_without_dying",
        "1",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("thread 'vmhost-api' panicked at")
            && stderr.contains("a bug in a handler")
            && !stderr.contains("forbidden"),
        "{stderr}"
    );
}

/// A filtered thread may not make executable memory.
#[test]
fn mmap_with_prot_exec_is_forbidden() {
    if std::env::var(CHILD).is_ok() {
        child_body(SeccompMode::On, || {
            // SAFETY: an anonymous private mapping of one page; never used.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
        });
    }
    let out = run_child("tests::mmap_with_prot_exec_is_forbidden", "1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(signal_of(out.status), Some(libc::SIGSYS), "{stderr}");
    assert!(
        stderr.contains("forbidden system call mmap (9)"),
        "{stderr}"
    );
}

#[test]
fn modes_parse_and_a_bad_one_names_the_choices() {
    assert_eq!("on".parse::<SeccompMode>().unwrap(), SeccompMode::On);
    assert_eq!("log".parse::<SeccompMode>().unwrap(), SeccompMode::Log);
    assert_eq!("off".parse::<SeccompMode>().unwrap(), SeccompMode::Off);
    let e = "yes".parse::<SeccompMode>().unwrap_err().to_string();
    assert!(e.contains("\"yes\"") && e.contains("on, log or off"), "{e}");
}

/// The published table cannot drift from the compiled lists.
#[test]
fn docs_security_md_publishes_the_compiled_counts() {
    let doc = include_str!("../../../docs/security.md");
    let table = counts_table();
    assert!(
        doc.contains(&table),
        "docs/security.md must contain this table exactly:\n{table}"
    );
    let count = |k: ThreadKind| k.allowed_syscalls().len();
    let firecracker = format!(
        "vmhost: vCPU {}, API {}, VMM {}.\n",
        count(ThreadKind::Vcpu),
        count(ThreadKind::Api),
        count(ThreadKind::Vmm)
    );
    assert!(
        doc.contains(&firecracker),
        "docs/security.md: {firecracker}"
    );
    // Below Firecracker's (issue 15).
    assert!(
        count(ThreadKind::Vcpu) < 27 && count(ThreadKind::Api) < 31 && count(ThreadKind::Vmm) < 50
    );
    let lists = lists_text();
    assert!(
        doc.contains(&format!("```text\n{lists}```\n")),
        "docs/security.md must contain these lists exactly, in a text block:\n{lists}"
    );
}

fn status_seccomp(tid: i32) -> String {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with("Seccomp:"))
        .unwrap()
        .to_owned()
}

/// A filtered thread lives and ends on its list: the kernel reports it in filter mode, and
/// the process goes on after the thread has exited.
#[test]
fn a_thread_that_installs_its_filter_runs_in_filter_mode_and_ends_cleanly() {
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::Builder::new()
        .name("vmhost-sig".into())
        .spawn(move || {
            // SAFETY: gettid has no arguments.
            let tid = i32::try_from(unsafe { libc::syscall(libc::SYS_gettid) }).unwrap();
            install(ThreadKind::Signal, SeccompMode::On).unwrap();
            tid_tx.send(tid).unwrap();
            go_rx.recv().unwrap();
        })
        .unwrap();
    let tid = tid_rx.recv().unwrap();
    assert_eq!(status_seccomp(tid), "Seccomp:\t2");
    // SAFETY: gettid has no arguments.
    let me = i32::try_from(unsafe { libc::syscall(libc::SYS_gettid) }).unwrap();
    assert_eq!(
        status_seccomp(me),
        "Seccomp:\t0",
        "the filter is per thread"
    );
    go_tx.send(()).unwrap();
    t.join().unwrap();
}

const CHILD: &str = "VMHOST_SECCOMP_TEST_CHILD";

/// Runs test `name` of this binary again in a child process with [`CHILD`] = `what`.
fn run_child(name: &str, what: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, what)
        .output()
        .unwrap()
}

/// In the child: a thread named `vcpu7` installs the vCPU filter in `mode` and makes the call.
fn child_body(mode: SeccompMode, call: fn()) {
    std::thread::Builder::new()
        .name("vcpu7".into())
        .spawn(move || {
            install(ThreadKind::Vcpu, mode).unwrap();
            call();
        })
        .unwrap()
        .join()
        .unwrap();
    std::process::exit(0);
}

fn signal_of(status: std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

#[test]
fn a_forbidden_call_kills_the_process_with_sigsys_after_naming_thread_and_call() {
    if std::env::var(CHILD).is_ok() {
        child_body(SeccompMode::On, trap::forbidden_call);
    }
    let out = run_child(
        "tests::a_forbidden_call_kills_the_process_with_sigsys_after_naming_thread_and_call",
        "1",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(signal_of(out.status), Some(libc::SIGSYS), "{stderr}");
    assert!(
        stderr.contains("vmhost: seccomp: thread vcpu7 (tid ")
            && stderr.contains(", vcpu filter) made the forbidden system call socket (41)"),
        "{stderr}"
    );
}

#[test]
fn an_ioctl_outside_the_allowed_requests_is_caught_with_its_request() {
    if std::env::var(CHILD).is_ok() {
        child_body(SeccompMode::On, || {
            let mut t = std::mem::MaybeUninit::<libc::termios>::uninit();
            // SAFETY: TCGETS writes one termios into `t`, which is large enough.
            unsafe { libc::ioctl(0, libc::TCGETS, t.as_mut_ptr()) };
        });
    }
    let out = run_child(
        "tests::an_ioctl_outside_the_allowed_requests_is_caught_with_its_request",
        "1",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(signal_of(out.status), Some(libc::SIGSYS), "{stderr}");
    assert!(
        stderr.contains("forbidden system call ioctl (16) request 0x5401;"),
        "{stderr}"
    );
}

#[test]
fn log_mode_lets_the_forbidden_call_through() {
    if std::env::var(CHILD).is_ok() {
        child_body(SeccompMode::Log, trap::forbidden_call);
    }
    let out = run_child("tests::log_mode_lets_the_forbidden_call_through", "1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("forbidden"), "{stderr}");
}

/// A kind's program is compiled once per mode and then shared; another mode or kind gets its
/// own, and the shared one is the program `compile` makes.
#[test]
fn a_kind_is_compiled_once_per_mode() {
    let a = program(ThreadKind::Vcpu, SeccompMode::Log, SeccompAction::Log).expect("vcpu, log");
    let b = program(ThreadKind::Vcpu, SeccompMode::Log, SeccompAction::Log).expect("again");
    assert!(Arc::ptr_eq(&a, &b), "compiled twice");
    let on = program(ThreadKind::Vcpu, SeccompMode::On, SeccompAction::Trap).expect("vcpu, on");
    assert!(!Arc::ptr_eq(&a, &on));
    let api = program(ThreadKind::Api, SeccompMode::On, SeccompAction::Trap).expect("api, on");
    assert!(!Arc::ptr_eq(&on, &api));
    let fresh = compile(ThreadKind::Vcpu, SeccompAction::Trap).expect("compile");
    let code = |p: &BpfProgram| {
        p.iter()
            .map(|f| (f.code, f.jt, f.jf, f.k))
            .collect::<Vec<_>>()
    };
    assert_eq!(code(&on), code(&fresh));
    assert_ne!(code(&on), code(&api));
}
