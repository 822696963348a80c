//! End-to-end tests of `vmhost memory` on real hugepages.
#![allow(clippy::unwrap_used)]

mod common;

use common::{stderr, vmhost, vmhost_json};
use vmhost_testsupport::{lock_pool, need_pages, pool};

const PAGE_2M: u64 = 2 << 20;

fn spec(text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!(
        "vmhost-cli-mem-{}-{}.toml",
        std::process::id(),
        text.len()
    ));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn memory_command_audits_every_page_on_the_bound_node() {
    let _pool = lock_pool();
    if !need_pages(
        "memory_command_audits_every_page_on_the_bound_node",
        PAGE_2M,
        32,
    ) {
        return;
    }
    let before = pool(PAGE_2M);
    let s = spec("[cpu]\ncores = 1\ndedicated_cpu_placement = true\n[memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n");
    let (code, j) = vmhost_json(&["memory", "--json", "--config", s.to_str().unwrap()]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["clean"], true);
    let region = &j["audit"]["regions"][0];
    assert_eq!(region["pages_by_node"]["0"], 32, "{region}");
    let steps: Vec<&str> = j["timings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["step"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            "admission",
            "allocate",
            "bind",
            "prefault",
            "audit",
            "release"
        ]
    );
    assert_eq!(pool(PAGE_2M), before, "pages released after the report");
}

#[test]
fn memory_command_refuses_a_pool_it_cannot_have() {
    let _pool = lock_pool();
    let (free, _) = pool(PAGE_2M);
    let s = spec(&format!(
        "[cpu]\ncores = 1\ndedicated_cpu_placement = true\n[memory]\nguest = \"{}Mi\"\nhugepages = {{ page_size = \"2Mi\" }}\n",
        (free + 8) * 2
    ));
    let before = pool(PAGE_2M);
    let o = vmhost(&["memory", "--config", s.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("the plan needs {}", free + 8)),
        "{}",
        stderr(&o)
    );
    assert_eq!(pool(PAGE_2M), before);
}
