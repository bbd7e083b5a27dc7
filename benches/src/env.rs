//! The environment a bench report records: CPU, kernel, memory, load average at start and end, and
//! the store's file or device as the kernel describes it (sysfs, `/proc/self/mountinfo`).
//!
//! Everything here is read, never inferred: a value the system does not expose (no sysfs on this
//! OS, a virtual disk without a model string, a file on a file system without a block device) is
//! `null` in the report rather than a guess. Sources (Linux): `uname(2)`, `/proc/cpuinfo`,
//! `/proc/meminfo`, `/proc/loadavg`, `/sys/dev/block/MAJ:MIN` (→ the disk's `queue/` and
//! `device/` attributes, as documented in the kernel's `Documentation/ABI/stable/sysfs-block`),
//! `/proc/self/mountinfo` (`proc(5)`), `/sys/bus/pci/devices/BDF`.

use std::path::Path;

use picchio_blockdev::host::{self, DevNum, Sysfs};
use picchio_core::StoreUri;
use serde::{Deserialize, Serialize};

/// Where a report was made.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    /// `std::env::consts::OS` (`linux`, `windows`, …).
    pub os: String,
    /// `std::env::consts::ARCH` (`x86_64`, `aarch64`, …).
    pub arch: String,
    /// `uname(2)`; `null` where unavailable.
    pub kernel: Option<Kernel>,
    /// The processor.
    pub cpu: Cpu,
    /// Memory from `/proc/meminfo` at start; `null` where unavailable.
    pub memory: Option<Memory>,
    /// `/proc/loadavg` 1, 5 and 15-minute load averages when the run started.
    pub load_avg_start: Option<[f64; 3]>,
    /// The same when the run ended (other work on the machine shows here).
    pub load_avg_end: Option<[f64; 3]>,
    /// The store measured, when the experiment has one.
    pub target: Option<Target>,
}

/// `uname(2)` fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernel {
    /// `sysname`, e.g. `Linux`.
    pub sysname: String,
    /// `release`, e.g. `6.1.0-27-amd64`.
    pub release: String,
    /// `version` (build string).
    pub version: String,
    /// `machine`, e.g. `x86_64`.
    pub machine: String,
}

/// The processor.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cpu {
    /// `model name` from `/proc/cpuinfo`.
    pub model: Option<String>,
    /// Online logical CPUs (`sysconf(_SC_NPROCESSORS_ONLN)`; `available_parallelism` elsewhere).
    pub logical_cpus: usize,
    /// CPUs this process may run on (`std::thread::available_parallelism`: affinity and cgroup
    /// quota applied).
    pub available_to_process: usize,
    /// `cpu MHz` of the first CPU in `/proc/cpuinfo` at start (nominal on many VMs).
    pub mhz: Option<f64>,
    /// Of the `/proc/cpuinfo` flags, those that bear on the figures: `hypervisor` (a VM),
    /// `constant_tsc` and `nonstop_tsc` (the timestamp counter `overhead` uses runs at a fixed
    /// rate), `avx2`, `avx512f` (kernels).
    pub flags_of_note: Vec<String>,
}

/// Memory at start, bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable`.
    pub available_bytes: u64,
    /// `Cached` (the page cache, which buffered reads may hit).
    pub page_cache_bytes: u64,
}

/// The store measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// The store URI as given (`file:…`, `raw:/dev/X`, `nvme-sim:…`, `nvme:BDF`).
    pub uri: String,
    /// `file`, `block device`, `nvme controller model`, `nvme controller (vfio)`.
    pub kind: String,
    /// The file or device node (the backing file for the controller model).
    pub path: Option<String>,
    /// Bytes of the file or device.
    pub size_bytes: Option<u64>,
    /// The block device the file lives on, or the device itself (`null` for a file on a file system
    /// without one, e.g. tmpfs or overlay).
    pub device: Option<BlockDevice>,
    /// The file system holding the file (`null` for a block device).
    pub filesystem: Option<FileSystem>,
    /// For `nvme:`, the PCI function (`/sys/bus/pci/devices/BDF`).
    pub pci: Option<PciFunction>,
    /// What a reader must know about the figures (e.g. that the controller model is software).
    pub note: Option<String>,
}

/// A block device as sysfs describes it. Queue attributes are the whole disk's (a partition has
/// none of its own).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockDevice {
    /// Kernel name (`vda1`, `nvme0n1p2`, `loop3`).
    pub name: String,
    /// `major:minor`.
    pub devnum: String,
    /// The whole disk (`vda`, `nvme0n1`), the same as `name` unless it is a partition.
    pub disk: String,
    /// `device/model` (SCSI/SATA, NVMe), `null` when absent (virtio has none).
    pub model: Option<String>,
    /// `device/vendor` (a name for SCSI, a PCI vendor id such as `0x1af4` for virtio).
    pub vendor: Option<String>,
    /// `device/firmware_rev` (NVMe) or `device/rev` (SCSI/SATA).
    pub firmware: Option<String>,
    /// The driver bound to the disk's device (`nvme`, `virtio_blk`, `sd`), from `device/driver`.
    pub driver: Option<String>,
    /// `queue/logical_block_size`, bytes.
    pub logical_block_size: Option<u32>,
    /// `queue/physical_block_size`, bytes.
    pub physical_block_size: Option<u32>,
    /// The active I/O scheduler (the bracketed entry of `queue/scheduler`).
    pub scheduler: Option<String>,
    /// `queue/rotational` (virtual disks often claim 1).
    pub rotational: Option<bool>,
    /// `queue/nr_requests`.
    pub nr_requests: Option<u32>,
    /// `queue/read_ahead_kb`, KiB (buffered sequential reads are read ahead by this much).
    pub read_ahead_kb: Option<u32>,
    /// `queue/max_sectors_kb`, KiB: the largest request the block layer sends down (larger reads
    /// are split).
    pub max_sectors_kb: Option<u32>,
    /// For a loop device, `loop/backing_file`.
    pub loop_backing_file: Option<String>,
    /// For a loop device, `loop/dio`: whether it reads its backing file with direct I/O. Without it
    /// (`false`), every read of the loop device — O_DIRECT ones included — goes through the backing
    /// file's page cache, so figures include that cache (see the target's `note`).
    #[serde(default)]
    pub loop_direct_io: Option<bool>,
}

/// The mount holding a file (one `/proc/self/mountinfo` line).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSystem {
    /// File system type (`ext4`, `xfs`, `tmpfs`, `overlay`).
    pub fstype: String,
    /// Mount source (`/dev/vda1`).
    pub source: String,
    /// Mount point.
    pub mount_point: String,
    /// Per-mount options (`rw,relatime`).
    pub mount_options: String,
    /// Per-super-block options (`rw,discard,…`).
    pub super_options: String,
}

/// A PCI function from sysfs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciFunction {
    /// `DDDD:BB:DD.F`.
    pub bdf: String,
    /// `vendor` (`0x144d`).
    pub vendor: Option<String>,
    /// `device` (`0xa808`).
    pub device: Option<String>,
    /// The bound driver (`vfio-pci`, `nvme`).
    pub driver: Option<String>,
}

impl Environment {
    /// Reads the environment now (load average = `load_avg_start`), describing the store `target`
    /// if given (`auto` and `safetensors` name no file or device and are not described).
    pub fn capture(target: Option<&StoreUri>) -> Environment {
        Environment {
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
            kernel: uname(),
            cpu: cpu(),
            memory: memory(),
            load_avg_start: load_average(),
            load_avg_end: None,
            target: target.and_then(describe_target),
        }
    }
}

/// `/proc/loadavg`'s three load averages, or `None` where there is no such file.
pub fn load_average() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = s.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

fn uname() -> Option<Kernel> {
    let u = host::uname()?;
    Some(Kernel { sysname: u.sysname, release: u.release, version: u.version, machine: u.machine })
}

fn cpu() -> Cpu {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let first = |key: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    let flags = first("flags").unwrap_or_default();
    let flags_of_note = ["hypervisor", "constant_tsc", "nonstop_tsc", "avx2", "avx512f"]
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .map(String::from)
        .collect();
    Cpu {
        model: first("model name"),
        logical_cpus: host::online_cpus().unwrap_or(available),
        available_to_process: available,
        mhz: first("cpu MHz").and_then(|v| v.parse().ok()),
        flags_of_note,
    }
}

/// Memory as `/proc/meminfo` reports it now (`None` off Linux or when unreadable).
pub fn memory() -> Option<Memory> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.split(':').next() == Some(key))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|k| k * 1024)
    };
    Some(Memory {
        total_bytes: kib("MemTotal")?,
        available_bytes: kib("MemAvailable").unwrap_or(0),
        page_cache_bytes: kib("Cached").unwrap_or(0),
    })
}

fn describe_target(store: &StoreUri) -> Option<Target> {
    let uri = &store.to_string();
    Some(match store {
        StoreUri::Auto | StoreUri::Safetensors => return None,
        StoreUri::File(path) => {
            let mut t = file_target(uri, path);
            t.kind = "file".into();
            t
        }
        StoreUri::Raw { device: path, .. } => {
            let dev = host::block_device_number(path);
            let device = dev.and_then(block_device);
            let note = device.as_ref().filter(|d| d.loop_direct_io == Some(false)).map(|d| {
                format!(
                    "loop device without direct I/O (loop/dio 0): reads of {} go through the page cache of its \
                     backing file {}, so figures (buffered, and O_DIRECT too) include that cache, not only the \
                     disk below; `losetup --direct-io=on` avoids it",
                    d.name,
                    d.loop_backing_file.as_deref().unwrap_or("?")
                )
            });
            Target {
                uri: uri.clone(),
                kind: "block device".into(),
                path: Some(path.display().to_string()),
                size_bytes: dev.and_then(|d| Sysfs::new("/sys").dir(d)).and_then(|d| Sysfs::size_bytes(&d)),
                device,
                filesystem: None,
                pci: None,
                note,
            }
        }
        StoreUri::NvmeSim(backing) => {
            let mut t = file_target(uri, backing);
            t.kind = "nvme controller model".into();
            t.note = Some(
                "picchio-nvme's software controller model (a thread serving NVMe commands from the backing \
                 file through the page cache): figures are the driver's and the model's costs, not a drive's"
                    .into(),
            );
            t
        }
        StoreUri::NvmeTcp { addr, .. } => Target {
            uri: uri.clone(),
            kind: "nvme-tcp namespace (remote)".into(),
            path: None,
            size_bytes: None,
            device: None,
            filesystem: None,
            pci: None,
            note: Some(format!("a namespace of a remote NVMe-oF subsystem at {addr}, read over NVMe/TCP")),
        },
        StoreUri::Nvme { bdf, .. } => Target {
            uri: uri.clone(),
            kind: "nvme controller (vfio)".into(),
            path: None,
            size_bytes: None,
            device: None,
            filesystem: None,
            pci: Some(pci_function(bdf)),
            note: None,
        },
    })
}

fn file_target(uri: &str, path: &Path) -> Target {
    let size = std::fs::metadata(path).ok().map(|m| m.len());
    let dev = host::device_of(path);
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Target {
        uri: uri.into(),
        kind: String::new(),
        path: Some(path.display().to_string()),
        size_bytes: size,
        device: dev.and_then(block_device),
        filesystem: std::fs::read_to_string("/proc/self/mountinfo").ok().and_then(|mi| mount_of(&mi, dev, &canonical)),
        pci: None,
        note: None,
    }
}

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// sysfs's description of block device `dev`, or `None` when it has no sysfs entry (the
/// anonymous devices of tmpfs, overlay, …).
fn block_device(dev: DevNum) -> Option<BlockDevice> {
    block_device_in(Path::new("/sys"), dev)
}

fn block_device_in(sys: &Path, dev: DevNum) -> Option<BlockDevice> {
    let dir = Sysfs::new(sys).dir(dev)?;
    let name = Sysfs::name(&dir);
    // A partition's directory sits inside its disk's and has a `partition` attribute.
    let disk_dir = Sysfs::parent(&dir).unwrap_or_else(|| dir.clone());
    let disk = Sysfs::name(&disk_dir);
    let q = |attr: &str| read_trim(disk_dir.join("queue").join(attr));
    let num = |attr: &str| q(attr).and_then(|s| s.parse::<u32>().ok());
    let devattr = |attr: &str| read_trim(disk_dir.join("device").join(attr));
    let scheduler = q("scheduler").map(|s| {
        s.split_whitespace()
            .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')).map(String::from))
            .unwrap_or(s)
    });
    let driver = std::fs::read_link(disk_dir.join("device/driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    Some(BlockDevice {
        name,
        devnum: dev.to_string(),
        disk,
        model: devattr("model"),
        vendor: devattr("vendor"),
        firmware: devattr("firmware_rev").or_else(|| devattr("rev")),
        driver,
        logical_block_size: num("logical_block_size"),
        physical_block_size: num("physical_block_size"),
        scheduler,
        rotational: q("rotational").map(|s| s == "1"),
        nr_requests: num("nr_requests"),
        read_ahead_kb: num("read_ahead_kb"),
        max_sectors_kb: num("max_sectors_kb"),
        loop_backing_file: read_trim(disk_dir.join("loop/backing_file")),
        loop_direct_io: read_trim(disk_dir.join("loop/dio")).map(|s| s == "1"),
    })
}

/// The mount holding `path` in a mountinfo text ([`picchio_blockdev::host::mount_holding`]: the
/// mount of device `dev` when one matches, else the longest mount-point prefix; later mounts win).
fn mount_of(mountinfo: &str, dev: Option<DevNum>, path: &Path) -> Option<FileSystem> {
    let entries = picchio_blockdev::mountinfo::parse(mountinfo);
    let e = host::mount_holding(&entries.iter().collect::<Vec<_>>(), dev, path)?;
    Some(FileSystem {
        fstype: e.fs_type.clone(),
        source: e.source.clone(),
        mount_point: e.mount_point.display().to_string(),
        mount_options: e.mount_options.clone(),
        super_options: e.super_options.clone(),
    })
}

fn pci_function(bdf: &str) -> PciFunction {
    let dir = Path::new("/sys/bus/pci/devices").join(bdf);
    PciFunction {
        bdf: bdf.into(),
        vendor: read_trim(dir.join("vendor")),
        device: read_trim(dir.join("device")),
        driver: std::fs::read_link(dir.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 8:17 / /mnt/my\\040disk rw,noatime shared:5 - xfs /dev/sdb1 rw,attr2
41 27 0:50 / /mnt/my\\040disk/tmp rw - tmpfs tmpfs rw,size=4k
";

    const fn dn(major: u32, minor: u32) -> Option<DevNum> {
        Some(DevNum { major, minor })
    }

    #[test]
    fn mountinfo_picks_the_mount_holding_the_path() {
        let m = mount_of(MOUNTINFO, dn(254, 0), Path::new("/work/x.picchioflat")).unwrap();
        assert_eq!((m.fstype.as_str(), m.source.as_str(), m.mount_point.as_str()), ("ext4", "/dev/vda", "/"));
        assert_eq!((m.mount_options.as_str(), m.super_options.as_str()), ("rw,relatime", "rw,discard"));
        // Optional fields ("shared:5") and an escaped space in the mount point.
        let m = mount_of(MOUNTINFO, dn(8, 17), Path::new("/mnt/my disk/e.picchioflat")).unwrap();
        assert_eq!((m.fstype.as_str(), m.mount_point.as_str()), ("xfs", "/mnt/my disk"));
        // The device number decides between nested mounts; without a match the longest prefix wins.
        let m = mount_of(MOUNTINFO, dn(0, 50), Path::new("/mnt/my disk/tmp/a")).unwrap();
        assert_eq!(m.fstype, "tmpfs");
        let m = mount_of(MOUNTINFO, None, Path::new("/mnt/my disk/tmp/a")).unwrap();
        assert_eq!(m.fstype, "tmpfs");
    }

    #[test]
    fn fake_sysfs_partition_reports_its_disk_queue() {
        let sys = tempfile::tempdir().unwrap();
        let disk = sys.path().join("devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1");
        let part = disk.join("nvme0n1p2");
        std::fs::create_dir_all(part.join("x")).unwrap();
        std::fs::create_dir_all(disk.join("queue")).unwrap();
        std::fs::create_dir_all(disk.join("device")).unwrap();
        std::fs::write(part.join("partition"), "2\n").unwrap();
        for (k, v) in [
            ("logical_block_size", "512"),
            ("physical_block_size", "4096"),
            ("scheduler", "[none] mq-deadline kyber"),
            ("rotational", "0"),
            ("nr_requests", "1023"),
            ("read_ahead_kb", "128"),
            ("max_sectors_kb", "512"),
        ] {
            std::fs::write(disk.join("queue").join(k), format!("{v}\n")).unwrap();
        }
        std::fs::write(disk.join("device/model"), "Samsung SSD 980 PRO 1TB                 \n").unwrap();
        std::fs::write(disk.join("device/firmware_rev"), "5B2QGXA7\n").unwrap();
        std::fs::create_dir_all(sys.path().join("dev/block")).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&part, sys.path().join("dev/block/259:3")).unwrap();
        #[cfg(unix)]
        {
            let d = block_device_in(sys.path(), DevNum { major: 259, minor: 3 }).unwrap();
            assert_eq!((d.name.as_str(), d.disk.as_str(), d.devnum.as_str()), ("nvme0n1p2", "nvme0n1", "259:3"));
            assert_eq!(d.model.as_deref(), Some("Samsung SSD 980 PRO 1TB"));
            assert_eq!(d.firmware.as_deref(), Some("5B2QGXA7"));
            assert_eq!((d.logical_block_size, d.physical_block_size), (Some(512), Some(4096)));
            assert_eq!((d.scheduler.as_deref(), d.rotational), (Some("none"), Some(false)));
            assert_eq!((d.nr_requests, d.read_ahead_kb, d.max_sectors_kb), (Some(1023), Some(128), Some(512)));
            assert!(block_device_in(sys.path(), DevNum { major: 0, minor: 50 }).is_none());
        }
    }

    #[test]
    fn captures_this_machine() {
        let e = Environment::capture(None);
        assert!(e.cpu.logical_cpus >= 1 && e.cpu.available_to_process >= 1);
        assert_eq!(e.os, std::env::consts::OS);
        if cfg!(target_os = "linux") {
            assert!(e.kernel.is_some() && e.memory.as_ref().is_some_and(|m| m.total_bytes > 0));
            assert!(e.load_avg_start.is_some_and(|l| l.iter().all(|&x| x >= 0.0)));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 12_288]).unwrap();
        let spec = StoreUri::File(path.clone());
        let t = Environment::capture(Some(&spec)).target.unwrap();
        assert_eq!((t.kind.as_str(), t.size_bytes), ("file", Some(12_288)));
        if cfg!(target_os = "linux") {
            let fs = t.filesystem.expect("every Linux file is on a mount");
            assert!(path.starts_with(&fs.mount_point) && !fs.fstype.is_empty(), "{fs:?}");
        }
    }
}
