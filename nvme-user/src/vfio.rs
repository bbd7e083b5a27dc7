//! VFIO: the container / group / device file descriptors, BAR0 mapped as an [`MmioBar`] (never
//! touching the MSI-X table), PCI bus mastering, and DMA mappings for [`HugepageDma`].
//!
//! Two IOMMU modes:
//! - **type1** (an IOMMU, or a vIOMMU in QEMU): `VFIO_IOMMU_MAP_DMA` maps each 2 MiB hugepage chunk at
//!   an IOVA we choose (from [`IOVA_BASE`] upwards).
//! - **no-IOMMU** (`vfio.enable_unsafe_noiommu_mode=1`, group `/dev/vfio/noiommu-N`): no translation,
//!   so the IOVA is the chunk's physical address from `/proc/self/pagemap` (needs CAP_SYS_ADMIN;
//!   hugepages do not move).
//!
//! The request numbers and argument layouts (linux/vfio.h) are in [`sys`]; every ioctl, the BAR0
//! mmap and getrlimit are one small private function each in `vfio_ioctls`, which has a `cfg(test)`
//! twin answering from a script so the error paths here run in unit tests without a kernel.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::bar::MmioBar;
use crate::ctrlr::{Controller, CtrlrOptions};
use crate::dma::{HugepageDma, Iova, IovaMapper};
use crate::error::{Error, Result};

/// First IOVA handed to DMA chunks in type1 mode (2 MiB aligned, clear of low addresses).
pub const IOVA_BASE: Iova = Iova(0x1_0000_0000);

/// The ioctl request numbers, constants and argument layouts of linux/vfio.h (the ioctls
/// themselves are issued by the private `vfio_ioctls` module).
pub mod sys {
    const VFIO_TYPE: u32 = b';' as u32;
    const VFIO_BASE: u32 = 100;
    const fn io(nr: u32) -> u32 {
        (VFIO_TYPE << 8) | (VFIO_BASE + nr)
    }
    /// VFIO_GET_API_VERSION.
    pub const GET_API_VERSION: u32 = io(0);
    /// VFIO_CHECK_EXTENSION.
    pub const CHECK_EXTENSION: u32 = io(1);
    /// VFIO_SET_IOMMU.
    pub const SET_IOMMU: u32 = io(2);
    /// VFIO_GROUP_GET_STATUS.
    pub const GROUP_GET_STATUS: u32 = io(3);
    /// VFIO_GROUP_SET_CONTAINER.
    pub const GROUP_SET_CONTAINER: u32 = io(4);
    /// VFIO_GROUP_GET_DEVICE_FD.
    pub const GROUP_GET_DEVICE_FD: u32 = io(6);
    /// VFIO_DEVICE_GET_REGION_INFO.
    pub const DEVICE_GET_REGION_INFO: u32 = io(8);
    /// VFIO_DEVICE_RESET.
    pub const DEVICE_RESET: u32 = io(11);
    /// VFIO_IOMMU_GET_INFO.
    pub const IOMMU_GET_INFO: u32 = io(12);
    /// VFIO_IOMMU_MAP_DMA.
    pub const IOMMU_MAP_DMA: u32 = io(13);
    /// VFIO_IOMMU_UNMAP_DMA.
    pub const IOMMU_UNMAP_DMA: u32 = io(14);
    /// VFIO_API_VERSION.
    pub const API_VERSION: i32 = 0;
    /// VFIO_TYPE1_IOMMU.
    pub const TYPE1_IOMMU: u64 = 1;
    /// VFIO_TYPE1v2_IOMMU.
    pub const TYPE1V2_IOMMU: u64 = 3;
    /// VFIO_NOIOMMU_IOMMU.
    pub const NOIOMMU_IOMMU: u64 = 8;
    /// VFIO_GROUP_FLAGS_VIABLE.
    pub const GROUP_FLAGS_VIABLE: u32 = 1;
    /// VFIO_REGION_INFO_FLAG_MMAP.
    pub const REGION_INFO_FLAG_MMAP: u32 = 4;
    /// VFIO_REGION_INFO_FLAG_CAPS.
    pub const REGION_INFO_FLAG_CAPS: u32 = 8;
    /// VFIO_REGION_INFO_CAP_SPARSE_MMAP.
    pub const REGION_INFO_CAP_SPARSE_MMAP: u16 = 1;
    /// VFIO_PCI_BAR0_REGION_INDEX.
    pub const PCI_BAR0_REGION_INDEX: u32 = 0;
    /// VFIO_PCI_CONFIG_REGION_INDEX.
    pub const PCI_CONFIG_REGION_INDEX: u32 = 7;
    /// VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE.
    pub const DMA_MAP_FLAG_RW: u32 = 3;
    /// VFIO_IOMMU_INFO_CAPS: `cap_offset` of vfio_iommu_type1_info is valid.
    pub const IOMMU_INFO_CAPS: u32 = 1 << 1;
    /// VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE.
    pub const IOMMU_TYPE1_INFO_CAP_IOVA_RANGE: u16 = 1;
    /// size of struct vfio_iommu_type1_info (argsz, flags, iova_pgsizes, cap_offset, pad).
    pub const IOMMU_TYPE1_INFO_LEN: u32 = 24;

    /// struct vfio_group_status.
    #[repr(C)]
    #[derive(Default, Debug)]
    pub struct GroupStatus {
        /// argsz.
        pub argsz: u32,
        /// flags.
        pub flags: u32,
    }

    /// struct vfio_region_info (fixed part).
    #[repr(C)]
    #[derive(Default, Debug, Clone, Copy)]
    pub struct RegionInfo {
        /// argsz.
        pub argsz: u32,
        /// flags.
        pub flags: u32,
        /// index.
        pub index: u32,
        /// cap_offset.
        pub cap_offset: u32,
        /// size.
        pub size: u64,
        /// offset into the device fd.
        pub offset: u64,
    }

    /// struct vfio_iommu_type1_dma_map.
    #[repr(C)]
    #[derive(Default, Debug)]
    pub struct DmaMap {
        /// argsz.
        pub argsz: u32,
        /// flags.
        pub flags: u32,
        /// vaddr.
        pub vaddr: u64,
        /// iova.
        pub iova: u64,
        /// size.
        pub size: u64,
    }

    /// struct vfio_iommu_type1_dma_unmap.
    #[repr(C)]
    #[derive(Default, Debug)]
    pub struct DmaUnmap {
        /// argsz.
        pub argsz: u32,
        /// flags.
        pub flags: u32,
        /// iova.
        pub iova: u64,
        /// size.
        pub size: u64,
    }

    /// struct vfio_iommu_type1_info (fixed part; capabilities follow within `argsz`).
    #[repr(C)]
    #[derive(Default, Debug, Clone, Copy)]
    pub struct IommuType1Info {
        /// argsz.
        pub argsz: u32,
        /// flags (VFIO_IOMMU_INFO_PGSIZES, VFIO_IOMMU_INFO_CAPS).
        pub flags: u32,
        /// Bitmap of supported IOMMU page sizes.
        pub iova_pgsizes: u64,
        /// Offset of the first capability header from the start of the struct (0: none).
        pub cap_offset: u32,
        /// pad.
        pub pad: u32,
    }

    const _: () = assert!(std::mem::size_of::<IommuType1Info>() == IOMMU_TYPE1_INFO_LEN as usize);
    const _: () = assert!(std::mem::size_of::<RegionInfo>() == 32);
    const _: () = assert!(std::mem::size_of::<DmaMap>() == 32);
    const _: () = assert!(std::mem::size_of::<DmaUnmap>() == 24);
}

/// A failed VFIO ioctl (or mmap): which one, and the OS error. The caller adds what it was done
/// on ([`SysError::on`]) to make an [`Error::Vfio`].
#[derive(Debug)]
struct SysError {
    /// The request's name in linux/vfio.h (`VFIO_GROUP_GET_STATUS`), or `mmap`.
    op: &'static str,
    /// errno.
    source: std::io::Error,
}

impl SysError {
    /// The crate error for this failure on `what` (a device, group or path).
    fn on(self, what: impl Into<String>) -> Error {
        Error::Vfio { op: self.op, what: what.into(), source: self.source }
    }
}

type SysResult<T> = std::result::Result<T, SysError>;

/// One small function per VFIO ioctl this module issues (and the BAR0 mmap, and getrlimit), each
/// with its own `SAFETY:` argument and a [`SysError`] naming the request. Under `cfg(test)` a twin
/// module of the same name replaces it with scripted results, so the callers' error paths run in
/// unit tests without a kernel (rust-vmm's vfio-ioctls does the same).
#[cfg(not(test))]
mod vfio_ioctls {
    use std::ffi::CStr;
    use std::fs::File;
    use std::os::fd::{AsRawFd, FromRawFd};

    use super::sys::{self, DmaMap, DmaUnmap, GroupStatus, IommuType1Info, RegionInfo};
    use super::{SysError, SysResult};

    /// errno of the failed `op`.
    fn last(op: &'static str) -> SysError {
        SysError { op, source: std::io::Error::last_os_error() }
    }

    /// `ret` as a result: negative is the errno of `op`.
    fn check(op: &'static str, ret: libc::c_int) -> SysResult<libc::c_int> {
        if ret < 0 {
            Err(last(op))
        } else {
            Ok(ret)
        }
    }

    /// A zeroed buffer of `argsz` bytes (rounded up to 8-byte words, aligned for the struct at its
    /// start) whose first words are `head`, for an ioctl struct followed by capabilities.
    fn words(argsz: u32, head: &[u64]) -> Vec<u64> {
        let mut buf = vec![0u64; (argsz as usize).div_ceil(8).max(head.len())];
        buf[..head.len()].copy_from_slice(head);
        buf
    }

    fn bytes(words: &[u64], argsz: u32) -> Vec<u8> {
        let mut b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        b.truncate(argsz as usize);
        b
    }

    /// VFIO_GET_API_VERSION on the container.
    pub(super) fn get_api_version(container: &File) -> SysResult<i32> {
        // SAFETY: the request takes no argument; the fd is a live file.
        check("VFIO_GET_API_VERSION", unsafe { libc::ioctl(container.as_raw_fd(), sys::GET_API_VERSION as _) })
    }

    /// VFIO_CHECK_EXTENSION: whether the container supports IOMMU type `ext`.
    pub(super) fn check_extension(container: &File, ext: u64) -> SysResult<bool> {
        // SAFETY: the request takes its argument by value; no memory is passed.
        let r = unsafe { libc::ioctl(container.as_raw_fd(), sys::CHECK_EXTENSION as _, ext as libc::c_ulong) };
        check("VFIO_CHECK_EXTENSION", r).map(|r| r > 0)
    }

    /// VFIO_SET_IOMMU: the container's IOMMU type (after a group is attached).
    pub(super) fn set_iommu(container: &File, iommu: u64) -> SysResult<()> {
        // SAFETY: the request takes its argument by value; no memory is passed.
        let r = unsafe { libc::ioctl(container.as_raw_fd(), sys::SET_IOMMU as _, iommu as libc::c_ulong) };
        check("VFIO_SET_IOMMU", r).map(drop)
    }

    /// VFIO_GROUP_GET_STATUS: the group's flags (VFIO_GROUP_FLAGS_VIABLE, ...).
    pub(super) fn group_get_status(group: &File) -> SysResult<GroupStatus> {
        let mut st = GroupStatus { argsz: std::mem::size_of::<GroupStatus>() as u32, flags: 0 };
        // SAFETY: the request writes one vfio_group_status (argsz = its size) into `st`, which is
        // that `repr(C)` struct and lives for the call.
        let r = unsafe { libc::ioctl(group.as_raw_fd(), sys::GROUP_GET_STATUS as _, &mut st as *mut GroupStatus) };
        check("VFIO_GROUP_GET_STATUS", r).map(|_| st)
    }

    /// VFIO_GROUP_SET_CONTAINER: attaches the group to `container`.
    pub(super) fn group_set_container(group: &File, container: &File) -> SysResult<()> {
        let fd: libc::c_int = container.as_raw_fd();
        // SAFETY: the request reads one int (the container fd) through the pointer; `fd` lives for
        // the call and names a file `container` keeps open.
        let r = unsafe { libc::ioctl(group.as_raw_fd(), sys::GROUP_SET_CONTAINER as _, &fd as *const libc::c_int) };
        check("VFIO_GROUP_SET_CONTAINER", r).map(drop)
    }

    /// VFIO_GROUP_GET_DEVICE_FD with the device name (`0000:01:00.0`): the new device fd.
    pub(super) fn group_get_device_fd(group: &File, name: &CStr) -> SysResult<File> {
        // SAFETY: the request reads a NUL-terminated string, which `name` is, alive for the call.
        let fd = unsafe { libc::ioctl(group.as_raw_fd(), sys::GROUP_GET_DEVICE_FD as _, name.as_ptr()) };
        let fd = check("VFIO_GROUP_GET_DEVICE_FD", fd)?;
        // SAFETY: the kernel returned a new fd that nothing else owns.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// VFIO_DEVICE_GET_REGION_INFO (fixed part) of region `index`. A returned `argsz` larger than
    /// the struct means capabilities follow: see [`device_get_region_info_caps`].
    pub(super) fn device_get_region_info(device: &File, index: u32) -> SysResult<RegionInfo> {
        let mut info = RegionInfo { argsz: std::mem::size_of::<RegionInfo>() as u32, index, ..Default::default() };
        // SAFETY: the request reads and writes one vfio_region_info of `argsz` (= its size) bytes at
        // the pointer; `info` is that `repr(C)` struct and lives for the call.
        let r =
            unsafe { libc::ioctl(device.as_raw_fd(), sys::DEVICE_GET_REGION_INFO as _, &mut info as *mut RegionInfo) };
        check("VFIO_DEVICE_GET_REGION_INFO", r).map(|_| info)
    }

    /// VFIO_DEVICE_GET_REGION_INFO of region `index` with room for `argsz` bytes: the struct and its
    /// capability chain as the kernel filled them (`argsz` bytes).
    pub(super) fn device_get_region_info_caps(device: &File, index: u32, argsz: u32) -> SysResult<Vec<u8>> {
        // argsz and flags in word 0 (little-endian u32s), index in the low half of word 1.
        let mut buf = words(argsz, &[u64::from(argsz), u64::from(index)]);
        // SAFETY: `buf` holds at least `argsz` bytes, 8-byte aligned, and starts with a
        // vfio_region_info whose argsz says so; the kernel writes at most argsz bytes; it lives for
        // the call.
        let r = unsafe { libc::ioctl(device.as_raw_fd(), sys::DEVICE_GET_REGION_INFO as _, buf.as_mut_ptr()) };
        check("VFIO_DEVICE_GET_REGION_INFO", r).map(|_| bytes(&buf, argsz))
    }

    /// VFIO_IOMMU_GET_INFO (fixed part). A returned `argsz` larger than the struct means the
    /// capabilities did not fit: see [`iommu_get_info_caps`].
    pub(super) fn iommu_get_info(container: &File) -> SysResult<IommuType1Info> {
        let mut info = IommuType1Info { argsz: sys::IOMMU_TYPE1_INFO_LEN, ..Default::default() };
        // SAFETY: the request reads and writes one vfio_iommu_type1_info of `argsz` (24, = its size)
        // bytes at the pointer; `info` is that `repr(C)` struct and lives for the call.
        let r =
            unsafe { libc::ioctl(container.as_raw_fd(), sys::IOMMU_GET_INFO as _, &mut info as *mut IommuType1Info) };
        check("VFIO_IOMMU_GET_INFO", r).map(|_| info)
    }

    /// VFIO_IOMMU_GET_INFO with room for `argsz` bytes: the struct and its capability chain.
    pub(super) fn iommu_get_info_caps(container: &File, argsz: u32) -> SysResult<Vec<u8>> {
        let mut buf = words(argsz, &[u64::from(argsz)]);
        // SAFETY: `buf` holds at least `argsz` bytes, 8-byte aligned, and starts with a
        // vfio_iommu_type1_info whose argsz says so; the kernel writes at most argsz bytes.
        let r = unsafe { libc::ioctl(container.as_raw_fd(), sys::IOMMU_GET_INFO as _, buf.as_mut_ptr()) };
        check("VFIO_IOMMU_GET_INFO", r).map(|_| bytes(&buf, argsz))
    }

    /// VFIO_IOMMU_MAP_DMA.
    ///
    /// # Safety
    /// `m.vaddr .. + m.size` must be memory of this process that stays mapped (and is not reused)
    /// until [`iommu_unmap_dma`] of the same range: the device reads and writes it until then.
    pub(super) unsafe fn iommu_map_dma(container: &File, m: &DmaMap) -> SysResult<()> {
        // SAFETY: the request reads one vfio_iommu_type1_dma_map (argsz 32 = its size) through the
        // pointer, alive for the call; the memory it names stays valid per this function's contract.
        let r = unsafe { libc::ioctl(container.as_raw_fd(), sys::IOMMU_MAP_DMA as _, m as *const DmaMap) };
        check("VFIO_IOMMU_MAP_DMA", r).map(drop)
    }

    /// VFIO_IOMMU_UNMAP_DMA (the kernel writes the unmapped size back into `u`).
    pub(super) fn iommu_unmap_dma(container: &File, u: &mut DmaUnmap) -> SysResult<()> {
        // SAFETY: the request reads and writes one vfio_iommu_type1_dma_unmap (argsz 24 = its size)
        // at the pointer; `u` is that `repr(C)` struct and lives for the call. Unmapping only
        // removes device access.
        let r = unsafe { libc::ioctl(container.as_raw_fd(), sys::IOMMU_UNMAP_DMA as _, u as *mut DmaUnmap) };
        check("VFIO_IOMMU_UNMAP_DMA", r).map(drop)
    }

    /// A shared read/write mapping of `len` bytes of `f` at `offset` (a device region).
    pub(super) fn mmap_shared(f: &File, len: usize, offset: u64) -> SysResult<*mut u8> {
        // SAFETY: a new mapping without an address hint aliases nothing; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            Err(last("mmap"))
        } else {
            Ok(p.cast())
        }
    }

    /// Unmaps what [`mmap_shared`] mapped.
    ///
    /// # Safety
    /// `p`/`len` must be a live mapping from [`mmap_shared`] that nothing uses any more.
    pub(super) unsafe fn munmap(p: *mut u8, len: usize) {
        // SAFETY: per the contract.
        unsafe { libc::munmap(p.cast(), len) };
    }

    /// RLIMIT_MEMLOCK's soft limit in bytes (`None`: unlimited); `Err` when getrlimit fails.
    pub(super) fn memlock_limit() -> std::result::Result<Option<u64>, ()> {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit into `lim`, which lives for the call.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
            return Err(());
        }
        Ok((lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur))
    }
}

/// The `cfg(test)` twin of the ioctl module: the same functions, answering from a per-thread
/// [`Script`] (each unit test runs on its own thread) and recording what was asked, so the error
/// paths of [`VfioDevice::open`] and the DMA mapper run without a kernel or a device.
#[cfg(test)]
mod vfio_ioctls {
    use std::cell::RefCell;
    use std::ffi::CStr;
    use std::fs::File;

    use super::sys::{self, DmaMap, DmaUnmap, GroupStatus, IommuType1Info, RegionInfo};
    use super::{SysError, SysResult};

    /// What the twin answers, and what it was asked.
    pub(super) struct Script {
        /// VFIO_GET_API_VERSION's answer.
        pub api_version: i32,
        /// Whether VFIO_CHECK_EXTENSION(TYPE1v2) says yes.
        pub type1v2: bool,
        /// VFIO_GROUP_GET_STATUS's flags.
        pub group_flags: u32,
        /// Requests that fail, with their errno.
        pub fail: Vec<(&'static str, i32)>,
        /// The vfio_iommu_type1_info bytes VFIO_IOMMU_GET_INFO fills (its `argsz` may ask for more).
        pub iommu_info: Vec<u8>,
        /// RLIMIT_MEMLOCK (`None`: unlimited).
        pub memlock: Option<u64>,
        /// Asked: VFIO_SET_IOMMU's type.
        pub set_iommu: Option<u64>,
        /// Asked: each MAP_DMA's `(iova, size)`.
        pub mapped: Vec<(u64, u64)>,
        /// Asked: each UNMAP_DMA's `(iova, size)`.
        pub unmapped: Vec<(u64, u64)>,
    }

    impl Default for Script {
        fn default() -> Script {
            let mut iommu_info = vec![0u8; sys::IOMMU_TYPE1_INFO_LEN as usize];
            iommu_info[0..4].copy_from_slice(&sys::IOMMU_TYPE1_INFO_LEN.to_le_bytes());
            Script {
                api_version: sys::API_VERSION,
                type1v2: true,
                group_flags: sys::GROUP_FLAGS_VIABLE,
                fail: Vec::new(),
                iommu_info,
                memlock: Some(8 << 20),
                set_iommu: None,
                mapped: Vec::new(),
                unmapped: Vec::new(),
            }
        }
    }

    thread_local! {
        static SCRIPT: RefCell<Script> = RefCell::new(Script::default());
    }

    /// Runs `f` on this thread's script.
    pub(super) fn script<R>(f: impl FnOnce(&mut Script) -> R) -> R {
        SCRIPT.with(|s| f(&mut s.borrow_mut()))
    }

    /// `Err` with the scripted errno when `op` is to fail.
    fn scripted(op: &'static str) -> SysResult<()> {
        match script(|s| s.fail.iter().find(|f| f.0 == op).map(|f| f.1)) {
            Some(errno) => Err(SysError { op, source: std::io::Error::from_raw_os_error(errno) }),
            None => Ok(()),
        }
    }

    pub(super) fn get_api_version(_container: &File) -> SysResult<i32> {
        scripted("VFIO_GET_API_VERSION")?;
        Ok(script(|s| s.api_version))
    }

    pub(super) fn check_extension(_container: &File, ext: u64) -> SysResult<bool> {
        scripted("VFIO_CHECK_EXTENSION")?;
        Ok(ext == sys::TYPE1_IOMMU || (ext == sys::TYPE1V2_IOMMU && script(|s| s.type1v2)))
    }

    pub(super) fn set_iommu(_container: &File, iommu: u64) -> SysResult<()> {
        scripted("VFIO_SET_IOMMU")?;
        script(|s| s.set_iommu = Some(iommu));
        Ok(())
    }

    pub(super) fn group_get_status(_group: &File) -> SysResult<GroupStatus> {
        scripted("VFIO_GROUP_GET_STATUS")?;
        Ok(GroupStatus { argsz: 8, flags: script(|s| s.group_flags) })
    }

    pub(super) fn group_set_container(_group: &File, _container: &File) -> SysResult<()> {
        scripted("VFIO_GROUP_SET_CONTAINER")
    }

    /// A temporary file of 4 KiB of zeros stands in for the device fd (its config space: no
    /// capability list).
    pub(super) fn group_get_device_fd(_group: &File, _name: &CStr) -> SysResult<File> {
        scripted("VFIO_GROUP_GET_DEVICE_FD")?;
        let f = tempfile::tempfile().expect("temporary file");
        f.set_len(4096).expect("set_len");
        Ok(f)
    }

    /// Every region: 16 KiB at offset 0 of the device fd, mmap-able, no capabilities.
    pub(super) fn device_get_region_info(_device: &File, index: u32) -> SysResult<RegionInfo> {
        scripted("VFIO_DEVICE_GET_REGION_INFO")?;
        let flags = sys::REGION_INFO_FLAG_MMAP;
        Ok(RegionInfo { argsz: 32, flags, index, cap_offset: 0, size: 0x4000, offset: 0 })
    }

    pub(super) fn device_get_region_info_caps(_device: &File, _index: u32, _argsz: u32) -> SysResult<Vec<u8>> {
        unreachable!("the twin's regions have no capabilities")
    }

    /// The script's `iommu_info`, cut to the fixed part (its `argsz` says how much there is).
    pub(super) fn iommu_get_info(_container: &File) -> SysResult<IommuType1Info> {
        scripted("VFIO_IOMMU_GET_INFO")?;
        let b = script(|s| s.iommu_info.clone());
        let u32at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Ok(IommuType1Info {
            argsz: u32at(0),
            flags: u32at(4),
            iova_pgsizes: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            cap_offset: u32at(16),
            pad: 0,
        })
    }

    pub(super) fn iommu_get_info_caps(_container: &File, argsz: u32) -> SysResult<Vec<u8>> {
        scripted("VFIO_IOMMU_GET_INFO")?;
        let mut b = script(|s| s.iommu_info.clone());
        b.resize(argsz as usize, 0);
        Ok(b)
    }

    /// # Safety
    /// None here (nothing is mapped); `unsafe` to match the real function.
    pub(super) unsafe fn iommu_map_dma(_container: &File, m: &DmaMap) -> SysResult<()> {
        scripted("VFIO_IOMMU_MAP_DMA")?;
        script(|s| s.mapped.push((m.iova, m.size)));
        Ok(())
    }

    pub(super) fn iommu_unmap_dma(_container: &File, u: &mut DmaUnmap) -> SysResult<()> {
        script(|s| s.unmapped.push((u.iova, u.size)));
        scripted("VFIO_IOMMU_UNMAP_DMA")
    }

    pub(super) fn mmap_shared(_f: &File, _len: usize, _offset: u64) -> SysResult<*mut u8> {
        scripted("mmap")?;
        Err(SysError { op: "mmap", source: std::io::Error::from_raw_os_error(libc::ENODEV) })
    }

    /// # Safety
    /// Never called: the twin's [`mmap_shared`] maps nothing.
    pub(super) unsafe fn munmap(_p: *mut u8, _len: usize) {
        unreachable!("the twin maps nothing")
    }

    pub(super) fn memlock_limit() -> std::result::Result<Option<u64>, ()> {
        Ok(script(|s| s.memlock))
    }
}

fn vfio_err(op: &'static str, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Vfio { op, what, source }
}

/// An open VFIO device (with its group and container).
pub struct VfioDevice {
    bdf: String,
    container: File,
    _group: File,
    device: File,
    noiommu: bool,
    config: sys::RegionInfo,
    /// Usable IOVA ranges reported by the type1 IOMMU (inclusive ends); empty in no-IOMMU mode or
    /// when the kernel reports none (before Linux 5.4), in which case MAP_DMA alone decides.
    iova_ranges: Vec<IovaRange>,
}

/// One usable IOVA range of the IOMMU, `start..=end` (struct vfio_iova_range, linux/vfio.h). Its
/// ends reflect the IOMMU's address width (e.g. `end` = 2^39 − 1 for a 39-bit Intel VT-d) and the
/// holes it reserves (the MSI window at 0xfee00000, RMRRs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IovaRange {
    /// First usable IOVA.
    pub start: u64,
    /// Last usable IOVA (inclusive).
    pub end: u64,
}

impl IovaRange {
    /// Whether `iova .. iova + len` lies inside this range (`len` > 0, no overflow).
    pub fn contains(&self, iova: u64, len: u64) -> bool {
        len > 0 && iova >= self.start && iova.checked_add(len - 1).is_some_and(|last| last <= self.end)
    }
}

/// Parses the VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE capability out of a vfio_iommu_type1_info
/// buffer (`buf` = the `argsz` bytes the kernel filled): the capability chain starts at
/// `cap_offset` (byte 16); each header is `id: u16, version: u16, next: u32`; the IOVA-range
/// capability then holds `nr_iovas: u32, reserved: u32` and `nr_iovas` × `{start: u64, end: u64}`.
/// Chains that point outside `buf` or loop are cut short, never followed out of bounds.
pub fn parse_iova_ranges(buf: &[u8]) -> Vec<IovaRange> {
    let u16at = |o: usize| buf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32at = |o: usize| buf.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let u64at = |o: usize| buf.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let mut out = Vec::new();
    let Some(flags) = u32at(4) else { return out };
    if flags & sys::IOMMU_INFO_CAPS == 0 {
        return out;
    }
    let mut off = u32at(16).unwrap_or(0) as usize;
    let mut hops = 0;
    while off != 0 && hops < 16 {
        hops += 1;
        let (Some(id), Some(next)) = (u16at(off), u32at(off + 4)) else { break };
        if id == sys::IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
            let n = u32at(off + 8).unwrap_or(0) as usize;
            for i in 0..n {
                let a = off + 16 + i * 16;
                match (u64at(a), u64at(a + 8)) {
                    (Some(start), Some(end)) if start <= end => out.push(IovaRange { start, end }),
                    _ => break,
                }
            }
        }
        off = next as usize;
    }
    out
}

/// `ranges` as `[0x0-0xfedfffff, 0xfef00000-0x7fffffffff]` for error messages.
fn describe_ranges(ranges: &[IovaRange]) -> String {
    let parts: Vec<String> = ranges.iter().map(|r| format!("{:#x}-{:#x}", r.start, r.end)).collect();
    format!("[{}]", parts.join(", "))
}

impl VfioDevice {
    /// Opens PCI function `bdf` (e.g. `0000:00:02.0`), already bound to vfio-pci.
    ///
    /// # Errors
    /// [`Error::Vfio`] naming the failing step.
    pub fn open(bdf: &str) -> Result<VfioDevice> {
        let link = std::fs::read_link(format!("/sys/bus/pci/devices/{bdf}/iommu_group"))
            .map_err(vfio_err("readlink iommu_group", bdf))?;
        let group_no = link.file_name().and_then(|s| s.to_str()).unwrap_or("").to_string();
        let open = |p: &str| std::fs::OpenOptions::new().read(true).write(true).open(p);
        let (group_path, noiommu) = if std::path::Path::new(&format!("/dev/vfio/{group_no}")).exists() {
            (format!("/dev/vfio/{group_no}"), false)
        } else {
            (format!("/dev/vfio/noiommu-{group_no}"), true)
        };
        let container = open("/dev/vfio/vfio").map_err(vfio_err("open", "/dev/vfio/vfio"))?;
        let group = open(&group_path).map_err(vfio_err("open", group_path.clone()))?;
        VfioDevice::attach(bdf, container, group, &group_path, noiommu)
    }

    /// The ioctl sequence of [`VfioDevice::open`] on an open container and group (`group_path`
    /// for messages): check the API version, check the group is viable, attach it to the container,
    /// set the IOMMU type (no-IOMMU, else type1v2 when the container has it, else type1), get the
    /// device fd, read the type1 IOMMU's usable IOVA ranges and the config-space region.
    fn attach(bdf: &str, container: File, group: File, group_path: &str, noiommu: bool) -> Result<VfioDevice> {
        let v = vfio_ioctls::get_api_version(&container).map_err(|e| e.on("container"))?;
        if v != sys::API_VERSION {
            return Err(Error::Unsupported { what: format!("VFIO API version {v}, want {}", sys::API_VERSION) });
        }
        let st = vfio_ioctls::group_get_status(&group).map_err(|e| e.on(group_path))?;
        if st.flags & sys::GROUP_FLAGS_VIABLE == 0 {
            return Err(Error::Unsupported {
                what: format!("VFIO group {group_path} is not viable (bind every device in it to vfio-pci)"),
            });
        }
        vfio_ioctls::group_set_container(&group, &container).map_err(|e| e.on(group_path))?;
        let iommu = if noiommu {
            sys::NOIOMMU_IOMMU
        } else if vfio_ioctls::check_extension(&container, sys::TYPE1V2_IOMMU).unwrap_or(false) {
            sys::TYPE1V2_IOMMU
        } else {
            sys::TYPE1_IOMMU
        };
        vfio_ioctls::set_iommu(&container, iommu).map_err(|e| e.on(format!("type {iommu}")))?;
        let name = std::ffi::CString::new(bdf).map_err(|_| Error::Vfio {
            op: "VFIO_GROUP_GET_DEVICE_FD",
            what: bdf.to_string(),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
        let device = vfio_ioctls::group_get_device_fd(&group, &name).map_err(|e| e.on(bdf))?;
        let iova_ranges = if noiommu { Vec::new() } else { iommu_iova_ranges(&container)? };
        if !iova_ranges.is_empty() {
            tracing::debug!(bdf, ranges = %describe_ranges(&iova_ranges), "IOMMU usable IOVA ranges");
            if !iova_ranges.iter().any(|r| r.contains(IOVA_BASE.0, HUGEPAGE_LEN)) {
                return Err(Error::Unsupported {
                    what: format!(
                        "the IOMMU behind {bdf} has no usable IOVA at {:#x} (first DMA chunk); its ranges are {}",
                        IOVA_BASE.0,
                        describe_ranges(&iova_ranges)
                    ),
                });
            }
        }
        let mut d = VfioDevice {
            bdf: bdf.to_string(),
            container,
            _group: group,
            device,
            noiommu,
            config: Default::default(),
            iova_ranges,
        };
        d.config = d.region_info(sys::PCI_CONFIG_REGION_INDEX)?.0;
        Ok(d)
    }

    /// The type1 IOMMU's usable IOVA ranges (empty in no-IOMMU mode or on kernels before 5.4,
    /// which do not report them).
    pub fn iova_ranges(&self) -> &[IovaRange] {
        &self.iova_ranges
    }

    /// The PCI address.
    pub fn bdf(&self) -> &str {
        &self.bdf
    }
    /// Whether the group is a no-IOMMU group (IOVA = physical address).
    pub fn noiommu(&self) -> bool {
        self.noiommu
    }

    /// Region info plus the sparse-mmap areas `(offset, size)` if the region has that capability.
    fn region_info(&self, index: u32) -> Result<(sys::RegionInfo, Vec<(u64, u64)>)> {
        let info = vfio_ioctls::device_get_region_info(&self.device, index)
            .map_err(|e| e.on(format!("{} region {index}", self.bdf)))?;
        let mut areas = Vec::new();
        if info.flags & sys::REGION_INFO_FLAG_CAPS != 0 && info.argsz > 32 {
            let bytes = vfio_ioctls::device_get_region_info_caps(&self.device, index, info.argsz)
                .map_err(|e| e.on(format!("{} region {index} caps", self.bdf)))?;
            let u16at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]);
            let u32at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4"));
            let u64at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8"));
            let mut off = u32at(12) as usize; // cap_offset
            let mut guard = 0;
            while off != 0 && off + 8 <= bytes.len() && guard < 16 {
                guard += 1;
                let (id, next) = (u16at(off), u32at(off + 4) as usize);
                if id == sys::REGION_INFO_CAP_SPARSE_MMAP && off + 16 <= bytes.len() {
                    let n = u32at(off + 8) as usize;
                    for i in 0..n {
                        let a = off + 16 + i * 16;
                        if a + 16 <= bytes.len() {
                            areas.push((u64at(a), u64at(a + 8)));
                        }
                    }
                }
                off = next;
            }
        }
        Ok((info, areas))
    }

    fn config_read(&self, off: u64, out: &mut [u8]) -> Result<()> {
        self.device
            .read_exact_at(out, self.config.offset + off)
            .map_err(vfio_err("pread config space", self.bdf.clone()))
    }

    /// Sets Memory Space Enable and Bus Master Enable in the PCI Command register (config 0x04).
    ///
    /// # Errors
    /// [`Error::Vfio`].
    pub fn enable_bus_master(&self) -> Result<()> {
        let mut cmd = [0u8; 2];
        self.config_read(4, &mut cmd)?;
        let v = u16::from_le_bytes(cmd) | 0x6;
        self.device
            .write_all_at(&v.to_le_bytes(), self.config.offset + 4)
            .map_err(vfio_err("pwrite config space", self.bdf.clone()))
    }

    /// The BAR0 byte range of the MSI-X table (from the MSI-X capability, ID 11h), page-rounded.
    fn msix_table_hole(&self) -> Result<std::ops::Range<usize>> {
        let mut cfg = vec![0u8; 256];
        self.config_read(0, &mut cfg)?;
        if cfg[6] & 0x10 == 0 {
            return Ok(0..0); // no capability list
        }
        let mut p = usize::from(cfg[0x34] & !3);
        for _ in 0..48 {
            if p == 0 || p + 8 > cfg.len() {
                break;
            }
            if cfg[p] == 0x11 {
                let ctrl = u16::from_le_bytes([cfg[p + 2], cfg[p + 3]]);
                let table = u32::from_le_bytes(cfg[p + 4..p + 8].try_into().expect("4"));
                if table & 7 != 0 {
                    return Ok(0..0); // table in another BAR
                }
                let start = (table & !7) as usize;
                let len = (usize::from(ctrl & 0x7FF) + 1) * 16;
                return Ok(start & !0xFFF..(start + len).div_ceil(4096) * 4096);
            }
            p = usize::from(cfg[p + 1] & !3);
        }
        Ok(0..0)
    }

    /// Maps BAR0 (the sparse-mmap area at offset 0 when the kernel restricts mapping) as an [`MmioBar`]
    /// that refuses any access inside the MSI-X table.
    ///
    /// # Errors
    /// [`Error::Vfio`], or [`Error::Unsupported`] if BAR0 cannot be mmapped.
    pub fn map_bar0(self: &Arc<Self>) -> Result<MmioBar> {
        let (info, areas) = self.region_info(sys::PCI_BAR0_REGION_INDEX)?;
        if info.flags & sys::REGION_INFO_FLAG_MMAP == 0 {
            return Err(Error::Unsupported { what: format!("{}: BAR0 is not mmap-able", self.bdf) });
        }
        let len = match areas.iter().find(|a| a.0 == 0) {
            Some(&(_, size)) => size as usize,
            None if areas.is_empty() => info.size as usize,
            None => {
                return Err(Error::Unsupported {
                    what: format!("{}: no mmap-able BAR0 area at 0: {areas:?}", self.bdf),
                })
            }
        };
        let hole = self.msix_table_hole()?;
        let p = vfio_ioctls::mmap_shared(&self.device, len, info.offset).map_err(|e| Error::Vfio {
            op: "mmap BAR0",
            what: self.bdf.clone(),
            source: e.source,
        })?;
        struct Mapping(*mut u8, usize, #[allow(dead_code)] Arc<VfioDevice>);
        // SAFETY: the mapping is only an address range; `MmioBar` does the accesses.
        unsafe impl Send for Mapping {}
        // SAFETY: as for `Send`.
        unsafe impl Sync for Mapping {}
        impl Drop for Mapping {
            fn drop(&mut self) {
                // SAFETY: mapped by `mmap_shared` with this length; the `MmioBar` that used it is gone.
                unsafe { vfio_ioctls::munmap(self.0, self.1) }
            }
        }
        tracing::debug!(bdf = %self.bdf, len, ?hole, "BAR0 mapped");
        let owner = Box::new(Mapping(p, len, self.clone()));
        // SAFETY: `p..p + len` is a live, page-aligned device mapping kept alive by `owner`.
        Ok(unsafe { MmioBar::new(p, len, hole, owner) })
    }

    /// A hugepage DMA allocator mapping its chunks for this device.
    pub fn dma(self: &Arc<Self>) -> HugepageDma {
        HugepageDma::new(Arc::new(VfioMapper { dev: self.clone() }), IOVA_BASE)
    }
}

struct VfioMapper {
    dev: Arc<VfioDevice>,
}

/// Bytes of one DMA chunk (a 2 MiB hugepage), the unit the IOVA check at open uses.
const HUGEPAGE_LEN: u64 = 2 << 20;

/// What to do when VFIO_IOMMU_MAP_DMA fails with ENOMEM: the type1 IOMMU driver pins the pages and
/// charges them to the process's RLIMIT_MEMLOCK unless it has CAP_IPC_LOCK (vfio_iommu_type1.c,
/// `vfio_pin_pages_remote`), so a non-root user with the default 8 MiB limit hits it first.
fn memlock_hint() -> String {
    let cur = match vfio_ioctls::memlock_limit() {
        Err(()) => "unknown".to_string(),
        Ok(None) => "unlimited".to_string(),
        Ok(Some(bytes)) => format!("{} KiB", bytes / 1024),
    };
    format!(
        " (ENOMEM: VFIO pins DMA memory against RLIMIT_MEMLOCK, now {cur}; raise it with `ulimit -l` / \
         limits.conf, or run with CAP_IPC_LOCK)"
    )
}

/// VFIO_IOMMU_GET_INFO on a container whose IOMMU type is set: the usable IOVA ranges.
fn iommu_iova_ranges(container: &File) -> Result<Vec<IovaRange>> {
    let info = vfio_ioctls::iommu_get_info(container).map_err(|e| e.on("container"))?;
    if info.flags & sys::IOMMU_INFO_CAPS == 0 || info.argsz <= sys::IOMMU_TYPE1_INFO_LEN {
        return Ok(Vec::new());
    }
    // The capabilities did not fit: ask again with a buffer of the size the kernel asked for.
    let bytes = vfio_ioctls::iommu_get_info_caps(container, info.argsz).map_err(|e| e.on("container capabilities"))?;
    Ok(parse_iova_ranges(&bytes))
}

fn pagemap_phys(vaddr: *mut u8) -> std::io::Result<u64> {
    let f = File::open("/proc/self/pagemap")?;
    let mut e = [0u8; 8];
    f.read_exact_at(&mut e, (vaddr as u64 / 4096) * 8)?;
    let e = u64::from_le_bytes(e);
    let pfn = e & ((1 << 55) - 1);
    if e >> 63 == 0 || pfn == 0 {
        return Err(std::io::Error::other("page not present or PFN hidden (needs CAP_SYS_ADMIN)"));
    }
    Ok(pfn * 4096 + vaddr as u64 % 4096)
}

impl IovaMapper for VfioMapper {
    fn map(&self, vaddr: *mut u8, len: usize, iova: Iova) -> Result<Iova> {
        if self.dev.noiommu {
            return pagemap_phys(vaddr).map(Iova).map_err(vfio_err("pagemap", format!("{vaddr:p}")));
        }
        let ranges = &self.dev.iova_ranges;
        if !ranges.is_empty() && !ranges.iter().any(|r| r.contains(iova.0, len as u64)) {
            return Err(Error::DmaMap {
                addr: vaddr as usize,
                len,
                why: format!(
                    "IOVA {:#x}..{:#x} is outside the IOMMU's usable ranges {} (its address width or a \
                     reserved window); the DMA pool is too large for this IOMMU",
                    iova.0,
                    iova.0.saturating_add(len as u64),
                    describe_ranges(ranges)
                ),
            });
        }
        let m =
            sys::DmaMap { argsz: 32, flags: sys::DMA_MAP_FLAG_RW, vaddr: vaddr as u64, iova: iova.0, size: len as u64 };
        // SAFETY: `IovaMapper::map`'s caller (the hugepage allocator) keeps `vaddr .. + len` mapped
        // for the device until `unmap`, which it calls before the chunk is munmapped.
        unsafe { vfio_ioctls::iommu_map_dma(&self.dev.container, &m) }.map_err(|e| {
            let mut what = format!("iova {:#x} + {len:#x}", iova.0);
            if e.source.raw_os_error() == Some(libc::ENOMEM) {
                // type1 pins the pages and charges them to RLIMIT_MEMLOCK (unless CAP_IPC_LOCK).
                what.push_str(&memlock_hint());
            }
            e.on(what)
        })?;
        Ok(iova)
    }
    fn translates(&self) -> bool {
        !self.dev.noiommu
    }
    fn unmap(&self, iova: Iova, len: usize) {
        if self.dev.noiommu {
            return;
        }
        let mut u = sys::DmaUnmap { argsz: 24, flags: 0, iova: iova.0, size: len as u64 };
        if let Err(e) = vfio_ioctls::iommu_unmap_dma(&self.dev.container, &mut u) {
            tracing::warn!(error = %e.source, iova = iova.0, "VFIO_IOMMU_UNMAP_DMA");
        }
    }
}

/// Opens `bdf` through VFIO, enables bus mastering, maps BAR0 and initializes the controller with
/// hugepage DMA memory.
///
/// # Errors
/// [`crate::Error::NoPciDevice`] when `/sys/bus/pci/devices/BDF` is absent (checked first, so an
/// absent device is not reported as a failed VFIO step); VFIO, DMA or controller-init errors.
pub fn open_controller(bdf: &str, opts: CtrlrOptions) -> Result<Controller> {
    if !std::path::Path::new("/sys/bus/pci/devices").join(bdf).exists() {
        return Err(crate::Error::NoPciDevice { bdf: bdf.into() });
    }
    let dev = Arc::new(VfioDevice::open(bdf)?);
    dev.enable_bus_master()?;
    let bar = Arc::new(dev.map_bar0()?);
    let dma = Arc::new(dev.dma());
    Controller::init(bar, dma, opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_linux_vfio_h() {
        assert_eq!(sys::GET_API_VERSION, 0x3B64);
        assert_eq!(sys::CHECK_EXTENSION, 0x3B65);
        assert_eq!(sys::SET_IOMMU, 0x3B66);
        assert_eq!(sys::GROUP_GET_STATUS, 0x3B67);
        assert_eq!(sys::GROUP_SET_CONTAINER, 0x3B68);
        assert_eq!(sys::GROUP_GET_DEVICE_FD, 0x3B6A);
        assert_eq!(sys::DEVICE_GET_REGION_INFO, 0x3B6C);
        assert_eq!(sys::DEVICE_RESET, 0x3B6F);
        assert_eq!(sys::IOMMU_GET_INFO, 0x3B70);
        assert_eq!(sys::IOMMU_MAP_DMA, 0x3B71);
        assert_eq!(sys::IOMMU_UNMAP_DMA, 0x3B72);
    }

    /// linux/ioctl.h's `_IOC(dir, type, nr, size)` (asm-generic layout: nr bits 0-7, type 8-15,
    /// size 16-29, dir 30-31), computed here independently of `sys`'s `io()`.
    fn ioc(dir: u32, ty: u8, nr: u32, size: u32) -> u32 {
        (dir << 30) | (size << 16) | (u32::from(ty) << 8) | nr
    }

    /// Every VFIO request is `_IO(VFIO_TYPE, VFIO_BASE + n)` (linux/vfio.h: VFIO_TYPE ';', VFIO_BASE
    /// 100, no direction or size bits: the argument size travels in `argsz`).
    #[test]
    fn ioctl_numbers_are_io_semicolon_100_plus_n() {
        let io = |n: u32| ioc(0, b';', 100 + n, 0);
        for (req, n, name) in [
            (sys::GET_API_VERSION, 0, "VFIO_GET_API_VERSION"),
            (sys::CHECK_EXTENSION, 1, "VFIO_CHECK_EXTENSION"),
            (sys::SET_IOMMU, 2, "VFIO_SET_IOMMU"),
            (sys::GROUP_GET_STATUS, 3, "VFIO_GROUP_GET_STATUS"),
            (sys::GROUP_SET_CONTAINER, 4, "VFIO_GROUP_SET_CONTAINER"),
            (sys::GROUP_GET_DEVICE_FD, 6, "VFIO_GROUP_GET_DEVICE_FD"),
            (sys::DEVICE_GET_REGION_INFO, 8, "VFIO_DEVICE_GET_REGION_INFO"),
            (sys::DEVICE_RESET, 11, "VFIO_DEVICE_RESET"),
            (sys::IOMMU_GET_INFO, 12, "VFIO_IOMMU_GET_INFO"),
            (sys::IOMMU_MAP_DMA, 13, "VFIO_IOMMU_MAP_DMA"),
            (sys::IOMMU_UNMAP_DMA, 14, "VFIO_IOMMU_UNMAP_DMA"),
        ] {
            assert_eq!(req, io(n), "{name} = _IO(';', 100 + {n})");
        }
        // The argument layouts the requests carry.
        assert_eq!(std::mem::size_of::<sys::GroupStatus>(), 8);
        assert_eq!(std::mem::size_of::<sys::RegionInfo>(), 32);
        assert_eq!(std::mem::size_of::<sys::DmaMap>(), 32);
        assert_eq!(std::mem::size_of::<sys::DmaUnmap>(), 24);
        assert_eq!(std::mem::size_of::<sys::IommuType1Info>(), 24);
    }

    /// [`VfioDevice::attach`] on stand-in files, against the twin ioctls as scripted by `setup`.
    fn attach_with(setup: impl FnOnce(&mut vfio_ioctls::Script), noiommu: bool) -> Result<VfioDevice> {
        vfio_ioctls::script(|s| {
            *s = vfio_ioctls::Script::default();
            setup(s);
        });
        let (container, group) = (tempfile::tempfile().unwrap(), tempfile::tempfile().unwrap());
        VfioDevice::attach("0000:01:00.0", container, group, "/dev/vfio/7", noiommu)
    }

    fn fail(op: &'static str, errno: i32) -> impl FnOnce(&mut vfio_ioctls::Script) {
        move |s| s.fail.push((op, errno))
    }

    /// The `Error::Vfio` parts of `e`: op, what, errno.
    fn vfio_parts(e: &Error) -> (&'static str, &str, Option<i32>) {
        match e {
            Error::Vfio { op, what, source } => (op, what, source.raw_os_error()),
            other => panic!("not Error::Vfio: {other:?}"),
        }
    }

    #[test]
    fn attach_sets_type1v2_when_the_container_has_it_else_type1_or_noiommu() {
        let d = attach_with(|_| {}, false).unwrap();
        assert_eq!(vfio_ioctls::script(|s| s.set_iommu), Some(sys::TYPE1V2_IOMMU));
        assert!(!d.noiommu() && d.iova_ranges().is_empty());
        assert_eq!((d.config.index, d.config.size), (sys::PCI_CONFIG_REGION_INDEX, 0x4000), "config region read");
        attach_with(|s| s.type1v2 = false, false).unwrap();
        assert_eq!(vfio_ioctls::script(|s| s.set_iommu), Some(sys::TYPE1_IOMMU));
        // A failing CHECK_EXTENSION means "not supported", not an error.
        attach_with(fail("VFIO_CHECK_EXTENSION", libc::EINVAL), false).unwrap();
        assert_eq!(vfio_ioctls::script(|s| s.set_iommu), Some(sys::TYPE1_IOMMU));
        let d = attach_with(|_| {}, true).unwrap();
        assert_eq!(vfio_ioctls::script(|s| s.set_iommu), Some(sys::NOIOMMU_IOMMU));
        assert!(d.noiommu());
    }

    #[test]
    fn a_wrong_api_version_is_unsupported() {
        let e = attach_with(|s| s.api_version = 1, false).err().expect("refused");
        assert!(matches!(&e, Error::Unsupported { what } if what == "VFIO API version 1, want 0"), "{e:?}");
        let e = attach_with(fail("VFIO_GET_API_VERSION", libc::ENOTTY), false).err().expect("refused");
        assert_eq!(vfio_parts(&e), ("VFIO_GET_API_VERSION", "container", Some(libc::ENOTTY)));
    }

    #[test]
    fn a_group_that_is_not_viable_is_unsupported() {
        let e = attach_with(|s| s.group_flags = 0, false).err().expect("refused");
        let Error::Unsupported { what } = &e else { panic!("{e:?}") };
        assert_eq!(what, "VFIO group /dev/vfio/7 is not viable (bind every device in it to vfio-pci)");
        assert_eq!(vfio_ioctls::script(|s| s.set_iommu), None, "stopped before SET_IOMMU");
        let e = attach_with(fail("VFIO_GROUP_GET_STATUS", libc::EFAULT), false).err().expect("refused");
        assert_eq!(vfio_parts(&e), ("VFIO_GROUP_GET_STATUS", "/dev/vfio/7", Some(libc::EFAULT)));
    }

    #[test]
    fn each_failing_setup_ioctl_is_named_with_what_it_was_done_on() {
        for (op, what) in [
            ("VFIO_GROUP_SET_CONTAINER", "/dev/vfio/7"),
            ("VFIO_SET_IOMMU", "type 3"),
            ("VFIO_GROUP_GET_DEVICE_FD", "0000:01:00.0"),
            ("VFIO_IOMMU_GET_INFO", "container"),
            ("VFIO_DEVICE_GET_REGION_INFO", "0000:01:00.0 region 7"),
        ] {
            let e = attach_with(fail(op, libc::EBUSY), false).err().expect("refused");
            assert_eq!(vfio_parts(&e), (op, what, Some(libc::EBUSY)));
            assert_eq!(e.to_string(), format!("VFIO {op} on {what}"));
            assert!(picchio_core::error::chain(&e)
                .to_string()
                .ends_with(&std::io::Error::from_raw_os_error(libc::EBUSY).to_string()));
        }
        // In no-IOMMU mode there is no type1 info to ask for.
        attach_with(fail("VFIO_IOMMU_GET_INFO", libc::EBUSY), true).unwrap();
    }

    #[test]
    fn the_iommu_ranges_come_from_the_capability_chain_and_must_cover_the_first_chunk() {
        let d = attach_with(|s| s.iommu_info = type1_info_39_bit(), false).unwrap();
        assert_eq!(d.iova_ranges().len(), 2);
        // A 32-bit IOMMU cannot place the first chunk at IOVA_BASE (4 GiB).
        let mut narrow = type1_info_39_bit();
        narrow[80..88].copy_from_slice(&0xffff_ffffu64.to_le_bytes());
        let e = attach_with(|s| s.iommu_info = narrow, false).err().expect("refused");
        let Error::Unsupported { what } = &e else { panic!("{e:?}") };
        assert!(what.starts_with("the IOMMU behind 0000:01:00.0 has no usable IOVA at 0x100000000"), "{what}");
        assert!(what.ends_with("[0x0-0xfedfffff, 0xfef00000-0xffffffff]"), "{what}");
    }

    fn mapper(setup: impl FnOnce(&mut vfio_ioctls::Script)) -> VfioMapper {
        let dev = attach_with(|s| s.iommu_info = type1_info_39_bit(), false).unwrap();
        vfio_ioctls::script(setup);
        VfioMapper { dev: Arc::new(dev) }
    }

    #[test]
    fn map_dma_maps_at_the_iova_asked_for() {
        let m = mapper(|_| {});
        let iova = m.map(0x7f00_0000_0000 as *mut u8, 2 << 20, IOVA_BASE).unwrap();
        assert_eq!(iova, IOVA_BASE);
        assert_eq!(vfio_ioctls::script(|s| s.mapped.clone()), vec![(IOVA_BASE.0, 2 << 20)]);
        assert!(m.translates());
        m.unmap(IOVA_BASE, 2 << 20);
        assert_eq!(vfio_ioctls::script(|s| s.unmapped.clone()), vec![(IOVA_BASE.0, 2 << 20)]);
    }

    #[test]
    fn a_failing_map_dma_is_a_vfio_error_and_enomem_names_the_memlock_limit() {
        let m = mapper(fail("VFIO_IOMMU_MAP_DMA", libc::ENOMEM));
        let e = m.map(0x7f00_0000_0000 as *mut u8, 2 << 20, IOVA_BASE).unwrap_err();
        let (op, what, errno) = vfio_parts(&e);
        assert_eq!((op, errno), ("VFIO_IOMMU_MAP_DMA", Some(libc::ENOMEM)));
        assert!(what.starts_with("iova 0x100000000 + 0x200000 (ENOMEM: VFIO pins DMA memory"), "{what}");
        assert!(what.contains("RLIMIT_MEMLOCK, now 8192 KiB"), "{what}");
        vfio_ioctls::script(|s| s.memlock = None);
        let e = m.map(0x7f00_0000_0000 as *mut u8, 2 << 20, IOVA_BASE).unwrap_err();
        assert!(vfio_parts(&e).1.contains("now unlimited"), "{e:?}");

        let m = mapper(fail("VFIO_IOMMU_MAP_DMA", libc::EINVAL));
        let e = m.map(0x7f00_0000_0000 as *mut u8, 2 << 20, IOVA_BASE).unwrap_err();
        assert_eq!(vfio_parts(&e), ("VFIO_IOMMU_MAP_DMA", "iova 0x100000000 + 0x200000", Some(libc::EINVAL)));
    }

    #[test]
    fn an_iova_outside_the_iommu_ranges_is_refused_before_map_dma() {
        let m = mapper(|_| {});
        let e = m.map(0x7f00_0000_0000 as *mut u8, 2 << 20, Iova(1 << 39)).unwrap_err();
        let Error::DmaMap { why, .. } = &e else { panic!("{e:?}") };
        assert!(why.contains("outside the IOMMU's usable ranges"), "{why}");
        assert!(vfio_ioctls::script(|s| s.mapped.is_empty()), "no MAP_DMA issued");
    }

    #[test]
    fn a_failing_unmap_dma_is_only_logged() {
        let m = mapper(fail("VFIO_IOMMU_UNMAP_DMA", libc::EINVAL));
        m.unmap(IOVA_BASE, 2 << 20);
        assert_eq!(vfio_ioctls::script(|s| s.unmapped.len()), 1);
    }

    #[test]
    fn a_failing_bar0_mmap_names_the_step() {
        let dev = Arc::new(attach_with(|_| {}, false).unwrap());
        let e = dev.map_bar0().err().expect("the twin maps nothing");
        assert_eq!(vfio_parts(&e), ("mmap BAR0", "0000:01:00.0", Some(libc::ENODEV)));
    }

    /// A vfio_iommu_type1_info as Linux fills it for a 39-bit VT-d (QEMU intel-iommu's default
    /// aw-bits): an unrelated capability first (id 2, DMA_AVAIL), then the IOVA ranges around the MSI
    /// window.
    fn type1_info_39_bit() -> Vec<u8> {
        let mut b = vec![0u8; 24];
        b[0..4].copy_from_slice(&88u32.to_le_bytes()); // argsz
        b[4..8].copy_from_slice(&(sys::IOMMU_INFO_CAPS | 1).to_le_bytes());
        b[8..16].copy_from_slice(&0x4020_1000u64.to_le_bytes());
        b[16..20].copy_from_slice(&24u32.to_le_bytes()); // cap_offset
                                                         // DMA_AVAIL capability at 24: header {id 3, version 1, next 40}, avail u32, pad.
        b.extend_from_slice(&3u16.to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&40u32.to_le_bytes());
        b.extend_from_slice(&65535u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        // IOVA_RANGE capability at 40: header {id 1, version 1, next 0}, nr_iovas 2, reserved, ranges.
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for (s, e) in [(0u64, 0xfedf_ffffu64), (0xfef0_0000, (1 << 39) - 1)] {
            b.extend_from_slice(&s.to_le_bytes());
            b.extend_from_slice(&e.to_le_bytes());
        }
        assert_eq!(b.len(), 88);
        b
    }

    #[test]
    fn iova_ranges_are_read_from_the_capability_chain() {
        let r = parse_iova_ranges(&type1_info_39_bit());
        assert_eq!(
            r,
            vec![IovaRange { start: 0, end: 0xfedf_ffff }, IovaRange { start: 0xfef0_0000, end: (1 << 39) - 1 }]
        );
        assert!(r[1].contains(IOVA_BASE.0, HUGEPAGE_LEN));
        assert!(!r[0].contains(0xfee0_0000 - 4096, 8192), "straddles the MSI window");
        assert!(r[1].contains((1 << 39) - HUGEPAGE_LEN, HUGEPAGE_LEN), "last chunk below 2^39");
        assert!(!r[1].contains((1 << 39) - HUGEPAGE_LEN + 4096, HUGEPAGE_LEN), "crosses the address width");
        assert!(!r[1].contains(u64::MAX - 10, 4096), "overflow is outside, not a wrap");
        assert_eq!(describe_ranges(&r), "[0x0-0xfedfffff, 0xfef00000-0x7fffffffff]");
    }

    #[test]
    fn iova_range_parse_survives_truncated_and_looping_chains() {
        let full = type1_info_39_bit();
        // Cut inside the second range: only the first survives.
        assert_eq!(parse_iova_ranges(&full[..72]), vec![IovaRange { start: 0, end: 0xfedf_ffff }]);
        // No CAPS flag: nothing is read.
        let mut no_caps = full.clone();
        no_caps[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(parse_iova_ranges(&no_caps).is_empty());
        // A chain pointing back at itself stops after a bounded number of hops.
        let mut looped = full.clone();
        looped[28..32].copy_from_slice(&24u32.to_le_bytes());
        assert!(parse_iova_ranges(&looped).is_empty());
        // cap_offset past the end.
        let mut far = full;
        far[16..20].copy_from_slice(&4000u32.to_le_bytes());
        assert!(parse_iova_ranges(&far).is_empty());
        assert!(parse_iova_ranges(&[]).is_empty());
    }

    #[test]
    fn open_controller_of_an_absent_device_says_there_is_no_such_device() {
        let Err(e) = open_controller("9999:99:99.9", CtrlrOptions::default()) else { panic!("no such device") };
        assert!(matches!(e, crate::Error::NoPciDevice { .. }), "{e}");
        assert!(e.to_string().starts_with("no PCI device 9999:99:99.9"), "{e}");
    }

    #[test]
    fn open_of_a_missing_device_names_the_step() {
        let e = VfioDevice::open("9999:99:99.9").err().expect("no such device");
        assert!(e.to_string().starts_with("VFIO readlink iommu_group on 9999:99:99.9"), "{e}");
    }
}
