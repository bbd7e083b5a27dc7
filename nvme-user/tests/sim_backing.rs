//! The controller model's backing files: one shorter than an LBA is refused at start, naming the
//! file, its size and the minimum, instead of becoming an inactive namespace that the driver then
//! reports as "namespace 1 not found".
#![cfg(target_os = "linux")]

use picchio_nvme::sim::{Sim, SimConfig};
use picchio_nvme::{Error, HeapDma};

#[test]
fn a_backing_file_shorter_than_one_lba_is_named_with_its_size_and_the_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"remember to buy milk\n").unwrap();
    for lba in [512u32, 4096] {
        let e = Sim::start(SimConfig::single(&notes, lba), HeapDma::new().registry()).err().expect("refused");
        assert!(matches!(e, Error::SimBacking { nsid: 1, .. }), "{e}");
        let s = e.to_string();
        assert!(s.contains(&notes.display().to_string()), "{s}");
        assert!(s.contains("21 bytes") && s.contains(&format!("one {lba}-byte LBA (the minimum")), "{s}");
    }
    // One whole LBA is a (one-block) namespace.
    std::fs::write(&notes, [0u8; 512]).unwrap();
    assert!(Sim::start(SimConfig::single(&notes, 512), HeapDma::new().registry()).is_ok());
}
