//! The engine benchmarks (`fragment`, `hol`, `incast`, `qps`) run end to
//! end on tiny settings and write their JSON rows (smoke runs: the figures
//! are the benchmarks' business, not the tests').
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

fn run(bench: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["--quick", "--secs", "0.2", "--polling", "event"];
    all.extend_from_slice(args);
    let (result, dir) = common::run_bench(bench, &all);
    assert!(dir.path().join(format!("{bench}.md")).exists());
    result["rows"].as_array().unwrap().clone()
}

#[test]
fn fragment_rows_per_size() {
    let rows = run("fragment", &["--sizes", "4096,65536"]);
    assert_eq!(rows.len(), 2);
    for row in &rows {
        assert_eq!(row["test"], "fragment");
        assert!(row["fragment_bytes"].as_u64().is_some());
        assert!(row["gbytes_per_sec"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn hol_rows_with_and_without_fragmentation_on_one_qp() {
    let rows = run("hol", &["--large", "0,2", "--iterations", "30"]);
    assert_eq!(rows.len(), 4);
    for row in &rows {
        assert_eq!(row["test"], "hol");
        assert!(row["fragmentation"].is_boolean());
        assert_eq!(row["qps_open"], 1, "the flows share one QP: {row}");
        assert!(row["p99_us"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn incast_windows_bound_bytes_in_flight() {
    let rows = run("incast", &["--senders", "3", "--windows", "0,4096"]);
    assert_eq!(rows.len(), 2);
    let windowed = rows.iter().find(|r| r["window_bytes"] == 4096).unwrap();
    let peak = windowed["peak_inflight_bytes"].as_u64().unwrap();
    assert!(peak > 0 && peak <= 3 * 4096, "{windowed}");
    assert!(windowed["goodput_gbytes_per_sec"].as_f64().unwrap() > 0.0);
}

#[test]
fn qps_rows_per_count_with_one_qp_each() {
    let rows = run("qps", &["--qps", "1,3", "--io-threads", "2"]);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["qps_open"], 3);
    assert!(rows[1]["msgs_per_sec"].as_f64().unwrap() > 0.0);
}
