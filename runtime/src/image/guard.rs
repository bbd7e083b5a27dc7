//! What keeps writers of an image from hurting each other, its readers and the disk:
//!
//! - [`sweep_leftovers`]: the temporary names the writers use beside a target — `<name>.tmp-<pid>`
//!   (pack's and synth's image file, [`picchio_core::FileSink`]; `run --dump-logits`; the synthetic
//!   model directory of `demo`), `.<name>.picchio-convert-<pid>/` (convert's output being built) and
//!   `.<name>.picchio-old-<pid>/` (convert's replaced destination, moved aside) — left by a writer
//!   that was killed (`kill -9`, power loss) are found before the next writer of the same target
//!   starts and removed when their process is gone, with a line on stderr naming each and its size.
//!   A writer's free-space check runs after the sweep, so leftovers no longer count against it.
//! - Advisory locks (`flock(2)` on Linux, `LockFileEx` on Windows, through std's [`File::lock`]
//!   family): readers ([`crate::expert::open::open_engine`]: run, verify, bench) hold a shared lock
//!   on the image file or device node for as long as their queue lives ([`ReadLock`]); writers
//!   take [`WriteLock`]: an exclusive lock on a sibling lock file (file targets: two writers of one
//!   path cannot both proceed) or on the device node (`raw:`), and refuse while a reader holds the
//!   target, unless `--force`.
//!
//! Liveness of a pid is read from `/proc/<pid>` (Linux). Elsewhere no leftover is ever taken for
//! dead, so nothing is removed (the behaviour before the sweep existed).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Whether process `pid` is running: `/proc/<pid>` exists (Linux). Off Linux, always `true`.
pub fn pid_alive(pid: u32) -> bool {
    #[cfg(target_os = "linux")]
    {
        Path::new("/proc").join(pid.to_string()).exists()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        true
    }
}

/// Which writer's name a leftover has (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeftoverKind {
    /// `<name>.tmp-<pid>`: an image file, logits dump or synthetic model directory being written.
    Tmp,
    /// `.<name>.picchio-{convert,transcode,synthetic}-<pid>`: a model directory being built by
    /// `convert`, `transcode` or the synthetic-model writer (`synth --model-out`, `demo`).
    Convert,
    /// `.<name>.picchio-old-<pid>`: a replaced convert destination moved aside before the rename.
    Old,
}

/// One temporary file or directory a writer of a target left behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leftover {
    /// Its path.
    pub path: PathBuf,
    /// The pid in its name.
    pub pid: u32,
    /// Which scheme named it.
    pub kind: LeftoverKind,
}

/// The leftovers of writers of `target` in its directory, any pid (our own included), sorted by path.
///
/// # Errors
/// [`Error::Io`] when the directory cannot be listed.
pub fn find_leftovers(target: &Path) -> Result<Vec<Leftover>> {
    let Some(name) = target.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(Vec::new());
    };
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, "list the directory for leftovers of interrupted writers")(e)),
    };
    let schemes = [
        (format!("{name}.tmp-"), LeftoverKind::Tmp),
        (format!(".{name}.picchio-convert-"), LeftoverKind::Convert),
        (format!(".{name}.picchio-transcode-"), LeftoverKind::Convert),
        (format!(".{name}.picchio-synthetic-"), LeftoverKind::Convert),
        (format!(".{name}.picchio-old-"), LeftoverKind::Old),
    ];
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(Error::io(dir, "list the directory for leftovers of interrupted writers"))?;
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else { continue };
        for (prefix, kind) in &schemes {
            let pid = file_name
                .strip_prefix(prefix.as_str())
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|d| d.parse::<u32>().ok());
            if let Some(pid) = pid {
                found.push(Leftover { path: entry.path(), pid, kind: *kind });
            }
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(found)
}

/// Bytes under `path` (a file's length, a directory's files summed; symlinks not followed).
fn size_of(path: &Path) -> u64 {
    let Ok(md) = std::fs::symlink_metadata(path) else { return 0 };
    if !md.is_dir() {
        return md.len();
    }
    std::fs::read_dir(path).map(|es| es.flatten().map(|e| size_of(&e.path())).sum()).unwrap_or(0)
}

/// Removes the leftovers of writers of `target` whose process is gone ([`pid_alive`]), printing a
/// line on stderr for each (`command` names who does it: `pack`, `synth`, `convert`). A leftover of
/// a live process — another writer at work, or ours — is kept. A convert destination moved aside
/// ([`LeftoverKind::Old`]) whose replacement never arrived (`target` missing) is renamed back to
/// `target` instead of removed. Returns the bytes freed.
///
/// # Errors
/// [`Error::Io`] when the directory cannot be listed or a leftover cannot be removed.
pub fn sweep_leftovers(target: &Path, command: &str) -> Result<u64> {
    let me = std::process::id();
    let mut freed = 0;
    for l in find_leftovers(target)? {
        if l.pid == me || pid_alive(l.pid) {
            continue;
        }
        let bytes = size_of(&l.path);
        if l.kind == LeftoverKind::Old && std::fs::symlink_metadata(target).is_err() {
            std::fs::rename(&l.path, target).map_err(Error::io(&l.path, "restore the destination moved aside"))?;
            eprintln!(
                "picchio {command}: restored {} from {} (moved aside by process {}, which stopped before replacing it)",
                target.display(),
                l.path.display(),
                l.pid
            );
            continue;
        }
        let is_dir = std::fs::symlink_metadata(&l.path).map(|m| m.is_dir()).unwrap_or(false);
        let removed = if is_dir { std::fs::remove_dir_all(&l.path) } else { std::fs::remove_file(&l.path) };
        match removed {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(&l.path, "remove the leftover of an interrupted writer")(e)),
        }
        freed += bytes;
        eprintln!(
            "picchio {command}: removed {} ({bytes} bytes, {:.2} GB), left by process {} which is no longer running",
            l.path.display(),
            bytes as f64 / 1e9,
            l.pid
        );
    }
    Ok(freed)
}

/// The pids holding a `flock(2)` lock on the file `f` is open on, from `/proc/locks` (Linux; empty
/// elsewhere or when unreadable). Our own pid is left out.
fn lock_holders(f: &File) -> Vec<u32> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let Ok(md) = f.metadata() else { return Vec::new() };
        let dev = md.dev();
        let (major, minor) = (((dev >> 32) & !0xfff) | ((dev >> 8) & 0xfff), ((dev >> 12) & !0xff) | (dev & 0xff));
        let key = format!("{major:02x}:{minor:02x}:{}", md.ino());
        let me = std::process::id();
        let mut pids: Vec<u32> = std::fs::read_to_string("/proc/locks")
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().filter(|w| *w != "->").collect();
                // `N: FLOCK ADVISORY READ|WRITE PID MAJ:MIN:INODE START END`
                (fields.get(1) == Some(&"FLOCK") && fields.get(5) == Some(&key.as_str()))
                    .then(|| fields.get(4).and_then(|p| p.parse().ok()))
                    .flatten()
            })
            .filter(|&p| p != me)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = f;
        Vec::new()
    }
}

fn by_whom(pids: &[u32]) -> String {
    match pids {
        [] => String::new(),
        [p] => format!(" (pid {p})"),
        ps => format!(" (pids {})", ps.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// A shared lock on an image file or device node, held for as long as a reader reads it.
#[derive(Debug)]
pub struct ReadLock {
    _file: Option<File>,
}

impl ReadLock {
    /// Takes a shared lock on `path` (`name` is the store as messages name it). A file is locked
    /// waiting out a writer's brief probe; a device node an exclusive holder of which is writing it
    /// is refused at once. Anything but a regular file (or, for a device, a block device) is not
    /// opened here, so a FIFO never blocks: the engine's open names what it is (no lock is taken).
    ///
    /// # Errors
    /// [`Error::Io`] when `path` cannot be opened or locked; [`Error::BeingWritten`] naming the writer
    /// while a device is being written.
    pub fn acquire(path: &Path, name: &str, device: bool) -> Result<ReadLock> {
        let lockable = std::fs::metadata(path).map(|m| {
            #[cfg(unix)]
            let block = std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type());
            #[cfg(not(unix))]
            let block = false;
            if device {
                block
            } else {
                m.is_file()
            }
        });
        if !lockable.unwrap_or(false) {
            return Ok(ReadLock { _file: None });
        }
        let file = File::open(path).map_err(Error::io(path, "open to take a shared (reader's) lock"))?;
        match file.try_lock_shared() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) if device => {
                return Err(Error::BeingWritten { target: name.into(), holders: by_whom(&lock_holders(&file)) })
            }
            Err(TryLockError::WouldBlock) => {
                file.lock_shared().map_err(Error::io(path, "take a shared (reader's) lock"))?;
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(path, "take a shared (reader's) lock")(e)),
        }
        Ok(ReadLock { _file: Some(file) })
    }
}

/// A writer's exclusive claim on a target: refuses to start while another writer or (without
/// `force`) a reader holds it.
#[derive(Debug)]
pub struct WriteLock {
    file: File,
    /// The sibling lock file to remove on drop (file targets).
    remove: Option<PathBuf>,
}

/// `.<name>.picchio-lock` beside `target`: the file writers of `target` lock exclusively.
pub fn lock_path(target: &Path) -> PathBuf {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    target.with_file_name(format!(".{name}.picchio-lock"))
}

fn busy_reader(what: &Path, pids: &[u32]) -> Error {
    Error::BeingRead { target: what.display().to_string(), holders: by_whom(pids) }
}

impl WriteLock {
    /// For a file target: locks `.<name>.picchio-lock` beside `target` exclusively (refusing while
    /// another writer holds it), then checks that no reader holds `target` (if it exists) — unless
    /// `force`. The lock file is removed again on drop. A reader of the old image keeps its open file
    /// across the rename: it goes on reading the old bytes.
    ///
    /// # Errors
    /// [`Error::BeingWritten`] or [`Error::BeingRead`] naming the target and the other process; [`Error::Io`] when the lock file
    /// cannot be created or locked.
    pub fn file(target: &Path, force: bool) -> Result<WriteLock> {
        let lock = lock_path(target);
        let mut attempts = 0;
        let file = loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&lock)
                .map_err(Error::io(&lock, "create the writers' lock file"))?;
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(Error::BeingWritten {
                        target: target.display().to_string(),
                        holders: by_whom(&lock_holders(&file)),
                    })
                }
                Err(TryLockError::Error(e)) => return Err(Error::io(&lock, "lock the writers' lock file")(e)),
            }
            // The previous holder may have removed the file between our open and our lock: then
            // the lock is on a file nobody else will open; take the one at the path again.
            if same_file(&file, &lock) || attempts == 3 {
                break file;
            }
            attempts += 1;
        };
        let claim = WriteLock { file, remove: Some(lock) };
        if !force {
            if let Ok(t) = File::open(target) {
                if t.metadata().map(|m| m.is_file()).unwrap_or(false) {
                    match t.try_lock() {
                        Ok(()) => drop(t),
                        Err(TryLockError::WouldBlock) => return Err(busy_reader(target, &lock_holders(&t))),
                        Err(TryLockError::Error(e)) => {
                            return Err(Error::io(target, "check for readers (lock the image)")(e))
                        }
                    }
                }
            }
        }
        Ok(claim)
    }

    /// For a device target: locks the device node `device` exclusively for the write (readers that
    /// start meanwhile are refused); refuses while a reader holds it unless `force`, and then writes
    /// without the lock.
    ///
    /// # Errors
    /// [`Error::BeingRead`] naming the device and the readers; [`Error::Io`] when it cannot be opened.
    pub fn device(device: &Path, force: bool) -> Result<Option<WriteLock>> {
        let file = File::open(device).map_err(Error::io(device, "open to lock it for writing"))?;
        match file.try_lock() {
            Ok(()) => Ok(Some(WriteLock { file, remove: None })),
            Err(TryLockError::WouldBlock) if force => Ok(None),
            Err(TryLockError::WouldBlock) => Err(busy_reader(device, &lock_holders(&file))),
            Err(TryLockError::Error(e)) => Err(Error::io(device, "lock it for writing")(e)),
        }
    }
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        if let Some(p) = &self.remove {
            // Removed while still locked, so a writer that opened it meanwhile sees it is stale.
            let _ = std::fs::remove_file(p);
        }
        let _ = self.file.unlock();
    }
}

/// Whether the open `f` is the file at `path` now.
fn same_file(f: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (f.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        // An open file cannot be removed on Windows: the path is still ours.
        let _ = (f, path);
        true
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_every_scheme_are_found_and_only_dead_ones_removed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("experts.picchioflat");
        // A pid above the kernel's maximum (4194304) is never alive.
        let dead = 4_194_305u32 + 17;
        let live = std::process::id();
        let parent = std::os::unix::process::parent_id();
        std::fs::write(dir.path().join(format!("experts.picchioflat.tmp-{dead}")), vec![7u8; 1000]).unwrap();
        std::fs::write(dir.path().join(format!("experts.picchioflat.tmp-{parent}")), b"live").unwrap();
        std::fs::write(dir.path().join(format!("experts.picchioflat.tmp-{live}")), b"ours").unwrap();
        let conv = dir.path().join(format!(".experts.picchioflat.picchio-convert-{dead}"));
        std::fs::create_dir(&conv).unwrap();
        std::fs::write(conv.join("a"), vec![0u8; 24]).unwrap();
        // Not ours: another target's, no digits, a suffix after the pid.
        std::fs::write(dir.path().join(format!("other.tmp-{dead}")), b"x").unwrap();
        std::fs::write(dir.path().join("experts.picchioflat.tmp-"), b"x").unwrap();
        std::fs::write(dir.path().join(format!("experts.picchioflat.tmp-{dead}x")), b"x").unwrap();
        let found = find_leftovers(&target).unwrap();
        assert_eq!(found.len(), 4, "{found:?}");
        assert_eq!(sweep_leftovers(&target, "pack").unwrap(), 1024);
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut want = vec![
            format!("experts.picchioflat.tmp-{parent}"),
            format!("experts.picchioflat.tmp-{live}"),
            format!("other.tmp-{dead}"),
            "experts.picchioflat.tmp-".into(),
            format!("experts.picchioflat.tmp-{dead}x"),
        ];
        want.sort();
        assert_eq!(left, want);
    }

    #[test]
    fn a_destination_moved_aside_is_restored_when_its_replacement_never_came() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("model");
        let old = dir.path().join(format!(".model.picchio-old-{}", 4_194_305u32 + 3));
        std::fs::create_dir(&old).unwrap();
        std::fs::write(old.join("config.json"), b"{}").unwrap();
        assert_eq!(sweep_leftovers(&target, "convert").unwrap(), 0);
        assert_eq!(std::fs::read(target.join("config.json")).unwrap(), b"{}");
        assert!(!old.exists());
    }

    #[test]
    fn a_reader_makes_a_writer_refuse_unless_forced_and_two_writers_exclude_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("e.picchioflat");
        std::fs::write(&target, b"PCHIOFL1").unwrap();
        let reader = ReadLock::acquire(&target, "file:e", false).unwrap();
        let e = WriteLock::file(&target, false).unwrap_err().to_string();
        assert!(e.contains("is being read by another picchio process"), "{e}");
        assert!(!lock_path(&target).exists(), "a refused writer removes its lock file");
        let w = WriteLock::file(&target, true).unwrap();
        let e = WriteLock::file(&target, true).unwrap_err().to_string();
        assert!(e.contains("is being written by another picchio process"), "{e}");
        drop(w);
        assert!(!lock_path(&target).exists());
        drop(reader);
        drop(WriteLock::file(&target, false).unwrap());
    }
}
