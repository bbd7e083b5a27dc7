//! Windows: the host queries of [`crate::host`] and [`crate::pagecache`] are not made here (no
//! `statvfs`, `getrusage`, `uname`); each answers "unknown".

use std::io;
use std::path::Path;

/// No `statvfs`: unknown.
pub(crate) fn available_bytes(_: &Path) -> io::Result<Option<u64>> {
    Ok(None)
}

/// No `getrusage`: unknown.
pub(crate) fn cpu_times() -> Option<(f64, f64)> {
    None
}

/// No `uname`.
pub(crate) fn uname() -> Option<[String; 4]> {
    None
}

/// `available_parallelism` answers for the caller.
pub(crate) fn online_cpus() -> Option<usize> {
    None
}
