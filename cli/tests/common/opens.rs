//! Counting the opens of the files in one directory with inotify(7) (Linux): an `IN_OPEN` watch on
//! the directory queues one event, with the entry's name, for every open(2) of a file in it by any
//! process — the `picchio` child a test runs included — at the time of the open, so after the child
//! has exited every open it made is in the queue. Nothing is timed, and no code path can forget to
//! report an open: the kernel reports it.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// An inotify instance watching one directory for `IN_OPEN`.
pub struct OpenWatch {
    fd: OwnedFd,
}

impl OpenWatch {
    /// Watches `dir` (opens from now on are counted).
    ///
    /// # Panics
    /// When inotify cannot be set up (no inotify in this kernel, the watch limit reached).
    pub fn new(dir: &Path) -> OpenWatch {
        // SAFETY: inotify_init1 takes flags only and returns a new descriptor or -1.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(raw >= 0, "inotify_init1: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a descriptor just returned to us and owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let path = CString::new(dir.as_os_str().as_bytes()).expect("a path without NUL");
        // SAFETY: `fd` is an inotify descriptor and `path` a NUL-terminated string that outlives the call.
        let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), libc::IN_OPEN) };
        assert!(wd >= 0, "inotify_add_watch {}: {}", dir.display(), std::io::Error::last_os_error());
        OpenWatch { fd }
    }

    /// The opens queued since [`OpenWatch::new`] or the last call, by entry name (an open of the
    /// directory itself, as read_dir makes, is counted under "").
    ///
    /// # Panics
    /// When the kernel's event queue overflowed (`IN_Q_OVERFLOW`: the count would be short).
    pub fn take(&mut self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "read inotify events: {e}");
                return counts;
            }
            let n = n as usize;
            let mut at = 0;
            // struct inotify_event { int wd; uint32_t mask; uint32_t cookie; uint32_t len; char name[len]; }
            while at + 16 <= n {
                let u32_at = |o: usize| u32::from_ne_bytes(buf[at + o..at + o + 4].try_into().unwrap());
                let (mask, len) = (u32_at(4), u32_at(12) as usize);
                assert_eq!(mask & libc::IN_Q_OVERFLOW, 0, "the inotify queue overflowed: opens were lost");
                let name = &buf[at + 16..at + 16 + len];
                let name = String::from_utf8_lossy(name.split(|&b| b == 0).next().unwrap_or_default()).into_owned();
                if mask & libc::IN_OPEN != 0 {
                    *counts.entry(name).or_insert(0) += 1;
                }
                at += 16 + len;
            }
        }
    }
}
