//! What every benchmark result records about where it was measured, and
//! how results are written.
//!
//! Absolute timings are this machine's: a result carries the machine
//! (cores, memory, CPU model), the git revision and the command line, so
//! that a figure is never read without them, and every figure also comes
//! as a ratio to a baseline measured in the same run.
//!
//! A result is one JSON object, `{"bench", "meta", "rows"}`, written to
//! `<bench>.json` next to its table in `<bench>.md`.

use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// Where and how a result was measured.
#[derive(Debug, Clone)]
pub struct Meta {
    /// The benchmark's name (`rpc`, `transport`, ...).
    pub bench: String,
    /// The command line that ran it.
    pub command: String,
    /// `git rev-parse --short HEAD` of the working directory, or
    /// `unknown` outside a checkout.
    pub git_rev: String,
    /// CPUs this process may run on.
    pub cores: usize,
    /// The machine's memory, GiB.
    pub memory_gib: f64,
    /// The CPU model (`/proc/cpuinfo`).
    pub cpu_model: String,
    /// Seconds since the Unix epoch when it started.
    pub started_unix: u64,
    started: Instant,
}

impl Meta {
    /// The machine and revision of a run of `bench` starting now.
    pub fn collect(bench: &str) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|rest| rest.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, m)| m.trim().to_owned());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_kib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        let git_rev = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|out| out.status.success())
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .map_or_else(|| "unknown".to_owned(), |rev| rev.trim().to_owned());
        Self {
            bench: bench.to_owned(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            git_rev,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib: memory_kib / (1024.0 * 1024.0),
            cpu_model,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            started: Instant::now(),
        }
    }

    /// As JSON, with the seconds the run has taken so far.
    pub fn json(&self) -> Value {
        json!({
            "command": self.command,
            "git_rev": self.git_rev,
            "cores": self.cores,
            "memory_gib": (self.memory_gib * 10.0).round() / 10.0,
            "cpu_model": self.cpu_model,
            "started_unix": self.started_unix,
            "duration_s": (self.started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        })
    }

    /// One line naming the machine, for the top of a table.
    pub fn machine_line(&self) -> String {
        format!(
            "Machine: {} cores, {:.1} GiB, {}; revision {}; `{}` ({:.0} s). Absolute figures are this machine's; ratios are to a baseline of the same run.",
            self.cores,
            self.memory_gib,
            self.cpu_model,
            self.git_rev,
            self.command,
            self.started.elapsed().as_secs_f64()
        )
    }
}

/// The result object of `meta`'s bench with `rows`.
pub fn result(meta: &Meta, rows: &[Value]) -> Value {
    json!({ "bench": meta.bench, "meta": meta.json(), "rows": rows })
}

/// Writes `<bench>.json` and `<bench>.md` into `dir`.
pub fn write(dir: &Path, meta: &Meta, rows: &[Value], markdown: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_string_pretty(&result(meta, rows))?;
    std::fs::write(dir.join(format!("{}.json", meta.bench)), json + "\n")?;
    std::fs::write(dir.join(format!("{}.md", meta.bench)), markdown)?;
    Ok(())
}

/// Appends a formatted line (or an empty one) to a `String` table.
#[macro_export]
macro_rules! out_line {
    ($out:expr) => {
        $out.push('\n')
    };
    ($out:expr, $($arg:tt)*) => {{
        $out.push_str(&format!($($arg)*));
        $out.push('\n');
    }};
}

/// Prints `table` (after the machine line) and, with `out`, writes the
/// result there.
#[allow(clippy::print_stdout)]
pub fn emit(meta: &Meta, out: Option<&Path>, rows: &[Value], table: &str) -> std::io::Result<()> {
    let table = format!("{}\n\n{table}", meta.machine_line());
    print!("{table}");
    if let Some(dir) = out {
        write(dir, meta, rows, &table)?;
    }
    Ok(())
}

/// The value at quantile `q` of `sorted` (ascending), or 0 when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_names_the_machine_and_the_command() {
        let meta = Meta::collect("unit");
        let value = result(&meta, &[json!({"x": 1})]);
        assert_eq!(value["bench"], "unit");
        assert!(value["meta"]["cores"].as_u64().unwrap() >= 1);
        assert!(!value["meta"]["command"].as_str().unwrap().is_empty());
        assert_eq!(value["rows"][0]["x"], 1);
        assert!(meta.machine_line().contains("cores"));
    }

    #[test]
    fn quantiles_of_a_sorted_sample() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&sorted, 0.5), 51.0);
        assert_eq!(quantile(&sorted, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
