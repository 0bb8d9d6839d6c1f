//! `tessera-bench alloc --quick` runs every system in its own process and
//! writes the JSON and Markdown reports.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

#[test]
fn quick_alloc_run_writes_a_row_per_system_and_workload() {
    let (json, dir) = common::run_bench("alloc", &["--quick", "--threads", "1", "--repeat", "1"]);
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
