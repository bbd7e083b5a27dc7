//! The signature scan of a raw device's first bytes (`pack --out raw:` and `run --store raw:` refuse
//! a device that holds a partition table, a file system, swap, a volume or another image): the input
//! is the device head (up to 64 KiB here, of the 256 KiB the scan reads), scanned at two device
//! offsets. Any bytes must give a list of signatures, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_blockdev::raw::scan_signatures;

fuzz_target!(|head: &[u8]| {
    for start in [0, 1 << 40] {
        for s in scan_signatures(head, start) {
            assert!(s.offset >= start && s.offset - start < head.len() as u64, "a signature lies in the head");
            let _ = (s.kind.name(), s.to_string());
        }
    }
});
