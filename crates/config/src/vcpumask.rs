//! vCPU lists as KubeVirt's `cpu.realtime.mask` writes them (libvirt's cpuset syntax):
//! comma-separated items, each `N`, `N-M` or `^N` (exclude), e.g. `"0-3,^1"`.

/// Parses `mask` into the ascending vCPUs it selects, all below `vcpus`; the error says why
/// not in words.
pub fn parse(mask: &str, vcpus: u32) -> Result<Vec<u32>, String> {
    let mut on = std::collections::BTreeSet::new();
    let mut off = std::collections::BTreeSet::new();
    let number = |t: &str| -> Result<u32, String> {
        let n: u32 = t
            .trim()
            .parse()
            .map_err(|_| format!("{t:?} is not a vCPU number"))?;
        if n >= vcpus {
            return Err(format!("vCPU {n} does not exist (the VM has {vcpus})"));
        }
        Ok(n)
    };
    for item in mask.split(',').map(str::trim) {
        if let Some(x) = item.strip_prefix('^') {
            off.insert(number(x)?);
        } else if let Some((a, b)) = item.split_once('-') {
            let (a, b) = (number(a)?, number(b)?);
            if a > b {
                return Err(format!("range {item:?} runs backwards"));
            }
            on.extend(a..=b);
        } else {
            on.insert(number(item)?);
        }
    }
    Ok(on.difference(&off).copied().collect())
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn ranges_singles_and_exclusions() {
        assert_eq!(parse("0-3,^1", 4).unwrap(), vec![0, 2, 3]);
        assert_eq!(parse("2", 4).unwrap(), vec![2]);
        assert_eq!(parse(" 0 , 3 ", 4).unwrap(), vec![0, 3]);
    }

    #[test]
    fn out_of_range_and_garbage_are_refused() {
        assert!(parse("4", 4).unwrap_err().contains("vCPU 4 does not exist"));
        assert!(parse("3-1", 4).unwrap_err().contains("backwards"));
        assert!(parse("a", 4).unwrap_err().contains("not a vCPU number"));
        assert!(parse("", 4).is_err());
    }
}
