use std::os::unix::fs::symlink;

use super::*;

#[test]
fn mountinfo_and_swaps_parse_with_escapes_and_resolved_sources() {
    let text = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
90 27 7:3 / /mnt/with\\040space rw shared:5 master:1 - ext4 /dev/loop3 rw
91 27 0:45 / /data rw - btrfs /dev/sdb2 rw
bogus line
";
    let resolve = |p: &Path| match p.to_str() {
        Some("/dev/sdb2") => Some(DevNum { major: 8, minor: 18 }),
        Some("/dev/loop3") => Some(DevNum { major: 7, minor: 3 }),
        Some("/dev/sdc") => Some(DevNum { major: 8, minor: 32 }),
        _ => None,
    };
    let m = parse_mountinfo(text, &resolve);
    assert_eq!(m.len(), 4);
    assert_eq!(m[2].entry.mount_point, Path::new("/mnt/with space"));
    assert_eq!(m[2].devices, [DevNum { major: 7, minor: 3 }]);
    assert_eq!(m[3].devices, [DevNum { major: 0, minor: 45 }, DevNum { major: 8, minor: 18 }]);
    assert_eq!(m[3].entry.fs_type, "btrfs");
    let swaps = "Filename\tType\tSize\tUsed\tPriority\n/dev/sdc  partition 100 0 -2\n/swapfile file 100 0 -3\n";
    assert_eq!(parse_swaps(swaps, &resolve), [DevNum { major: 8, minor: 32 }]);
    assert_eq!(unescape("a\\011b\\134c\\9"), "a\tb\\c\\9");
}

/// A fake sysfs: `devices/<disk>[/<part>]` directories with `dev` files, `dev/block/M:m` links and
/// `class/block/NAME` links.
struct FakeSys {
    dir: tempfile::TempDir,
}

impl FakeSys {
    fn new() -> Self {
        FakeSys { dir: tempfile::tempdir().unwrap() }
    }
    fn root(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
    fn add(&self, rel: &str, num: DevNum, partition: bool) -> PathBuf {
        let d = self.root().join("devices").join(rel);
        std::fs::create_dir_all(d.join("holders")).unwrap();
        std::fs::create_dir_all(d.join("slaves")).unwrap();
        std::fs::write(d.join("dev"), format!("{num}\n")).unwrap();
        if partition {
            std::fs::write(d.join("partition"), "1\n").unwrap();
        }
        std::fs::create_dir_all(self.root().join("dev/block")).unwrap();
        symlink(&d, self.root().join("dev/block").join(num.to_string())).unwrap();
        std::fs::create_dir_all(self.root().join("class/block")).unwrap();
        symlink(&d, self.root().join("class/block").join(d.file_name().unwrap())).unwrap();
        d
    }
    /// Adds disk `name` as `num` and its partitions `name/<part>` as `num.major:<minor>`; returns
    /// the disk's directory and the partitions', in `parts`' order.
    fn disk(&self, name: &str, num: DevNum, parts: &[(&str, u32)]) -> (PathBuf, Vec<PathBuf>) {
        let disk = self.add(name, num, false);
        let parts = parts.iter().map(|&(part, minor)| self.add(&format!("{name}/{part}"), dn(num.major, minor), true));
        (disk, parts.collect())
    }
    fn link(&self, from: &Path, which: &str, to: &Path) {
        symlink(to, from.join(which).join(to.file_name().unwrap())).unwrap();
    }
    fn host(&self, mounts: Vec<Mount>, swaps: Vec<DevNum>, root: Vec<DevNum>) -> Host {
        Host::new(Sysfs::new(self.root()), mounts, swaps, &root)
    }
}

const fn dn(major: u32, minor: u32) -> DevNum {
    DevNum { major, minor }
}

fn mount(devices: Vec<DevNum>, mount_point: &str, fs_type: &str) -> Mount {
    let entry = MountEntry {
        devnum: devices.first().copied(),
        root: "/".into(),
        mount_point: mount_point.into(),
        mount_options: "rw".into(),
        fs_type: fs_type.into(),
        source: "none".into(),
        super_options: "rw".into(),
    };
    Mount { devices, entry }
}

#[test]
fn uses_cover_partitions_holders_and_swap() {
    let fs = FakeSys::new();
    let (sda, parts) = fs.disk("sda", dn(8, 0), &[("sda1", 1), ("sda2", 2)]);
    let sda1 = &parts[0];
    let dm0 = fs.add("dm-0", dn(253, 0), false);
    fs.link(sda1, "holders", &dm0);
    std::fs::create_dir_all(sda.join("device")).unwrap();
    std::fs::write(sda.join("device/model"), "Fake SSD  \n").unwrap();
    let host = fs.host(vec![mount(vec![dn(8, 2)], "/srv", "xfs")], vec![dn(8, 0)], vec![dn(254, 0)]);
    let found = host.uses(dn(8, 0), "sda");
    assert_eq!(
        found,
        [
            Use::Swap { device: "sda".into() },
            Use::Held { device: "sda1".into(), holder: "dm-0".into() },
            Use::Mounted { device: "sda2".into(), mount_point: "/srv".into(), fs_type: "xfs".into() },
        ]
    );
    assert_eq!(Sysfs::describe(sda1).as_deref(), Some("Fake SSD"));
    assert_eq!(Sysfs::parent(sda1).map(|p| Sysfs::name(&p)).as_deref(), Some("sda"));
    assert_eq!(host.partitions(dn(8, 0)), [("sda1".to_string(), dn(8, 1)), ("sda2".to_string(), dn(8, 2))]);
    assert_eq!(host.holders(dn(8, 1)), ["dm-0"]);
    assert!(host.partitions(dn(8, 1)).is_empty() && host.holders(dn(8, 0)).is_empty());
    // A partition alone only sees itself.
    assert_eq!(host.uses(dn(8, 1), "sda1").len(), 1);
    assert!(!host.root_backing().contains_key(&dn(8, 0)));
}

#[test]
fn root_backing_follows_partitions_and_slaves() {
    let fs = FakeSys::new();
    let (_, parts) = fs.disk("nvme0n1", dn(259, 0), &[("nvme0n1p2", 2), ("nvme0n1p3", 3)]);
    let dm = fs.add("dm-0", dn(253, 0), false);
    fs.link(&dm, "slaves", &parts[0]);
    let host = fs.host(vec![], vec![], vec![dn(253, 0)]);
    let set = host.root_backing();
    assert_eq!(set.keys().copied().collect::<Vec<_>>(), [dn(253, 0), dn(259, 0), dn(259, 2)]);
    assert_eq!(set[&dn(259, 0)], "/ is on dm-0, built on nvme0n1p2, a partition of nvme0n1");
    // A spare partition of the root disk is not the root device.
    assert!(!set.contains_key(&dn(259, 3)));
    // An unknown root (no sysfs entry) still counts itself.
    let host = fs.host(vec![], vec![], vec![dn(0, 33)]);
    assert_eq!(host.root_backing().len(), 1);
}

#[test]
fn from_texts_resolves_sources_through_sysfs_and_finds_root_in_the_mount_table() {
    let fs = FakeSys::new();
    fs.disk("vda", dn(254, 0), &[("vda1", 1)]);
    fs.add("vdb", dn(254, 16), false);
    // btrfs `/` (anonymous 0:31) on vda1; a later mount on `/` hides an earlier one.
    let mi = "1 0 8:1 / / rw - ext4 /dev/sdz1 rw\n2 0 0:31 / / rw - btrfs /dev/vda1 rw\n";
    let swaps = "Filename Type Size Used Priority\n/dev/vdb partition 8 0 -2\n/dev/nope partition 8 0 -3\n";
    let host = Host::from_texts(fs.root(), mi, swaps);
    assert_eq!(host.root_devices(), [dn(0, 31), dn(254, 1)]);
    assert!(host.is_swap(dn(254, 16)) && !host.is_swap(dn(254, 0)));
    assert_eq!(host.mounts_of(dn(254, 1)).map(|m| m.entry.fs_type.as_str()).collect::<Vec<_>>(), ["btrfs"]);
    let backing = host.root_backing();
    assert_eq!(backing[&dn(254, 0)], "/ is on vda1, a partition of vda");
    assert!(!backing.contains_key(&dn(254, 16)));
    assert_eq!(host.uses(dn(254, 16), "vdb"), [Use::Swap { device: "vdb".into() }]);
    // Nothing known: no mounts, no root.
    let empty = Host::from_texts(fs.root(), "", "");
    assert!(empty.root_devices().is_empty() && empty.mounts().is_empty() && empty.root_backing().is_empty());
}

#[test]
fn mount_holding_picks_the_mount_of_the_device_then_the_longest_prefix() {
    let mi = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 8:17 / /mnt/my\\040disk rw,noatime shared:5 - xfs /dev/sdb1 rw,attr2
41 27 0:50 / /mnt/my\\040disk/tmp rw - tmpfs tmpfs rw,size=4k
";
    let host = Host::from_texts("/nonexistent-sysfs", mi, "");
    let at = |dev, p: &str| host.mount_holding(Path::new(p), dev).map(|e| e.fs_type.as_str());
    assert_eq!(at(Some(dn(254, 0)), "/work/x.picchioflat"), Some("ext4"));
    assert_eq!(at(Some(dn(8, 17)), "/mnt/my disk/e.picchioflat"), Some("xfs"));
    assert_eq!(at(Some(dn(0, 50)), "/mnt/my disk/tmp/a"), Some("tmpfs"));
    assert_eq!(at(None, "/mnt/my disk/tmp/a"), Some("tmpfs"));
    // The device decides between nested mounts: /mnt/my disk/tmp is under sdb1's mount point too.
    assert_eq!(at(Some(dn(8, 17)), "/mnt/my disk/tmp/a"), Some("xfs"));
    assert_eq!(at(None, "relative"), None);
}

#[test]
#[cfg(target_os = "linux")]
fn the_running_system_has_a_root_device() {
    let host = Host::current().unwrap();
    assert!(!host.root_devices().is_empty());
    assert!(device_of(Path::new("/")).is_some_and(|d| host.root_devices().contains(&d)));
    assert_eq!(block_device_number(Path::new("/")), None, "a directory is not a block device node");
}
