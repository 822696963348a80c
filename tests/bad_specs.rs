//! The corpus of bad specs in `tests/bad-specs/`: each file states, in `#` comment lines at its
//! top, the arguments to add (`# args:`), the exit status (`# expect-exit:`) and lines that
//! must appear in stderr (`# expect-stderr:`) or stdout (`# expect-stdout:`).
#![allow(clippy::unwrap_used)]

mod common;

use common::{root, stderr, stdout, vmhost};

/// Splits `--flag value --flag2 value2` at each ` --`, keeping values with spaces intact.
fn split_args(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in format!(" {line}")
        .split(" --")
        .filter(|p| !p.trim().is_empty())
    {
        let (flag, value) = part.trim().split_once(' ').unwrap_or((part.trim(), ""));
        out.push(format!("--{flag}"));
        if !value.is_empty() {
            out.push(value.to_string());
        }
    }
    out
}

#[test]
fn every_bad_spec_fails_with_its_message_and_exit_status() {
    let dir = root().join("tests/bad-specs");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 15, "corpus too small: {files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let header = |key: &str| -> Vec<String> {
            text.lines()
                .filter_map(|l| l.strip_prefix(&format!("# {key}: ")).map(str::to_string))
                .collect()
        };
        let code: i32 = header("expect-exit")
            .first()
            .expect("expect-exit line")
            .parse()
            .unwrap();
        let mut args = vec![
            "plan".to_string(),
            "--config".to_string(),
            file.display().to_string(),
        ];
        if let Some(extra) = header("args").first() {
            args.extend(split_args(extra));
        }
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = vmhost(&argv);
        let (so, se) = (stdout(&out), stderr(&out));
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(
            out.status.code(),
            Some(code),
            "{name}: exit status\nstdout:\n{so}\nstderr:\n{se}"
        );
        for want in header("expect-stderr") {
            assert!(
                se.contains(&want),
                "{name}: stderr lacks {want:?}\nstderr:\n{se}"
            );
        }
        for want in header("expect-stdout") {
            assert!(
                so.contains(&want),
                "{name}: stdout lacks {want:?}\nstdout:\n{so}"
            );
        }
    }
}
