//! Read errors while opening an image name the store, the structure and its offset — also when the
//! image is shorter than the length the caller was told (a device whose image was cut, a file that
//! shrank after it was measured) and the superblock's own length checks cannot see it.

use picchio_blockdev::{PsyncOptions, PsyncQueue};
use picchio_core::loader::StoreDims;
use picchio_core::FlatWriter;
use picchio_runtime::image::verify::{verify_queue, VerifyOptions};

#[test]
fn a_short_index_read_names_the_store_and_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.pf");
    let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
    FlatWriter::write(&img, dims, &[[1u8; 4096], [2u8; 4096]]).unwrap();
    let bytes = std::fs::read(&img).unwrap();
    std::fs::write(&img, &bytes[..5000]).unwrap();
    let mut q = PsyncQueue::open(&img, PsyncOptions { threads: 1, direct: false }).unwrap();
    // Told the image is 16384 bytes (as a stale length would say): the index read comes up short.
    let opts = VerifyOptions { io_threads: 1, direct: false, progress: false };
    let e = verify_queue(&mut q, "img.pf", 0, 16384, None, &opts).unwrap_err();
    let e = picchio_core::error::chain(&e).to_string();
    assert!(e.contains("img.pf: reading the index at offset 0x1000") && e.contains("short read"), "{e}");
}

#[test]
fn an_image_past_byte_0_is_verified_at_its_base_and_errors_name_image_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.pf");
    let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
    let mut w = FlatWriter::create(&img, dims, 2).unwrap();
    w.push(&[1u8; 4096]).unwrap();
    w.push(&[2u8; 4096]).unwrap();
    w.finish().unwrap();
    let image = std::fs::read(&img).unwrap();
    // The image at byte 8192 of its target (raw:/dev/X@8192), after bytes that are no image.
    let target = dir.path().join("target");
    std::fs::write(&target, [vec![0xEE; 8192], image.clone()].concat()).unwrap();
    let mut q = PsyncQueue::open(&target, PsyncOptions { threads: 1, direct: false }).unwrap();
    let opts = VerifyOptions { io_threads: 1, direct: false, progress: false };
    let r = verify_queue(&mut q, "target@8192", 8192, image.len() as u64, None, &opts).unwrap();
    assert!(r.is_clean() && r.entries == 2 && r.bytes_read == 8192, "{r}");
    // Read from byte 0 instead, the same bytes are no image.
    let e = verify_queue(&mut q, "target", 0, image.len() as u64, None, &opts).unwrap_err().to_string();
    assert!(e.contains("target"), "{e}");
    // Cut inside the index: the short read names the image offset, not the target's.
    std::fs::write(&target, [vec![0xEE; 8192], image[..5000].to_vec()].concat()).unwrap();
    let mut q = PsyncQueue::open(&target, PsyncOptions { threads: 1, direct: false }).unwrap();
    let e = verify_queue(&mut q, "target@8192", 8192, 16384, None, &opts).unwrap_err();
    let e = picchio_core::error::chain(&e).to_string();
    assert!(e.contains("target@8192: reading the index at offset 0x1000") && e.contains("short read"), "{e}");
}
