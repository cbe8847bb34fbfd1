//! Environment files: only cohabit's lines of a GPU client's file are rewritten, and put
//! back from a note of the original.

use super::*;

/// The variable that carries a client's share.
pub(super) const VAR: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// The variable that carries the pinned device-memory limit.
pub(super) const PINNED_VAR: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The variables cohabit writes in environment files; no other line is touched.
pub const MANAGED: [&str; 2] = [VAR, PINNED_VAR];

/// The variable a line of an environment file sets (`KEY=…` or `export KEY=…`), if any.
pub(super) fn key_of(line: &str) -> Option<&str> {
    let l = line.trim_start();
    let l = l.strip_prefix("export ").unwrap_or(l);
    let (key, _) = l.split_once('=')?;
    let key = key.trim();
    (!key.is_empty() && !key.starts_with('#')).then_some(key)
}

pub(super) fn share_in(text: &str) -> Option<u8> {
    text.lines()
        .filter(|l| key_of(l) == Some(VAR))
        .find_map(|l| l.split_once('=')?.1.trim().parse().ok())
}

/// `text` with the line of each variable of `set` replaced by the given line (`Some`) or
/// removed (`None`): the first line setting it is replaced in place, later ones dropped; a
/// missing one is appended. Every other line stays as it is.
pub(super) fn with_lines(text: &str, set: &[(&str, Option<String>)]) -> String {
    let mut done = vec![false; set.len()];
    let mut out = String::with_capacity(text.len() + 64);
    let mut put = |line: &str| {
        out.push_str(line);
        out.push('\n');
    };
    for line in text.lines() {
        match key_of(line).and_then(|k| set.iter().position(|(name, _)| *name == k)) {
            None => put(line),
            Some(i) => {
                if let (false, Some(new)) = (done[i], &set[i].1) {
                    put(new);
                }
                done[i] = true;
            }
        }
    }
    for (i, (_, line)) in set.iter().enumerate() {
        if let (false, Some(new)) = (done[i], line) {
            put(new);
        }
    }
    out
}

/// The environment file `current` with the share `pct` (and the pinned limit, when
/// given; an existing limit line is kept otherwise). Refuses a limit that would add lines.
pub(super) fn env_with_share(
    current: &str,
    pct: u8,
    pinned: Option<&str>,
) -> Result<String, GpuError> {
    let mut set = vec![(VAR, Some(format!("{VAR}={pct}")))];
    if let Some(limit) = pinned {
        if limit.contains(['\n', '\r', '\0']) {
            return Err(GpuError::PinnedLimit {
                limit: limit.to_string(),
            });
        }
        set.push((PINNED_VAR, Some(format!("{PINNED_VAR}={limit}"))));
    }
    Ok(with_lines(current, &set))
}

/// The environment file `current` with cohabit's variables as in `original` (the file
/// before cohabit's first write, whose lines come back verbatim; `None`: it did not exist).
/// `None` when the file should go: cohabit created it and nothing but its lines is in it.
pub(super) fn env_restored(current: &str, original: Option<&str>) -> Option<String> {
    let set: Vec<(&str, Option<String>)> = MANAGED
        .iter()
        .map(|name| {
            let line = original
                .and_then(|o| o.lines().find(|l| key_of(l) == Some(*name)))
                .map(str::to_string);
            (*name, line)
        })
        .collect();
    let text = with_lines(current, &set);
    if original.is_none() && text.trim().is_empty() {
        return None;
    }
    Some(text)
}

/// Puts a GPU client's environment file back from a note of its original (`None`: cohabit
/// created it): cohabit's variables get their old lines back, or go; other lines stay; a
/// file cohabit created and that holds nothing else is removed. For
/// [`HostChange::File`] notes, on exit and after a crash.
pub fn restore_file(path: &Path, original: Option<&str>) -> Result<(), FileError> {
    let Some((current, meta)) = files::read_regular(path)? else {
        return match original {
            // Gone meanwhile: put the original back whole.
            Some(text) => files::replace(path, text.as_bytes(), None),
            None => Ok(()),
        };
    };
    match env_restored(&current, original) {
        Some(text) if text == current => Ok(()),
        Some(text) => files::replace(path, text.as_bytes(), Some(&meta)),
        None => files::remove(path),
    }
}

/// Checks, at start, every GPU service's environment file: its directory must be owned by
/// root and writable by nobody else (created `0755` when missing, unless `dry_run`), and the
/// file, if there, must be a regular file and not a symlink. The error names the path.
pub fn check_env_files(services: &[ManagedService], dry_run: bool) -> Result<(), FileError> {
    for g in services.iter().filter_map(|s| s.gpu.as_ref()) {
        let dir = files::parent_dir(&g.env_file);
        if dry_run && !dir.exists() {
            continue;
        }
        files::ensure_private_dir(dir, 0o755)?;
        files::read_regular(&g.env_file)?;
    }
    Ok(())
}
