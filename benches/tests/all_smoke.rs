//! `tessera-bench all --quick` runs every benchmark, writes a result per
//! benchmark that follows `benches/result.schema.json`, their figures and
//! one `REPORT.md` embedding them (a smoke run: the figures themselves are
//! the benchmarks').
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

#[test]
fn all_quick_writes_every_result_to_the_schema_and_a_report_with_figures() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tessera-bench"))
        .args(["all", "--quick", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stderr),
        std::fs::read_to_string(dir.path().join("REPORT.md")).unwrap_or_default()
    );
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../result.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let report = std::fs::read_to_string(dir.path().join("REPORT.md")).unwrap();
    for bench in [
        "rpc",
        "ps-inference",
        "ps-training",
        "scale",
        "transport",
        "alloc",
        "fragment",
        "hol",
        "incast",
        "fabric",
        "qps",
        "replication",
        "recovery",
    ] {
        let result: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(format!("{bench}.json"))).unwrap(),
        )
        .unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&result)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{bench}.json: {errors:?}");
        assert_eq!(result["bench"], bench);
        assert!(
            report.contains(&format!("\n## {bench}\n")),
            "{bench} in the report"
        );
    }
    // scale sweeps all three dimensions, over both transports where it
    // should, and says how much bigger a row is than its payload.
    let scale: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("scale.json")).unwrap())
            .unwrap();
    let rows = scale["rows"].as_array().unwrap();
    for (section, transport) in [
        ("keys", "tcp"),
        ("keys", "rdma-soft"),
        ("rows", "tcp"),
        ("connections", "tcp"),
        ("connections", "rdma-soft"),
    ] {
        let n = rows
            .iter()
            .filter(|r| r["section"] == section && r["transport"] == transport)
            .count();
        assert_eq!(n, 3, "{section} over {transport}");
    }
    let largest = rows.iter().rfind(|r| r["section"] == "rows").unwrap();
    assert!(
        largest["bytes_per_added_row_vs_payload"].as_f64().unwrap() > 1.0,
        "{largest}"
    );
    // fabric: Table 4's trend (issue 58): the servers an incast holds
    // before the first PFC pause grow with every smaller window, at least
    // tenfold from none to 4 KB; and Figure 15's rows carry their fields.
    let fabric: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("fabric.json")).unwrap())
            .unwrap();
    let rows = fabric["rows"].as_array().unwrap();
    let before = |window: serde_json::Value| {
        rows.iter()
            .find(|r| r["scenario"] == "table4" && r["window"] == window)
            .and_then(|r| r["servers_before_pfc"].as_u64())
            .unwrap()
    };
    let counts: Vec<u64> = [
        serde_json::json!("none"),
        serde_json::json!(16384),
        serde_json::json!(8192),
        serde_json::json!(4096),
    ]
    .into_iter()
    .map(before)
    .collect();
    assert!(counts.windows(2).all(|w| w[0] < w[1]), "{counts:?}");
    assert!(counts[3] >= 10 * counts[0], "{counts:?}");
    // The calibration ran the real incast and the simulated one: each
    // row has both sides and their ratios (how close they come is the
    // full run's report, not a check a debug build can hold).
    for row in rows.iter().filter(|r| r["scenario"] == "calibration") {
        for field in ["goodput", "p50", "p99"] {
            let ratio = row[format!("{field}_sim_vs_measured")].as_f64().unwrap();
            assert!(ratio.is_finite() && ratio > 0.0, "{row}");
        }
        let sim = row["sim_goodput_mbps"].as_f64().unwrap();
        let link = row["link_mbps"].as_f64().unwrap();
        assert!(sim > 0.9 * link && sim <= link, "{row}");
    }
    for (scenario, n) in [
        ("fig15", 4),
        ("table7", 6),
        ("calibration", 4),
        ("speed", 1),
    ] {
        assert_eq!(
            rows.iter().filter(|r| r["scenario"] == scenario).count(),
            n,
            "{scenario}: {rows:?}"
        );
    }
    // Every figure the report embeds is a PNG next to it.
    let figures: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("![")?.split_once("](")?.1.strip_suffix(')'))
        .collect();
    assert!(figures.len() >= 18, "{figures:?}");
    for file in figures {
        let png = std::fs::read(dir.path().join(file)).unwrap();
        assert_eq!(&png[1..4], b"PNG", "{file}");
    }
}

#[test]
fn the_schema_refuses_a_result_without_its_machine() {
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../result.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let result = serde_json::json!({
        "bench": "rpc",
        "meta": { "command": "tessera-bench rpc", "git_rev": "abc" },
        "rows": [{ "way": "grpc", "p50_us": 1.0 }]
    });
    assert!(!validator.is_valid(&result));
}
