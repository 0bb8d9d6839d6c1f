//! The Kubernetes deployment (`deploy/kubernetes/`): the base and every
//! overlay render (`kubectl kustomize`), validate against the Kubernetes
//! schemas (`kubernetes-validate --strict`, which the test command installs
//! from PyPI), and every Tessera container's command line, with the
//! rendered ConfigMap, is one the binaries accept (`--check-config`) for
//! each pod it would run as.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::binary;

/// The Kubernetes version the manifests are validated against (the oldest
/// they need: `matchLabelKeys` and the pod-index label).
const KUBERNETES_VERSION: &str = "1.30.0";

fn kubernetes_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kubernetes")
}

fn tool_missing(program: &str, args: &[&str]) -> bool {
    !Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Every kustomization: the base and each overlay.
fn kustomizations() -> Vec<PathBuf> {
    let mut dirs = vec![kubernetes_dir().join("base")];
    let mut overlays: Vec<PathBuf> = std::fs::read_dir(kubernetes_dir().join("overlays"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .collect();
    overlays.sort();
    dirs.extend(overlays);
    dirs
}

fn render(dir: &Path) -> String {
    let output = Command::new("kubectl")
        .args(["kustomize"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn every_overlay_renders_validates_and_configures_the_binaries() {
    if tool_missing("kubectl", &["version", "--client"]) {
        // `scripts/dev test` installs it (Debian's kubernetes-client).
        eprintln!("SKIP: kubectl is not installed, so the manifests are not rendered");
        return;
    }
    if tool_missing("python3", &["-m", "kubernetes_validate", "--version"]) {
        eprintln!(
            "SKIP: kubernetes-validate is not installed (scripts/dev test installs it from PyPI)"
        );
        return;
    }
    let dirs = kustomizations();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["base", "etcd", "external-etcd", "rdma"]);
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let rendered = render(&dir);
        let work = tempfile::tempdir().unwrap();
        let manifest = work.path().join("rendered.yaml");
        std::fs::write(&manifest, &rendered).unwrap();
        // The Kubernetes schemas, strictly (an unknown field fails).
        let validated = Command::new("python3")
            .args(["-m", "kubernetes_validate", "--strict", "--quiet", "-k"])
            .arg(KUBERNETES_VERSION)
            .arg(&manifest)
            .output()
            .unwrap();
        assert!(
            validated.status.success(),
            "{name}: kubernetes-validate: {}{}",
            String::from_utf8_lossy(&validated.stdout),
            String::from_utf8_lossy(&validated.stderr)
        );
        // What the pods would run.
        let extracted = Command::new("python3")
            .arg(kubernetes_dir().join("check_rendered.py"))
            .stdin(std::fs::File::open(&manifest).unwrap())
            .output()
            .unwrap();
        assert!(
            extracted.status.success(),
            "{name}: check_rendered.py: {}",
            String::from_utf8_lossy(&extracted.stderr)
        );
        let plan: serde_json::Value = serde_json::from_slice(&extracted.stdout).unwrap();
        let config_dir = work.path().join("etc");
        std::fs::create_dir_all(&config_dir).unwrap();
        let files = plan["files"].as_object().expect("the ConfigMap's files");
        assert!(
            files.contains_key("ps-server.toml") && files.contains_key("worker.toml"),
            "{name}: the ConfigMap has ps-server.toml and worker.toml"
        );
        for (file, text) in files {
            std::fs::write(config_dir.join(file), text.as_str().unwrap()).unwrap();
        }
        let commands = plan["commands"].as_array().unwrap();
        let servers = commands
            .iter()
            .filter(|c| c["binary"] == "ps-server")
            .count();
        assert_eq!(servers, 4, "{name}: 2 shards x 2 replica groups");
        assert!(
            commands.iter().any(|c| c["binary"] == "worker"),
            "{name}: a worker"
        );
        for command in commands {
            let binary = binary(command["binary"].as_str().unwrap());
            let args: Vec<String> = command["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| {
                    a.as_str()
                        .unwrap()
                        .replace("/etc/tessera/", &format!("{}/", config_dir.display()))
                        .replace(
                            "/var/lib/tessera",
                            &work.path().join("state").display().to_string(),
                        )
                })
                .collect();
            let output = Command::new(&binary)
                .arg("--check-config")
                .args(&args)
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "{name}: pod {} ({} {}) is refused: {}",
                command["pod"],
                binary.display(),
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        eprintln!(
            "{name}: {} objects validate against Kubernetes {KUBERNETES_VERSION}; {} pods' command lines accepted",
            rendered.matches("\nkind: ").count() + usize::from(rendered.starts_with("kind: ")),
            commands.len()
        );
    }
}
