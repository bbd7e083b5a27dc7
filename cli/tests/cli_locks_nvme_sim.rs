//! The `nvme-sim:` store's reader (our NVMe driver against the software controller model serving an
//! image file) coordinates with writers as the `file:` reader does (docs/guarantees.md, "Advisory
//! locks"): while a run reads the image through it, `pack` onto that image is refused naming the
//! run, and once the run is gone the same `pack` writes. The run is held at a stop point
//! (`PICCHIO_STOP_AFTER_LOADS`), not raced.
#![cfg(target_os = "linux")]

mod common;

use common::stop::{kill9, spawn_stopped};
use std::process::Command;

#[test]
fn pack_onto_an_image_an_nvme_sim_run_reads_is_refused_naming_the_run() {
    let tmp = common::scratch();
    let m = common::private_model(tmp.path());
    let img = m.join("experts.picchioflat");
    let before = std::fs::read(&img).unwrap();
    let (ms, is) = (m.to_str().unwrap(), img.to_str().unwrap());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picchio"));
    cmd.args(["run", "--model", ms, "--store", &format!("nvme-sim:{is}"), "--ecap", "4", "--prompt-ids", "1,2,3"])
        .args(["-n", "8"])
        .env(picchio_core::stop_point::LOADS_ENV, "1");
    let run = spawn_stopped(&mut cmd, &tmp.path().join("run.log")).unwrap_or_else(|e| panic!("{e}"));
    let pid = run.id();

    let o = common::picchio(&["pack", ms, "--out", is, "--no-progress"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains(&format!("{is} is being read by another picchio process (pid {pid}); stop it or use --force")),
        "{e}"
    );
    assert!(std::fs::read(&img).unwrap() == before, "a refused pack changed the image");

    // The reader gone, its lock is too: the same pack writes.
    kill9(run);
    let o = common::picchio(&["pack", ms, "--out", is, "--no-progress"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
