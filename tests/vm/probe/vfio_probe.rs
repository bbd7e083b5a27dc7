//! Harness-owned VFIO probe (driver independent). Built by tests/vm/run.sh with plain `rustc --test`
//! (static, no crates) and run in the guest like any picchio-nvme test binary, so it follows the same
//! contract: it reads `PICCHIO_NVME_BDF` and skips itself when it is unset. It checks that the
//! controller bound to vfio-pci is usable from user space: container + group + device fd, BAR0
//! mmap with sane NVMe CAP/VS, and (vIOMMU mode) a DMA map/unmap of a hugepage buffer.
#![allow(clippy::missing_safety_doc)]

use std::ffi::CString;
use std::os::raw::{c_char, c_int, c_long, c_ulong, c_void};

extern "C" {
    fn open(path: *const c_char, flags: c_int, ...) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn ioctl(fd: c_int, req: c_ulong, ...) -> c_int;
    fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: c_long) -> *mut c_void;
    fn munmap(addr: *mut c_void, len: usize) -> c_int;
}

const O_RDWR: c_int = 2;
const PROT_READ: c_int = 1;
const PROT_WRITE: c_int = 2;
const MAP_SHARED: c_int = 1;
const MAP_PRIVATE: c_int = 2;
const MAP_ANONYMOUS: c_int = 0x20;
const MAP_HUGETLB: c_int = 0x40000;

// _IO(';', 100 + n): linux/vfio.h
const VFIO_GET_API_VERSION: c_ulong = 0x3B64;
const VFIO_CHECK_EXTENSION: c_ulong = 0x3B65;
const VFIO_SET_IOMMU: c_ulong = 0x3B66;
const VFIO_GROUP_GET_STATUS: c_ulong = 0x3B67;
const VFIO_GROUP_SET_CONTAINER: c_ulong = 0x3B68;
const VFIO_GROUP_GET_DEVICE_FD: c_ulong = 0x3B6A;
const VFIO_DEVICE_GET_INFO: c_ulong = 0x3B6B;
const VFIO_DEVICE_GET_REGION_INFO: c_ulong = 0x3B6C;
const VFIO_IOMMU_MAP_DMA: c_ulong = 0x3B71;
const VFIO_IOMMU_UNMAP_DMA: c_ulong = 0x3B72;
const VFIO_TYPE1_IOMMU: c_ulong = 1;
const VFIO_NOIOMMU_IOMMU: c_ulong = 8;
const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
const VFIO_DEVICE_FLAGS_PCI: u32 = 2;

#[repr(C)]
#[derive(Default)]
struct GroupStatus {
    argsz: u32,
    flags: u32,
}
#[repr(C)]
#[derive(Default)]
struct DeviceInfo {
    argsz: u32,
    flags: u32,
    num_regions: u32,
    num_irqs: u32,
}
#[repr(C)]
#[derive(Default)]
struct RegionInfo {
    argsz: u32,
    flags: u32,
    index: u32,
    cap_offset: u32,
    size: u64,
    offset: u64,
}
#[repr(C)]
struct DmaMap {
    argsz: u32,
    flags: u32,
    vaddr: u64,
    iova: u64,
    size: u64,
}
#[repr(C)]
struct DmaUnmap {
    argsz: u32,
    flags: u32,
    iova: u64,
    size: u64,
}

fn env() -> Option<(String, String, String)> {
    let bdf = std::env::var("PICCHIO_NVME_BDF").ok()?;
    let mode = std::env::var("PICCHIO_NVME_VFIO_MODE").unwrap_or_else(|_| "iommu".into());
    let group = std::env::var("PICCHIO_NVME_VFIO_GROUP").unwrap_or_default();
    Some((bdf, mode, group))
}

fn open_rw(path: &str) -> c_int {
    let c = CString::new(path).unwrap();
    let fd = unsafe { open(c.as_ptr(), O_RDWR) };
    assert!(fd >= 0, "open {path}: {}", std::io::Error::last_os_error());
    fd
}

struct Vfio {
    container: c_int,
    group: c_int,
    device: c_int,
}

fn setup(bdf: &str, mode: &str, group_path: &str) -> Vfio {
    let container = open_rw("/dev/vfio/vfio");
    assert_eq!(unsafe { ioctl(container, VFIO_GET_API_VERSION) }, 0, "VFIO API version");
    let iommu = if mode == "noiommu" { VFIO_NOIOMMU_IOMMU } else { VFIO_TYPE1_IOMMU };
    assert_eq!(unsafe { ioctl(container, VFIO_CHECK_EXTENSION, iommu) }, 1, "extension {iommu}");
    let group = open_rw(group_path);
    let mut st = GroupStatus { argsz: 8, flags: 0 };
    assert_eq!(unsafe { ioctl(group, VFIO_GROUP_GET_STATUS, &mut st) }, 0);
    assert!(st.flags & VFIO_GROUP_FLAGS_VIABLE != 0, "group not viable: {:#x}", st.flags);
    let r = unsafe { ioctl(group, VFIO_GROUP_SET_CONTAINER, &container) };
    assert_eq!(r, 0, "SET_CONTAINER: {}", std::io::Error::last_os_error());
    let r = unsafe { ioctl(container, VFIO_SET_IOMMU, iommu) };
    assert_eq!(r, 0, "SET_IOMMU: {}", std::io::Error::last_os_error());
    let name = CString::new(bdf).unwrap();
    let device = unsafe { ioctl(group, VFIO_GROUP_GET_DEVICE_FD, name.as_ptr()) };
    assert!(device >= 0, "GET_DEVICE_FD {bdf}: {}", std::io::Error::last_os_error());
    Vfio { container, group, device }
}

impl Drop for Vfio {
    fn drop(&mut self) {
        unsafe {
            close(self.device);
            close(self.group);
            close(self.container);
        }
    }
}

#[test]
fn vfio_device_and_bar0_registers() {
    let Some((bdf, mode, group)) = env() else {
        eprintln!("skipped: PICCHIO_NVME_BDF is not set (only meaningful in tests/vm)");
        return;
    };
    let v = setup(&bdf, &mode, &group);
    let mut info = DeviceInfo { argsz: 16, ..Default::default() };
    assert_eq!(unsafe { ioctl(v.device, VFIO_DEVICE_GET_INFO, &mut info) }, 0);
    assert!(info.flags & VFIO_DEVICE_FLAGS_PCI != 0, "not a PCI device: {:#x}", info.flags);
    assert!(info.num_regions >= 7, "regions {}", info.num_regions);
    let mut reg = RegionInfo { argsz: 32, index: 0, ..Default::default() };
    assert_eq!(unsafe { ioctl(v.device, VFIO_DEVICE_GET_REGION_INFO, &mut reg) }, 0);
    assert!(reg.size >= 0x2000, "BAR0 size {:#x}", reg.size);
    // Only the first page (controller registers); the MSI-X table lives further into BAR0.
    let p =
        unsafe { mmap(std::ptr::null_mut(), 4096, PROT_READ | PROT_WRITE, MAP_SHARED, v.device, reg.offset as c_long) };
    assert!(p as isize != -1, "mmap BAR0: {}", std::io::Error::last_os_error());
    let cap = unsafe { std::ptr::read_volatile(p as *const u64) };
    let vs = unsafe { std::ptr::read_volatile((p as *const u8).add(8) as *const u32) };
    unsafe { munmap(p, 4096) };
    let mqes = (cap & 0xffff) + 1;
    let css_nvm = (cap >> 37) & 1;
    eprintln!(
        "{bdf} ({mode}): BAR0 {:#x} bytes, CAP={cap:#018x} VS={vs:#010x} MQES={mqes} regions={} irqs={}",
        reg.size, info.num_regions, info.num_irqs
    );
    assert!(vs >= 0x0001_0000, "NVMe version {vs:#x}");
    assert!(mqes >= 2, "MQES {mqes}");
    assert_eq!(css_nvm, 1, "CAP.CSS lacks the NVM command set");
}

#[test]
fn vfio_dma_map_hugepage() {
    let Some((bdf, mode, group)) = env() else {
        eprintln!("skipped: PICCHIO_NVME_BDF is not set (only meaningful in tests/vm)");
        return;
    };
    if mode == "noiommu" {
        eprintln!("skipped: no-IOMMU mode has no VFIO_IOMMU_MAP_DMA");
        return;
    }
    let v = setup(&bdf, &mode, &group);
    let len = 2 << 20;
    let buf = unsafe {
        mmap(std::ptr::null_mut(), len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0)
    };
    assert!(buf as isize != -1, "MAP_HUGETLB: {}", std::io::Error::last_os_error());
    unsafe { std::ptr::write_bytes(buf as *mut u8, 0, len) };
    let map = DmaMap { argsz: 32, flags: 3, vaddr: buf as u64, iova: 0x1000_0000, size: len as u64 };
    let r = unsafe { ioctl(v.container, VFIO_IOMMU_MAP_DMA, &map) };
    assert_eq!(r, 0, "MAP_DMA: {}", std::io::Error::last_os_error());
    let unmap = DmaUnmap { argsz: 24, flags: 0, iova: 0x1000_0000, size: len as u64 };
    let r = unsafe { ioctl(v.container, VFIO_IOMMU_UNMAP_DMA, &unmap) };
    assert_eq!(r, 0, "UNMAP_DMA: {}", std::io::Error::last_os_error());
    unsafe { munmap(buf, len) };
}
