//! The machine around a store: free space of a file system, this process's CPU time, the kernel
//! and the online CPUs. Safe wrappers of the calls in `sys/host_unix.rs` (`statvfs`, `getrusage`,
//! `uname`, `sysconf`); off unix each answers "unknown".

use std::io;
use std::path::Path;

/// Bytes available to an unprivileged writer on the file system holding `dir` (`statvfs(3)`:
/// `f_bavail × f_frsize`), or `None` where there is no `statvfs` (Windows).
///
/// # Errors
/// The `statvfs` error (e.g. `dir` does not exist), or `InvalidInput` for a path with a NUL byte.
pub fn free_bytes(dir: &Path) -> io::Result<Option<u64>> {
    crate::sys::host::available_bytes(dir)
}

/// User and system CPU seconds of this process so far (`getrusage(RUSAGE_SELF)`: every thread,
/// the engines' workers included), or `None` where unavailable.
pub fn cpu_seconds() -> Option<(f64, f64)> {
    crate::sys::host::cpu_times()
}

/// `uname(2)`'s fields.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Uname {
    /// `sysname`, e.g. `Linux`.
    pub sysname: String,
    /// `release`, e.g. `6.1.0-27-amd64`.
    pub release: String,
    /// `version` (build string).
    pub version: String,
    /// `machine`, e.g. `x86_64`.
    pub machine: String,
}

/// `uname(2)`, or `None` where unavailable.
pub fn uname() -> Option<Uname> {
    let [sysname, release, version, machine] = crate::sys::host::uname()?;
    Some(Uname { sysname, release, version, machine })
}

/// Online logical CPUs (`sysconf(_SC_NPROCESSORS_ONLN)`), or `None` where unavailable.
pub fn online_cpus() -> Option<usize> {
    crate::sys::host::online_cpus()
}

#[cfg(test)]
mod tests {
    #[test]
    fn answers_for_this_machine() {
        let dir = tempfile::tempdir().unwrap();
        let free = super::free_bytes(dir.path()).unwrap();
        assert_eq!(free.is_some(), cfg!(unix));
        assert!(super::free_bytes(&dir.path().join("missing")).is_err() || cfg!(not(unix)));
        if cfg!(unix) {
            assert!(super::cpu_seconds().is_some_and(|(u, s)| u >= 0.0 && s >= 0.0));
            assert!(super::uname().is_some_and(|u| !u.sysname.is_empty()));
            assert!(super::online_cpus().is_some_and(|n| n >= 1));
        }
    }
}
