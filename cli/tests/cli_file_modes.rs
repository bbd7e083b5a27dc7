//! The files and directories every writer creates get the mode `open(2)` and `mkdir(2)` give under
//! the process's umask — `0644`/`0755` under umask `022` — like any other program's output: none is
//! private `0600` (what `safetensors::serialize_to_file` gave `synth --model-out`'s shards, through
//! `tempfile`), none takes a copied source's mode (`std::fs::copy`). One place creates the writers'
//! files, `picchio_core::output`.
//!
//! Each writer runs through `sh -c 'umask 027; exec picchio …'`: `027` is neither the usual `022`
//! (a hard-coded `0644` fails) nor `077` (a private `0600` fails), so only a mode taken from the
//! umask passes: files `0640`, directories `0750`.
#![cfg(unix)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::{scratch, strs, synth_one_layer};

const UMASK: u32 = 0o027;

/// Runs `picchio ARGS` under [`UMASK`] and asserts it succeeded.
fn ok_under_umask(args: &[&str]) {
    let script = format!("umask {UMASK:03o}; exec \"$0\" \"$@\"");
    let mut sh_args = vec!["-c", script.as_str(), env!("CARGO_BIN_EXE_picchio")];
    sh_args.extend_from_slice(args);
    let o = picchio_testkit::bin::Bin::new("sh", "/bin/sh").run(&sh_args);
    assert!(o.status.success(), "picchio {} failed under umask {UMASK:03o}", args.join(" "));
}

/// `p` and, for a directory, everything under it, with its permission bits.
fn modes(p: &Path) -> Vec<(PathBuf, bool, u32)> {
    let md = std::fs::symlink_metadata(p).unwrap();
    let mut out = vec![(p.to_path_buf(), md.is_dir(), md.permissions().mode() & 0o7777)];
    if md.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for e in entries {
            out.extend(modes(&e));
        }
    }
    out
}

/// Asserts every file under `p` is `0666 & !UMASK` and every directory `0777 & !UMASK`.
fn assert_umask_modes(writer: &str, p: &Path) {
    let found = modes(p);
    let wrong: Vec<String> = found
        .iter()
        .filter(|(_, dir, mode)| *mode != if *dir { 0o777 } else { 0o666 } & !UMASK)
        .map(|(path, dir, mode)| format!("{} ({}) {mode:04o}", path.display(), if *dir { "dir" } else { "file" }))
        .collect();
    assert!(
        wrong.is_empty(),
        "{writer}: under umask {UMASK:03o} files must be {:04o} and directories {:04o}; wrong: {wrong:#?}",
        0o666 & !UMASK,
        0o777 & !UMASK
    );
    eprintln!("{writer}: {} entries of {} have the umask's mode", found.len(), p.display());
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn every_writer_creates_its_files_with_the_umask_mode() {
    let dir = scratch();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe");

    // convert: a directory of shards, the index, config.json and the copied files.
    let converted = dir.path().join("converted");
    ok_under_umask(&["convert", s(&fixture), s(&converted), "--no-progress"]);
    assert_umask_modes("convert", &converted);

    // pack: the image file written into the converted directory.
    ok_under_umask(&["pack", s(&converted), "--no-progress"]);
    assert_umask_modes("pack", &converted.join("experts.picchioflat"));

    // transcode: another directory, from the converted one.
    let q3 = dir.path().join("q3");
    ok_under_umask(&["transcode", s(&converted), "--to", "q3", "--out", s(&q3), "--no-progress"]);
    assert_umask_modes("transcode", &q3);

    // synth: an image file.
    let image = dir.path().join("synth.picchioflat");
    ok_under_umask(&[
        "synth",
        "--arch",
        "custom",
        "--hidden",
        "128",
        "--moe-intermediate",
        "128",
        "--experts",
        "4",
        "--model-layers",
        "2",
        "--no-progress",
        "--out",
        s(&image),
    ]);
    assert_umask_modes("synth", &image);

    // synth --model-out: config.json, the safetensors shards (once 0600), the index and the image.
    let model = dir.path().join("synthetic");
    let mut args = synth_one_layer(256);
    args.extend(["--no-progress".into(), "--model-out".into(), s(&model).to_string()]);
    ok_under_umask(&strs(&args));
    let shards = std::fs::read_dir(&model)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".safetensors"))
        .count();
    assert_eq!(shards, 2, "the embeddings' shard and the layer's");
    assert_umask_modes("synth --model-out", &model);
}
