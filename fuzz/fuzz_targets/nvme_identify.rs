//! The NVMe Identify decoders (§5.17.2): the input's first 4096 bytes (zero-padded, as the driver's
//! zeroed scratch page holds a shorter transfer) parsed as an Identify Controller and an Identify
//! Namespace page, and every derived value the driver uses (MDTS in bytes for every CAP.MPSMIN, the
//! LBA format in use, LBA and metadata sizes). Nothing may panic or overflow, whatever the device
//! wrote.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_nvme::spec::{IdentifyController, IdentifyNamespace};

fuzz_target!(|data: &[u8]| {
    let mut page = [0u8; 4096];
    let n = data.len().min(4096);
    page[..n].copy_from_slice(&data[..n]);
    let c = IdentifyController::parse(&page);
    for mpsmin in 0..16u32 {
        if let Some(max) = c.max_transfer(4096 << mpsmin) {
            assert!(max >= 4096 << mpsmin, "MDTS is at least one page");
        }
    }
    let ns = IdentifyNamespace::parse(&page);
    assert!(ns.lbaf.len() <= 64);
    let _ = (ns.format_index(), ns.format(), ns.metadata_size());
    if let Some(lba) = ns.lba_size() {
        assert!(lba.is_power_of_two() && lba >= 512);
    }
});
