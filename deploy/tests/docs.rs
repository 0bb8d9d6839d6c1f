//! The book cannot drift from the code. Over the README, `docs/` and the
//! READMEs under `deploy/`:
//!
//! - every relative link names a file that exists, and every `#anchor` a
//!   heading of its target (GitHub's anchors: lower case, punctuation
//!   dropped, spaces to dashes, `-1`, `-2` for repeats);
//! - every command in a `sh` block that runs one of Tessera's binaries
//!   parses against that binary's own argument parser (run with
//!   `TESSERA_PARSE_ONLY`, [`tessera_config::PARSE_ONLY_ENV`]), every
//!   `scripts/dev` command names a command the script has, every script of
//!   the repository it runs exists, and every `cargo` command names
//!   packages, binaries, examples and tests that exist;
//! - every code block whose first line names a file (`// path` or
//!   `# path`) is that file, whole: the guides' examples are the files the
//!   suite runs.
//!
//! The shell is read by a small lexer of its own (quotes, `\` line
//! continuations, comments, `$(...)`, redirections, `&&`, `|`, `;`, `&`):
//! enough for the commands a manual shows, which is all it reads.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The manual: the README, every page of the book, and the READMEs beside
/// the deployment files.
fn manual() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs"), root.join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md")
                && (path.starts_with(root.join("docs"))
                    || path.file_name().is_some_and(|n| n == "README.md"))
            {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// A fenced code block.
struct Block {
    /// The info string (`sh`, `rust`, ...).
    info: String,
    /// Its lines, the fence's indentation removed.
    body: String,
    /// The line of its opening fence (1-based).
    line: usize,
}

/// A page split into its prose (code blocks blanked) and its code blocks.
struct Page {
    path: PathBuf,
    prose: Vec<(usize, String)>,
    blocks: Vec<Block>,
}

fn read_page(path: &Path) -> Page {
    let text = std::fs::read_to_string(path).unwrap();
    let mut prose = Vec::new();
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String, Block)> = None;
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match open.take() {
            Some((fence_indent, fence, block)) => {
                if trimmed.starts_with(fence.as_str()) && trimmed.trim_end() == fence {
                    blocks.push(block);
                } else {
                    let mut block = block;
                    let cut = line.len().min(fence_indent);
                    let cut = if line[..cut].trim().is_empty() {
                        cut
                    } else {
                        0
                    };
                    block.body.push_str(&line[cut..]);
                    block.body.push('\n');
                    open = Some((fence_indent, fence, block));
                }
            }
            None if trimmed.starts_with("```") => {
                let fence: String = trimmed.chars().take_while(|&c| c == '`').collect();
                let info = trimmed[fence.len()..].trim().to_owned();
                open = Some((
                    indent,
                    fence,
                    Block {
                        info,
                        body: String::new(),
                        line: index + 1,
                    },
                ));
            }
            None => prose.push((index + 1, line.to_owned())),
        }
    }
    assert!(
        open.is_none(),
        "{}: a code block is not closed",
        path.display()
    );
    Page {
        path: path.to_owned(),
        prose,
        blocks,
    }
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(page: &Page) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = BTreeSet::new();
    for (_, line) in &page.prose {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let slug = slug(&line[hashes..]);
            let count = seen.entry(slug.clone()).or_insert(0);
            anchors.insert(if *count == 0 {
                slug.clone()
            } else {
                format!("{slug}-{count}")
            });
            *count += 1;
        }
    }
    anchors
}

/// The link targets of a line of prose, inline code left out.
fn links(line: &str) -> Vec<String> {
    let mut text = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            text.push(c);
        }
    }
    let mut found = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        found.push(after[..end].to_owned());
        rest = &after[end..];
    }
    found
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_link_and_anchor_in_the_manual_resolves() {
    let pages: Vec<Page> = manual().iter().map(|p| read_page(p)).collect();
    let anchors: HashMap<PathBuf, BTreeSet<String>> = pages
        .iter()
        .map(|page| (page.path.clone(), anchors(page)))
        .collect();
    let root = repo();
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let dir = page.path.parent().unwrap();
        for (line_no, line) in &page.prose {
            for link in links(line) {
                if link.starts_with("http://")
                    || link.starts_with("https://")
                    || link.starts_with("mailto:")
                {
                    continue;
                }
                checked += 1;
                let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
                let target = if path.is_empty() {
                    page.path.clone()
                } else {
                    normalize(&dir.join(path))
                };
                let at = format!(
                    "{}:{line_no}: ({link})",
                    page.path.strip_prefix(&root).unwrap().display()
                );
                if !target.starts_with(&root) || !target.exists() {
                    broken.push(format!("{at}: no such file"));
                } else if !fragment.is_empty()
                    && target.extension().is_some_and(|e| e == "md")
                    && !anchors
                        .get(&target)
                        .is_some_and(|known| known.contains(fragment))
                {
                    broken.push(format!("{at}: no heading with that anchor"));
                }
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} links found: is the manual there?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The simple commands of a shell text: each a list of words, quotes
/// removed, `$(...)` kept whole as one word, redirections dropped.
fn commands(script: &str) -> Vec<Vec<String>> {
    let chars: Vec<char> = script.chars().collect();
    let mut commands = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut skip_next_word = false;
    let mut i = 0;
    let end_word =
        |word: &mut String, in_word: &mut bool, words: &mut Vec<String>, skip: &mut bool| {
            if *in_word {
                if *skip {
                    *skip = false;
                } else {
                    words.push(std::mem::take(word));
                }
                word.clear();
                *in_word = false;
            }
        };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\\' if chars.get(i + 1) == Some(&'\n') => i += 1,
            '\\' => {
                if let Some(&next) = chars.get(i + 1) {
                    word.push(next);
                    in_word = true;
                    i += 1;
                }
            }
            '\'' => {
                in_word = true;
                i += 1;
                while i < chars.len() && chars[i] != '\'' {
                    word.push(chars[i]);
                    i += 1;
                }
            }
            '"' => {
                in_word = true;
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' && i + 1 < chars.len() {
                        i += 1;
                    }
                    word.push(chars[i]);
                    i += 1;
                }
            }
            '$' if chars.get(i + 1) == Some(&'(') => {
                in_word = true;
                let mut depth = 0;
                while i < chars.len() {
                    word.push(chars[i]);
                    match chars[i] {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            '#' if !in_word => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '>' | '<' => {
                // `2>>file`, `>file`, `2>&1`: the operator, and the file
                // after it, are not arguments.
                if in_word && word.chars().all(|c| c.is_ascii_digit()) {
                    word.clear();
                    in_word = false;
                }
                end_word(&mut word, &mut in_word, &mut words, &mut skip_next_word);
                while matches!(chars.get(i + 1), Some('>' | '&')) {
                    i += 1;
                }
                if chars.get(i + 1).is_some_and(|c| c.is_ascii_digit()) {
                    i += 1;
                } else {
                    skip_next_word = true;
                }
            }
            ' ' | '\t' => end_word(&mut word, &mut in_word, &mut words, &mut skip_next_word),
            '\n' | ';' | '&' | '|' | '(' | ')' => {
                end_word(&mut word, &mut in_word, &mut words, &mut skip_next_word);
                if !words.is_empty() {
                    commands.push(std::mem::take(&mut words));
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
        i += 1;
    }
    end_word(&mut word, &mut in_word, &mut words, &mut skip_next_word);
    if !words.is_empty() {
        commands.push(words);
    }
    // `VAR=value cmd ...`: the assignments are not the command.
    commands
        .into_iter()
        .map(|words| {
            words
                .into_iter()
                .skip_while(|w| {
                    w.split_once('=').is_some_and(|(name, _)| {
                        !name.is_empty()
                            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    })
                })
                .collect::<Vec<_>>()
        })
        .filter(|words| !words.is_empty())
        .collect()
}

#[test]
fn the_shell_lexer_reads_what_the_manual_writes() {
    let script = "a --x 'one two' \"three\" # a comment\n\
                  b \\\n  --c $(grep -o 'x y' f) 2>>log &\n\
                  RUST_LOG=debug c && d | e; (cd f && g)\n";
    assert_eq!(
        commands(script),
        vec![
            vec!["a", "--x", "one two", "three"],
            vec!["b", "--c", "$(grep -o 'x y' f)"],
            vec!["c"],
            vec!["d"],
            vec!["e"],
            vec!["cd", "f"],
            vec!["g"],
        ]
    );
}

/// The workspace's packages, and each one's targets by kind.
struct Workspace {
    /// package -> [(kind, target name)]
    packages: HashMap<String, Vec<(String, String)>>,
}

impl Workspace {
    fn load() -> Self {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let output = Command::new(cargo)
            .args([
                "metadata",
                "--no-deps",
                "--format-version",
                "1",
                "--offline",
            ])
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let mut packages = HashMap::new();
        for package in metadata["packages"].as_array().unwrap() {
            let targets = package["targets"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|target| {
                    let name = target["name"].as_str().unwrap().to_owned();
                    target["kind"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(move |kind| (kind.as_str().unwrap().to_owned(), name.clone()))
                })
                .collect();
            packages.insert(package["name"].as_str().unwrap().to_owned(), targets);
        }
        Self { packages }
    }

    /// Whether a target of `kind` named `name` exists, in `package` if
    /// given.
    fn has(&self, package: Option<&str>, kind: &str, name: &str) -> bool {
        self.packages
            .iter()
            .filter(|(p, _)| package.is_none_or(|wanted| wanted == p.as_str()))
            .any(|(_, targets)| targets.iter().any(|(k, n)| k == kind && n == name))
    }
}

/// What is wrong with a `cargo` command's packages and targets, if
/// anything.
fn check_cargo(workspace: &Workspace, words: &[String]) -> Option<String> {
    let mut package = None;
    let mut wanted = Vec::new();
    let mut args = words.iter().skip(1);
    while let Some(arg) = args.next() {
        let (flag, value) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_owned())),
            _ => (arg.as_str(), None),
        };
        let kind = match flag {
            "-p" | "--package" => "package",
            "--bin" => "bin",
            "--example" => "example",
            "--test" => "test",
            "--bench" => "bench",
            "--" => break,
            _ => continue,
        };
        let Some(value) = value.or_else(|| args.next().cloned()) else {
            return Some(format!("{flag} without a value"));
        };
        if kind == "package" {
            if !workspace.packages.contains_key(&value) {
                return Some(format!("no package {value}"));
            }
            package = Some(value);
        } else {
            wanted.push((kind, value));
        }
    }
    wanted
        .iter()
        .find(|(kind, name)| !workspace.has(package.as_deref(), kind, name))
        .map(|(kind, name)| format!("no {kind} target {name}"))
}

/// The commands `scripts/dev` has (its `case` arms).
fn dev_commands() -> BTreeSet<String> {
    std::fs::read_to_string(repo().join("scripts/dev"))
        .unwrap()
        .lines()
        .filter_map(|line| {
            let arm = line.trim().strip_suffix(')')?;
            (!arm.is_empty() && arm.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                .then(|| arm.to_owned())
        })
        .collect()
}

#[test]
fn every_command_the_manual_shows_parses() {
    let root = repo();
    let profile = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_owned();
    let binaries: HashMap<&str, PathBuf> = [
        ("tessera", PathBuf::from(env!("CARGO_BIN_EXE_tessera"))),
        ("ps-server", profile.join("ps-server")),
        ("worker", profile.join("worker")),
        ("tessera-bench", profile.join("tessera-bench")),
    ]
    .into_iter()
    .collect();
    for (name, path) in &binaries {
        assert!(
            path.is_file(),
            "no {name} binary at {}: the suite builds every binary (`--all-targets`)",
            path.display()
        );
    }
    let workspace = Workspace::load();
    let dev = dev_commands();
    assert!(dev.contains("test") && dev.contains("demo"), "{dev:?}");

    let mut wrong = Vec::new();
    let mut parsed = 0;
    for path in manual() {
        let page = read_page(&path);
        for block in page.blocks.iter().filter(|b| b.info == "sh") {
            for words in commands(&block.body) {
                let program = words[0].as_str();
                let base = program.rsplit('/').next().unwrap_or(program);
                let at = format!(
                    "{}:{} `{}`",
                    path.strip_prefix(&root).unwrap().display(),
                    block.line,
                    words.join(" ")
                );
                let from_build = !program.contains('/')
                    || program.starts_with("target/release/")
                    || program.starts_with("target/debug/");
                if let (Some(binary), true) = (binaries.get(base), from_build) {
                    parsed += 1;
                    let output = Command::new(binary)
                        .args(&words[1..])
                        .env(tessera_config::PARSE_ONLY_ENV, "1")
                        .output()
                        .unwrap();
                    if !output.status.success() {
                        wrong.push(format!(
                            "{at}: {}",
                            String::from_utf8_lossy(&output.stderr).trim()
                        ));
                    }
                } else if program == "scripts/dev" {
                    parsed += 1;
                    match words.get(1) {
                        Some(command) if dev.contains(command) => {}
                        other => wrong.push(format!(
                            "{at}: scripts/dev has no command {other:?} (it has {dev:?})"
                        )),
                    }
                } else if program == "cargo" {
                    parsed += 1;
                    if let Some(problem) = check_cargo(&workspace, &words) {
                        wrong.push(format!("{at}: {problem}"));
                    }
                } else if ["scripts/", "deploy/", "benches/"]
                    .iter()
                    .any(|dir| program.starts_with(dir))
                    && !root.join(program).is_file()
                {
                    wrong.push(format!("{at}: no such script"));
                }
            }
        }
    }
    assert!(parsed > 50, "only {parsed} commands found");
    assert!(
        wrong.is_empty(),
        "commands in the manual that do not parse:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_block_that_names_a_file_is_that_file() {
    let root = repo();
    let mut wrong = Vec::new();
    let mut found = 0;
    for path in manual() {
        let page = read_page(&path);
        for block in &page.blocks {
            let Some((first, rest)) = block.body.split_once('\n') else {
                continue;
            };
            let named = first
                .strip_prefix("// ")
                .or_else(|| first.strip_prefix("# "))
                .filter(|name| {
                    !name.contains(' ')
                        && name.contains('/')
                        && [".rs", ".py", ".toml", ".proto"]
                            .iter()
                            .any(|ext| name.ends_with(ext))
                });
            let Some(named) = named else { continue };
            found += 1;
            let at = format!(
                "{}:{}",
                path.strip_prefix(&root).unwrap().display(),
                block.line
            );
            match std::fs::read_to_string(root.join(named)) {
                Err(err) => wrong.push(format!("{at}: {named}: {err}")),
                Ok(file) if file != rest => wrong.push(format!(
                    "{at}: the block is not {named} as it is (copy the file into the block)"
                )),
                Ok(_) => {}
            }
        }
    }
    assert!(found >= 2, "only {found} blocks name a file");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------
// The configuration reference against the code.
//
// Each table of `docs/src/reference/configuration.md` that documents a
// configuration is preceded by a marker naming the configurations its keys
// belong to, and a prefix where the table documents a section
// (`<!-- config ps-server worker up prefix=rdma -->`). A row's first cell
// holds its keys, backquoted and dotted from the file's root (`tables[].dim`
// for a key of every `[[tables]]` entry); its second cell their defaults,
// one backquoted TOML literal per key, `none` (unset or empty), or words
// (`required`, `see ...`), which are not checked.

use serde_json::Value as Json;
use std::collections::BTreeMap;

/// A configuration's keys as the code has them: every leaf of its
/// serialized default and of samples that set what the default leaves
/// unset (optional sections, array entries), objects opened, arrays of
/// objects opened as `key[]`.
fn code_keys(values: &[Json]) -> BTreeMap<String, Json> {
    fn walk(prefix: &str, value: &Json, out: &mut BTreeMap<String, Json>) {
        match value {
            Json::Object(map) if !map.is_empty() => {
                for (key, value) in map {
                    let path = if prefix.is_empty() {
                        key.clone()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    walk(&path, value, out);
                }
            }
            Json::Array(items) if items.iter().any(Json::is_object) => {
                for item in items {
                    walk(&format!("{prefix}[]"), item, out);
                }
            }
            leaf => {
                out.entry(prefix.to_owned()).or_insert_with(|| leaf.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    for value in values {
        walk("", value, &mut out);
    }
    out
}

/// A documented key: its default cell, as written.
#[derive(Debug, Clone)]
enum Documented {
    /// A TOML literal.
    Literal(String),
    /// Unset or empty.
    None,
    /// Words: not checked.
    Words,
}

/// The documented keys of each configuration, by the markers.
fn documented() -> BTreeMap<String, BTreeMap<String, (Documented, usize)>> {
    let path = repo().join("docs/src/reference/configuration.md");
    let page = read_page(&path);
    let mut out: BTreeMap<String, BTreeMap<String, (Documented, usize)>> = BTreeMap::new();
    let mut current: Option<(Vec<String>, String)> = None;
    let mut in_table = false;
    for (line_no, line) in &page.prose {
        let trimmed = line.trim();
        if let Some(marker) = trimmed
            .strip_prefix("<!-- config ")
            .and_then(|rest| rest.strip_suffix("-->"))
        {
            let mut configs = Vec::new();
            let mut prefix = String::new();
            for word in marker.split_whitespace() {
                match word.strip_prefix("prefix=") {
                    Some(p) => prefix = format!("{p}."),
                    None => configs.push(word.to_owned()),
                }
            }
            current = Some((configs, prefix));
            in_table = false;
            continue;
        }
        if !trimmed.starts_with('|') {
            if in_table {
                current = None;
                in_table = false;
            }
            continue;
        }
        let Some((configs, prefix)) = &current else {
            continue;
        };
        in_table = true;
        let cells: Vec<&str> = trimmed.trim_matches('|').split(" | ").collect();
        if cells.len() < 2 || cells[0].starts_with("---") || cells[0].trim() == "key" {
            continue;
        }
        let spans = |cell: &str| -> Vec<String> {
            cell.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect()
        };
        let keys = spans(cells[0]);
        let defaults = spans(cells[1]);
        let only_spans = cells[1]
            .split('`')
            .step_by(2)
            .all(|between| between.trim().trim_matches(',').trim().is_empty());
        for (i, key) in keys.iter().enumerate() {
            let default = if cells[1].trim() == "none" {
                Documented::None
            } else if only_spans && defaults.len() == keys.len() {
                Documented::Literal(defaults[i].clone())
            } else {
                Documented::Words
            };
            for config in configs {
                let documented = out.entry(config.clone()).or_default();
                let full = format!("{prefix}{key}");
                let line = *line_no;
                assert!(
                    documented
                        .insert(full.clone(), (default.clone(), line))
                        .is_none(),
                    "configuration.md:{line}: {full} of {config} is documented twice"
                );
            }
        }
    }
    out
}

/// A TOML literal as JSON.
fn literal(text: &str) -> Json {
    let doc: toml::Table = toml::from_str(&format!("v = {text}"))
        .unwrap_or_else(|e| panic!("`{text}` is not a TOML value: {e}"));
    serde_json::to_value(&doc["v"]).unwrap()
}

/// Equal as configuration values: numbers within float rounding.
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) if x.is_f64() || y.is_f64() => {
            // A float is written in decimal and stored as f32 or f64.
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            (x - y).abs() <= 1e-6 * x.abs().max(y.abs())
        }
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Json::Object(x), Json::Object(y)) => {
            // A literal may leave out fields whose defaults apply.
            x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        (a, b) => a == b,
    }
}

/// The value at a documented key in a configuration's default: `None`
/// where an array on the way is empty.
fn at(value: &Json, key: &str) -> Option<Json> {
    let mut here = value.clone();
    for part in key.split('.') {
        let (name, array) = match part.strip_suffix("[]") {
            Some(name) => (name, true),
            None => (part, false),
        };
        here = here.get(name)?.clone();
        if array {
            here = here.as_array()?.first()?.clone();
        }
    }
    Some(here)
}

fn json<T: serde::Serialize>(value: &T) -> Json {
    serde_json::to_value(value).unwrap()
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, toml_text: &str) -> T {
    toml::from_str(toml_text).unwrap_or_else(|e| panic!("the {what} sample: {e}"))
}

/// Each configuration: its default and samples that set what the default
/// leaves out (every optional section, an entry of every list).
fn configurations() -> Vec<(&'static str, Json, Vec<Json>)> {
    const RDMA: &str = "[rdma]\ndevice = \"d\"\ndevices = [\"a\"]\ngid_index = 1\n\
                        soft_port_file = \"p\"\n[rdma.soft_faults]\nseed = 1\n\
                        [[rdma.soft_rails]]\nlink_mbps = 1\nport_file = \"p\"\n";
    const TLS: &str = "[tls]\ncert = \"c\"\nkey = \"k\"\nca = \"a\"\nserver_name = \"n\"\n";
    let server = tessera_ps_server::PsServerConfig::default();
    let worker = tessera_worker::WorkerConfig::default();
    let up = tessera_deploy::ClusterConfig::default();
    let transport_sample =
        parse::<tessera_rpc::TransportConfig>("transport", &format!("{TLS}{RDMA}"));
    vec![
        (
            "transport",
            json(&tessera_rpc::TransportConfig::default()),
            vec![json(&transport_sample)],
        ),
        (
            "channel",
            json(&tessera_rpc::ChannelConfig::default()),
            Vec::new(),
        ),
        (
            "server",
            json(&tessera_rpc::ServerConfig::default()),
            Vec::new(),
        ),
        (
            "replica-set",
            json(&tessera_rpc::ReplicaSetConfig::default()),
            vec![json(&parse::<tessera_rpc::ReplicaSetConfig>(
                "replica-set",
                "seed = 1\n[[replicas]]\naddr = \"a\"\n",
            ))],
        ),
        (
            "ps-server",
            json(&server),
            vec![json(&parse::<tessera_ps_server::PsServerConfig>(
                "ps-server",
                &format!(
                    "advertise = \"a\"\ngrpc_listen = \"g\"\nmetrics_listen = \"m\"\n\
                     [[peers]]\naddress = \"p\"\nreplica_group = 1\nshards = [0]\n\
                     [checkpoint]\ndir = \"d\"\n[[delta.servers]]\naddress = \"s\"\nshards = [0]\n\
                     [[tables]]\nname = \"t\"\ndim = 1\nseed = 1\nmax_rows = 1\n\
                     admission = {{ kind = \"count\", min_pushes = 2 }}\nexpiry = {{ after_secs = 1 }}\n\
                     {TLS}{RDMA}"
                ),
            ))],
        ),
        (
            "worker",
            json(&worker),
            vec![json(&parse::<tessera_worker::WorkerConfig>(
                "worker",
                &format!(
                    "replica_group = 0\nreplica_groups = 1\nmetrics_listen = \"m\"\n\
                     admin_listen = \"a\"\n{TLS}{RDMA}"
                ),
            ))],
        ),
        (
            "up",
            json(&up),
            vec![json(&parse::<tessera_deploy::ClusterConfig>(
                "up",
                &format!("ps_server_bin = \"p\"\netcd_bin = \"e\"\n[serving]\n{RDMA}"),
            ))],
        ),
    ]
}

#[test]
fn the_configuration_reference_names_every_key_with_its_default() {
    let documented = documented();
    let mut wrong = Vec::new();
    for (name, default, samples) in configurations() {
        let mut values = vec![default.clone()];
        values.extend(samples);
        let code = code_keys(&values);
        let Some(docs) = documented.get(name) else {
            wrong.push(format!("{name}: no table is marked for it"));
            continue;
        };
        let is_prefix = |parent: &str, child: &str| {
            child.len() > parent.len()
                && child.starts_with(parent)
                && matches!(&child[parent.len()..parent.len() + 1], "." | "[")
        };
        // Every key of the code is documented, itself or by an enclosing
        // value (`tables[].optimizer` documents its `kind`), or, for an
        // unset section or an empty list, by the keys within it.
        for key in code.keys() {
            let covered = docs.contains_key(key)
                || docs.keys().any(|doc| is_prefix(doc, key))
                || (code[key].is_null() || code[key] == Json::Array(vec![]))
                    && docs.keys().any(|doc| is_prefix(key, doc));
            if !covered {
                wrong.push(format!("{name}: `{key}` is not in the reference"));
            }
        }
        for (key, (default_doc, line)) in docs {
            let at_line = format!("configuration.md:{line}: {name} `{key}`");
            if !code.contains_key(key) && !code.keys().any(|k| is_prefix(key, k)) {
                wrong.push(format!("{at_line}: no such key in the code"));
                continue;
            }
            match default_doc {
                Documented::Literal(text) => {
                    // Where the default leaves a section unset (`[serving]`
                    // of `tessera up`), a sample sets it empty: its defaults.
                    let actual =
                        at(&default, key).or_else(|| values[1..].iter().find_map(|v| at(v, key)));
                    if let Some(actual) = actual
                        && !same(&literal(text), &actual)
                    {
                        wrong.push(format!(
                            "{at_line}: documented default `{text}`, the code's is {actual}"
                        ));
                    }
                }
                Documented::None => {
                    if let Some(actual) = at(&default, key)
                        && !(actual.is_null() || actual == Json::Array(vec![]))
                    {
                        wrong.push(format!(
                            "{at_line}: documented as unset, the code's default is {actual}"
                        ));
                    }
                }
                Documented::Words => {}
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the configuration reference and the code differ:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn defaults_compare_integers_exactly_and_floats_to_their_rounding() {
    assert!(same(&literal("4194304"), &serde_json::json!(4194304)));
    assert!(!same(&literal("4194305"), &serde_json::json!(4194304)));
    // 0.01 as an f32, widened.
    assert!(same(
        &literal("0.01"),
        &serde_json::json!(0.009999999776482582)
    ));
    assert!(!same(&literal("0.02"), &serde_json::json!(0.01)));
    // An inline table may leave out fields that keep their defaults.
    assert!(same(
        &literal("{ kind = \"sgd\" }"),
        &serde_json::json!({"kind": "sgd", "learning_rate": 0.01})
    ));
    assert!(!same(
        &literal("{ kind = \"adam\" }"),
        &serde_json::json!({"kind": "sgd"})
    ));
    let keys = code_keys(&[serde_json::json!({
        "a": 1, "b": {"c": null}, "d": [{"e": 1}, {"f": 2}], "g": [1, 2], "h": []
    })]);
    assert_eq!(
        keys.keys().map(String::as_str).collect::<Vec<_>>(),
        ["a", "b.c", "d[].e", "d[].f", "g", "h"]
    );
}

/// Statements of the manual that the code can check, each beside the
/// code that makes it true.
#[test]
fn the_manual_says_how_a_narrow_table_stores_its_optimizer_state() {
    use tessera_ps_server::rows::layout::{RowLayout, Storage};
    // The code: a narrow table's record holds its values and its
    // optimizer state in 16 bits each, whichever narrow format it uses
    // (dim 64, Adam's 128 words of state).
    let wide = RowLayout::new(64, 128, Storage::F32, false).words();
    for storage in [Storage::F16, Storage::Bf16] {
        let narrow = RowLayout::new(64, 128, storage, false).words();
        assert_eq!(wide - narrow, (64 + 128) / 2, "{storage:?}");
    }
    // (That the 16 bits are bf16's is the row store's own test,
    // `narrow_storage_rounds_values_and_keeps_the_state_in_bf16`.)
    // The manual: the configuration reference and the row store's page.
    let reference =
        std::fs::read_to_string(repo().join("docs/src/reference/configuration.md")).unwrap();
    let row = reference
        .lines()
        .find(|l| l.starts_with("| `tables[].storage`"))
        .expect("the reference has a row for tables[].storage");
    assert!(
        row.contains("optimizer state of a narrow table is stored as `bf16`"),
        "{row}"
    );
    for page in manual() {
        let text = std::fs::read_to_string(&page).unwrap();
        assert!(
            !text.contains("optimizer state stays `f32`"),
            "{} says the optimizer state of a narrow table stays f32",
            page.display()
        );
    }
}

/// `tessera status` exits 0 once every copy serves; `--in-step` once every
/// copy is in step. The upgrade procedure waits for the second.
#[test]
fn the_upgrade_procedure_waits_for_copies_in_step() {
    let upgrades = std::fs::read_to_string(repo().join("docs/src/operations/upgrades.md")).unwrap();
    assert!(
        upgrades.contains("Wait until `tessera status --in-step` exits 0"),
        "upgrades.md"
    );
    let roll = std::fs::read_to_string(repo().join("scripts/roll")).unwrap();
    assert!(roll.contains("status --in-step"), "scripts/roll");
    // What each way of asking counts is `status::problems`' unit test.
}
