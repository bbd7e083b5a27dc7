//! Kernel fixtures for tests on real block devices: loop devices and mounts that undo themselves when
//! dropped — also when the test panics, since `Drop` runs while unwinding.
//!
//! Tests that use them need root (`losetup`, `mkfs`, `mount`) and are marked
//! `#[ignore = "needs root: losetup (CI runs ignored tests as root)"]`, so a plain `cargo test` lists
//! them as ignored; `cargo test -- --ignored` (as root, what `.ci/run` does) runs them, and then a
//! missing precondition is a failure with a message ([`require_root`], [`require_tool`],
//! [`LoopDevice::attach_for_test`]), never a silent pass.
//!
//! Loop device numbers are the kernel's: `losetup --find` picks a free one atomically, so tests in
//! parallel threads each get their own device; nothing here assumes a number.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The effective user id (`Uid:` in `/proc/self/status`), if it can be read.
pub fn euid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Whether the effective user is root.
pub fn is_root() -> bool {
    euid() == Some(0)
}

/// Panics with a message naming `test` unless the effective user is root: for tests marked
/// `#[ignore = "needs root: ..."]`, which run only when asked (`cargo test -- --ignored`, as root).
pub fn require_root(test: &str) {
    assert!(
        is_root(),
        "{test}: needs root for losetup, mkfs and mount (euid {:?}); it is #[ignore]d for this reason: \
         run it as root with `cargo test --workspace -- --ignored` (CI does)",
        euid()
    );
}

/// Panics with a message naming `test` and `cmd` unless `cmd probe_args...` runs: for a tool CI
/// installs (e.g. `mkfs.ext4`, `dmsetup`, `fio`).
pub fn require_tool(test: &str, cmd: &str, probe_args: &[&str]) {
    if let Err(why) = run(cmd, probe_args) {
        panic!("{test}: needs {cmd} ({why}); CI installs it (see .ci/run)");
    }
}

/// [`require_root`], then [`require_tool`] for each of `tools` (probed with `-V`): for a test that
/// makes or probes file systems on its loop devices (`mkfs.ext4`, `blkid`, ...).
pub fn require_root_and_tools(test: &str, tools: &[&str]) {
    require_root(test);
    for tool in tools {
        require_tool(test, tool, &["-V"]);
    }
}

/// Runs `cmd args...`, returning its output or a message naming the command and its stderr.
pub fn run(cmd: &str, args: &[&str]) -> Result<Output, String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("cannot run {cmd}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!("{cmd} {}: {}: {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether `cmd` can be run (e.g. `dmsetup`, `mkfs.ext4`).
pub fn have(cmd: &str, probe_args: &[&str]) -> bool {
    run(cmd, probe_args).is_ok()
}

/// A device-mapper device (`/dev/mapper/<name>`) made from a `dmsetup` table, removed on drop. For
/// tests that need a device whose reads fail in a chosen range (the `error` target).
#[derive(Debug)]
pub struct DmDevice {
    /// The mapping's name.
    pub name: String,
    /// `/dev/mapper/<name>`.
    pub dev: PathBuf,
}

impl DmDevice {
    /// Panics naming `test` unless the effective user is root ([`require_root`]) and device-mapper
    /// answers (`dmsetup targets`); for tests marked `#[ignore = "needs root and device-mapper ..."]`.
    pub fn require(test: &str) {
        require_root(test);
        if let Err(why) = run("dmsetup", &["targets"]) {
            panic!("{test}: device-mapper unavailable ({why}); it is #[ignore]d for this reason");
        }
    }

    /// `dmsetup create <name>` with `table` (one `start length target args` line per segment,
    /// in 512-byte sectors) written to a file in `dir`.
    ///
    /// # Errors
    /// The message of a failed `dmsetup create` ([`run`]).
    pub fn create(dir: &Path, name: &str, table: &str) -> Result<DmDevice, String> {
        let file = dir.join(format!("{name}.table"));
        std::fs::write(&file, table).map_err(|e| format!("write {}: {e}", file.display()))?;
        run("dmsetup", &["create", name, &file.to_string_lossy()])?;
        Ok(DmDevice { name: name.to_string(), dev: PathBuf::from(format!("/dev/mapper/{name}")) })
    }

    /// A device `picchio-<tag>-<pid>` whose first `good` 512-byte sectors read sectors `0..good` of
    /// `dev` (the `linear` target) and whose sectors `good..total` fail every read with EIO (the
    /// `error` target): a disk with a bad range. Its table is written in `dir` ([`DmDevice::create`]).
    ///
    /// # Errors
    /// The message of a failed `dmsetup create` ([`run`]).
    pub fn linear_then_error(dir: &Path, tag: &str, dev: &Path, good: u64, total: u64) -> Result<DmDevice, String> {
        let name = format!("picchio-{tag}-{}", std::process::id());
        let table = format!("0 {good} linear {} 0\n{good} {} error\n", dev.display(), total - good);
        DmDevice::create(dir, &name, &table)
    }
}

impl Drop for DmDevice {
    fn drop(&mut self) {
        let _ = run("dmsetup", &["remove", "--retry", &self.name]);
    }
}

/// How to attach a loop device.
#[derive(Clone, Copy, Debug)]
pub struct LoopOptions {
    /// Logical block size (`--sector-size`): 512 or 4096.
    pub sector_size: u32,
    /// `--direct-io=on`: the loop driver reads its backing file with O_DIRECT (and then reports
    /// reads past the backing file's end as I/O errors instead of zeros).
    pub direct_io: bool,
    /// `--read-only`.
    pub read_only: bool,
    /// `--partscan`: the kernel creates `loopNpM` for a partition table.
    pub partscan: bool,
}

impl Default for LoopOptions {
    fn default() -> Self {
        LoopOptions { sector_size: 512, direct_io: true, read_only: false, partscan: false }
    }
}

/// A loop device over a file (`losetup --find --show ...`), detached on drop (also while unwinding).
#[derive(Debug)]
pub struct LoopDevice {
    /// `/dev/loopN`.
    pub dev: PathBuf,
    /// The backing file.
    pub backing: PathBuf,
}

impl LoopDevice {
    /// Attaches a free loop device to `file`.
    pub fn attach(file: &Path, opts: LoopOptions) -> Result<LoopDevice, String> {
        let sector = opts.sector_size.to_string();
        let file_s = file.to_string_lossy().into_owned();
        let mut args = vec!["--find", "--show", "--sector-size", &sector];
        args.push(if opts.direct_io { "--direct-io=on" } else { "--direct-io=off" });
        if opts.read_only {
            args.push("--read-only");
        }
        if opts.partscan {
            args.push("--partscan");
        }
        args.push(&file_s);
        let out = run("losetup", &args)?;
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Ok(LoopDevice { dev, backing: file.into() })
    }

    /// Attaches for test `test` (root only, see [`require_root`]), panicking with a message naming
    /// the test and the `losetup` error when it cannot.
    pub fn attach_for_test(test: &str, file: &Path, opts: LoopOptions) -> LoopDevice {
        require_root(test);
        LoopDevice::attach(file, opts).unwrap_or_else(|why| panic!("{test}: no loop device: {why}"))
    }

    /// Attaches for test `test` (as [`LoopDevice::attach_for_test`]) a loop device over a new sparse
    /// file of `len` bytes at `path` ([`sparse_file`]); the file is the device's `backing`.
    pub fn sparse_for_test(test: &str, path: &Path, len: u64, opts: LoopOptions) -> LoopDevice {
        LoopDevice::attach_for_test(test, &sparse_file(path, len), opts)
    }

    /// `loopN`.
    pub fn name(&self) -> String {
        self.dev.file_name().unwrap().to_string_lossy().into_owned()
    }

    /// Whether the loop driver really reads the backing file with O_DIRECT
    /// (`/sys/block/loopN/loop/dio`; it silently falls back when the backing file system refuses).
    pub fn direct_io_active(&self) -> bool {
        std::fs::read_to_string(format!("/sys/block/{}/loop/dio", self.name())).is_ok_and(|s| s.trim() == "1")
    }

    /// Partition `n` (`/dev/loopNpN`) of the partition table on the device, from 512-byte sector
    /// `start` for `sectors` sectors (needs `partscan`). When the kernel parsed the table itself the
    /// partition is in sysfs; a kernel built without partition-table parsers (no
    /// `CONFIG_MSDOS_PARTITION`) is told about it with `addpart` (the `BLKPG` ioctl) instead. Then
    /// waits (at most 60 s) for the device node.
    pub fn partition(&self, n: u32, start: u64, sectors: u64) -> Result<PathBuf, String> {
        let p = PathBuf::from(format!("{}p{n}", self.dev.display()));
        // `--partscan` parses the table synchronously (BLKRRPART): whether the kernel knows the
        // partition is in sysfs at once. The device node follows asynchronously (devtmpfs/udev):
        // wait for it on that condition, bounded generously, instead of a fixed number of sleeps.
        let name = self.name();
        if !Path::new(&format!("/sys/block/{name}/{name}p{n}")).exists() {
            run("addpart", &[&self.dev.to_string_lossy(), &n.to_string(), &start.to_string(), &sectors.to_string()])?;
        }
        if crate::wait_until(std::time::Duration::from_secs(60), || p.exists()) {
            Ok(p)
        } else {
            Err(format!("{} did not appear within 60 s", p.display()))
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Err(e) = run("losetup", &["-d", &self.dev.to_string_lossy()]) {
            eprintln!("warning: detaching {}: {e}", self.dev.display());
        }
    }
}

/// A file system mounted on a temporary directory, unmounted on drop (lazily if busy).
#[derive(Debug)]
pub struct Mounted {
    /// The mount point.
    pub dir: PathBuf,
}

impl Mounted {
    /// Mounts `dev` on a new directory `dir` (created; kept canonical, as the mount table shows it).
    pub fn mount(dev: &Path, dir: &Path) -> Result<Mounted, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let dir = dir.canonicalize().map_err(|e| format!("{}: {e}", dir.display()))?;
        run("mount", &[&dev.to_string_lossy(), &dir.to_string_lossy()])?;
        Ok(Mounted { dir })
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let d = self.dir.to_string_lossy().into_owned();
        if run("umount", &[&d]).is_err() {
            let _ = run("umount", &["-l", &d]);
        }
    }
}

/// `mkfs.ext4 -q -F` on `dev` (4096-byte blocks, so it also works on 4 KiB-sector devices).
pub fn mkfs_ext4(dev: &Path) -> Result<(), String> {
    run("mkfs.ext4", &["-q", "-F", "-b", "4096", &dev.to_string_lossy()]).map(drop)
}

/// A sparse file of `len` bytes.
pub fn sparse_file(path: &Path, len: u64) -> PathBuf {
    let f = std::fs::File::create(path).expect("create backing file");
    f.set_len(len).expect("size backing file");
    path.into()
}

/// Writes `bytes` at `offset` of the file `path` (no truncation).
pub fn poke(path: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).expect("open for poke");
    f.write_all_at(bytes, offset).expect("poke");
    f.sync_all().expect("sync poke");
}

/// A protective MBR (one entry of type 0xEE) and a GPT header signature (`"EFI PART"` at LBA 1 of
/// `sector` bytes): what `blkid`/`wipefs` would call a GPT disk, written without sfdisk.
pub fn write_gpt_signature(path: &Path, sector: u64) {
    let mut mbr = [0u8; 512];
    mbr[446 + 4] = 0xEE; // partition type: GPT protective
    mbr[446 + 8..446 + 12].copy_from_slice(&1u32.to_le_bytes()); // first LBA
    mbr[446 + 12..446 + 16].copy_from_slice(&u32::MAX.to_le_bytes()); // size (whole disk)
    mbr[510] = 0x55;
    mbr[511] = 0xAA;
    poke(path, 0, &mbr);
    let mut hdr = [0u8; 92];
    hdr[..8].copy_from_slice(b"EFI PART");
    hdr[8..12].copy_from_slice(&0x0001_0000u32.to_le_bytes()); // revision 1.0
    hdr[12..16].copy_from_slice(&92u32.to_le_bytes()); // header size
    hdr[24..32].copy_from_slice(&1u64.to_le_bytes()); // my LBA
    poke(path, sector, &hdr);
}

/// An MBR partition table with one Linux partition (type 0x83) from LBA `start` for `count` sectors:
/// the kernel parses it (no checksums), so `--partscan` creates `loopNp1`.
pub fn write_mbr_partition(path: &Path, start: u32, count: u32) {
    let mut mbr = [0u8; 512];
    mbr[446 + 4] = 0x83;
    mbr[446 + 8..446 + 12].copy_from_slice(&start.to_le_bytes());
    mbr[446 + 12..446 + 16].copy_from_slice(&count.to_le_bytes());
    mbr[510] = 0x55;
    mbr[511] = 0xAA;
    poke(path, 0, &mbr);
}
