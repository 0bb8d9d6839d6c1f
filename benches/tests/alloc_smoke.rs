//! `tessera-bench alloc --quick` runs every system in its own process and
//! writes the JSON and Markdown reports.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

#[test]
fn quick_alloc_run_writes_a_row_per_system_and_workload() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tessera-bench"))
        .args([
            "alloc",
            "--quick",
            "--threads",
            "1",
            "--repeat",
            "1",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("alloc.json")).unwrap())
            .unwrap();
    assert_eq!(json["bench"], "alloc");
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 8);
    for system in ["tessera-pool", "system", "mimalloc", "rpmalloc"] {
        for workload in ["large", "small"] {
            let row = rows
                .iter()
                .find(|r| r["system"] == system && r["workload"] == workload)
                .unwrap_or_else(|| panic!("no row for {system} {workload}"));
            assert_eq!(row["threads"], 1);
            assert!(row["ops_per_sec"].as_f64().unwrap() > 0.0);
            assert!(row["peak_bytes"].as_u64().is_some());
        }
    }
    let markdown = std::fs::read_to_string(dir.path().join("alloc.md")).unwrap();
    assert!(
        markdown.contains("| large | 1 | tessera-pool |"),
        "{markdown}"
    );
}
