//! The target side of a live migration: `vmhost receive --listen … --auth-key F [run options]`.
//!
//! Listens (a Unix socket 0600, or TCP on the given address only), authenticates each
//! connection (a peer without the key is refused and logged, and the target keeps
//! listening), reads the source's `Hello` and checks it before anything is allocated or
//! `/dev/kvm` is opened for the VM: protocol version, spec, CPU vendor, the guest's TSC rate
//! (a throwaway probe VM). Then the normal start path runs
//! (`main::start_vm`) with [`crate::run::Start::Incoming`]: admission as an incoming ledger
//! entry planned with `plan_for_guest` (same guest topology), the `Answer`, guest memory
//! allocated and bound per the target's plan and filled by the rounds ([`Incoming::receive`]),
//! the state checked (CPUID, TSC) and restored, then the `Commit` — the commit point — and
//! the guest runs here; the ledger hand-over and the report follow on the main thread while
//! it runs ([`Arrival::finish`]). Before the commit point the guest never runs
//! here: a source that goes away or cancels ends the target with a non-zero status, its
//! hugepages, cgroup and ledger entry released.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use vmhost_memory::GuestMemory;
use vmhost_persist::auth::{AuthKey, Role};
use vmhost_persist::container::RecordKind;
use vmhost_persist::migration::{self as msg, Answer, Commit, Hello};
use vmhost_plan::{GuestIdentity, Plan};
use vmhost_vcpu::persist::TargetCaps;

use super::source::expect;
use super::wire::{Channel, Listener};
use crate::snapshot::SpecSource;
use crate::timeline::StepClock;
use crate::{Exit, EXIT_INVALID};

/// A round as the target received it.
#[derive(Debug, Clone, Serialize)]
pub struct Received {
    /// The round.
    pub round: u32,
    /// The cell.
    pub cell: u32,
    /// Whether it was the final round (guest paused on the source).
    pub last: bool,
    /// Bytes of pages written into guest RAM.
    pub bytes: u64,
}

/// A migration coming in: the authenticated connection and what the source said.
pub struct Incoming {
    channel: Channel,
    /// Kept until the page streams are accepted.
    listener: Option<Listener>,
    /// The page streams, accepted right after the answer.
    cells: Option<Vec<(u32, Channel)>>,
    key: AuthKey,
    hello: Hello,
    identity: GuestIdentity,
    /// This host's KVM as probed at the hello.
    caps: TargetCaps,
    started: Instant,
    /// The steps from the hello to the receivers' start.
    arriving: StepClock,
    rounds: Vec<Received>,
    saved: Option<crate::vmstate::Saved>,
}

/// An invalid-input refusal (exit status 2).
fn invalid(what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(Exit {
        code: EXIT_INVALID,
        message: format!("receive: {what}"),
    })
}

/// Listens on `args.listen` until an authenticated source says hello; returns the spec to
/// run and the incoming migration.
pub fn accept(
    args: &crate::cli::ReceiveArgs,
) -> Result<(vmhost_config::LoadedSpec, SpecSource, Incoming)> {
    let key = AuthKey::load(&args.auth_key).map_err(|e| {
        let e = anyhow::Error::new(e);
        invalid(format!("--auth-key {}: {e:#}", args.auth_key.display()))
    })?;
    let at: super::wire::Endpoint = args.listen.parse().map_err(invalid)?;
    // This host's KVM, probed once (a throwaway VM) before any source connects: the TSC rule
    // at the hello, the vCPUs' CPUID when the state arrives, and neither inside the
    // migration's time.
    let caps = TargetCaps::of_this_host().context("probing this host's KVM")?;
    let listener = Listener::bind(&at)?;
    eprintln!("vmhost: receive: listening on {at}");
    let mut channel = loop {
        let (stream, peer) = listener.accept()?;
        match Channel::open(stream, &key, Role::Target, &msg::TARGET_READS) {
            Ok(ch) => {
                eprintln!("vmhost: receive: {peer}: authenticated");
                break ch;
            }
            Err(e) => eprintln!("vmhost: receive: refused a connection on {peer}: {e:#}"),
        }
    };
    match read_hello(&mut channel, args.same_distances, caps) {
        Ok(h) => Ok((
            h.spec,
            h.source,
            Incoming {
                channel,
                listener: Some(listener),
                cells: None,
                key,
                hello: h.hello,
                identity: h.identity,
                caps: h.caps,
                started: Instant::now(),
                arriving: h.clock,
                rounds: Vec::new(),
                saved: None,
            },
        )),
        Err(e) => {
            send_answer(&mut channel, Err(&format!("{e:#}")));
            Err(e)
        }
    }
}

/// A checked hello and what it said.
struct Heard {
    spec: vmhost_config::LoadedSpec,
    source: SpecSource,
    hello: Hello,
    identity: GuestIdentity,
    caps: TargetCaps,
    /// When it arrived: the start of the target's steps up to the receivers.
    clock: StepClock,
}

/// Reads and checks the `Hello`: protocol, spec, identity, CPU vendor, TSC rate.
fn read_hello(channel: &mut Channel, same_distances: bool, caps: TargetCaps) -> Result<Heard> {
    let rec = channel
        .recv("the source's hello")
        .map_err(|e| invalid(format!("{e:#}")))?;
    let clock = StepClock::start();
    let mut hello: Hello = expect(&rec, RecordKind::MIG_HELLO, "hello").map_err(invalid)?;
    if hello.protocol != msg::PROTOCOL_VERSION {
        return Err(invalid(format!(
            "the source speaks migration protocol {}, this vmhost {}: use the same vmhost \
             version on both hosts",
            hello.protocol,
            msg::PROTOCOL_VERSION
        )));
    }
    let vendor = super::cpu_vendor();
    if hello.cpu_vendor != vendor {
        return Err(invalid(format!(
            "the source's CPU vendor is {:?}, this host's {vendor:?}: a guest cannot move \
             between them",
            hello.cpu_vendor
        )));
    }
    check_tsc(hello.tsc_khz, &caps)?;
    let source: SpecSource = serde_json::from_value(hello.spec.clone())
        .map_err(|e| invalid(format!("the source's spec record is not valid: {e}")))?;
    let spec = source
        .load()
        .map_err(|e| invalid(format!("the source's spec: {e}")))?;
    let identity = serde_json::from_value(hello.identity.clone())
        .map_err(|e| invalid(format!("the source's guest identity is not valid: {e}")))?;
    hello.same_distances |= same_distances;
    clock.mark("hello checked");
    Ok(Heard {
        spec,
        source,
        hello,
        identity,
        caps,
        clock,
    })
}

/// The guest's TSC on the target.
#[derive(Debug, Clone, Serialize)]
pub struct TscKept {
    /// The guest's rate, from the source's hello (kHz).
    pub guest_khz: u32,
    /// This host's rate (`KVM_GET_TSC_KHZ` of a probe vCPU).
    pub host_khz: u32,
    /// How the guest's rate is kept (the same, scaled, or within KVM's tolerance).
    pub how: String,
}

/// How this host keeps a guest TSC rate of `guest_khz` (`None`: a source that did not say),
/// or why it cannot ([`vmhost_vcpu::persist::tsc_match`]).
fn tsc_kept(
    guest_khz: u32,
    caps: &TargetCaps,
) -> Result<Option<TscKept>, vmhost_vcpu::persist::CompatError> {
    if guest_khz == 0 {
        return Ok(None);
    }
    let how = vmhost_vcpu::persist::tsc_match(guest_khz, caps)?;
    Ok(Some(TscKept {
        guest_khz,
        host_khz: caps.tsc_khz,
        how: how.to_string(),
    }))
}

/// Whether this host can run the guest's TSC rate (0: a source that did not say; the state
/// check decides when it arrives): KVM scales it where it can, takes it within its tolerance
/// otherwise, and anything further is refused here, before any memory moves.
fn check_tsc(guest_khz: u32, caps: &TargetCaps) -> Result<()> {
    if let Some(t) = tsc_kept(guest_khz, caps).map_err(invalid)? {
        if t.guest_khz != t.host_khz {
            eprintln!(
                "vmhost: receive: the guest's TSC runs at {} kHz, this host's at {} kHz: {}",
                t.guest_khz, t.host_khz, t.how
            );
        }
    }
    Ok(())
}

/// Answers the source: accepted with the target's plan, or refused with the reason.
fn send_answer(channel: &mut Channel, outcome: Result<&Plan, &str>) {
    let answer = match outcome {
        Ok(plan) => Answer::Accepted {
            placement: serde_json::to_value(plan).unwrap_or_default(),
        },
        Err(reason) => Answer::Refused {
            reason: reason.to_string(),
        },
    };
    if let Err(e) = channel.send(RecordKind::MIG_ANSWER, &msg::encode(&answer)) {
        tracing::warn!(error = %format!("{e:#}"), "cannot answer the migration source");
    }
}

impl Incoming {
    /// The guest identity the target must keep.
    pub fn identity(&self) -> &GuestIdentity {
        &self.identity
    }

    /// Whether the guest must get the same NUMA distances.
    pub fn same_distances(&self) -> bool {
        self.hello.same_distances
    }

    /// Answers the source: accepted with the target's plan, or refused with the reason. An
    /// accepted VM's page streams are accepted at once, so that the source's round 0 begins
    /// while this side enters its cgroup and allocates the guest's memory (the rounds wait in
    /// the sockets until the receivers start); a failure to accept them is
    /// the error (the ledger entry, dropped by the caller, is released; nothing else is held
    /// yet).
    pub fn answer(&mut self, outcome: Result<&Plan, &str>) -> Result<()> {
        send_answer(&mut self.channel, outcome);
        self.arriving.mark("answered");
        let (Ok(plan), Some(listener)) = (outcome, self.listener.take()) else {
            return Ok(());
        };
        self.cells = Some(super::streams::accept_cells(&listener, &self.key, plan)?);
        self.arriving.mark("page streams");
        Ok(())
    }

    /// Marks the end of `step` of the target's work between the hello and the receivers.
    pub fn mark(&self, step: &'static str) {
        self.arriving.mark(step);
    }

    /// Where the time between the hello and the receivers' start went: "ready for the rounds
    /// N ms after the hello: step a ms, …".
    pub fn arriving_line(&self) -> String {
        let (total, steps) = self.arriving.steps();
        format!("ready for the rounds {total:.1} ms after the hello: {steps}")
    }

    /// Fills `memory` from the page streams [`Incoming::answer`] accepted (one pinned worker per cell)
    /// until the VM state arrives on the control connection, running `meanwhile` on this
    /// thread as the rounds arrive; checks that this host can run the saved vCPUs (CPUID,
    /// TSC). Before `/dev/kvm` is opened for the VM. Returns what `meanwhile` returned.
    pub fn receive<T>(
        &mut self,
        memory: &GuestMemory,
        plan: &Plan,
        meanwhile: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let cells = self
            .cells
            .take()
            .context("the source's page streams were not accepted: the VM was not admitted")?;
        let control = self.channel.stream();
        let (rounds, early) =
            super::streams::receive_all(memory, plan, cells, &control, meanwhile, || {
                let rec = self.channel.recv("the VM state")?;
                match rec.kind {
                    RecordKind::VM_STATE => self.take_state(&rec.payload),
                    _ => Err(
                        expect::<msg::Cancel>(&rec, RecordKind::VM_STATE, "VM state")
                            .err()
                            .unwrap_or_else(|| anyhow::anyhow!("the source sent no VM state")),
                    ),
                }
            })?;
        self.rounds = rounds;
        Ok(early)
    }

    fn take_state(&mut self, payload: &[u8]) -> Result<()> {
        let saved = crate::vmstate::decode(payload).context("decoding the source's VM state")?;
        if let Err(e) = saved.check_compatible(&self.caps) {
            let reason = format!("this host cannot run the guest's vCPUs: {e:#}");
            let cancel = msg::Cancel {
                reason: reason.clone(),
            };
            let _ = self
                .channel
                .send(RecordKind::MIG_CANCEL, &msg::encode(&cancel));
            bail!(reason);
        }
        self.saved = Some(saved);
        Ok(())
    }

    /// The saved state [`Incoming::receive`] took.
    pub fn take_saved(&mut self) -> Result<crate::vmstate::Saved> {
        self.saved.take().context("the source sent no VM state")
    }

    /// The commit point: tells the source the state is loaded and the guest resumes here.
    /// The connection to the source closes. What is left (the ledger hand-over and the
    /// report) does not hold the guest back: [`Arrival::finish`], once it runs.
    pub fn commit(
        self: Box<Self>,
        plan: &Plan,
        audit: &vmhost_memory::Audit,
        admission: &crate::vms::Admission,
        json: bool,
    ) -> Result<Arrival> {
        let Incoming {
            mut channel,
            hello,
            caps,
            started,
            rounds,
            ..
        } = *self;
        let bytes_received: u64 = rounds.iter().map(|r| r.bytes).sum();
        let commit = Commit {
            bytes_received,
            audit: serde_json::to_value(audit).unwrap_or_default(),
        };
        channel
            .send(RecordKind::MIG_COMMIT, &msg::encode(&commit))
            .context("sending the commit to the source (the guest does not run here)")?;
        drop(channel);
        Ok(Arrival {
            handover: admission.handover(),
            // Checked at the hello: the same answer now.
            tsc: tsc_kept(hello.tsc_khz, &caps).ok().flatten(),
            source_plan: hello.source_plan,
            target_plan: plan.clone(),
            rounds,
            bytes_received,
            seconds: started.elapsed().as_secs_f64(),
            audit: audit.clone(),
            json,
        })
    }
}

/// A migration that committed: what the target does once the guest runs here.
pub struct Arrival {
    handover: crate::vms::HandOver,
    source_plan: serde_json::Value,
    target_plan: Plan,
    rounds: Vec<Received>,
    bytes_received: u64,
    seconds: f64,
    audit: vmhost_memory::Audit,
    tsc: Option<TscKept>,
    json: bool,
}

impl Arrival {
    /// Takes over the VM's ledger entry and reports the migration on stderr. A hand-over that
    /// fails is reported and the guest runs on: it has nowhere else to run.
    pub fn finish(self) {
        if let Err(e) = self.handover.run() {
            eprintln!(
                "vmhost: receive: warning: the guest runs here, but its ledger entry is still \
                 the incoming one: taking over the VM's ledger entry failed: {e:#}"
            );
        }
        let report = super::report::TargetReport {
            source_plan: &self.source_plan,
            target_plan: &self.target_plan,
            rounds: &self.rounds,
            bytes_received: self.bytes_received,
            seconds: self.seconds,
            audit: &self.audit,
            tsc: self.tsc.as_ref(),
        };
        eprint!("{}", report.render(self.json));
    }
}
