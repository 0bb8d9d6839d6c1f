//! `tessera-bench recovery` runs all four measurements and reports no
//! failed call around the killed replica and through the rolling restart,
//! and no replica quarantined by it (a smoke run: the figures themselves
//! are the benchmark's).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

#[test]
fn quick_recovery_run_prints_its_four_tables_without_failed_calls() {
    let output = Command::new(env!("CARGO_BIN_EXE_tessera-bench"))
        .args([
            "recovery",
            "--calls",
            "200",
            "--rounds",
            "1",
            "--probe-ms",
            "200",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for heading in [
        "policy overhead",
        "fallback and return",
        "failover",
        "rolling restart",
    ] {
        assert!(stdout.contains(heading), "{heading}: {stdout}");
    }
    for transport in ["tcp", "rdma-soft"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {transport} | 1 |")))
            .unwrap_or_else(|| panic!("no failover row for {transport}: {stdout}"));
        assert!(
            row.starts_with(&format!("| {transport} | 1 | 0 |")),
            "a call failed: {row}"
        );
    }
    let rolling = stdout
        .split("rolling restart")
        .nth(1)
        .unwrap_or_else(|| panic!("no rolling restart table: {stdout}"));
    for transport in ["tcp", "rdma-soft"] {
        let row = rolling
            .lines()
            .find(|l| l.starts_with(&format!("| {transport} | 1 |")))
            .unwrap_or_else(|| panic!("no rolling-restart row for {transport}: {rolling}"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // | transport | round | calls | failed | quarantined | ...
        assert_eq!(cells[4], "0", "failed calls in the rolling restart: {row}");
        assert_eq!(cells[5], "0", "replicas quarantined by it: {row}");
    }
}
