#![allow(clippy::cast_possible_truncation)] // test data: small known values

use std::process::Command;

use super::*;

fn seed(network: Option<&str>) -> NoCloudSeed {
    NoCloudSeed {
        instance_id: "vmi-fedora".into(),
        hostname: "vmi-fedora".into(),
        user_data: "#cloud-config\npassword: fedora\nchpasswd: { expire: False }\n".into(),
        network_config: network.map(str::to_string),
    }
}

fn le16(b: &[u8], at: usize) -> usize {
    usize::from(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// A FAT12 reader for the root directory: (long name, contents) of each file, and the label.
fn read_back(img: &[u8]) -> (String, Vec<(String, Vec<u8>)>) {
    assert_eq!(&img[510..512], &[0x55, 0xaa]);
    let bps = le16(img, 11);
    let spc = usize::from(img[13]);
    let reserved = le16(img, 14);
    let fats = usize::from(img[16]);
    let root_entries = le16(img, 17);
    let fat_sectors = le16(img, 22);
    let fat = &img[reserved * bps..(reserved + fat_sectors) * bps];
    let root = (reserved + fats * fat_sectors) * bps;
    let data = root + root_entries * 32;
    let next = |c: usize| {
        let v = le16(fat, c * 3 / 2);
        if c % 2 == 0 {
            v & 0xfff
        } else {
            v >> 4
        }
    };
    let mut label = String::new();
    let mut files = Vec::new();
    let mut long: Vec<u16> = Vec::new();
    for e in img[root..data].chunks(32) {
        match (e[0], e[11]) {
            (0, _) => break,
            (_, 0x0f) => {
                let offs = [1, 3, 5, 7, 9, 14, 16, 18, 20, 22, 24, 28, 30];
                let part: Vec<u16> = offs
                    .iter()
                    .map(|&o| u16::from_le_bytes([e[o], e[o + 1]]))
                    .collect();
                let mut merged = part;
                merged.extend_from_slice(&long);
                long = merged;
            }
            (_, 0x08) => label = String::from_utf8_lossy(&e[..11]).trim_end().to_string(),
            _ => {
                let name: String = String::from_utf16(
                    &long
                        .iter()
                        .copied()
                        .take_while(|&u| u != 0)
                        .collect::<Vec<_>>(),
                )
                .unwrap();
                long.clear();
                let size = u32::from_le_bytes([e[28], e[29], e[30], e[31]]) as usize;
                let mut cluster = le16(e, 26);
                let mut content = Vec::new();
                while (2..0xff8).contains(&cluster) && content.len() < size {
                    let at = data + (cluster - 2) * spc * bps;
                    content.extend_from_slice(&img[at..at + spc * bps]);
                    cluster = next(cluster);
                }
                content.truncate(size);
                files.push((name, content));
            }
        }
    }
    (label, files)
}

#[test]
fn the_seed_reads_back_byte_for_byte() {
    let s = seed(Some("version: 2\nethernets:\n  eth0:\n    dhcp4: true\n"));
    let img = s.build().unwrap();
    let (label, files) = read_back(&img);
    assert_eq!(label, "cidata");
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["meta-data", "user-data", "network-config"]);
    assert_eq!(
        files[0].1,
        b"instance-id: vmi-fedora\nlocal-hostname: vmi-fedora\n"
    );
    assert_eq!(files[1].1, s.user_data.as_bytes());
    assert_eq!(files[2].1, s.network_config.unwrap().as_bytes());
}

#[test]
fn a_large_user_data_spans_clusters_and_reads_back() {
    let mut s = seed(None);
    s.user_data = (0..300_000u32)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let img = s.build().unwrap();
    let (_, files) = read_back(&img);
    assert_eq!(files.len(), 2, "no network-config without network data");
    assert_eq!(files[1].1, s.user_data.as_bytes());
}

#[test]
fn an_oversized_file_is_refused() {
    let mut s = seed(None);
    s.user_data = "x".repeat(SEED_FILE_MAX + 1);
    assert!(matches!(
        s.build(),
        Err(SeedError::TooLarge {
            file: "user-data",
            ..
        })
    ));
}

fn tool(name: &str) -> Command {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).exists()));
    assert!(
        found,
        "{name} is missing: run scripts/setup.sh (Debian packages mtools, dosfstools)"
    );
    Command::new(name)
}

#[test]
fn mtools_and_fsck_fat_accept_the_seed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seed.img");
    let s = seed(Some("version: 2\n"));
    s.write_to(&path).unwrap();
    let img = path.to_str().unwrap();
    let out = tool("mtype")
        .args(["-i", img, "::user-data"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, s.user_data.as_bytes());
    let out = tool("mlabel")
        .args(["-i", img, "-s", "::"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.to_lowercase().contains("cidata"), "{text}");
    let out = tool("fsck.fat").args(["-n", img]).output().unwrap();
    assert!(
        out.status.success(),
        "fsck.fat: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let blkid = Command::new("blkid")
        .args(["-o", "value", "-s", "LABEL", img])
        .output();
    if let Ok(out) = blkid {
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "cidata");
    }
}

const NOBODY: u32 = 65534;

#[test]
fn a_seed_is_never_written_through_a_symlink_another_user_planted() {
    // A run directory prepared by another user, with a symlink where the seed goes.
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let outside = dir.path().join("outside");
    std::fs::write(&outside, b"precious").unwrap();
    let path = run.join("vm-seed.cidata.img");
    std::os::unix::fs::symlink(&outside, &path).unwrap();
    std::os::unix::fs::lchown(&path, Some(NOBODY), Some(NOBODY))
        .expect("lchown needs root (the tests run as root, as CI does)");
    std::os::unix::fs::chown(&run, Some(NOBODY), Some(NOBODY)).unwrap();

    let err = seed(None).write_to(&path).unwrap_err();
    assert!(
        matches!(err, SeedError::InTheWay { owner: NOBODY, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("symlink owned by uid 65534"), "{msg}");
    assert!(msg.contains("remove it"), "{msg}");
    assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&path)
        .unwrap()
        .file_type()
        .is_symlink());
}

#[test]
fn a_stale_seed_of_ours_is_replaced_by_a_private_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm-seed.cidata.img");
    std::fs::write(&path, b"left by a killed run").unwrap();
    let s = seed(None);
    s.write_to(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), s.build().unwrap());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
}
