//! The checkpoint directory: numbered `ckpt-<n>` directories, `LATEST`
//! naming the newest complete one, leftovers of interrupted saves, and
//! pruning to the newest `keep`.

use std::fs;
use std::path::Path;

use super::{CheckpointError, io};

pub(super) const LATEST: &str = "LATEST";

/// The checkpoints (complete or not) in `dir`: (number, name), by number.
/// A name that is `ckpt-` and digits counts; anything else is not ours.
pub(super) fn checkpoints(dir: &Path) -> Result<Vec<(u64, String)>, CheckpointError> {
    let mut found: Vec<(u64, String)> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let number = name
                .strip_prefix("ckpt-")
                .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))?
                .parse()
                .ok()?;
            Some((number, name))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Removes the temporary directories of interrupted saves (saves run one
/// at a time, so any that exists when one starts is stale).
pub(super) fn remove_temporaries(dir: &Path) -> Result<(), CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io(dir))?.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp-ckpt-")
        {
            let path = entry.path();
            tracing::info!(path = %path.display(), "removing an interrupted checkpoint");
            fs::remove_dir_all(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Removes all but the newest `keep` checkpoints (by number), never the
/// one `LATEST` names.
pub(super) fn prune(dir: &Path, keep: usize) -> Result<(), CheckpointError> {
    let latest = fs::read_to_string(dir.join(LATEST))
        .map(|name| name.trim().to_owned())
        .unwrap_or_default();
    let found = checkpoints(dir)?;
    let stale = found.len().saturating_sub(keep);
    for (_, name) in &found[..stale] {
        if *name == latest {
            continue;
        }
        let path = dir.join(name);
        fs::remove_dir_all(&path).map_err(io(&path))?;
    }
    Ok(())
}
