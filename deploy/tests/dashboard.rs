//! The Grafana dashboard in `deploy/grafana/tessera.json`: a well-formed
//! dashboard (panels with queries, unique ids, the Prometheus data source
//! as a variable), and every metric its queries name is one the code
//! records. A dashboard that names a metric nobody records shows an empty
//! panel in silence; this test makes a renamed metric fail the build
//! instead.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Every `.rs` file under the crates' `src/` directories.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && path.components().any(|c| c.as_os_str() == "src") {
            out.push(path);
        }
    }
}

/// The string literal at the start of `text` (after whitespace), if any.
fn literal(text: &str) -> Option<&str> {
    let text = text.trim_start().strip_prefix('"')?;
    Some(&text[..text.find('"')?])
}

/// The path at the start of `text` (after whitespace), if any: its last
/// segment (`crate::observe::CLIENT_RETRIES` -> `CLIENT_RETRIES`).
fn path_tail(text: &str) -> Option<&str> {
    let text = text.trim_start();
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(text.len());
    let path = &text[..end];
    let tail = path.rsplit("::").next()?;
    (!tail.is_empty()).then_some(tail)
}

/// The metric names the code records: the first argument of every
/// `counter!`, `gauge!` and `histogram!` of the `metrics` facade, as a
/// literal or as a `&str` constant defined in the workspace.
fn recorded_metrics() -> BTreeSet<String> {
    let mut files = Vec::new();
    sources(&workspace(), &mut files);
    let texts: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    let mut constants: HashMap<String, String> = HashMap::new();
    for text in &texts {
        for (at, _) in text.match_indices("const ") {
            let rest = &text[at + "const ".len()..];
            let Some(colon) = rest.find(':') else {
                continue;
            };
            let name = rest[..colon].trim();
            let Some(value) = rest[colon + 1..]
                .trim_start()
                .strip_prefix("&str")
                .and_then(|r| r.trim_start().strip_prefix('='))
                .and_then(literal)
            else {
                continue;
            };
            if value.starts_with("tessera_") {
                constants.insert(name.to_owned(), value.to_owned());
            }
        }
    }
    let mut recorded = BTreeSet::new();
    for text in &texts {
        for mac in ["counter!(", "gauge!(", "histogram!("] {
            for (at, _) in text.match_indices(mac) {
                let rest = &text[at + mac.len()..];
                if let Some(name) = literal(rest) {
                    recorded.insert(name.to_owned());
                } else if let Some(value) = path_tail(rest).and_then(|c| constants.get(c)) {
                    recorded.insert(value.clone());
                }
            }
        }
    }
    recorded
}

/// The `tessera_*` metric names in a PromQL expression, with a
/// histogram's `_bucket`/`_sum`/`_count` series named by its metric.
fn named_metrics(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("tessera_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let mut name = &tail[..end];
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix)
                && base.ends_with("_seconds")
            {
                name = base;
            }
        }
        names.push(name.to_owned());
        rest = &tail[end..];
    }
    names
}

#[test]
fn the_dashboard_is_well_formed_and_names_only_recorded_metrics() {
    let path = workspace().join("deploy/grafana/tessera.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(dashboard["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dashboard["uid"].as_str().is_some_and(|u| !u.is_empty()));
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables
            .iter()
            .any(|v| v["name"] == "datasource" && v["query"] == "prometheus"),
        "a Prometheus data source variable"
    );
    let recorded = recorded_metrics();
    // The scan finds what it should (a few the code certainly records),
    // and not what nobody records.
    for known in [
        "tessera_rpc_client_calls_finished_total",
        "tessera_ps_replication_lag_pushes",
        "tessera_transport_inbound_bytes",
    ] {
        assert!(recorded.contains(known), "the scan missed {known}");
    }
    assert!(!recorded.contains("tessera_not_a_metric_total"));

    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut named = BTreeSet::new();
    let mut unknown = Vec::new();
    let mut queries = 0;
    for panel in panels {
        let id = panel["id"].as_u64().unwrap();
        assert!(ids.insert(id), "panel id {id} twice");
        assert!(panel["gridPos"]["w"].as_u64().is_some(), "{panel}");
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap();
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{title}: the data source variable"
        );
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().unwrap();
            let names = named_metrics(expr);
            assert!(!names.is_empty(), "{title}: {expr} names no metric");
            queries += 1;
            for name in names {
                if !recorded.contains(&name) {
                    unknown.push(format!("{title}: {name}"));
                }
                named.insert(name);
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "the dashboard names metrics the code does not record: {unknown:?}"
    );
    eprintln!(
        "{} panels, {queries} queries, {} metrics, all recorded ({} recorded in all)",
        panels.len(),
        named.len(),
        recorded.len()
    );
    // What an operator of a PS fleet watches is there.
    for watched in [
        "tessera_rpc_client_calls_finished_total",
        "tessera_ps_replication_lag_pushes",
        "tessera_ps_primary_takeovers_total",
        "tessera_rpc_client_quarantine_ejections_total",
        "tessera_rpc_client_tcp_fallbacks_total",
        "tessera_transport_inbound_bytes",
    ] {
        assert!(named.contains(watched), "no panel shows {watched}");
    }
}
