//! The control API's view of a running VM (`--api-socket`): state, live placement read from
//! `/proc`, the envelope next to measured figures, and pause/resume/shutdown.

use std::collections::BTreeMap;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{json, Value};
use vmhost_api::{ControlError, VmControl};
use vmhost_config::VmSpec;
use vmhost_memory::audit::parse_numa_maps;
use vmhost_memory::Audit;
use vmhost_plan::{Backing, Plan};
use vmhost_vcpu::{thread_placements, StopHandle, ThreadPlacement, VmHandle, VmState};

/// A running VM as the API sees it.
pub struct Control {
    spec: VmSpec,
    plan: Plan,
    audit: Audit,
    started: Instant,
    handle: VmHandle,
    stop: StopHandle,
    envelope_guard: Option<Arc<crate::enforce::Enforcement>>,
    /// Arms the `vmhost-grace` timer (guests with a power button).
    grace: Option<Mutex<Sender<()>>>,
    /// The snapshot jobs (`PUT /vm/snapshot`).
    snapshots: Option<crate::snapshot::Jobs>,
    /// The migration jobs (`PUT /vm/migrate`).
    migrations: Option<crate::migrate::source::Jobs>,
}

impl Control {
    /// The API view of the VM of `plan`. For a guest with an ACPI power button it starts the
    /// `vmhost-grace` thread here, on the thread that serves the API's setup, so that the
    /// `vmhost-api` thread never starts a thread (its syscall filter has no `clone3`).
    pub fn new(
        spec: VmSpec,
        plan: Plan,
        audit: Audit,
        handle: VmHandle,
        stop: StopHandle,
        envelope_guard: Option<Arc<crate::enforce::Enforcement>>,
    ) -> std::io::Result<Self> {
        // From the plan, not the handle: a migration target serves its API before its VM
        // (and the power button) exists.
        let grace = if matches!(plan.boot, vmhost_config::BootSpec::Kernel { .. }) {
            let within = spec.termination_grace;
            Some(Mutex::new(start_grace_timer(stop.clone(), within)?))
        } else {
            None
        };
        Ok(Control {
            spec,
            plan,
            audit,
            started: Instant::now(),
            handle,
            stop,
            envelope_guard,
            grace,
            snapshots: None,
            migrations: None,
        })
    }

    /// Lets `PUT /vm/migrate` start migration jobs.
    pub fn with_migrations(mut self, jobs: Option<crate::migrate::source::Jobs>) -> Self {
        self.migrations = jobs;
        self
    }

    /// Lets `PUT /vm/snapshot` start snapshot jobs.
    pub fn with_snapshots(mut self, jobs: Option<crate::snapshot::Jobs>) -> Self {
        self.snapshots = jobs;
        self
    }

    fn state(&self) -> &'static str {
        match self.handle.state() {
            VmState::Created => "created",
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Stopped => "stopped",
        }
    }
}

/// Starts the `vmhost-grace` thread: each message starts a wait of `grace` (the spec's
/// `termination_grace_period_seconds`, 30 s unless written) after which the VM is stopped
/// unless it stopped meanwhile; it ends with its sender.
fn start_grace_timer(stop: StopHandle, grace: std::time::Duration) -> std::io::Result<Sender<()>> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("vmhost-grace".into())
        .spawn(move || {
            vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Grace);
            while rx.recv().is_ok() {
                let deadline = Instant::now() + grace;
                while Instant::now() < deadline && !stop.stop_requested() {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                if !stop.stop_requested() {
                    tracing::warn!(
                        ?grace,
                        "the guest did not power off after the power button: stopping it"
                    );
                    stop.stop();
                }
            }
        })?;
    Ok(tx)
}

/// Nanoseconds a thread has run (`/proc/self/task/TID/schedstat`).
fn cpu_ns(tid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

impl Control {
    fn thread_deviation(&self, t: &ThreadPlacement) -> Option<String> {
        let vcpu_pus: Vec<u32> = self.plan.vcpus.iter().filter_map(|v| v.host_cpu).collect();
        match t.vcpu_index().and_then(|i| self.plan.vcpus.get(i as usize)) {
            Some(v) => {
                let want = v
                    .host_cpu
                    .map_or_else(|| self.plan.floating_cpus.clone(), |c| vec![c]);
                (t.cpus_allowed != want)
                    .then(|| format!("allowed on {:?}, the plan says {want:?}", t.cpus_allowed))
            }
            None if self.plan.emulator.isolated => {
                let bad: Vec<u32> = t
                    .cpus_allowed
                    .iter()
                    .copied()
                    .filter(|c| vcpu_pus.contains(c))
                    .collect();
                (!bad.is_empty()).then(|| format!("allowed on vCPU PUs {bad:?} of an isolated VM"))
            }
            None => None,
        }
    }

    /// A built-in payload's progress per vCPU, from its mailbox (`null` for a Linux guest):
    /// its status, the TSC at its start (unchanged by a restore: the guest continued) and the
    /// `idle` payload's timer ticks and RAM pattern check (`ram_checked` pages verified,
    /// `ram_errors` found wrong).
    fn payload_progress(&self) -> Value {
        let vcpus: Vec<Value> = (0..self.plan.vcpus.len())
            .map_while(|i| self.handle.payload_mailbox(i))
            .zip(0u32..)
            .map(|(m, i)| {
                json!({"vcpu": i, "status": m.status, "tsc_start": m.tsc_start, "ticks": m.ticks,
                    "ram_checked": m.ram_checked, "ram_errors": m.ram_errors})
            })
            .collect();
        if vcpus.is_empty() {
            Value::Null
        } else {
            Value::Array(vcpus)
        }
    }

    fn memory_regions(&self) -> Vec<Value> {
        let maps = std::fs::read_to_string("/proc/self/numa_maps").unwrap_or_default();
        self.audit
            .regions
            .iter()
            .map(|r| {
                let entry = parse_numa_maps(&maps, r.host_addr, r.host_addr + r.size_bytes);
                let by_node: BTreeMap<u32, u64> = entry.as_ref().map(|e| e.pages_by_node.clone()).unwrap_or_default();
                let off: u64 = by_node.iter().filter(|(n, _)| r.expected_node.is_some_and(|e| e != **n)).map(|(_, p)| p).sum();
                json!({
                    "cell": r.cell, "gpa": r.gpa, "size_bytes": r.size_bytes,
                    "expected_node": r.expected_node,
                    "policy": entry.as_ref().map(|e| e.policy.clone()),
                    "page_size_bytes": entry.as_ref().map(|e| e.kernel_page_size_bytes),
                    "pages_by_node": by_node,
                    "deviation": (off > 0).then(|| format!("{off} pages off node {:?}", r.expected_node)),
                })
            })
            .collect()
    }
}

impl VmControl for Control {
    fn info(&self) -> Value {
        json!({
            "name": self.plan.name,
            "state": self.state(),
            "uptime_seconds": self.started.elapsed().as_secs_f64(),
            "pid": std::process::id(),
            "spec": self.spec,
            "payload": self.payload_progress(),
        })
    }

    fn placement(&self) -> Value {
        let threads = thread_placements().unwrap_or_default();
        let describe = |t: &ThreadPlacement| {
            json!({
                "tid": t.tid, "name": t.name, "cpus_allowed": t.cpus_allowed, "last_cpu": t.last_cpu,
                "deviation": self.thread_deviation(t),
            })
        };
        let vcpus: Vec<Value> = self
            .plan
            .vcpus
            .iter()
            .map(|v| {
                let t = threads.iter().find(|t| t.vcpu_index() == Some(v.vcpu));
                json!({
                    "vcpu": v.vcpu, "planned_cpu": v.host_cpu, "planned_node": v.host_node,
                    "thread": t.map(describe),
                    "deviation": if t.is_none() { Some("no thread".to_string()) } else { t.and_then(|t| self.thread_deviation(t)) },
                })
            })
            .collect();
        let io = crate::iothreads::io_threads_view(&self.plan, &threads);
        let others: Vec<Value> = threads
            .iter()
            .filter(|t| t.vcpu_index().is_none() && !crate::iothreads::is_io_thread(t))
            .map(describe)
            .collect();
        let memory = self.memory_regions();
        let deviations = vcpus
            .iter()
            .chain(&others)
            .chain(&io)
            .chain(&memory)
            .filter(|v| !v["deviation"].is_null())
            .count();
        json!({
            "vcpus": vcpus,
            "emulator": { "planned_cpus": self.plan.emulator.host_cpus, "isolated": self.plan.emulator.isolated, "threads": others },
            "io_threads": io,
            "memory": memory,
            "deviations": deviations,
        })
    }

    fn resources(&self) -> Value {
        let guest = self.plan.envelope.guest_memory_bytes;
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| crate::overhead::kib(&status, name);
        let (rss, hwm, shmem) = (field("VmRSS:"), field("VmHWM:"), field("RssShmem:"));
        // Anonymous guest RAM is shared memory counted in RSS; hugetlb pages are not in RSS.
        let guest_resident = match self.plan.backing {
            Backing::Anonymous => shmem.min(guest),
            Backing::Hugetlb { .. } => 0,
        };
        let peak_guest = if matches!(self.plan.backing, Backing::Anonymous) {
            guest
        } else {
            0
        };
        let threads: Vec<Value> = thread_placements()
            .unwrap_or_default()
            .iter()
            .map(|t| json!({"tid": t.tid, "name": t.name, "cpu_seconds": cpu_ns(t.tid) as f64 / 1e9}))
            .collect();
        let cgroup = self.envelope_guard.as_ref().map(|e| e.readings());
        json!({
            "envelope": self.plan.envelope,
            "measured": {
                "guest_memory_bytes": guest,
                "hugetlb_bytes": field("HugetlbPages:"),
                "rss_bytes": rss,
                "rss_beyond_guest_bytes": rss.saturating_sub(guest_resident),
                "peak_rss_beyond_guest_bytes": hwm.saturating_sub(peak_guest),
                "threads": threads,
                "cgroup": cgroup,
            },
        })
    }

    fn pause(&self) -> Result<Value, ControlError> {
        match self.handle.state() {
            VmState::Running => {}
            VmState::Paused => {
                return Err(ControlError::Conflict("the VM is already paused".into()))
            }
            s => {
                return Err(ControlError::Conflict(format!(
                    "the VM is {s:?}, not running"
                )))
            }
        }
        self.handle.pause().map_err(|e| ControlError::Failed {
            action: "pausing the vCPUs".into(),
            source: Box::new(e),
        })?;
        Ok(json!({"state": self.state()}))
    }

    fn resume(&self) -> Result<Value, ControlError> {
        if self.handle.state() != VmState::Paused {
            return Err(ControlError::Conflict(format!(
                "the VM is {}, not paused",
                self.state()
            )));
        }
        self.handle.resume().map_err(|e| ControlError::Failed {
            action: "resuming the vCPUs".into(),
            source: Box::new(e),
        })?;
        Ok(json!({"state": self.state()}))
    }

    fn start_snapshot(&self, request: vmhost_api::SnapshotRequest) -> Result<Value, ControlError> {
        let Some(jobs) = &self.snapshots else {
            return Err(ControlError::Conflict(
                "this VM cannot be snapshotted (started without its spec text)".into(),
            ));
        };
        match self.handle.state() {
            VmState::Running | VmState::Paused => crate::snapshot::request(jobs, request),
            _ => Err(ControlError::Conflict(format!(
                "the VM is {}: only a running or paused VM can be snapshotted",
                self.state()
            ))),
        }
    }

    fn start_migration(&self, request: vmhost_api::MigrateRequest) -> Result<Value, ControlError> {
        let Some(jobs) = &self.migrations else {
            return Err(ControlError::Conflict(
                "this VM cannot migrate (started without its spec text)".into(),
            ));
        };
        match self.handle.state() {
            VmState::Running | VmState::Paused => {
                crate::migrate::source::request(jobs, request, &self.plan)
            }
            _ => Err(ControlError::Conflict(format!(
                "the VM is {}: only a running or paused VM can migrate",
                self.state()
            ))),
        }
    }

    fn migration_job(&self) -> Value {
        self.migrations.as_ref().map_or_else(
            || json!({"state": "none"}),
            crate::migrate::source::Jobs::progress,
        )
    }

    fn snapshot_job(&self) -> Value {
        self.snapshots
            .as_ref()
            .map_or_else(|| json!({"state": "none"}), crate::snapshot::Jobs::progress)
    }

    /// A payload VM stops at once. A Linux guest is asked to power off through its ACPI power
    /// button; if it is still running the spec's termination grace later, it is stopped.
    fn shutdown(&self) -> Result<Value, ControlError> {
        if self.handle.state() == VmState::Stopped {
            return Err(ControlError::Conflict("the VM is already stopped".into()));
        }
        if !self.handle.has_power_button() {
            self.stop.stop();
            return Ok(json!({"state": "stopping"}));
        }
        self.handle
            .press_power_button()
            .map_err(|e| ControlError::Failed {
                action: "pressing the guest's ACPI power button".into(),
                source: Box::new(e),
            })?;
        let armed = self
            .grace
            .as_ref()
            .and_then(|g| g.lock().ok().map(|tx| tx.send(()).is_ok()));
        if armed != Some(true) {
            tracing::warn!("no grace-period timer: stopping the VM now");
            self.stop.stop();
        }
        Ok(json!({
            "state": "powering_off",
            "via": "acpi_power_button",
            "grace_seconds": self.spec.termination_grace.as_secs(),
        }))
    }
}
