//! The mount table, `/proc/self/mountinfo` (proc(5), "/proc/pid/mountinfo"), parsed once for every
//! user: the raw-device inspection before `pack --out raw:` (mounted devices and partitions), `picchio
//! nvme bind` (mounted namespaces) and `picchio bench`'s environment record (the file system and
//! mount options under a store).
//!
//! Pure text parsing, so it builds on every platform and is tested on literal tables.

use std::fmt;
use std::path::PathBuf;

/// A block device number, `major:minor` (as in `/proc/self/mountinfo` and `/sys/dev/block`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevNum {
    /// Major number (the driver: 7 is loop, 8 is sd, 259 is blkext/NVMe).
    pub major: u32,
    /// Minor number (the device of that driver).
    pub minor: u32,
}

impl fmt::Display for DevNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

impl std::str::FromStr for DevNum {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (a, b) = s.trim().split_once(':').ok_or_else(|| format!("{s:?} is not major:minor"))?;
        let n = |x: &str| x.parse::<u32>().map_err(|_| format!("{s:?} is not major:minor"));
        Ok(DevNum { major: n(a)?, minor: n(b)? })
    }
}

/// One line of the mount table:
/// `ID PARENT MAJ:MIN ROOT MOUNT_POINT MOUNT_OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`.
/// Paths and the source have their `\ooo` octal escapes undone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// The `MAJ:MIN` field: the device of the file system's `st_dev` (btrfs and other multi-device
    /// file systems report an anonymous `0:N` here; see [`MountEntry::source`]).
    pub devnum: Option<DevNum>,
    /// The directory of the file system that forms the root of this mount (`/` unless a bind mount).
    pub root: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw,relatime`).
    pub mount_options: String,
    /// File system type (`ext4`, `xfs`, `tmpfs`, `fuse.sshfs`).
    pub fs_type: String,
    /// Mount source (`/dev/vda1`, `tmpfs`, `server:/export`).
    pub source: String,
    /// Per-super-block options (`rw,discard`).
    pub super_options: String,
}

/// Parses a mount table. Lines that do not have the documented shape are skipped (the kernel never
/// writes them; a truncated read could), so the result holds every well-formed line in order — later
/// lines are later mounts, which hide earlier ones on the same mount point.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let f: Vec<&str> = line.split(' ').collect();
    // The optional fields end at a lone "-"; at least 6 fields precede it, 3 follow.
    let sep = f.iter().position(|&x| x == "-")?;
    if sep < 6 || f.len() < sep + 3 {
        return None;
    }
    Some(MountEntry {
        devnum: f[2].parse().ok(),
        root: unescape(f[3]),
        mount_point: unescape(f[4]).into(),
        mount_options: f[5].to_string(),
        fs_type: unescape(f[sep + 1]),
        source: unescape(f[sep + 2]),
        super_options: f[sep + 3..].join(" "),
    })
}

/// Undoes the `\ooo` octal escapes of `/proc` tables (the kernel escapes space, tab, newline and
/// backslash in paths); anything else, including a backslash not followed by three octal digits, is
/// kept as is.
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b.get(i + 1..i + 4).filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], oct) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 8:17 / /mnt/my\\040disk rw,noatime shared:5 master:2 - xfs /dev/sdb1 rw,attr2
41 27 0:50 /sub /mnt/my\\040disk/tmp rw - tmpfs tmpfs rw,size=4k
42 27 0:51 / /srv rw - btrfs /dev/nvme0n1p2 rw,ssd,space_cache=v2,subvolid=5,subvol=/
broken line without separator
43 27 0:52 / /x rw - onlytype
";

    #[test]
    fn parses_fields_escapes_optional_fields_and_skips_malformed_lines() {
        let m = parse(TABLE);
        assert_eq!(m.len(), 5, "{m:#?}");
        assert_eq!(m[1].devnum, Some(DevNum { major: 254, minor: 0 }));
        assert_eq!(m[1].mount_point, PathBuf::from("/"));
        assert_eq!((m[1].fs_type.as_str(), m[1].source.as_str()), ("ext4", "/dev/vda"));
        assert_eq!(m[1].super_options, "rw,discard");
        assert_eq!(m[2].mount_point, PathBuf::from("/mnt/my disk"), "\\040 is a space");
        assert_eq!(m[2].mount_options, "rw,noatime");
        assert_eq!((m[2].fs_type.as_str(), m[2].source.as_str()), ("xfs", "/dev/sdb1"));
        assert_eq!(m[3].root, "/sub");
        assert_eq!(m[4].devnum, Some(DevNum { major: 0, minor: 51 }), "btrfs: anonymous st_dev");
        assert_eq!(m[4].source, "/dev/nvme0n1p2");
    }

    #[test]
    fn unescape_keeps_what_is_not_an_octal_escape() {
        assert_eq!(unescape("a\\011b\\134c\\9"), "a\tb\\c\\9");
        assert_eq!(unescape("end\\04"), "end\\04");
        assert_eq!(unescape(""), "");
    }

    #[test]
    fn devnum_round_trips_and_rejects_garbage() {
        let d: DevNum = "259:3".parse().unwrap();
        assert_eq!(d, DevNum { major: 259, minor: 3 });
        assert_eq!(d.to_string(), "259:3");
        assert!("259".parse::<DevNum>().is_err());
        assert!("a:b".parse::<DevNum>().is_err());
    }
}
