//! `tessera-bench rpc` starts its server processes, calls them four ways
//! and writes one result object (a smoke run: the figures themselves are
//! the benchmark's).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

#[test]
fn quick_rpc_run_measures_every_way_of_both_calls() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tessera-bench"))
        .args([
            "rpc",
            "--quick",
            "--iterations",
            "40",
            "--throughput-secs",
            "0.2",
            "--concurrency",
            "4",
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
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("rpc.json")).unwrap())
            .unwrap();
    assert_eq!(result["bench"], "rpc");
    assert!(result["meta"]["cores"].as_u64().unwrap() >= 1);
    assert!(!result["meta"]["cpu_model"].as_str().unwrap().is_empty());
    let rows = result["rows"].as_array().unwrap();
    for call in ["fetch", "health"] {
        for way in [
            "floor (bare TCP)",
            "tessera-tcp",
            "tessera-rdma-soft",
            "grpc (tonic)",
        ] {
            let row = rows
                .iter()
                .find(|r| r["call"] == call && r["way"] == way)
                .unwrap_or_else(|| panic!("no row for {call} {way}"));
            assert_eq!(row["calls_measured"], 40, "{row}");
            for key in [
                "p50_us",
                "p99_us",
                "calls_per_s",
                "p50_vs_grpc",
                "p50_vs_floor",
            ] {
                assert!(row[key].as_f64().unwrap() > 0.0, "{key} of {row}");
            }
        }
    }
    let table = std::fs::read_to_string(dir.path().join("rpc.md")).unwrap();
    assert!(table.contains("Machine:") && table.contains("| target |"));
}
