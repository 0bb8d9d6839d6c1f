//! `tessera-bench transport` runs its server processes and writes a JSON row
//! per measurement (a smoke run: the figures themselves are benchmarks').
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

#[test]
fn quick_transport_run_writes_latency_throughput_and_memcpy_rows() {
    let (result, dir) = common::run_bench(
        "transport",
        &[
            "--quick",
            "--iterations",
            "20",
            "--sizes",
            "32,16384",
            "--throughput-secs",
            "0.2",
            "--fragment-sizes",
            "65536,8192",
        ],
    );
    let rows = result["rows"].as_array().unwrap();
    let find = |test: &str, transport: &str, size: u64| {
        rows.iter()
            .filter(|r| r["test"] == test && r["transport"] == transport && r["size"] == size)
            .count()
    };
    for transport in ["tcp", "rdma-soft"] {
        assert_eq!(find("latency", transport, 32), 1, "{transport} 32 B");
        assert_eq!(find("latency", transport, 16384), 1, "{transport} 16 KiB");
    }
    assert_eq!(find("throughput", "tcp", 1 << 20), 1);
    assert_eq!(
        find("throughput", "rdma-soft", 1 << 20),
        2,
        "one per fragment size"
    );
    assert_eq!(find("memcpy", "memcpy", 1 << 20), 1);
    for row in rows {
        assert_eq!(row["bench"], "transport");
        match row["test"].as_str().unwrap() {
            "latency" => assert!(row["p50_us"].as_f64().unwrap() > 0.0, "{row}"),
            _ => assert!(row["gbytes_per_sec"].as_f64().unwrap() > 0.0, "{row}"),
        }
    }
    let markdown = std::fs::read_to_string(dir.path().join("transport.md")).unwrap();
    assert!(markdown.contains("| rdma-soft | 65536 |"), "{markdown}");
}
