//! Read-only queries of a sysfs tree (`/sys`, or a fake one in tests), as the kernel's
//! `Documentation/ABI/stable/sysfs-block` describes it: `dev/block/MAJ:MIN` links to the device's
//! directory, which holds `dev`, `size`, `partition` (partitions only), `holders/` and `slaves/`;
//! a partition's directory sits inside its disk's.

use std::path::{Path, PathBuf};

use crate::mountinfo::DevNum;

/// A sysfs tree, rooted at `/sys` on a running system.
#[derive(Clone, Debug)]
pub struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    /// The tree at `root` (`/sys`, or a directory laid out like it).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    /// Its root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The device's directory (`ROOT/dev/block/MAJ:MIN` resolved), if sysfs knows it.
    pub fn dir(&self, d: DevNum) -> Option<PathBuf> {
        std::fs::canonicalize(self.root.join("dev/block").join(d.to_string())).ok()
    }

    /// The device number of a kernel block device name (`ROOT/class/block/NAME/dev`), e.g. the
    /// source `/dev/nvme0n1p1` of a mount.
    pub fn devnum_of_name(&self, name: &str) -> Option<DevNum> {
        Sysfs::devnum(&self.root.join("class/block").join(name))
    }

    /// The kernel name of a device directory (`sda1`, `dm-0`): its last component.
    pub fn name(dir: &Path) -> String {
        dir.file_name().unwrap_or_default().to_string_lossy().into_owned()
    }

    /// A sysfs attribute, trimmed; `None` when absent, unreadable or empty.
    pub fn read(path: &Path) -> Option<String> {
        std::fs::read_to_string(path).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
    }

    /// The device number in `dir/dev`.
    pub fn devnum(dir: &Path) -> Option<DevNum> {
        Sysfs::read(&dir.join("dev"))?.parse().ok()
    }

    /// The size in bytes: `dir/size` counts 512-byte sectors whatever the logical block size.
    pub fn size_bytes(dir: &Path) -> Option<u64> {
        Sysfs::read(&dir.join("size"))?.parse::<u64>().ok().map(|n| n * 512)
    }

    /// Whether `dir` is a partition (it has a `partition` attribute).
    pub fn is_partition(dir: &Path) -> bool {
        dir.join("partition").exists()
    }

    /// The whole disk of a partition (its parent directory); `None` for a whole disk.
    pub fn parent(dir: &Path) -> Option<PathBuf> {
        Sysfs::is_partition(dir).then(|| dir.parent().map(Path::to_path_buf)).flatten()
    }

    /// The partitions of a whole disk: its subdirectories holding a `partition` file, sorted.
    pub fn partitions(dir: &Path) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| Sysfs::is_partition(p)).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// The devices built on this one (`dir/holders`: device-mapper, LVM, LUKS, md, bcache), resolved
    /// to their directories, sorted.
    pub fn holders(dir: &Path) -> Vec<PathBuf> {
        Sysfs::links(dir, "holders")
    }

    /// The devices this one is built on (`dir/slaves`: a device-mapper or md device's members),
    /// resolved to their directories, sorted.
    pub fn slaves(dir: &Path) -> Vec<PathBuf> {
        Sysfs::links(dir, "slaves")
    }

    /// The devices linked from `dir/<which>`, resolved to their directories.
    fn links(dir: &Path, which: &str) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir.join(which))
            .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| std::fs::canonicalize(e.path()).ok()).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// A loop device's backing file, else the disk's vendor and model (a partition's from its disk).
    pub fn describe(dir: &Path) -> Option<String> {
        if let Some(f) = Sysfs::read(&dir.join("loop/backing_file")) {
            return Some(format!("loop device over {f}"));
        }
        let disk = Sysfs::parent(dir).unwrap_or_else(|| dir.to_path_buf());
        let part = |f: &str| Sysfs::read(&disk.join("device").join(f));
        match (part("vendor"), part("model")) {
            (Some(v), Some(m)) => Some(format!("{v} {m}")),
            (None, Some(m)) => Some(m),
            (Some(v), None) => Some(v),
            (None, None) => None,
        }
    }
}
