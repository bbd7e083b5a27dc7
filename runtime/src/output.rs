//! Where a command writes a file of its own (`run --trace`, `bench --json`), checked before any
//! work: an existing path is replaced only when it holds an earlier output of the same kind, never a
//! directory, a device node or any other file, and its directory must exist.

use std::path::Path;

use crate::error::{Error, Result};

/// Checks that `path` may be created or replaced by the output of `flag` (e.g. `--json`): it does
/// not exist and its parent directory does, or it is a regular file for which `is_earlier(path)`
/// says it holds an earlier output (`expected` names that kind in the refusal). Only metadata and
/// what `is_earlier` reads are touched; nothing is created.
///
/// # Errors
/// [`Error::Invalid`] naming the path and what it is instead (a directory, a device or other
/// non-regular file, a file of another kind, a missing parent directory); [`Error::Io`] when its
/// metadata cannot be read.
pub fn check_replaceable(path: &Path, flag: &str, expected: &str, is_earlier: impl Fn(&Path) -> bool) -> Result<()> {
    let refuse = |what: String| {
        Err(Error::Invalid(format!(
            "{}: {what}; {flag} will not replace it: remove it or choose another path",
            path.display()
        )))
    };
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => check_parent(path, flag),
        Err(e) => Err(Error::io(path, "stat the output path")(e)),
        Ok(m) if m.is_dir() => refuse(format!("is a directory ({flag} takes a file path)")),
        Ok(m) if !m.is_file() => refuse("is not a regular file (a device, FIFO or socket)".into()),
        // stat before open (in `is_earlier`): opening a FIFO would block.
        Ok(_) if is_earlier(path) => Ok(()),
        Ok(_) => refuse(format!("exists and is not {expected}")),
    }
}

/// Checks that the directory `path` would be created in exists (so an output is never left to fail
/// after a run, and a mistyped path does not grow a chain of directories); `flag` names the option
/// that gave `path`.
///
/// # Errors
/// [`Error::Invalid`] when the parent is missing or not a directory.
pub fn check_parent(path: &Path, flag: &str) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::Invalid(format!("{flag} {}: {} is not a directory", path.display(), parent.display()))),
        Err(e) => Err(Error::Invalid(format!(
            "{flag} {}: the directory {} does not exist ({e}); create it first",
            path.display(),
            parent.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_new_path_or_an_earlier_output_is_replaceable() {
        let d = tempfile::tempdir().unwrap();
        let earlier = |p: &Path| std::fs::read_to_string(p).is_ok_and(|t| t.starts_with("EARLIER"));
        let check = |p: &Path| check_replaceable(p, "--out", "an earlier output", earlier);
        check(&d.path().join("new")).unwrap();
        let old = d.path().join("old");
        std::fs::write(&old, "EARLIER 1").unwrap();
        check(&old).unwrap();
        let other = d.path().join("other");
        std::fs::write(&other, "keep me").unwrap();
        let e = check(&other).unwrap_err().to_string();
        assert!(e.contains("exists and is not an earlier output; --out will not replace it"), "{e}");
        let e = check(d.path()).unwrap_err().to_string();
        assert!(e.contains("is a directory (--out takes a file path)"), "{e}");
        let e = check(&d.path().join("no/such/file")).unwrap_err().to_string();
        assert!(e.contains("does not exist") && e.contains("create it first"), "{e}");
    }
}
