//! `tessera doctor` as an operator runs it: a report, JSON on request, and
//! an exit code that says whether the configured transport runs here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::process::Command;

fn doctor(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("doctor")
        .args(args)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn doctor_reports_the_host_and_fails_only_when_the_transport_cannot_run() {
    let (ok, text) = doctor(&[]);
    assert!(ok, "TCP runs anywhere:\n{text}");
    assert!(
        text.contains("RDMA devices") && text.contains("locked memory"),
        "{text}"
    );
    assert!(text.contains("soft NIC               ok"), "{text}");
    let (ok, json) = doctor(&["--transport", "rdma", "--provider", "soft", "--json"]);
    assert!(ok, "{json}");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["can_run"], true);
    assert!(
        report["would_use"]
            .as_str()
            .unwrap()
            .starts_with("RDMA on soft")
    );
    let (ok, text) = doctor(&["--transport", "rdma", "--provider", "ibverbs"]);
    let has_device = text.contains("port 1") && !text.contains("none:");
    if has_device {
        eprintln!("this host has an RDMA device: the exit code follows its state\n{text}");
    } else {
        assert!(!ok, "no device: ibverbs RDMA cannot run\n{text}");
        assert!(text.contains("CANNOT RUN"), "{text}");
        // `auto` falls back and runs.
        let (ok, text) = doctor(&["--transport", "auto"]);
        assert!(ok, "{text}");
        assert!(text.contains("would run on TCP"), "{text}");
    }
}
