//! A stop request (SIGINT/SIGTERM, raised here with `interrupt::request` as the handler would) ends
//! every image write — `pack` to a file, `convert`, `transcode`, `synth` onto an NVMe namespace — with
//! `Error::Interrupted`, and the unwinding leaves nothing that looks like a result: no temporary
//! file or directory, no destination, no valid superblock on the namespace.
//!
//! Its own test binary, with one test: the stop request is process-wide and cannot be withdrawn.

use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::image::pack::{pack, PackOptions};
use picchio_runtime::image::transcode::{transcode, TranscodeOptions};
use picchio_runtime::Error;
use picchio_tests::*;

fn names(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn a_stop_request_ends_every_write_leaving_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    picchio_runtime::interrupt::request(2);
    assert_eq!(picchio_runtime::interrupt::exit_code(), 130);

    let out = dir.path().join("e.picchioflat");
    let e = pack(
        &fixture("picchio_c/qwen3_moe"),
        &out,
        &PackOptions { layers: None, progress: false, ..Default::default() },
    )
    .unwrap_err();
    assert!(matches!(&e, Error::Interrupted { done: 0, unit: "payloads", .. }), "{e}");
    assert!(e.to_string().starts_with("interrupted by SIGINT after 0 of "), "{e}");
    assert!(names(dir.path()).is_empty(), "pack left {:?}", names(dir.path()));

    let dst = dir.path().join("converted");
    let e =
        convert(&fixture("qwen3_moe"), &dst, &ConvertOptions { progress: false, ..Default::default() }).unwrap_err();
    assert!(matches!(&e, Error::Interrupted { done: 0, unit: "tensors", .. }), "{e}");
    assert!(names(dir.path()).is_empty(), "convert left {:?}", names(dir.path()));

    let dst = dir.path().join("transcoded");
    let opts = TranscodeOptions { progress: false, ..Default::default() };
    let e = transcode(&fixture("picchio_c/qwen3_moe"), &dst, &opts).unwrap_err();
    assert!(matches!(&e, Error::Interrupted { done: 0, unit: "tensors", .. }), "{e}");
    assert!(names(dir.path()).is_empty(), "transcode left {:?}", names(dir.path()));

    #[cfg(target_os = "linux")]
    {
        use picchio_nvme::sim::SimConfig;
        use picchio_nvme::{HeapDma, NvmeQueue, NvmeQueueOptions};
        use picchio_runtime::image::synthetic_image::{synth_to, Geometry, SynthOptions};
        use picchio_runtime::image::write::{WriteOptions, WriteTo};
        // An earlier valid image on the namespace: after the interrupted write its superblock is gone.
        let ns = dir.path().join("ns");
        let mut bytes = picchio_core::format::MAGIC.to_vec();
        bytes.resize(1 << 20, 0xA5);
        std::fs::write(&ns, &bytes).unwrap();
        let mut cfg = SimConfig::single(&ns, 4096);
        cfg.namespaces[0].writable = true;
        let qopts = NvmeQueueOptions { qd: 8, ..Default::default() };
        let (mut q, _sim) = NvmeQueue::open_sim_with(cfg, &qopts, HeapDma::new(), true).unwrap();
        let opts = SynthOptions { geometry: Geometry::q4(64, 2, 4, 2, 64), layers: None, seed: 1, progress: false };
        let to = WriteTo::NvmeQueue { queue: &mut q, name: "nvme:sim/1" };
        let e = synth_to(to, &opts, &WriteOptions::default(), &mut |_| {}).unwrap_err();
        drop(q);
        assert!(matches!(&e, Error::Interrupted { done: 0, wanted: 8, unit: "payloads", .. }), "{e}");
        let after = std::fs::read(&ns).unwrap();
        assert!(after[..4096].iter().all(|&b| b == 0), "the first block is zeroed: no valid-looking image");
    }
}
