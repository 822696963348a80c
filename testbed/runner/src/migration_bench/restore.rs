//! The migration benchmark's restore part: a snapshot of an idle guest (`ctl snapshot
//! --stop`), then restores of it to a running guest alternating with the runner reading the
//! same memory files into 2 MiB hugepages bound to node 0 ([`restore_vs_read`]), and the pace
//! of software SHA-256 in the emulated host beside them.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use super::process::Proc;
use super::report::{against, show};
use super::{pairs, Setup, BOOT_LIMIT, GUEST_PAGES, JOB_LIMIT, TARGET_RESTORE, WARM_BEATS};
use crate::{ensure, host, Outcome};

/// `MPOL_BIND` (linux/mempolicy.h).
const MPOL_BIND: libc::c_int = 2;

/// Reads `file` into an anonymous mapping of 2 MiB hugepages bound to `node` (mmap, mbind,
/// then `read` into it); the bytes read.
fn read_into_hugepages(file: &Path, node: u32) -> Result<u64, String> {
    let mut f = std::fs::File::open(file).map_err(|e| format!("open {}: {e}", file.display()))?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    let bytes = usize::try_from(size).map_err(|e| e.to_string())?;
    let len = bytes.div_ceil(2 << 20) * (2 << 20);
    if len == 0 {
        return Ok(0);
    }
    let mut map = crate::host::HugeMap::new(len)?;
    let mask: u64 = 1 << node;
    // SAFETY: mbind only sets the policy of the mapping made above (`map.ptr()`, `len`);
    // `mask` is a valid 64-bit node mask for the duration of the call.
    let bound = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            map.ptr(),
            len,
            MPOL_BIND,
            &mask,
            64u64,
            0u32,
        )
    };
    ensure!(
        bound == 0,
        "mbind to node{node}: {}",
        std::io::Error::last_os_error()
    );
    f.read_exact(&mut map.bytes()[..bytes])
        .map(|()| size)
        .map_err(|e| format!("read {} into hugepages: {e}", file.display()))
}

/// Reads every `memory-cell*` file of the snapshot `dir` into hugepages on `node`; seconds.
fn read_snapshot_memory(dir: &Path, node: u32) -> Result<(f64, u64), String> {
    let t = Instant::now();
    let mut bytes = 0;
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with("memory-cell") {
            bytes += read_into_hugepages(&e.path(), node)?;
        }
    }
    ensure!(bytes > 0, "no memory-cell file in {}", dir.display());
    Ok((t.elapsed().as_secs_f64(), bytes))
}

/// Prints how fast this emulated host hashes with software SHA-256 (`sha256sum` of `file`):
/// the emulated CPU has no SHA extensions (TCG): the pace of the per-file SHA-256 of older
/// snapshots' manifests (now XXH3-128), and of the HMAC-SHA256 tags of migration streams
/// before format 3 (docs/migration.md, "Authenticated streams").
fn sha256_pace(file: &Path) {
    let bytes = std::fs::metadata(file).map_or(0, |m| m.len());
    let t = Instant::now();
    let ok = Command::new("sha256sum")
        .arg(file)
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let secs = t.elapsed().as_secs_f64();
    if ok {
        println!(
            "     software SHA-256 here (sha256sum of {:.1} MiB): {:.1} MiB/s",
            bytes as f64 / 1048576.0,
            bytes as f64 / 1048576.0 / secs
        );
    } else {
        println!("     sha256sum of {} failed", file.display());
    }
}

/// A snapshot (`ctl snapshot --stop`) of a booted idle guest on node 0.
fn take_snapshot(s: &Setup) -> Result<PathBuf, String> {
    let spec = s.spec("beat")?;
    let (cmd, sock) = s.vmhost("migsnap", &["--config", &spec.to_string_lossy()]);
    let mut vm = Proc::spawn(cmd, s.env, "vmhost to snapshot")?;
    vm.wait_beats(WARM_BEATS, BOOT_LIMIT)?;
    let dir = s.env.work.join("migbench-snap");
    let _ = std::fs::remove_dir_all(&dir);
    let out = s.ctl(
        &sock,
        &["snapshot", &dir.to_string_lossy(), "--stop"],
        JOB_LIMIT,
    )?;
    ensure!(
        out.code == 0,
        "ctl snapshot --stop: exit {}: {}",
        out.code,
        out.stderr
    );
    let code = vm.wait_exit(JOB_LIMIT)?;
    ensure!(
        code.success(),
        "the VM after snapshot --stop: {code}; {}",
        vm.tail()
    );
    Ok(dir)
}

/// One `vmhost restore` of `dir`: seconds from the spawn to the restored guest's first beat,
/// and vmhost's own `restore:` lines.
fn restore_once(s: &Setup, dir: &Path) -> Result<(f64, String), String> {
    let (cmd, _) = s.vmhost("migrest", &["restore", &dir.to_string_lossy()]);
    let t0 = Instant::now();
    let mut vm = Proc::spawn(cmd, s.env, "vmhost restore")?;
    vm.wait_beats(1, JOB_LIMIT)?;
    let secs = vm.beats().first().map_or(0.0, |t| (*t - t0).as_secs_f64());
    vm.stop()?;
    let err = std::fs::read_to_string(&vm.err).unwrap_or_default();
    let own: Vec<&str> = err.lines().filter(|l| l.contains("restore:")).collect();
    Ok((secs, own.join(" | ")))
}

/// The restore part: a snapshot, then [`pairs`] alternating (read into hugepages, restore).
pub(super) fn restore_vs_read(s: &Setup) -> Outcome {
    host::set_2m_pools(&[GUEST_PAGES, 0])?;
    let dir = take_snapshot(s)?;
    sha256_pace(&dir.join("memory-cell0"));
    // Room for the restore or the read (a memory file is a little larger than the RAM).
    host::set_2m_pools(&[GUEST_PAGES + 2, 0])?;
    let (mut reads, mut restores, mut mib, mut own) = (Vec::new(), Vec::new(), 0.0, String::new());
    for _ in 0..pairs() {
        let (secs, bytes) = read_snapshot_memory(&dir, 0)?;
        reads.push(secs);
        mib = bytes as f64 / 1048576.0;
        let (secs, lines) = restore_once(s, &dir)?;
        restores.push(secs);
        own = lines;
    }
    let ratios: Vec<f64> = restores.iter().zip(&reads).map(|(r, b)| r / b).collect();
    println!(
        "     restore (spawn -> first beat of the restored guest), s: {}; reading the \
         {mib:.1} MiB of memory files into 2 MiB pages on node0: {}; target <= \
         {TARGET_RESTORE}: {}",
        show(&restores, 3),
        show(&reads, 3),
        against(&ratios, TARGET_RESTORE)
    );
    println!("     vmhost's own restore lines (last run): {own}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::read_into_hugepages;

    /// Runs on the CI host too (`make test` reserves its 2 MiB pool): node 0 always exists.
    #[test]
    fn a_file_is_read_whole_into_bound_hugepages() {
        let path = std::env::temp_dir().join(format!("vmhost-tb-read-{}", std::process::id()));
        let data: Vec<u8> = (0..(3u32 << 20) + 123)
            .map(|i| i.to_le_bytes()[0])
            .collect();
        std::fs::write(&path, &data).expect("write the file");
        let read = read_into_hugepages(&path, 0);
        let _ = std::fs::remove_file(&path);
        assert_eq!(read, Ok(data.len() as u64));
    }
}
