//! Backing files, mappings and NUMA binding of guest cells.
//!
//! This module owns the life of a cell's memory up to (not including) the first touch: it
//! creates the cell's backing file, maps each of the cell's layout regions `MAP_SHARED`
//! through vm-memory, and binds each mapping to the cell's host node with
//! `mbind(MPOL_BIND, MPOL_MF_STRICT | MPOL_MF_MOVE)`.
//!
//! Backing files:
//! - hugepages, default: `memfd_create(MFD_HUGETLB | MFD_HUGE_<size>)`: nothing to mount,
//!   nothing left behind when the process dies;
//! - hugepages on a named hugetlbfs mount: an `O_TMPFILE` file in the mount (or, where the
//!   kernel lacks it there, a named file unlinked right after creation);
//! - anonymous: a plain `memfd` (shared memory) with `MADV_HUGEPAGE`, so transparent hugepages
//!   are used where the host's `shmem_enabled` allows them.
//!
//! Hugepage mappings are made without `MAP_NORESERVE`: the kernel reserves every page when
//! the mapping is created, so a short pool fails here with `ENOMEM` rather than with a
//! `SIGBUS` inside a running guest. Every mapping is `MADV_DONTDUMP`: guest RAM stays out of
//! the VMM's core dumps (docs/security.md). Everything is released by dropping: unmapping and closing
//! the last descriptor returns the pages (and the reservations) to the pool.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vm_memory::bitmap::NewBitmap;
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{FileOffset, GuestAddress};

use crate::{AtomicBitmap, GuestRegionMmap};
use vmhost_config::format_bytes;
use vmhost_plan::Backing;

use crate::layout::LayoutRegion;
use crate::policy::PolicyOverride;
use crate::sys;

/// Why a cell's memory could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// `memfd_create` failed.
    #[error("cannot create the memfd backing guest cell {cell}")]
    Memfd {
        /// Cell number.
        cell: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The backing file on the hugetlbfs mount could not be created.
    #[error("cannot create the backing file of guest cell {cell} in hugetlbfs mount {path}")]
    HugetlbfsFile {
        /// Cell number.
        cell: u32,
        /// The mount.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The backing file could not be sized.
    #[error("cannot size the backing file of guest cell {cell} to {size_bytes} bytes")]
    Resize {
        /// Cell number.
        cell: u32,
        /// Requested size.
        size_bytes: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A region does not fit in this process's address space.
    #[error("guest cell {cell}: region at GPA {gpa:#x} of {size_bytes} bytes is too large to map")]
    TooLarge {
        /// Cell number.
        cell: u32,
        /// Guest-physical start.
        gpa: u64,
        /// Region size.
        size_bytes: u64,
    },
    /// The backing file's size could not be read.
    #[error("cannot read the size of the backing file of guest cell {cell}")]
    Stat {
        /// Cell number.
        cell: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The region would map past the end of the backing file (an access there is a SIGBUS).
    #[error(
        "guest cell {cell}: region at GPA {gpa:#x} maps file bytes {file_offset:#x}+{size_bytes:#x}, \
         past the end of the {file_bytes:#x}-byte backing file"
    )]
    PastEnd {
        /// Cell number.
        cell: u32,
        /// Guest-physical start.
        gpa: u64,
        /// Offset in the file.
        file_offset: u64,
        /// Region size.
        size_bytes: u64,
        /// File size.
        file_bytes: u64,
    },
    /// `mmap` failed; for hugepages this is where a short pool is detected (`ENOMEM`).
    #[error(
        "cannot map guest cell {cell} at GPA {gpa:#x} ({} in {} pages)",
        format_bytes(*size_bytes),
        format_bytes(*page_size_bytes)
    )]
    Map {
        /// Cell number.
        cell: u32,
        /// Guest-physical start.
        gpa: u64,
        /// Region size.
        size_bytes: u64,
        /// Backing page size.
        page_size_bytes: u64,
        /// The cause.
        #[source]
        source: MmapRegionError,
    },
    /// The region's guest address range overflows.
    #[error("guest cell {cell}: region at GPA {gpa:#x} overflows the guest address space")]
    GuestRegion {
        /// Cell number.
        cell: u32,
        /// Guest-physical start.
        gpa: u64,
    },
    /// `madvise(MADV_HUGEPAGE)` failed.
    #[error("cannot request transparent hugepages for guest cell {cell} at GPA {gpa:#x}")]
    AdviseHugepage {
        /// Cell number.
        cell: u32,
        /// Guest-physical start.
        gpa: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `madvise(MADV_DONTDUMP)` failed.
    #[error("cannot leave guest cell {cell} at GPA {gpa:#x} out of core dumps")]
    AdviseDontDump {
        /// Cell number.
        cell: u32,
        /// Guest-physical start.
        gpa: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mbind` with a [`PolicyOverride`] failed.
    #[error("cannot set memory policy {policy} on guest cell {cell} (GPA {gpa:#x})")]
    Policy {
        /// Cell number.
        cell: u32,
        /// The policy, as `numa_maps` spells it.
        policy: String,
        /// Guest-physical start.
        gpa: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mbind` failed.
    #[error("cannot bind guest cell {cell} (GPA {gpa:#x}) to host node{node}")]
    Bind {
        /// Cell number.
        cell: u32,
        /// Target node.
        node: u32,
        /// Guest-physical start.
        gpa: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// One mapped, bound region of a guest cell. Clones share the mapping, which is unmapped when
/// the last of them is dropped.
#[derive(Debug, Clone)]
pub struct MappedRegion {
    /// Where it sits in the guest.
    pub layout: LayoutRegion,
    /// Its mapping, ready to join a `GuestMemoryMmap`.
    pub region: Arc<GuestRegionMmap>,
    /// Backing page size.
    pub page_size_bytes: u64,
}

impl MappedRegion {
    /// Host virtual address of the region's first byte.
    pub fn host_addr(&self) -> *mut u8 {
        self.region.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.size()
    }

    /// True for an empty region (never produced by the layout).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Creates the backing file of a cell of `size_bytes` and sizes it.
pub fn create_file(
    vm: &str,
    cell: u32,
    size_bytes: u64,
    backing: &Backing,
) -> Result<File, BackingError> {
    let name = format!("vmhost:{vm}:cell{cell}");
    let file = match backing {
        Backing::Hugetlb {
            page_size_bytes,
            hugetlbfs: None,
        } => {
            let flags = sys::memfd_hugetlb_flags(*page_size_bytes)
                .map_err(|source| BackingError::Memfd { cell, source })?;
            sys::memfd_create(&name, flags)
                .map_err(|source| BackingError::Memfd { cell, source })?
        }
        Backing::Hugetlb {
            hugetlbfs: Some(dir),
            ..
        } => hugetlbfs_file(dir, vm, cell).map_err(|source| BackingError::HugetlbfsFile {
            cell,
            path: dir.clone(),
            source,
        })?,
        Backing::Anonymous => {
            sys::memfd_create(&name, 0).map_err(|source| BackingError::Memfd { cell, source })?
        }
    };
    file.set_len(size_bytes)
        .map_err(|source| BackingError::Resize {
            cell,
            size_bytes,
            source,
        })?;
    Ok(file)
}

/// An unnamed file in `dir`: `O_TMPFILE`, else a named file unlinked at once.
fn hugetlbfs_file(dir: &Path, vm: &str, cell: u32) -> io::Result<File> {
    let tmp = OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE)
        .open(dir);
    match tmp {
        Ok(f) => Ok(f),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
            ) =>
        {
            let path = dir.join(format!(".vmhost-{vm}-cell{cell}-{}", std::process::id()));
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)?;
            std::fs::remove_file(&path)?;
            Ok(f)
        }
        Err(e) => Err(e),
    }
}

/// Maps one layout region of a cell's file `MAP_SHARED`, reserving its hugepages.
///
/// Nothing is touched: the first touch comes with prefaulting, after [`bind_region`].
pub fn map_region(
    file: &Arc<File>,
    layout: LayoutRegion,
    backing: &Backing,
) -> Result<MappedRegion, BackingError> {
    let cell = layout.cell;
    let gpa = layout.gpa;
    let page_size_bytes = backing.page_size_bytes();
    let size = usize::try_from(layout.size_bytes).map_err(|_| BackingError::TooLarge {
        cell,
        gpa,
        size_bytes: layout.size_bytes,
    })?;
    let file_bytes = file
        .metadata()
        .map_err(|source| BackingError::Stat { cell, source })?
        .len();
    if layout
        .file_offset
        .checked_add(layout.size_bytes)
        .is_none_or(|end| end > file_bytes)
    {
        return Err(BackingError::PastEnd {
            cell,
            gpa,
            file_offset: layout.file_offset,
            size_bytes: layout.size_bytes,
            file_bytes,
        });
    }
    let hugetlb = matches!(backing, Backing::Hugetlb { .. });
    // `MmapRegionBuilder::new` would give an empty bitmap that tracks nothing.
    let mmap = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::with_len(size))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED)
        .with_file_offset(FileOffset::from_arc(Arc::clone(file), layout.file_offset))
        .with_hugetlbfs(hugetlb)
        .build()
        .map_err(|source| BackingError::Map {
            cell,
            gpa,
            size_bytes: layout.size_bytes,
            page_size_bytes,
            source,
        })?;
    let region = GuestRegionMmap::new(mmap, GuestAddress(gpa))
        .ok_or(BackingError::GuestRegion { cell, gpa })?;
    let mapped = MappedRegion {
        layout,
        region: Arc::new(region),
        page_size_bytes,
    };
    if !hugetlb {
        sys::madvise(mapped.host_addr(), size, sys::Advice::Hugepage)
            .map_err(|source| BackingError::AdviseHugepage { cell, gpa, source })?;
    }
    sys::madvise(mapped.host_addr(), size, sys::Advice::DontDump)
        .map_err(|source| BackingError::AdviseDontDump { cell, gpa, source })?;
    Ok(mapped)
}

/// Binds a mapped region to its cell's host node, if it has one, before its first touch.
///
/// `MPOL_MF_STRICT | MPOL_MF_MOVE`: pages already present elsewhere (there are none before
/// prefaulting) are moved, and the call fails if any cannot be.
pub fn bind_region(region: &MappedRegion) -> Result<(), BackingError> {
    let l = region.layout;
    if let Some(node) = l.host_node {
        sys::mbind(
            region.host_addr(),
            region.len(),
            sys::MPOL_BIND,
            &[node],
            sys::MPOL_MF_STRICT | sys::MPOL_MF_MOVE,
        )
        .map_err(|source| BackingError::Bind {
            cell: l.cell,
            node,
            gpa: l.gpa,
            source,
        })?;
    }
    Ok(())
}

/// Sets the memory policy of a mapped region before its first touch: `policy` when given
/// (for example `MPOL_INTERLEAVE` over several nodes), else [`bind_region`]'s `MPOL_BIND` to the
/// cell's node.
pub fn apply_policy(
    region: &MappedRegion,
    policy: Option<&PolicyOverride>,
) -> Result<(), BackingError> {
    let Some(policy) = policy else {
        return bind_region(region);
    };
    let l = region.layout;
    sys::mbind(
        region.host_addr(),
        region.len(),
        policy.mode(),
        &policy.nodes(),
        sys::MPOL_MF_STRICT | sys::MPOL_MF_MOVE,
    )
    .map_err(|source| BackingError::Policy {
        cell: l.cell,
        policy: policy.policy_string(),
        gpa: l.gpa,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(cell: u32, node: Option<u32>, size: u64, file_offset: u64) -> LayoutRegion {
        LayoutRegion {
            cell,
            host_node: node,
            gpa: 0x1000_0000,
            size_bytes: size,
            file_offset,
        }
    }

    #[test]
    fn anonymous_region_is_shared_bound_and_writable() {
        let file = Arc::new(create_file("unit", 0, 1 << 20, &Backing::Anonymous).unwrap());
        let m = map_region(&file, region(0, Some(0), 1 << 20, 0), &Backing::Anonymous).unwrap();
        bind_region(&m).unwrap();
        assert_eq!(m.region.flags(), libc::MAP_SHARED);
        assert_eq!(m.len(), 1 << 20);
        assert!(!m.is_empty());
        assert_eq!(
            sys::policy_at(m.host_addr()).unwrap(),
            (sys::MPOL_BIND, vec![0])
        );
        // The mapping is shared: a second mapping of the file sees the write.
        let m2 = map_region(&file, region(0, None, 1 << 20, 0), &Backing::Anonymous).unwrap();
        // SAFETY: both pointers are live, writable mappings of at least 1 MiB.
        unsafe {
            m.host_addr().write_volatile(0x5a);
            assert_eq!(m2.host_addr().read_volatile(), 0x5a);
        }
    }

    /// The `VmFlags` line of the `/proc/self/smaps` entry that starts at `addr`.
    fn vm_flags(addr: *mut u8) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", addr as usize);
        let entry = smaps
            .split_inclusive('\n')
            .skip_while(|l| !l.starts_with(&start))
            .skip(1)
            .find(|l| l.starts_with("VmFlags:"))
            .unwrap_or_else(|| panic!("no smaps entry at {start}"));
        entry.trim().to_string()
    }

    #[test]
    fn guest_ram_is_left_out_of_core_dumps() {
        let file = Arc::new(create_file("unit", 0, 1 << 20, &Backing::Anonymous).unwrap());
        let m = map_region(&file, region(0, None, 1 << 20, 0), &Backing::Anonymous).unwrap();
        let flags = vm_flags(m.host_addr());
        assert!(
            flags.split_whitespace().any(|f| f == "dd"),
            "MADV_DONTDUMP not set: {flags}"
        );
    }

    #[test]
    fn mapping_past_the_end_of_the_file_fails_with_context() {
        let file = Arc::new(create_file("unit", 3, 1 << 20, &Backing::Anonymous).unwrap());
        let err = map_region(
            &file,
            region(3, None, 1 << 20, 1 << 20),
            &Backing::Anonymous,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                BackingError::PastEnd {
                    cell: 3,
                    gpa: 0x1000_0000,
                    file_bytes: 0x10_0000,
                    ..
                }
            ),
            "{err:?}"
        );
        // A mapping vm-memory refuses (size 0) surfaces as a Map error with its context.
        let err = map_region(&file, region(3, None, 0, 0), &Backing::Anonymous).unwrap_err();
        assert!(
            matches!(
                err,
                BackingError::Map {
                    cell: 3,
                    gpa: 0x1000_0000,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn binding_to_a_missing_node_fails_with_context() {
        let file = Arc::new(create_file("unit", 1, 1 << 20, &Backing::Anonymous).unwrap());
        let m = map_region(&file, region(1, Some(999), 1 << 20, 0), &Backing::Anonymous).unwrap();
        let err = bind_region(&m).unwrap_err();
        assert!(
            matches!(
                err,
                BackingError::Bind {
                    cell: 1,
                    node: 999,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "cannot bind guest cell 1 (GPA 0x10000000) to host node999"
        );
    }

    #[test]
    fn interleave_override_replaces_the_bind() {
        let file = Arc::new(create_file("unit", 2, 1 << 20, &Backing::Anonymous).unwrap());
        let m = map_region(&file, region(2, Some(0), 1 << 20, 0), &Backing::Anonymous).unwrap();
        let interleave = PolicyOverride::Interleave(vec![0]);
        apply_policy(&m, Some(&interleave)).unwrap();
        assert_eq!(
            sys::policy_at(m.host_addr()).unwrap(),
            (sys::MPOL_INTERLEAVE, vec![0])
        );
        apply_policy(&m, None).unwrap();
        assert_eq!(
            sys::policy_at(m.host_addr()).unwrap(),
            (sys::MPOL_BIND, vec![0])
        );
        // The kernel drops nodes without memory from the set and fails only when none is
        // left (admission rejects any missing node before this).
        let err = apply_policy(&m, Some(&PolicyOverride::Interleave(vec![999]))).unwrap_err();
        assert!(
            matches!(&err, BackingError::Policy { cell: 2, policy, .. } if policy == "interleave:999"),
            "{err:?}"
        );
    }

    #[test]
    fn hugetlbfs_file_in_a_missing_directory_fails_with_path() {
        let backing = Backing::Hugetlb {
            page_size_bytes: 2 << 20,
            hugetlbfs: Some("/no/such/dir".into()),
        };
        let err = create_file("unit", 0, 2 << 20, &backing).unwrap_err();
        assert!(
            matches!(err, BackingError::HugetlbfsFile { cell: 0, .. }),
            "{err:?}"
        );
    }
}
