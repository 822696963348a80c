//! The host ledger with several VMs on several nodes: two dedicated VMs started together land
//! on different nodes, a third is refused with the shortfall, and SIGKILL of one frees its PUs
//! and pages for the next.

use crate::host;
use crate::vm::{dedicated_spec, Env};
use crate::{ensure, Outcome};

/// The node holding every vCPU thread of `pid` (read back from `/proc`), or an error when
/// they are spread.
fn vcpu_node(pid: u32) -> Result<(u32, Vec<u32>), String> {
    let mut pus: Vec<u32> = Vec::new();
    for t in host::threads(pid)?
        .iter()
        .filter(|t| t.name.starts_with("vcpu"))
    {
        ensure!(
            t.cpus.len() == 1,
            "{} (tid {}) is allowed on {:?}, not one PU",
            t.name,
            t.tid,
            t.cpus
        );
        pus.push(t.cpus[0]);
    }
    pus.sort_unstable();
    for n in host::nodes()? {
        let cpus = host::node_cpus(n)?;
        if pus.iter().all(|p| cpus.contains(p)) {
            return Ok((n, pus));
        }
    }
    Err(format!("vCPUs of pid {pid} on PUs {pus:?}, not one node"))
}

/// Two VMs started together land on different nodes; a third is refused naming the nodes and
/// the PU shortfall; SIGKILL of one lets the third start on the freed PUs with the freed pages.
pub fn two_vms_then_refusal_then_kill(env: &Env) -> Outcome {
    // Some slack over the 2 × 32 pages: a page freed by the previous test may still be on
    // its way back to the pool.
    host::set_2m_pools(&[40, 40])?;
    let spec = |n: &str| env.spec(n, &dedicated_spec(n, 1, 2, "", "64Mi", "idle"));
    let (a, b, c) = (spec("vma")?, spec("vmb")?, spec("vmc")?);
    // Started together: both race for the ledger lock.
    let ca = env.command(&["--config", &a.to_string_lossy()]);
    let cb = env.command(&["--config", &b.to_string_lossy()]);
    let (ra, rb) = std::thread::scope(|s| {
        let ha = s.spawn(|| env.start("vma", ca, 2));
        let hb = s.spawn(|| env.start("vmb", cb, 2));
        (ha.join(), hb.join())
    });
    let va = ra.map_err(|_| "starting vma panicked")??;
    let vb = rb.map_err(|_| "starting vmb panicked")??;
    let (na, pa) = vcpu_node(va.vmm)?;
    let (nb, pb) = vcpu_node(vb.vmm)?;
    ensure!(
        na != nb,
        "both VMs on node{na}: vma PUs {pa:?}, vmb PUs {pb:?}"
    );

    let out = env.run(&["--config", &c.to_string_lossy()])?;
    out.expect_code(3)?;
    ensure!(
        out.stderr.contains("PU"),
        "the refusal does not name the PU shortfall: {}",
        out.stderr.trim()
    );
    ensure!(
        out.stderr.contains("2 PUs") || out.stderr.contains("needs 2"),
        "the refusal does not say 2 PUs are needed: {}",
        out.stderr.trim()
    );

    let free_before = host::hugepages(na, 2048)?.1;
    env.signal(va.pid, libc::SIGKILL)?;
    let code = env.wait(va.pid)?;
    ensure!(code == -1, "vma exited {code} after SIGKILL");
    let free_after = host::hugepages(na, 2048)?.1;
    ensure!(
        free_after == free_before + 32,
        "node{na} free 2 MiB pages {free_before} -> {free_after} after SIGKILL, want +32"
    );

    let vc = env.start("vmc", env.command(&["--config", &c.to_string_lossy()]), 2)?;
    let (nc, pc) = vcpu_node(vc.vmm)?;
    ensure!(
        nc == na && pc == pa,
        "vmc got node{nc} PUs {pc:?}, the freed ones are node{na} {pa:?}"
    );
    let ps = env.run(&["ps", "--json"])?.expect_code(0)?.json()?;
    ensure!(
        !ps.to_string().contains("\"vma\""),
        "the ledger still lists the killed vma: {ps}"
    );
    for vm in [&vb, &vc] {
        let code = env.shutdown(vm)?;
        ensure!(
            code == 0,
            "exit {code} after shutdown; stderr: {}",
            vm.stderr()
        );
    }
    Ok(())
}
