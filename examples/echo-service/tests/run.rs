//! The service guide's example runs as a user runs it, over TCP and over
//! the soft RNIC.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

fn run(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_echo-service"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "echo-service {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn the_service_is_served_and_called_over_tcp() {
    let out = run(&["hi there"]);
    assert!(out.contains("answered \"hi there\" over tcp"), "{out}");
}

#[test]
fn the_service_is_served_and_called_over_the_soft_rnic() {
    let out = run(&["--rdma-soft", "over rdma"]);
    assert!(
        out.contains("answered \"over rdma\" over rdma-soft"),
        "{out}"
    );
}
