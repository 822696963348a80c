//! CPU affinity of this process and its threads (`sched_getaffinity` / `sched_setaffinity`):
//! the one place in vmhost that makes these calls. This is the crate's only `unsafe` code.
//!
//! Masks are arrays of `unsigned long` sized to the CPUs involved, so hosts with more than
//! `CPU_SETSIZE` (1024) CPUs work too.
//!
//! ```
//! let cpus = vmhost_topology::affinity::current_thread().unwrap();
//! vmhost_topology::affinity::pin_current_thread(&cpus).unwrap();
//! assert_eq!(vmhost_topology::affinity::current_thread().unwrap(), cpus);
//! ```

use std::io;

/// Bits in one word of the affinity mask.
const WORD_BITS: usize = libc::c_ulong::BITS as usize;

/// The CPUs in this process's scheduler affinity mask (OS indexes, ascending).
///
/// This is the mask of the process (its main thread, as `Cpus_allowed_list` in
/// `/proc/self/status` shows), not of the calling thread, which may have been pinned.
///
/// The mask buffer grows until the kernel accepts it, so hosts with more than
/// `CPU_SETSIZE` (1024) CPUs work too.
pub fn process() -> io::Result<Vec<u32>> {
    // SAFETY: getpid() has no preconditions and only returns this process's id.
    get(unsafe { libc::getpid() })
}

/// The CPUs the calling thread may run on.
pub fn current_thread() -> io::Result<Vec<u32>> {
    get(0)
}

/// Pins the calling thread to `cpus`.
pub fn pin_current_thread(cpus: &[u32]) -> io::Result<()> {
    set_thread(0, cpus)
}

/// Restricts thread `tid` (0: the calling thread) to `cpus`. An empty list is rejected with
/// `EINVAL`, as the kernel would.
pub fn set_thread(tid: libc::pid_t, cpus: &[u32]) -> io::Result<()> {
    let Some(&max) = cpus.iter().max() else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    let max = usize::try_from(max).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let words = (max / WORD_BITS + 1).max(1024 / WORD_BITS);
    let mut mask: Vec<libc::c_ulong> = vec![0; words];
    for &cpu in cpus {
        let cpu = cpu as usize;
        mask[cpu / WORD_BITS] |= 1 << (cpu % WORD_BITS);
    }
    let bytes = words * std::mem::size_of::<libc::c_ulong>();
    // SAFETY: `mask` is a live allocation of exactly `bytes` bytes that outlives the call; the
    // kernel only reads it; cpu_set_t is the kernel's array of unsigned longs, so `c_ulong`
    // words have its layout and alignment.
    let rc =
        unsafe { libc::sched_setaffinity(tid, bytes, mask.as_ptr().cast::<libc::cpu_set_t>()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The CPUs thread `tid` (0: the calling thread; a pid: that process's main thread) may run on.
fn get(tid: libc::pid_t) -> io::Result<Vec<u32>> {
    // Start at libc's CPU_SETSIZE (1024 CPUs); the kernel rejects a buffer smaller than its own
    // cpumask with EINVAL, so grow until it fits (bounded: 1 Mi CPUs).
    let mut words = 1024 / WORD_BITS;
    loop {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        let bytes = words * std::mem::size_of::<libc::c_ulong>();
        // SAFETY: `mask` is a live, writable allocation of exactly `bytes` bytes that outlives
        // the call; the kernel writes at most `bytes` bytes into it (the cpusetsize argument)
        // and cpu_set_t is the kernel's array of unsigned longs, so `c_ulong` words have its
        // layout and alignment.
        let rc = unsafe {
            libc::sched_getaffinity(tid, bytes, mask.as_mut_ptr().cast::<libc::cpu_set_t>())
        };
        if rc == 0 {
            return Ok(set_bits(&mask));
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) && words * WORD_BITS < (1 << 20) {
            words *= 2;
            continue;
        }
        return Err(err);
    }
}

/// The indexes of the set bits of a kernel cpumask (bit `n % WORD_BITS` of word `n / WORD_BITS`).
fn set_bits(mask: &[libc::c_ulong]) -> Vec<u32> {
    let mut cpus = Vec::new();
    for (w, &word) in mask.iter().enumerate() {
        for b in 0..WORD_BITS {
            if word & (1 << b) != 0 {
                if let Ok(cpu) = u32::try_from(w * WORD_BITS + b) {
                    cpus.push(cpu);
                }
            }
        }
    }
    cpus
}

#[cfg(test)]
mod tests {
    #[test]
    fn set_thread_round_trips_and_rejects_empty_and_unknown_cpus() {
        let before = current_thread().unwrap();
        let one = [before[0]];
        pin_current_thread(&one).unwrap();
        assert_eq!(current_thread().unwrap(), one);
        pin_current_thread(&before).unwrap();
        assert_eq!(current_thread().unwrap(), before);
        assert_eq!(
            pin_current_thread(&[]).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        assert!(
            pin_current_thread(&[5000]).is_err(),
            "a CPU the host does not have"
        );
    }

    use super::*;

    #[test]
    fn set_bits_reads_words_in_order() {
        let top = libc::c_ulong::BITS;
        assert_eq!(
            set_bits(&[0b1011, 1 << (top - 1), 1]),
            [0, 1, 3, 2 * top - 1, 2 * top]
        );
        assert!(set_bits(&[0, 0]).is_empty());
    }

    #[test]
    fn affinity_is_not_empty_and_includes_current_cpu() {
        let cpus = process().unwrap();
        assert!(!cpus.is_empty());
        // SAFETY: sched_getcpu takes no arguments and only returns a number.
        let now = unsafe { libc::sched_getcpu() };
        assert!(
            cpus.contains(&u32::try_from(now).unwrap()),
            "{now} not in {cpus:?}"
        );
    }
}
