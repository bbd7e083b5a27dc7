//! Memory figures of this process and this machine: the peak resident set (`VmHWM`), the memory
//! the kernel says is available (`MemAvailable`) and the cgroup's limit (`memory.max`), all read
//! from procfs and cgroupfs text (Linux; `None` elsewhere or when a file is missing).

use std::path::Path;

/// The peak resident set size of this process in bytes: `VmHWM` of `/proc/self/status` (proc(5)),
/// the high-water mark of anonymous, file-backed and shared pages mapped at once — a mapped file's
/// pages count while they are mapped, which is why a model's safetensors pages are released after
/// copying. `None` off Linux.
pub fn peak_rss() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/self/status").ok()?, "VmHWM:")
}

/// The resident set size of this process now in bytes (`VmRSS` of `/proc/self/status`).
pub fn current_rss() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/self/status").ok()?, "VmRSS:")
}

/// The value of a `Key:   N kB` line of `/proc/*/status` or `/proc/meminfo`, in bytes.
fn status_kb(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// `MemAvailable` of `/proc/meminfo` in bytes: the kernel's estimate of memory available to start
/// new work without swapping (proc(5)).
pub fn mem_available() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemAvailable:")
}

/// The tightest memory limit of this process's cgroup and its ancestors, in bytes, with the file
/// that sets it: cgroup v2 `memory.max` (a number, or `max` for none) along the path that
/// `/proc/self/cgroup` gives for hierarchy `0::`, else cgroup v1 `memory.limit_in_bytes` of the
/// `memory` controller. `None` when no limit is set or nothing can be read.
pub fn cgroup_limit() -> Option<(u64, std::path::PathBuf)> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_in(Path::new("/sys/fs/cgroup"), &cgroup)
}

/// [`cgroup_limit`] with the cgroup file system mounted at `root` and `/proc/self/cgroup`'s text.
pub(crate) fn cgroup_limit_in(root: &Path, proc_cgroup: &str) -> Option<(u64, std::path::PathBuf)> {
    let read = |p: &Path| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    // v1 reports "no limit" as a huge page-rounded number (LONG_MAX rounded down to pages).
    let limit = |s: &str| s.parse::<u64>().ok().filter(|&v| v < (1u64 << 62));
    let mut best: Option<(u64, std::path::PathBuf)> = None;
    let mut consider = |v: u64, p: std::path::PathBuf| {
        if best.as_ref().is_none_or(|(b, _)| v < *b) {
            best = Some((v, p));
        }
    };
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let rel = path.trim_start_matches('/');
        let (dir, file) = if id == "0" && controllers.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        // The cgroup itself and every ancestor up to the root: the tightest one binds.
        let mut here = dir.join(rel);
        loop {
            let p = here.join(file);
            if let Some(v) = read(&p).as_deref().and_then(limit) {
                consider(v, p);
            }
            if here == dir || !here.pop() {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_are_read_in_bytes() {
        let text = "Name:\tpicchio\nVmPeak:\t  200 kB\nVmHWM:\t    1234 kB\nVmRSS:\t  1000 kB\n";
        assert_eq!(status_kb(text, "VmHWM:"), Some(1234 * 1024));
        assert_eq!(status_kb(text, "VmRSS:"), Some(1000 * 1024));
        assert_eq!(status_kb(text, "VmSwap:"), None);
        if cfg!(target_os = "linux") {
            let (peak, now) = (peak_rss().unwrap(), current_rss().unwrap());
            assert!(peak >= now && now > 0, "VmHWM {peak} < VmRSS {now}");
        }
    }

    #[test]
    fn the_tightest_cgroup_limit_of_the_path_binds() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("user.slice/job")).unwrap();
        std::fs::write(r.join("user.slice/memory.max"), "8589934592\n").unwrap();
        std::fs::write(r.join("user.slice/job/memory.max"), "max\n").unwrap();
        let (v, p) = cgroup_limit_in(r, "0::/user.slice/job\n").unwrap();
        assert_eq!((v, p), (8 << 30, r.join("user.slice/memory.max")));
        std::fs::write(r.join("user.slice/job/memory.max"), "1073741824\n").unwrap();
        assert_eq!(cgroup_limit_in(r, "0::/user.slice/job\n").unwrap().0, 1 << 30);
        std::fs::write(r.join("user.slice/job/memory.max"), "max\n").unwrap();
        std::fs::write(r.join("user.slice/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit_in(r, "0::/user.slice/job\n"), None);
        // cgroup v1: the memory controller's hierarchy; "unlimited" is a huge number.
        std::fs::create_dir_all(r.join("memory/docker/abc")).unwrap();
        std::fs::write(r.join("memory/docker/abc/memory.limit_in_bytes"), "536870912\n").unwrap();
        std::fs::write(r.join("memory/memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let text = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n";
        assert_eq!(cgroup_limit_in(r, text).unwrap().0, 512 << 20);
        assert_eq!(cgroup_limit_in(r, "4:memory:/\n"), None);
    }
}
