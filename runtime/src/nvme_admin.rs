//! NVMe controller administration through sysfs: list the controllers, hand one to `vfio-pci` for
//! the user-space driver and give it back to the kernel `nvme` driver.
//!
//! Every function takes the sysfs root (`/sys` on a real machine) and the text of
//! `/proc/self/mountinfo`, so the logic runs unchanged on a fake sysfs tree in a test, where the
//! control files (`driver_override`, `unbind`, `drivers_probe`) are plain files.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use picchio_blockdev::host::{Host, Sysfs};
use serde::Serialize;

/// The PCI class of an NVMe controller: mass storage, non-volatile memory, NVMe interface.
pub const NVME_CLASS: &str = "0x010802";

/// Errors of NVMe administration.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The PCI address is not `DDDD:BB:DD.F` (or `BB:DD.F`) in hexadecimal.
    #[error("{bdf:?} is not a PCI address: expected DOMAIN:BUS:DEVICE.FUNCTION in hex, e.g. 0000:01:00.0 (see `picchio nvme list`)")]
    BadBdf {
        /// What was given.
        bdf: String,
    },
    /// No such PCI device in sysfs.
    #[error("no PCI device {bdf} ({path} does not exist): see `picchio nvme list`")]
    NoDevice {
        /// The address.
        bdf: String,
        /// Its sysfs directory.
        path: PathBuf,
    },
    /// The device is not an NVMe controller.
    #[error("{bdf} is not an NVMe controller (class {class}, want {NVME_CLASS}): see `picchio nvme list`")]
    NotNvme {
        /// The address.
        bdf: String,
        /// Its class.
        class: String,
    },
    /// A sysfs file could not be read or written.
    #[error("cannot {what} {path} (writing sysfs needs root)")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        cause: std::io::Error,
    },
    /// A namespace or partition of the controller is mounted.
    #[error("{bdf} is in use: {uses}; unmount it first, or pass --force to detach it anyway")]
    Mounted {
        /// The address.
        bdf: String,
        /// What is mounted where.
        uses: String,
    },
    /// The controller holds the root file system.
    #[error("{bdf} backs the root file system ({uses}); refusing even with --force")]
    BacksRoot {
        /// The address.
        bdf: String,
        /// What is mounted where.
        uses: String,
    },
    /// After probing, the device is not on the wanted driver.
    #[error("{bdf} is bound to {got} after drivers_probe, not {want}: {hint}")]
    WrongDriver {
        /// The address.
        bdf: String,
        /// The wanted driver.
        want: &'static str,
        /// The driver it is on (`none` when unbound).
        got: String,
        /// The next step.
        hint: String,
    },
}

/// Result of this module.
pub type Result<T> = std::result::Result<T, AdminError>;

/// A PCI address, normalized to `dddd:bb:dd.f` in lower case.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Bdf(String);

impl Bdf {
    /// Parses `DDDD:BB:DD.F` or `BB:DD.F` (domain 0000), hexadecimal, device at most 1f and
    /// function at most 7.
    ///
    /// # Errors
    /// [`AdminError::BadBdf`].
    pub fn parse(s: &str) -> Result<Bdf> {
        let bad = || AdminError::BadBdf { bdf: s.to_string() };
        let t = s.trim().to_ascii_lowercase();
        let full = if t.matches(':').count() == 1 { format!("0000:{t}") } else { t };
        let (rest, func) = full.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split(':').collect();
        let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
        if parts.len() != 3 || !hex(parts[0], 4) || !hex(parts[1], 2) || !hex(parts[2], 2) {
            return Err(bad());
        }
        if u8::from_str_radix(parts[2], 16).map_err(|_| bad())? > 0x1f || !matches!(func.as_bytes(), [b'0'..=b'7']) {
            return Err(bad());
        }
        Ok(Bdf(full))
    }

    /// The normalized address.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A block device (namespace or partition) of a kernel-bound controller and where it is mounted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// Kernel name, e.g. `nvme0n1` or `nvme0n1p2`.
    pub name: String,
    /// `major:minor`.
    pub dev: String,
    /// Size in bytes (sysfs `size` is in 512-byte sectors).
    pub size: u64,
    /// Mount points of this device.
    pub mounts: Vec<String>,
    /// Devices stacked on it (device-mapper, md), from sysfs `holders/`.
    pub holders: Vec<String>,
}

/// A namespace of a kernel-bound controller, with its partitions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NamespaceInfo {
    /// The namespace block device.
    #[serde(flatten)]
    pub block: BlockInfo,
    /// Its partitions.
    pub partitions: Vec<BlockInfo>,
}

/// One NVMe controller on the PCI bus.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ControllerInfo {
    /// PCI address.
    pub bdf: Bdf,
    /// `vendor:device`, hexadecimal without `0x`.
    pub id: String,
    /// Bound driver (`nvme`, `vfio-pci`, ...), `None` when unbound.
    pub driver: Option<String>,
    /// IOMMU group number, when the device has one.
    pub iommu_group: Option<String>,
    /// Namespaces (kernel `nvme` driver only).
    pub namespaces: Vec<NamespaceInfo>,
    /// Whether any namespace or partition is mounted or held by a stacked device (device-mapper, md).
    pub mounted: bool,
    /// Whether one of them holds `/`, directly or under device-mapper or md.
    pub backs_root: bool,
}

impl ControllerInfo {
    /// Each mounted namespace or partition as `dev on mount point`, comma separated.
    pub fn uses(&self) -> String {
        let mut out = Vec::new();
        for ns in &self.namespaces {
            for b in std::iter::once(&ns.block).chain(&ns.partitions) {
                for m in &b.mounts {
                    out.push(format!("{} is mounted on {m}", b.name));
                }
                for h in &b.holders {
                    out.push(format!("{} is held by {h}", b.name));
                }
            }
        }
        out.join(", ")
    }
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn link_name(p: &Path) -> Option<String> {
    std::fs::read_link(p).ok().and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

fn subdirs(p: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(p)
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// `nvme3n1` or `nvme3c0n1`.
fn is_namespace_name(n: &str) -> bool {
    let Some(rest) = n.strip_prefix("nvme") else { return false };
    let ctrl: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let rest = &rest[ctrl.len()..];
    let rest = match rest.strip_prefix('c') {
        Some(r) => r.trim_start_matches(|c: char| c.is_ascii_digit()),
        None => rest,
    };
    !ctrl.is_empty() && rest.len() > 1 && rest.starts_with('n') && rest[1..].bytes().all(|b| b.is_ascii_digit())
}

fn block_info(dir: &Path, host: &Host) -> BlockInfo {
    let num = Sysfs::devnum(dir);
    let size = Sysfs::size_bytes(dir).unwrap_or(0);
    let mounts =
        num.map(|n| host.mounts_of(n).map(|m| m.entry.mount_point.display().to_string()).collect()).unwrap_or_default();
    let holders = Sysfs::holders(dir).iter().map(|h| Sysfs::name(h)).collect();
    BlockInfo { name: file_name(dir), dev: num.map(|n| n.to_string()).unwrap_or_default(), size, mounts, holders }
}

fn device_dir(sysfs: &Path, bdf: &Bdf) -> PathBuf {
    sysfs.join("bus/pci/devices").join(bdf.as_str())
}

fn describe(sysfs: &Path, dir: &Path, bdf: Bdf, host: &Host) -> ControllerInfo {
    let vendor = read_trim(&dir.join("vendor")).unwrap_or_default();
    let device = read_trim(&dir.join("device")).unwrap_or_default();
    let strip = |s: &str| s.trim_start_matches("0x").to_string();
    let mut ns_dirs: Vec<PathBuf> = Vec::new();
    for ctrl in subdirs(&dir.join("nvme")) {
        let name = file_name(&ctrl);
        for base in [ctrl.clone(), sysfs.join("class/nvme").join(&name)] {
            for d in subdirs(&base) {
                if is_namespace_name(&file_name(&d)) && !ns_dirs.iter().any(|x| file_name(x) == file_name(&d)) {
                    ns_dirs.push(d);
                }
            }
        }
    }
    // Native multipath: the controller has hidden `nvmeXcYnZ` paths; the block device used (and
    // mounted) is the subsystem's head `nvmeSnZ`, which lists the path under `multipath/`.
    let heads: Vec<PathBuf> = subdirs(&sysfs.join("block"))
        .into_iter()
        .filter(|h| ns_dirs.iter().any(|p| h.join("multipath").join(file_name(p)).exists()))
        .filter(|h| !ns_dirs.iter().any(|x| file_name(x) == file_name(h)))
        .collect();
    ns_dirs.extend(heads);
    ns_dirs.sort_by_key(|d| file_name(d));
    let namespaces: Vec<NamespaceInfo> = ns_dirs
        .iter()
        .map(|d| NamespaceInfo {
            block: block_info(d, host),
            partitions: subdirs(d)
                .iter()
                .filter(|p| p.join("partition").exists())
                .map(|p| block_info(p, host))
                .collect(),
        })
        .collect();
    let all = || namespaces.iter().flat_map(|n| std::iter::once(&n.block).chain(&n.partitions));
    let mounted = all().any(|b| !b.mounts.is_empty() || !b.holders.is_empty());
    // The device(s) of `/` and everything they are built on (`slaves/`, transitively).
    let root = host.root_backing();
    let backs_root =
        all().any(|b| b.mounts.iter().any(|m| m == "/") || b.dev.parse().is_ok_and(|d| root.contains_key(&d)));
    ControllerInfo {
        bdf,
        id: format!("{}:{}", strip(&vendor), strip(&device)),
        driver: link_name(&dir.join("driver")),
        iommu_group: link_name(&dir.join("iommu_group")),
        namespaces,
        mounted,
        backs_root,
    }
}

/// Every NVMe controller (PCI class [`NVME_CLASS`]) under `SYSFS/bus/pci/devices`, by address.
/// `mountinfo` is the text of `/proc/self/mountinfo`.
pub fn list(sysfs: &Path, mountinfo: &str) -> Vec<ControllerInfo> {
    let host = Host::from_texts(sysfs, mountinfo, "");
    let root = sysfs.join("bus/pci/devices");
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(&root).map(|rd| rd.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    entries.sort();
    entries
        .into_iter()
        .filter(|d| read_trim(&d.join("class")).as_deref() == Some(NVME_CLASS))
        .filter_map(|d| Bdf::parse(&file_name(&d)).ok().map(|b| describe(sysfs, &d, b, &host)))
        .collect()
}

/// The controller at `bdf`, checked to exist and to be NVMe.
///
/// # Errors
/// [`AdminError::NoDevice`], [`AdminError::NotNvme`].
pub fn controller(sysfs: &Path, mountinfo: &str, bdf: &Bdf) -> Result<ControllerInfo> {
    let dir = device_dir(sysfs, bdf);
    if !dir.exists() {
        return Err(AdminError::NoDevice { bdf: bdf.to_string(), path: dir });
    }
    let class = read_trim(&dir.join("class")).unwrap_or_default();
    if class != NVME_CLASS {
        return Err(AdminError::NotNvme { bdf: bdf.to_string(), class });
    }
    Ok(describe(sysfs, &dir, bdf.clone(), &Host::from_texts(sysfs, mountinfo, "")))
}

/// One write to a sysfs control file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysfsWrite {
    /// The file.
    pub path: PathBuf,
    /// What is written.
    pub value: String,
}

/// The writes that move `bdf` (currently on `current`) to `target` (`None` for the kernel's
/// choice), in order: `driver_override`, `unbind` of the current driver, `drivers_probe`.
pub fn rebind_plan(sysfs: &Path, bdf: &Bdf, current: Option<&str>, target: Option<&str>) -> Vec<SysfsWrite> {
    let dir = device_dir(sysfs, bdf);
    let mut v = vec![SysfsWrite { path: dir.join("driver_override"), value: target.unwrap_or("").to_string() }];
    if let Some(cur) = current {
        v.push(SysfsWrite { path: sysfs.join("bus/pci/drivers").join(cur).join("unbind"), value: bdf.to_string() });
    }
    v.push(SysfsWrite { path: sysfs.join("bus/pci/drivers_probe"), value: bdf.to_string() });
    v
}

fn apply(plan: &[SysfsWrite]) -> Result<()> {
    for w in plan {
        // One write(2) per file, as sysfs wants; an empty override is a lone newline.
        let value = if w.value.is_empty() { "\n".to_string() } else { w.value.clone() };
        std::fs::write(&w.path, value).map_err(|cause| AdminError::Io {
            path: w.path.clone(),
            what: "write",
            cause,
        })?;
    }
    Ok(())
}

/// Waits up to `wait` for the device's driver link to name `want`; returns the driver it is on.
fn wait_driver(sysfs: &Path, bdf: &Bdf, want: &str, wait: Duration) -> Option<String> {
    let link = device_dir(sysfs, bdf).join("driver");
    let deadline = std::time::Instant::now() + wait;
    loop {
        let got = link_name(&link);
        if got.as_deref() == Some(want) || std::time::Instant::now() >= deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What [`bind_vfio`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BindReport {
    /// The controller.
    pub bdf: Bdf,
    /// The driver it was on before (`None` when unbound).
    pub previous: Option<String>,
    /// Its IOMMU group.
    pub iommu_group: Option<String>,
    /// The VFIO group device to open: `/dev/vfio/N`, or `/dev/vfio/noiommu-N` in no-IOMMU mode.
    pub group_device: Option<String>,
}

/// Moves `bdf` to `vfio-pci`. Refuses a controller with a mounted namespace or partition unless
/// `force`, and always one that holds `/`. `wait` bounds how long the new binding is waited for.
///
/// # Errors
/// [`AdminError::NoDevice`], [`AdminError::NotNvme`], [`AdminError::Mounted`],
/// [`AdminError::BacksRoot`], [`AdminError::Io`], [`AdminError::WrongDriver`].
pub fn bind_vfio(sysfs: &Path, mountinfo: &str, bdf: &Bdf, force: bool, wait: Duration) -> Result<BindReport> {
    let c = controller(sysfs, mountinfo, bdf)?;
    if c.backs_root {
        return Err(AdminError::BacksRoot { bdf: bdf.to_string(), uses: c.uses() });
    }
    if c.mounted && !force {
        return Err(AdminError::Mounted { bdf: bdf.to_string(), uses: c.uses() });
    }
    if c.driver.as_deref() != Some("vfio-pci") {
        apply(&rebind_plan(sysfs, bdf, c.driver.as_deref(), Some("vfio-pci")))?;
        let got = wait_driver(sysfs, bdf, "vfio-pci", wait);
        if got.as_deref() != Some("vfio-pci") {
            let hint = if sysfs.join("bus/pci/drivers/vfio-pci").exists() {
                "check `dmesg` for why vfio-pci rejected it".to_string()
            } else {
                "the vfio-pci driver is not loaded: run `modprobe vfio-pci` (add \
                 `vfio.enable_unsafe_noiommu_mode=1` without an IOMMU), then retry"
                    .to_string()
            };
            return Err(AdminError::WrongDriver {
                bdf: bdf.to_string(),
                want: "vfio-pci",
                got: got.unwrap_or_else(|| "none".into()),
                hint,
            });
        }
    }
    let group = link_name(&device_dir(sysfs, bdf).join("iommu_group"));
    let group_device = group.as_ref().map(|g| {
        let noiommu =
            read_trim(&sysfs.join("kernel/iommu_groups").join(g).join("name")).as_deref() == Some("vfio-noiommu");
        if noiommu {
            format!("/dev/vfio/noiommu-{g}")
        } else {
            format!("/dev/vfio/{g}")
        }
    });
    Ok(BindReport { bdf: bdf.clone(), previous: c.driver, iommu_group: group, group_device })
}

/// Gives `bdf` back to the kernel `nvme` driver: clears `driver_override`, unbinds from the current
/// driver, probes, and checks it ended on `nvme`. Returns the driver it was on before.
///
/// # Errors
/// [`AdminError::NoDevice`], [`AdminError::NotNvme`], [`AdminError::Io`], [`AdminError::WrongDriver`].
pub fn unbind_vfio(sysfs: &Path, bdf: &Bdf, wait: Duration) -> Result<Option<String>> {
    let c = controller(sysfs, "", bdf)?;
    if c.driver.as_deref() == Some("nvme") {
        return Ok(c.driver);
    }
    apply(&rebind_plan(sysfs, bdf, c.driver.as_deref(), None))?;
    let got = wait_driver(sysfs, bdf, "nvme", wait);
    if got.as_deref() != Some("nvme") {
        let hint = if sysfs.join("bus/pci/drivers/nvme").exists() {
            "check `dmesg` for why nvme did not take it".to_string()
        } else {
            "the nvme driver is not loaded: run `modprobe nvme`, then retry".to_string()
        };
        return Err(AdminError::WrongDriver {
            bdf: bdf.to_string(),
            want: "nvme",
            got: got.unwrap_or_else(|| "none".into()),
            hint,
        });
    }
    Ok(c.driver)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::fs;

    const B: &str = "0000:01:00.0";

    /// A fake sysfs with one NVMe controller at `B` bound to `driver`, namespace nvme0n1 (259:0,
    /// 2048 sectors) with partition nvme0n1p1 (259:1), and a non-NVMe device.
    fn fake(driver: Option<&str>) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let s = t.path();
        let dev = s.join("bus/pci/devices").join(B);
        fs::create_dir_all(&dev).unwrap();
        fs::write(dev.join("class"), "0x010802\n").unwrap();
        fs::write(dev.join("vendor"), "0x1b36\n").unwrap();
        fs::write(dev.join("device"), "0x0010\n").unwrap();
        fs::write(dev.join("driver_override"), "(null)\n").unwrap();
        fs::write(s.join("bus/pci/drivers_probe"), "").unwrap();
        for d in ["nvme", "vfio-pci"] {
            fs::create_dir_all(s.join("bus/pci/drivers").join(d)).unwrap();
            fs::write(s.join("bus/pci/drivers").join(d).join("unbind"), "").unwrap();
        }
        if let Some(d) = driver {
            std::os::unix::fs::symlink(s.join("bus/pci/drivers").join(d), dev.join("driver")).unwrap();
        }
        fs::create_dir_all(s.join("kernel/iommu_groups/7")).unwrap();
        std::os::unix::fs::symlink(s.join("kernel/iommu_groups/7"), dev.join("iommu_group")).unwrap();
        let ns = dev.join("nvme/nvme0/nvme0n1");
        fs::create_dir_all(ns.join("nvme0n1p1")).unwrap();
        fs::write(ns.join("dev"), "259:0\n").unwrap();
        fs::write(ns.join("size"), "2048\n").unwrap();
        fs::write(ns.join("nvme0n1p1/dev"), "259:1\n").unwrap();
        fs::write(ns.join("nvme0n1p1/size"), "1024\n").unwrap();
        fs::write(ns.join("nvme0n1p1/partition"), "1\n").unwrap();
        fs::create_dir_all(s.join("class/block/nvme0n1p1")).unwrap();
        fs::write(s.join("class/block/nvme0n1p1/dev"), "259:1\n").unwrap();
        let other = s.join("bus/pci/devices/0000:00:02.0");
        fs::create_dir_all(&other).unwrap();
        fs::write(other.join("class"), "0x030000\n").unwrap();
        t
    }

    const MOUNT_P1: &str = "36 1 259:1 / /data rw - ext4 /dev/nvme0n1p1 rw\n";
    const MOUNT_ROOT: &str = "1 0 0:31 / / rw - btrfs /dev/nvme0n1p1 rw\n";

    #[test]
    fn bdf_syntax() {
        assert_eq!(Bdf::parse("0000:01:00.0").unwrap().as_str(), "0000:01:00.0");
        assert_eq!(Bdf::parse("3B:00.1").unwrap().as_str(), "0000:3b:00.1");
        for bad in ["0000:zz:00.0", "01:00", "0000:01:20.0", "0000:01:00.8", "0:01:00.0", "", "0000:01:00.00"] {
            let e = Bdf::parse(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn list_parses_the_fake_tree() {
        let t = fake(Some("nvme"));
        let l = list(t.path(), "");
        assert_eq!(l.len(), 1);
        let c = &l[0];
        assert_eq!(c.bdf.as_str(), B);
        assert_eq!(c.id, "1b36:0010");
        assert_eq!(c.driver.as_deref(), Some("nvme"));
        assert_eq!(c.iommu_group.as_deref(), Some("7"));
        assert_eq!(c.namespaces.len(), 1);
        assert_eq!(c.namespaces[0].block.name, "nvme0n1");
        assert_eq!(c.namespaces[0].block.size, 2048 * 512);
        assert_eq!(c.namespaces[0].partitions[0].name, "nvme0n1p1");
        assert!(!c.mounted && !c.backs_root);
        let m = list(t.path(), MOUNT_P1);
        assert!(m[0].mounted && !m[0].backs_root);
        assert_eq!(m[0].uses(), "nvme0n1p1 is mounted on /data");
        // The root on btrfs (anonymous 0:N) is found through its source device.
        assert!(list(t.path(), MOUNT_ROOT)[0].backs_root);
        // `/` on LVM: dm-0 (253:0) built on nvme0n1p1, which lists it as a holder.
        let s = t.path();
        fs::create_dir_all(s.join("dev/block/253:0/slaves/nvme0n1p1")).unwrap();
        fs::write(s.join("dev/block/253:0/slaves/nvme0n1p1/dev"), "259:1\n").unwrap();
        let p1 = s.join("bus/pci/devices").join(B).join("nvme/nvme0/nvme0n1/nvme0n1p1");
        fs::create_dir_all(p1.join("holders/dm-0")).unwrap();
        let held = &list(s, "")[0];
        assert!(held.mounted && !held.backs_root);
        assert_eq!(held.uses(), "nvme0n1p1 is held by dm-0");
        let lvm_root = "1 0 253:0 / / rw - xfs /dev/mapper/vg-root rw\n";
        assert!(list(s, lvm_root)[0].backs_root);
        // Native multipath: hidden path nvme0c0n2 under the controller, head nvme1n2 in /sys/block.
        let dev = s.join("bus/pci/devices").join(B);
        fs::create_dir_all(dev.join("nvme/nvme0/nvme0c0n2")).unwrap();
        fs::create_dir_all(s.join("block/nvme1n2/multipath/nvme0c0n2")).unwrap();
        fs::write(s.join("block/nvme1n2/dev"), "259:5\n").unwrap();
        fs::write(s.join("block/nvme1n2/size"), "8\n").unwrap();
        let mp = &list(s, "2 1 259:5 / /mnt rw - ext4 x rw\n")[0];
        let names: Vec<&str> = mp.namespaces.iter().map(|n| n.block.name.as_str()).collect();
        assert_eq!(names, ["nvme0c0n2", "nvme0n1", "nvme1n2"]);
        assert!(mp.uses().contains("nvme1n2 is mounted on /mnt"), "{}", mp.uses());
        assert!(list(Path::new("/nonexistent-sysfs"), "").is_empty());
        assert!(serde_json::to_string(&l).unwrap().contains("\"bdf\":\"0000:01:00.0\""));
    }

    #[test]
    fn bind_refuses_mounted_and_root() {
        let t = fake(Some("nvme"));
        let s = t.path();
        let b = Bdf::parse(B).unwrap();
        let e = bind_vfio(s, MOUNT_P1, &b, false, Duration::ZERO).unwrap_err();
        assert!(matches!(e, AdminError::Mounted { .. }), "{e}");
        assert!(e.to_string().contains("--force"), "{e}");
        let e = bind_vfio(s, MOUNT_ROOT, &b, true, Duration::ZERO).unwrap_err();
        assert!(matches!(e, AdminError::BacksRoot { .. }), "{e}");
        // Nothing was written.
        assert_eq!(fs::read_to_string(s.join("bus/pci/devices").join(B).join("driver_override")).unwrap(), "(null)\n");
        assert_eq!(fs::read_to_string(s.join("bus/pci/drivers_probe")).unwrap(), "");
        let e = bind_vfio(s, "", &Bdf::parse("0000:00:02.0").unwrap(), false, Duration::ZERO).unwrap_err();
        assert!(matches!(e, AdminError::NotNvme { .. }), "{e}");
        let e = bind_vfio(s, "", &Bdf::parse("0000:09:00.0").unwrap(), false, Duration::ZERO).unwrap_err();
        assert!(matches!(e, AdminError::NoDevice { .. }), "{e}");
    }

    #[test]
    fn bind_writes_override_unbind_probe_in_order() {
        let t = fake(Some("nvme"));
        let s = t.path();
        let b = Bdf::parse(B).unwrap();
        let plan = rebind_plan(s, &b, Some("nvme"), Some("vfio-pci"));
        let files: Vec<String> =
            plan.iter().map(|w| w.path.strip_prefix(s).unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(
            files,
            [
                format!("bus/pci/devices/{B}/driver_override"),
                "bus/pci/drivers/nvme/unbind".to_string(),
                "bus/pci/drivers_probe".to_string()
            ]
        );
        assert_eq!(plan.iter().map(|w| w.value.as_str()).collect::<Vec<_>>(), ["vfio-pci", B, B]);
        // --force passes a mounted data partition; the fake kernel does not rebind, so the check fails
        // and names the next step.
        let e = bind_vfio(s, MOUNT_P1, &b, true, Duration::ZERO).unwrap_err();
        assert!(matches!(e, AdminError::WrongDriver { .. }), "{e}");
        assert!(e.to_string().contains("dmesg"), "{e}");
        assert_eq!(fs::read_to_string(s.join("bus/pci/devices").join(B).join("driver_override")).unwrap(), "vfio-pci");
        assert_eq!(fs::read_to_string(s.join("bus/pci/drivers/nvme/unbind")).unwrap(), B);
        assert_eq!(fs::read_to_string(s.join("bus/pci/drivers_probe")).unwrap(), B);
        fs::remove_dir_all(s.join("bus/pci/drivers/vfio-pci")).unwrap();
        let e = bind_vfio(s, "", &b, false, Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("modprobe vfio-pci"), "{e}");
    }

    #[test]
    fn bind_on_vfio_reports_group_and_unbind_plans_back() {
        let t = fake(Some("vfio-pci"));
        let s = t.path();
        let b = Bdf::parse(B).unwrap();
        let r = bind_vfio(s, "", &b, false, Duration::ZERO).unwrap();
        assert_eq!(r.group_device.as_deref(), Some("/dev/vfio/7"));
        fs::write(s.join("kernel/iommu_groups/7/name"), "vfio-noiommu\n").unwrap();
        let r = bind_vfio(s, "", &b, false, Duration::ZERO).unwrap();
        assert_eq!(r.group_device.as_deref(), Some("/dev/vfio/noiommu-7"));
        let e = unbind_vfio(s, &b, Duration::ZERO).unwrap_err();
        assert!(matches!(e, AdminError::WrongDriver { want: "nvme", .. }), "{e}");
        assert_eq!(fs::read_to_string(s.join("bus/pci/devices").join(B).join("driver_override")).unwrap(), "\n");
        assert_eq!(fs::read_to_string(s.join("bus/pci/drivers/vfio-pci/unbind")).unwrap(), B);
        assert_eq!(fs::read_to_string(s.join("bus/pci/drivers_probe")).unwrap(), B);
    }
}
