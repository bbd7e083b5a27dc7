//! The host's view of its block devices: is this device mounted, swapped to, held (device-mapper,
//! md, ...), or behind `/`? One answer for every user — the inspection before writing `raw:`
//! ([`crate::raw`]), `picchio nvme list|bind` (a controller's namespaces mounted or backing `/`) and
//! `picchio bench`'s environment record (the mount and device under a store).
//!
//! A [`Host`] is built from the running system ([`Host::current`]: `/proc/self/mountinfo`,
//! `/proc/swaps`, `stat("/")`, `/sys`) or from given texts and a sysfs root ([`Host::from_texts`]),
//! which is how tests describe a machine. Sources: proc(5) (`/proc/pid/mountinfo`, `/proc/swaps`)
//! and the kernel's `Documentation/ABI/stable/sysfs-block` (see [`Sysfs`]).
//!
//! Everything here reads files; only [`Host::current`] and the `stat` helpers are Linux-only (they
//! return nothing elsewhere).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::mountinfo::unescape;
pub use crate::mountinfo::{DevNum, MountEntry};

mod machine;
mod sysfs;

pub use machine::{cpu_seconds, free_bytes, online_cpus, uname, Uname};
pub use sysfs::Sysfs;

/// One mount of the mount table, with the block devices it uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// The `MAJ:MIN` field, and the source's device when it is a block device node (btrfs and some
    /// others report an anonymous `0:N` in the first).
    pub devices: Vec<DevNum>,
    /// The mount table line.
    pub entry: MountEntry,
}

/// How a block device (or a partition of it) is in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Use {
    /// It is mounted.
    Mounted {
        /// The kernel name of the mounted device (the device asked about or one of its partitions).
        device: String,
        /// Where.
        mount_point: PathBuf,
        /// The file-system type.
        fs_type: String,
    },
    /// It is an active swap area (`/proc/swaps`).
    Swap {
        /// The kernel name of the swap device.
        device: String,
    },
    /// Something is built on it (`/sys/class/block/X/holders`: device-mapper, LVM, LUKS, md RAID,
    /// bcache).
    Held {
        /// The held device.
        device: String,
        /// The holder (e.g. `dm-0`, `md127`).
        holder: String,
    },
}

impl std::fmt::Display for Use {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Use::Mounted { device, mount_point, fs_type } => {
                write!(f, "{device} is mounted at {} ({fs_type})", mount_point.display())
            }
            Use::Swap { device } => write!(f, "{device} is an active swap area"),
            Use::Held { device, holder } => {
                write!(f, "{device} is held by {holder} (device-mapper, LVM, LUKS or md is built on it)")
            }
        }
    }
}

/// The kernel's view of block devices: sysfs, the mount table, the active swap areas and the
/// device(s) of `/`.
#[derive(Clone, Debug)]
pub struct Host {
    sysfs: Sysfs,
    mounts: Vec<Mount>,
    swaps: Vec<DevNum>,
    root: Vec<DevNum>,
}

impl Host {
    /// Reads the running system: `/proc/self/mountinfo`, `/proc/swaps` (absent means none), the
    /// device of `/` (`stat`, plus the devices of the visible `/` mount) and `/sys`. Mount and swap
    /// sources are resolved to devices with `stat`.
    ///
    /// # Errors
    /// [`crate::Error::Inspect`] when the mount table or `/` cannot be read.
    #[cfg(target_os = "linux")]
    pub fn current() -> Result<Host> {
        use crate::error::Error;
        let read =
            |p: &str, what| std::fs::read_to_string(p).map_err(|cause| Error::Inspect { path: p.into(), what, cause });
        let resolve = |p: &Path| block_device_number(p);
        let mounts = parse_mountinfo(&read("/proc/self/mountinfo", "read the mount table")?, &resolve);
        let swaps = std::fs::read_to_string("/proc/swaps").map(|s| parse_swaps(&s, &resolve)).unwrap_or_default();
        let root = crate::sys::rawdev::device_of(Path::new("/")).map_err(|cause| Error::Inspect {
            path: "/".into(),
            what: "stat the root directory",
            cause,
        })?;
        Ok(Host::new(Sysfs::new("/sys"), mounts, swaps, &[root]))
    }

    /// The running system, off Linux: nothing is known to be mounted, swapped to or behind `/`.
    ///
    /// # Errors
    /// None; the signature matches the Linux one.
    #[cfg(not(target_os = "linux"))]
    pub fn current() -> Result<Host> {
        Ok(Host::new(Sysfs::new("/sys"), Vec::new(), Vec::new(), &[]))
    }

    /// A host described by texts: `mountinfo` (the text of `/proc/self/mountinfo`), `swaps` (of
    /// `/proc/swaps`, `""` for none) and the sysfs tree at `sysfs_root`. A mount or swap source
    /// `/dev/.../NAME` is resolved through `SYSFS/class/block/NAME/dev`; `/` is on the devices of
    /// the visible `/` mount.
    pub fn from_texts(sysfs_root: impl Into<PathBuf>, mountinfo: &str, swaps: &str) -> Host {
        let sysfs = Sysfs::new(sysfs_root);
        let resolve = |p: &Path| {
            let name = p.to_str()?.strip_prefix("/dev/")?;
            sysfs.devnum_of_name(name.rsplit('/').next().unwrap_or(name))
        };
        let mounts = parse_mountinfo(mountinfo, &resolve);
        let swaps = parse_swaps(swaps, &resolve);
        Host::new(sysfs, mounts, swaps, &[])
    }

    /// A host from parts: `root` are devices known to hold `/` besides the devices of the visible
    /// `/` mount in `mounts` (which are added).
    pub fn new(sysfs: Sysfs, mounts: Vec<Mount>, swaps: Vec<DevNum>, root: &[DevNum]) -> Host {
        let mut root = root.to_vec();
        // The last mount on `/` is the visible one; its source names the device when st_dev does not.
        if let Some(m) = mounts.iter().rev().find(|m| m.entry.mount_point == Path::new("/")) {
            root.extend(m.devices.iter().copied());
        }
        root.sort();
        root.dedup();
        Host { sysfs, mounts, swaps, root }
    }

    /// The sysfs tree.
    pub fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    /// The mount table, in order (later mounts hide earlier ones on the same mount point).
    pub fn mounts(&self) -> &[Mount] {
        &self.mounts
    }

    /// The mounts that use `dev`.
    pub fn mounts_of(&self, dev: DevNum) -> impl Iterator<Item = &Mount> {
        self.mounts.iter().filter(move |m| m.devices.contains(&dev))
    }

    /// Whether `dev` is an active swap area.
    pub fn is_swap(&self, dev: DevNum) -> bool {
        self.swaps.contains(&dev)
    }

    /// The device(s) `/` is on, sorted: its `st_dev` (for [`Host::current`]) and the devices of
    /// the visible `/` mount.
    pub fn root_devices(&self) -> &[DevNum] {
        &self.root
    }

    /// The partitions of `dev` as `(kernel name, device number)`, sorted by name (none for a
    /// partition or a device sysfs does not know).
    pub fn partitions(&self, dev: DevNum) -> Vec<(String, DevNum)> {
        let Some(dir) = self.sysfs.dir(dev) else { return Vec::new() };
        Sysfs::partitions(&dir).iter().filter_map(|p| Some((Sysfs::name(p), Sysfs::devnum(p)?))).collect()
    }

    /// The kernel names of the devices built on `dev` (device-mapper, md, ...), sorted.
    pub fn holders(&self, dev: DevNum) -> Vec<String> {
        self.sysfs.dir(dev).map(|d| Sysfs::holders(&d).iter().map(|h| Sysfs::name(h)).collect()).unwrap_or_default()
    }

    /// How `dev` (named `name`) and each partition of it are used: for each, in that order, its
    /// mounts, whether it is swap, and its holders.
    pub fn uses(&self, dev: DevNum, name: &str) -> Vec<Use> {
        let mut family = vec![(name.to_string(), dev)];
        family.extend(self.partitions(dev));
        let mut out = Vec::new();
        for (device, num) in family {
            for m in self.mounts_of(num) {
                out.push(Use::Mounted {
                    device: device.clone(),
                    mount_point: m.entry.mount_point.clone(),
                    fs_type: m.entry.fs_type.clone(),
                });
            }
            if self.is_swap(num) {
                out.push(Use::Swap { device: device.clone() });
            }
            for holder in self.holders(num) {
                out.push(Use::Held { device: device.clone(), holder });
            }
        }
        out
    }

    /// Every device whose overwriting destroys the root file system, with how it backs `/`: the
    /// device(s) of `/`, the whole disk of a partition in the set, and the slaves (device-mapper, md
    /// members) of a device in the set, transitively. A spare partition of the root disk is not in it.
    pub fn root_backing(&self) -> BTreeMap<DevNum, String> {
        let mut out = BTreeMap::new();
        let mut todo: Vec<(DevNum, String)> = self.root.iter().map(|&d| (d, "/ is on".to_string())).collect();
        while let Some((num, prefix)) = todo.pop() {
            if out.contains_key(&num) {
                continue;
            }
            let dir = self.sysfs.dir(num);
            let name = dir.as_deref().map(Sysfs::name).unwrap_or_else(|| num.to_string());
            let chain = format!("{prefix} {name}");
            if let Some(dir) = dir {
                if let Some(parent) = Sysfs::parent(&dir).and_then(|p| Sysfs::devnum(&p)) {
                    todo.push((parent, format!("{chain}, a partition of")));
                }
                for slave in Sysfs::slaves(&dir) {
                    if let Some(n) = Sysfs::devnum(&slave) {
                        todo.push((n, format!("{chain}, built on")));
                    }
                }
            }
            out.insert(num, chain);
        }
        out
    }

    /// The mount holding `path` (see [`mount_holding`]).
    pub fn mount_holding(&self, path: &Path, dev: Option<DevNum>) -> Option<&MountEntry> {
        let entries: Vec<&MountEntry> = self.mounts.iter().map(|m| &m.entry).collect();
        mount_holding(&entries, dev, path)
    }
}

/// The mount holding `path` among `entries` (in mount-table order): among entries whose mount
/// point is a prefix of `path`, those of device `dev` when any match (bind mounts and stacked
/// mounts share prefixes), then the longest mount point; the last such entry wins (later mounts
/// hide earlier ones).
pub fn mount_holding<'a>(entries: &[&'a MountEntry], dev: Option<DevNum>, path: &Path) -> Option<&'a MountEntry> {
    let under: Vec<&MountEntry> = entries.iter().copied().filter(|e| path.starts_with(&e.mount_point)).collect();
    let by_dev: Vec<&MountEntry> = under.iter().copied().filter(|e| dev.is_some() && e.devnum == dev).collect();
    let pool = if by_dev.is_empty() { under } else { by_dev };
    let longest = pool.iter().map(|e| e.mount_point.as_os_str().len()).max()?;
    pool.into_iter().rfind(|e| e.mount_point.as_os_str().len() == longest)
}

/// The device holding `path` (its `st_dev`); `None` when it cannot be stat'ed, or off Linux.
pub fn device_of(path: &Path) -> Option<DevNum> {
    #[cfg(target_os = "linux")]
    return crate::sys::rawdev::device_of(path).ok();
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// The device number of the block device node at `path` (its `st_rdev`, symlinks followed);
/// `None` when it is not a block device, cannot be stat'ed, or off Linux.
pub fn block_device_number(path: &Path) -> Option<DevNum> {
    #[cfg(target_os = "linux")]
    return crate::sys::rawdev::stat_block_device(path).ok().and_then(std::result::Result::ok);
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// The mount table ([`crate::mountinfo::parse`]) with the devices each mount uses: its `MAJ:MIN`
/// and, when the source is a path, the block device `resolve` maps it to.
fn parse_mountinfo(text: &str, resolve: &dyn Fn(&Path) -> Option<DevNum>) -> Vec<Mount> {
    crate::mountinfo::parse(text)
        .into_iter()
        .map(|entry| {
            let mut devices: Vec<DevNum> = entry.devnum.into_iter().collect();
            if entry.source.starts_with('/') {
                if let Some(d) = resolve(Path::new(&entry.source)).filter(|d| !devices.contains(d)) {
                    devices.push(d);
                }
            }
            Mount { devices, entry }
        })
        .collect()
}

/// Parses `/proc/swaps` (a header line, then `FILENAME TYPE SIZE USED PRIORITY`) into the block
/// devices used as swap (swap files are skipped: they live on a file system, found as a mount).
fn parse_swaps(text: &str, resolve: &dyn Fn(&Path) -> Option<DevNum>) -> Vec<DevNum> {
    text.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| resolve(Path::new(&unescape(name))))
        .collect()
}

#[cfg(all(test, unix))]
mod tests;
