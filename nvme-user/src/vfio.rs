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
//! Every ioctl and mmap lives in [`sys`].

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::bar::MmioBar;
use crate::ctrlr::{Controller, CtrlrOptions};
use crate::dma::{HugepageDma, Iova, IovaMapper};
use crate::error::{Error, Result};

/// First IOVA handed to DMA chunks in type1 mode (2 MiB aligned, clear of low addresses).
pub const IOVA_BASE: Iova = Iova(0x1_0000_0000);

/// The ioctls, their numbers and argument layouts (linux/vfio.h), and mmap.
pub mod sys {
    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd;

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

    /// An ioctl whose argument is an integer.
    pub fn ioctl_val(f: &File, req: u32, arg: u64) -> io::Result<i32> {
        // SAFETY: these requests take their argument by value; no memory is passed.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), req as _, arg as libc::c_ulong) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// An ioctl whose argument points at `arg` (a `repr(C)` struct or buffer the kernel reads and
    /// writes within its `argsz`).
    ///
    /// # Safety
    /// `arg` must be the argument type of `req`, with its `argsz` no larger than `size_of_val(arg)`.
    pub unsafe fn ioctl_ptr<T: ?Sized>(f: &File, req: u32, arg: &mut T) -> io::Result<i32> {
        // SAFETY: the caller guarantees `arg` matches `req` and is large enough for its argsz.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), req as _, (arg as *mut T).cast::<libc::c_void>()) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// VFIO_GROUP_GET_DEVICE_FD with the device name; returns the new device fd.
    pub fn group_get_device_fd(group: &File, name: &str) -> io::Result<File> {
        use std::os::fd::FromRawFd;
        let c = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: the request takes a NUL-terminated string, which `c` is, alive for the call.
        let fd = unsafe { libc::ioctl(group.as_raw_fd(), GROUP_GET_DEVICE_FD as _, c.as_ptr()) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel returned a new fd that nothing else owns.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// A shared read/write mapping of `len` bytes of `f` at `offset`.
    pub fn mmap_shared(f: &File, len: usize, offset: u64) -> io::Result<*mut u8> {
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
            Err(io::Error::last_os_error())
        } else {
            Ok(p.cast())
        }
    }

    /// Unmaps what [`mmap_shared`] mapped.
    ///
    /// # Safety
    /// `p`/`len` must be a live mapping from [`mmap_shared`] that nothing uses any more.
    pub unsafe fn munmap(p: *mut u8, len: usize) {
        // SAFETY: per the contract.
        unsafe { libc::munmap(p.cast(), len) };
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
        let v = sys::ioctl_val(&container, sys::GET_API_VERSION, 0)
            .map_err(vfio_err("VFIO_GET_API_VERSION", "container"))?;
        if v != sys::API_VERSION {
            return Err(Error::Unsupported { what: format!("VFIO API version {v}, want {}", sys::API_VERSION) });
        }
        let group = open(&group_path).map_err(vfio_err("open", group_path.clone()))?;
        let mut st = sys::GroupStatus { argsz: 8, flags: 0 };
        // SAFETY: GROUP_GET_STATUS takes a vfio_group_status, which `st` is (argsz 8 = its size).
        unsafe { sys::ioctl_ptr(&group, sys::GROUP_GET_STATUS, &mut st) }
            .map_err(vfio_err("VFIO_GROUP_GET_STATUS", group_path.clone()))?;
        if st.flags & sys::GROUP_FLAGS_VIABLE == 0 {
            return Err(Error::Unsupported {
                what: format!("VFIO group {group_path} is not viable (bind every device in it to vfio-pci)"),
            });
        }
        let mut cfd: i32 = container.as_raw_fd();
        // SAFETY: GROUP_SET_CONTAINER takes a pointer to the container fd (an int).
        unsafe { sys::ioctl_ptr(&group, sys::GROUP_SET_CONTAINER, &mut cfd) }
            .map_err(vfio_err("VFIO_GROUP_SET_CONTAINER", group_path.clone()))?;
        let iommu = if noiommu {
            sys::NOIOMMU_IOMMU
        } else if sys::ioctl_val(&container, sys::CHECK_EXTENSION, sys::TYPE1V2_IOMMU).unwrap_or(0) > 0 {
            sys::TYPE1V2_IOMMU
        } else {
            sys::TYPE1_IOMMU
        };
        sys::ioctl_val(&container, sys::SET_IOMMU, iommu)
            .map_err(vfio_err("VFIO_SET_IOMMU", format!("type {iommu}")))?;
        let device = sys::group_get_device_fd(&group, bdf).map_err(vfio_err("VFIO_GROUP_GET_DEVICE_FD", bdf))?;
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
        let mut info = sys::RegionInfo { argsz: 32, index, ..Default::default() };
        // SAFETY: GET_REGION_INFO takes a vfio_region_info of `argsz` (32) bytes.
        unsafe { sys::ioctl_ptr(&self.device, sys::DEVICE_GET_REGION_INFO, &mut info) }
            .map_err(vfio_err("VFIO_DEVICE_GET_REGION_INFO", format!("{} region {index}", self.bdf)))?;
        let mut areas = Vec::new();
        if info.flags & sys::REGION_INFO_FLAG_CAPS != 0 && info.argsz > 32 {
            let mut buf = vec![0u64; (info.argsz as usize).div_ceil(8)];
            let full = buf.as_mut_slice();
            let words = full.len();
            // Write the fixed header (argsz, index) into the u64 buffer.
            full[0] = u64::from(info.argsz);
            full[1] = u64::from(index);
            // SAFETY: the buffer holds `argsz` bytes (rounded up to u64s) and starts with a
            // vfio_region_info whose argsz says so; the kernel writes at most argsz bytes.
            unsafe { sys::ioctl_ptr(&self.device, sys::DEVICE_GET_REGION_INFO, full) }
                .map_err(vfio_err("VFIO_DEVICE_GET_REGION_INFO", format!("{} region {index} caps", self.bdf)))?;
            let bytes: Vec<u8> = buf[..words].iter().flat_map(|w| w.to_le_bytes()).collect();
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
        let p = sys::mmap_shared(&self.device, len, info.offset).map_err(vfio_err("mmap BAR0", self.bdf.clone()))?;
        struct Mapping(*mut u8, usize, #[allow(dead_code)] Arc<VfioDevice>);
        // SAFETY: the mapping is only an address range; `MmioBar` does the accesses.
        unsafe impl Send for Mapping {}
        // SAFETY: as for `Send`.
        unsafe impl Sync for Mapping {}
        impl Drop for Mapping {
            fn drop(&mut self) {
                // SAFETY: mapped by `mmap_shared` with this length; the `MmioBar` that used it is gone.
                unsafe { sys::munmap(self.0, self.1) }
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
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives for the call.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0;
    let cur = if !ok {
        "unknown".to_string()
    } else if lim.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".to_string()
    } else {
        format!("{} KiB", lim.rlim_cur / 1024)
    };
    format!(
        " (ENOMEM: VFIO pins DMA memory against RLIMIT_MEMLOCK, now {cur}; raise it with `ulimit -l` / \
         limits.conf, or run with CAP_IPC_LOCK)"
    )
}

/// VFIO_IOMMU_GET_INFO on a container whose IOMMU type is set: the usable IOVA ranges.
fn iommu_iova_ranges(container: &File) -> Result<Vec<IovaRange>> {
    let mut info = sys::IommuType1Info { argsz: sys::IOMMU_TYPE1_INFO_LEN, ..Default::default() };
    // SAFETY: GET_INFO takes a vfio_iommu_type1_info of `argsz` (24) bytes, which `info` is.
    unsafe { sys::ioctl_ptr(container, sys::IOMMU_GET_INFO, &mut info) }
        .map_err(vfio_err("VFIO_IOMMU_GET_INFO", "container"))?;
    if info.flags & sys::IOMMU_INFO_CAPS == 0 || info.argsz <= sys::IOMMU_TYPE1_INFO_LEN {
        return Ok(Vec::new());
    }
    // The capabilities did not fit: ask again with a buffer of the size the kernel asked for.
    let mut buf = vec![0u64; (info.argsz as usize).div_ceil(8)];
    buf[0] = u64::from(info.argsz);
    // SAFETY: the buffer holds at least `argsz` bytes and starts with a vfio_iommu_type1_info
    // whose argsz says so (little-endian u32 in the low half of word 0); the kernel writes at most
    // argsz bytes.
    unsafe { sys::ioctl_ptr(container, sys::IOMMU_GET_INFO, buf.as_mut_slice()) }
        .map_err(vfio_err("VFIO_IOMMU_GET_INFO", "container capabilities"))?;
    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_le_bytes()).collect();
    Ok(parse_iova_ranges(&bytes[..info.argsz as usize]))
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
        let mut m =
            sys::DmaMap { argsz: 32, flags: sys::DMA_MAP_FLAG_RW, vaddr: vaddr as u64, iova: iova.0, size: len as u64 };
        // SAFETY: MAP_DMA takes a vfio_iommu_type1_dma_map (argsz 32 = its size). The memory stays
        // mapped for the device until `unmap`, called before the chunk is munmapped.
        unsafe { sys::ioctl_ptr(&self.dev.container, sys::IOMMU_MAP_DMA, &mut m) }.map_err(|e| {
            let mut what = format!("iova {:#x} + {len:#x}", iova.0);
            if e.raw_os_error() == Some(libc::ENOMEM) {
                // type1 pins the pages and charges them to RLIMIT_MEMLOCK (unless CAP_IPC_LOCK).
                what.push_str(&memlock_hint());
            }
            Error::Vfio { op: "VFIO_IOMMU_MAP_DMA", what, source: e }
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
        // SAFETY: UNMAP_DMA takes a vfio_iommu_type1_dma_unmap (argsz 24 = its size).
        if let Err(e) = unsafe { sys::ioctl_ptr(&self.dev.container, sys::IOMMU_UNMAP_DMA, &mut u) } {
            tracing::warn!(error = %e, iova = iova.0, "VFIO_IOMMU_UNMAP_DMA");
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
