//! What the benchmark smoke tests share.
#![allow(clippy::unwrap_used, dead_code)]

/// Runs `tessera-bench <bench> <args> --out DIR`, asserting it succeeds:
/// the result object it wrote to `DIR/<bench>.json`, and `DIR`.
pub fn run_bench(bench: &str, args: &[&str]) -> (serde_json::Value, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-bench"))
        .arg(bench)
        .args(args)
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{bench}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let result: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(format!("{bench}.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(result["bench"], bench);
    (result, dir)
}
