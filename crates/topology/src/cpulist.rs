//! The Linux cpulist format (`0-3,8,10-11`), as in `/sys/devices/system/cpu/online`,
//! `/sys/devices/system/node/nodeN/cpulist` and `Cpus_allowed_list` in `/proc/PID/status`.
//!
//! This module owns parsing and formatting of that format; nothing else.

use thiserror::Error;

/// A cpulist that does not follow the Linux cpulist format.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid cpu list {text:?}: {reason}; expected comma-separated CPU numbers or ranges, e.g. \"0-3,8,10-11\"")]
pub struct CpuListError {
    /// The text that was parsed.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The widest range accepted in one item (Linux supports at most 8192 CPUs).
const MAX_RANGE: u32 = 1 << 16;

/// Parse a cpulist (`"0-3,8,10-11"`) into ascending, de-duplicated CPU numbers.
///
/// Surrounding whitespace (a trailing newline from sysfs) is ignored and an empty list is valid
/// (`""` → `[]`). Ranges are inclusive; the kernel's stride form `0-7:2` (every 2nd CPU) is
/// accepted too.
///
/// ```
/// assert_eq!(vmhost_topology::cpulist::parse("0-3,8,10-11").unwrap(), [0, 1, 2, 3, 8, 10, 11]);
/// ```
pub fn parse(text: &str) -> Result<Vec<u32>, CpuListError> {
    let err = |reason: String| CpuListError {
        text: text.to_owned(),
        reason,
    };
    let trimmed = text.trim();
    let mut cpus = Vec::new();
    if trimmed.is_empty() {
        return Ok(cpus);
    }
    for item in trimmed.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(err("empty item between commas".to_owned()));
        }
        let (range, stride) = match item.split_once(':') {
            Some((range, stride)) => (range, number(stride).map_err(&err)?),
            None => (item, 1),
        };
        if stride == 0 {
            return Err(err(format!("stride 0 in {item:?}")));
        }
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (number(a).map_err(&err)?, number(b).map_err(&err)?),
            None => {
                let n = number(range).map_err(&err)?;
                (n, n)
            }
        };
        if first > last {
            return Err(err(format!("range {item:?} runs backwards")));
        }
        if last - first > MAX_RANGE {
            return Err(err(format!(
                "range {item:?} spans more than {MAX_RANGE} CPUs"
            )));
        }
        cpus.extend((first..=last).step_by(stride as usize));
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// One CPU number of a cpulist item.
fn number(s: &str) -> Result<u32, String> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} is not a CPU number"));
    }
    s.parse::<u32>()
        .map_err(|_| format!("CPU number {s} is too large"))
}

/// Format CPU numbers as a cpulist, folding consecutive runs into ranges.
///
/// The input need not be sorted or unique. `[]` gives `""`.
///
/// ```
/// assert_eq!(vmhost_topology::cpulist::format(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
/// ```
pub fn format(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_sysfs_forms() {
        assert_eq!(parse("0-1\n").unwrap(), [0, 1]);
        assert_eq!(parse("0").unwrap(), [0]);
        assert_eq!(parse("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse("\n").unwrap(), Vec::<u32>::new());
        assert_eq!(parse("8,0-2").unwrap(), [0, 1, 2, 8]);
        assert_eq!(parse("0-7:2").unwrap(), [0, 2, 4, 6]);
        assert_eq!(parse("3,3,2-3").unwrap(), [2, 3]);
    }

    #[test]
    fn rejects_malformed_lists() {
        for bad in [
            "a",
            "1-",
            "-1",
            "3-1",
            "1,,2",
            "1-2-3",
            "0-7:0",
            "4294967296",
            "1 2",
            "+1",
            "0-4294967295",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.text, bad);
            assert!(e.to_string().contains("expected comma-separated"), "{e}");
        }
    }

    #[test]
    fn formats_ranges() {
        assert_eq!(format(&[]), "");
        assert_eq!(format(&[5]), "5");
        assert_eq!(format(&[0, 1]), "0-1");
        assert_eq!(format(&[11, 10, 8, 3, 2, 1, 0]), "0-3,8,10-11");
        assert_eq!(
            format(&[u32::MAX - 1, u32::MAX]),
            format!("{}-{}", u32::MAX - 1, u32::MAX)
        );
    }

    proptest! {
        #[test]
        fn roundtrip(cpus in proptest::collection::btree_set(0u32..2048, 0..200)) {
            let cpus: Vec<u32> = cpus.into_iter().collect();
            let text = format(&cpus);
            prop_assert_eq!(parse(&text).unwrap(), cpus.clone());
            // Formatting is canonical: parse then format gives the same text back.
            prop_assert_eq!(format(&parse(&text).unwrap()), text);
        }

        #[test]
        fn parse_never_panics(text in "[0-9,:\\- ]{0,24}") {
            let _ = parse(&text);
        }
    }
}
