//! Where a bench run writes (`--json`, `--trace`, `--plot`), checked before anything is measured: an
//! existing path is replaced only when it holds an earlier output of the same kind, never the store
//! being measured, a directory, a device node or any other file.

use std::path::Path;

use crate::error::{Error, Result};

pub use picchio_runtime::output::{check_parent, check_replaceable};

/// Whether the file at `path` begins as every `picchio bench` report does: `{` then the
/// `"schema": "picchio-bench/…"` member that [`super::Report::to_json`] writes first. Only the first
/// bytes are read.
pub fn is_bench_report(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 64];
    let Ok(mut f) = std::fs::File::open(path) else { return false };
    let n = f.read(&mut head).unwrap_or(0);
    let text = String::from_utf8_lossy(&head[..n]);
    let rest = text.trim_start();
    let Some(rest) = rest.strip_prefix('{') else { return false };
    let Some(rest) = rest.trim_start().strip_prefix("\"schema\"") else { return false };
    let Some(rest) = rest.trim_start().strip_prefix(':') else { return false };
    rest.trim_start().starts_with("\"picchio-bench/")
}

/// Checks a `--json PATH` before the run: [`check_replaceable`] with [`is_bench_report`], and `path`
/// is not the store being measured (`store`: its file or device node; compared by device and inode,
/// so another name or a hard link of the store is refused too).
///
/// # Errors
/// As [`check_replaceable`]; [`Error::ReportIsStore`] when `path` is the store.
pub fn check_report_path(path: &Path, store: Option<&Path>) -> Result<()> {
    if let Some(store) = store {
        if same_file(path, store) {
            return Err(Error::ReportIsStore { path: path.into(), store: store.into() });
        }
    }
    Ok(check_replaceable(path, "--json", "a picchio-bench report", is_bench_report)?)
}

/// Whether `a` and `b` name the same existing file (same device and inode; elsewhere, the same
/// canonical path).
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        match (a.canonicalize(), b.canonicalize()) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        }
    }
}

/// Checks a `--plot DIR` before the run: an existing directory, or a path whose parent directory
/// exists (only the last component is created, by [`create_plot_dir`]).
///
/// # Errors
/// [`Error::PlotDirNotDir`], [`Error::ParentNotDir`] or [`Error::ParentMissing`] when `dir` exists and is not a directory, or its parent does not exist.
pub fn check_plot_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::PlotDirNotDir { dir: dir.into() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(check_parent(dir, "--plot")?),
        Err(e) => Err(Error::io(dir, "stat the --plot directory")(e)),
    }
}

/// Creates the `--plot` directory if it is missing (its parent must exist: see [`check_plot_dir`]).
///
/// # Errors
/// As [`check_plot_dir`]; [`Error::Io`] creating it.
pub fn create_plot_dir(dir: &Path) -> Result<()> {
    check_plot_dir(dir)?;
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(Error::io(dir, "create the --plot directory")(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_earlier_reports_are_replaceable() {
        let d = tempfile::tempdir().unwrap();
        let report = d.path().join("r.json");
        std::fs::write(&report, "{\n  \"schema\": \"picchio-bench/1\",\n  \"experiment\": \"env\"\n}\n").unwrap();
        assert!(is_bench_report(&report));
        check_report_path(&report, None).unwrap();
        let text = d.path().join("notes.txt");
        std::fs::write(&text, "keep me").unwrap();
        let e = check_report_path(&text, None).unwrap_err().to_string();
        assert!(e.contains("not a picchio-bench report") && e.contains("notes.txt"), "{e}");
        let e = check_report_path(d.path(), None).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = check_report_path(&d.path().join("no/such/r.json"), None).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        check_report_path(&d.path().join("new.json"), None).unwrap();
        // The store itself, under another name: refused by inode, even were it a report.
        let link = d.path().join("link.json");
        std::fs::hard_link(&report, &link).unwrap();
        let e = check_report_path(&link, Some(&report)).unwrap_err().to_string();
        assert!(e.contains("is the store"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn device_nodes_are_never_replaceable() {
        let e = check_report_path(Path::new("/dev/null"), None).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn plot_dir_creates_only_the_last_component() {
        let d = tempfile::tempdir().unwrap();
        let e = create_plot_dir(&d.path().join("a/b")).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        assert!(!d.path().join("a").exists());
        create_plot_dir(&d.path().join("a")).unwrap();
        assert!(d.path().join("a").is_dir());
        let f = d.path().join("f");
        std::fs::write(&f, "x").unwrap();
        assert!(check_plot_dir(&f).unwrap_err().to_string().contains("not a directory"));
    }
}
