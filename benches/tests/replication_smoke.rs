//! `tessera-bench replication` runs both acknowledgement modes over both
//! transports (a smoke run: the figures are the benchmark's).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

#[test]
fn quick_replication_run_prints_both_modes_over_both_transports() {
    let output = Command::new(env!("CARGO_BIN_EXE_tessera-bench"))
        .args(["replication", "--pushes", "80", "--blocks", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for transport in ["tcp", "rdma-soft"] {
        for row in [
            "| 1 | primary |",
            "| 1 | replicas |",
            "| 8 | primary |",
            "| 8 | replicas |",
        ] {
            assert!(
                stdout.contains(&format!("| {transport} {row}")),
                "no {transport} {row} row: {stdout}"
            );
        }
    }
}
