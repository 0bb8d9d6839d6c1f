//! `tessera-bench rpc` starts its server processes, calls them five ways
//! and writes one result object (a smoke run: the figures themselves are
//! the benchmark's).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

#[test]
fn quick_rpc_run_measures_every_way_of_both_calls() {
    let (result, dir) = common::run_bench(
        "rpc",
        &[
            "--quick",
            "--iterations",
            "40",
            "--throughput-secs",
            "0.2",
            "--concurrency",
            "4",
        ],
    );
    assert!(result["meta"]["cores"].as_u64().unwrap() >= 1);
    assert!(!result["meta"]["cpu_model"].as_str().unwrap().is_empty());
    let rows = result["rows"].as_array().unwrap();
    for call in ["fetch", "health"] {
        for way in [
            "floor (bare TCP)",
            "tessera-tcp",
            "tessera-rdma-soft",
            "grpc-tuned (tonic, 8/32 MiB windows, same connections)",
            "grpc (tonic defaults)",
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
                "p50_vs_grpc_tuned",
                "throughput_vs_grpc_tuned",
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
