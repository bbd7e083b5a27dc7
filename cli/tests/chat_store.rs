//! `picchio --store URI` with no `--model`: the chat finds the converted model directory the image
//! records in its superblock (`picchio pack` writes the record; docs/format.md, "Model record"), or
//! the directory holding a file image, and talks; a moved or changed directory, an image without a
//! record or with a damaged one, is a clear error naming what was recorded (or the damaged field) and
//! suggesting `--model`. Through a
//! file, the software NVMe controller (`nvme-sim:`) and, as root, a loop device (`raw:`).

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Output, Stdio};

use common::serve::packed_model;
#[cfg(target_os = "linux")]
use picchio_testkit::loopdev::{sparse_file, LoopDevice, LoopOptions};

/// `picchio ARGS` with `input` on stdin (then end of input), without `$PICCHIO_MODEL`.
fn chat(args: &[&str], input: &str) -> Output {
    let bin = picchio_testkit::bin::Bin::new("picchio", env!("CARGO_BIN_EXE_picchio"));
    let mut child = bin
        .command()
        .args(args)
        .env_remove("PICCHIO_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = picchio_testkit::bin::wait_bounded(child, picchio_testkit::bin::HANG_LIMIT).expect("picchio hung");
    eprintln!(
        "$ picchio {}\n[{}]\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts that `picchio --store STORE` (no model) found `model`, answered one turn and ended.
fn talks_with(store: &str, model: &Path, extra: &[&str]) {
    let mut args = vec!["-v", "--store", store, "--ecap", "4", "--ctx", "128", "-n", "4"];
    args.extend_from_slice(extra);
    let o = chat(&args, "Hi there\n");
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains(&format!("picchio chat: {} (", model.file_name().unwrap().to_string_lossy())), "{e}");
    if !extra.contains(&"--model") {
        assert!(e.contains(&format!("model {} (", model.canonicalize().unwrap().display())), "{e}");
    }
    assert!(e.lines().any(|l| l.starts_with('[') && l.contains(" tok/s; prompt ")), "one turn: {e}");
}

#[test]
fn the_image_names_its_model() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let image = model.join("experts.picchioflat");

    // The image, copied away from its directory, still names it (the record in the superblock).
    let away = tmp.path().join("away");
    std::fs::create_dir(&away).unwrap();
    let copy = away.join("copy.picchioflat");
    std::fs::copy(&image, &copy).unwrap();
    talks_with(&format!("file:{}", copy.display()), &model, &[]);
    // An answer that filled the context (the default -n is the rest of it): the next turn cannot
    // fit, and the REPL says how to go on.
    let o = chat(&["--model", model.to_str().unwrap(), "--ctx", "64", "--ecap", "4"], "Hi there\nAgain\n");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("exceeds the context of 64 positions") && out.contains("/reset starts a new one"), "{out}");
    // A context past the model's is named as such (as `plan` names it), not as a long prompt.
    let e = stderr(&chat(&["--model", model.to_str().unwrap(), "--ctx", "100000"], ""));
    assert!(e.contains("--ctx 100000: the model's context is 1..="), "{e}");
    let o = chat(&["-v", "--store", copy.to_str().unwrap(), "--ecap", "4", "--ctx", "128"], "");
    assert!(stderr(&o).contains("(recorded in the image)"), "{}", stderr(&o));
    // The software NVMe controller reading the image serves it the same way.
    talks_with(&format!("nvme-sim:{}", copy.display()), &model, &[]);

    // The model directory moved together with its image: found beside the image.
    let moved = tmp.path().join("moved");
    std::fs::rename(&model, &moved).unwrap();
    talks_with(&format!("file:{}", moved.join("experts.picchioflat").display()), &moved, &[]);
    let o = chat(&["-v", "--store", moved.join("experts.picchioflat").to_str().unwrap()], "");
    assert!(stderr(&o).contains("moved with it"), "{}", stderr(&o));

    // The copy away from it now names a directory that is gone: the error says what was recorded,
    // why it does not fit, and what to do.
    let o = chat(&["--store", copy.to_str().unwrap()], "");
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    let recorded = tmp.path().canonicalize().unwrap().join("m");
    assert!(e.contains(&format!("written for the model directory {}", recorded.display())), "{e}");
    assert!(e.contains("config.json SHA-256") && e.contains("it does not exist") && e.contains("--model DIR"), "{e}");

    // A directory at the recorded path whose config.json differs is not taken for the model.
    std::fs::create_dir(&recorded).unwrap();
    std::fs::write(recorded.join("config.json"), "{}").unwrap();
    let e = stderr(&chat(&["--store", copy.to_str().unwrap()], ""));
    assert!(e.contains("its config.json now has SHA-256") && e.contains("--model DIR"), "{e}");
    // --model still wins over the record.
    talks_with(&format!("file:{}", copy.display()), &moved, &["--model", moved.to_str().unwrap()]);

    // An image without a record (Picchio (C)'s fixture image, copied away from its directory).
    let c_image = tmp.path().join("c.picchioflat");
    std::fs::copy(common::model().join("experts.picchioflat"), &c_image).unwrap();
    let e = stderr(&chat(&["--store", c_image.to_str().unwrap()], ""));
    assert!(e.contains("records no model directory") && e.contains("--model DIR"), "{e}");

    // A damaged record (its version field overwritten) only loses the way to the model: without
    // --model the error names the field and its offset; with it the image is read as any other.
    let damaged = tmp.path().join("damaged.picchioflat");
    let mut bytes = std::fs::read(moved.join("experts.picchioflat")).unwrap();
    assert_eq!(&bytes[96..104], b"PCHMODEL");
    bytes[104..108].copy_from_slice(&7u32.to_le_bytes());
    std::fs::write(&damaged, &bytes).unwrap();
    let o = chat(&["--store", damaged.to_str().unwrap()], "");
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    let parts = ["model record in its superblock is damaged", "model_record.version", "0x68", "--model DIR"];
    common::assert_contains_all(&e, &parts);
    talks_with(&format!("file:{}", damaged.display()), &moved, &["--model", moved.to_str().unwrap()]);

    // No store and no model: say what to give.
    let o = chat(&["chat"], "");
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no model: give --model DIR"), "{}", stderr(&o));
}

#[cfg(target_os = "linux")]
#[test]
#[ignore = "needs root: losetup"]
fn a_raw_device_names_its_model() {
    let test = "a_raw_device_names_its_model";
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let file = sparse_file(&tmp.path().join("dev.img"), 16 << 20);
    let lo = LoopDevice::attach_for_test(test, &file, LoopOptions::default());
    let raw = format!("raw:{}", lo.dev.display());
    common::ok(&["pack", model.to_str().unwrap(), "--out", &raw, "--no-progress", "-q"]);
    talks_with(&raw, &model, &[]);
    // The model directory gone: the device's record is all there is, and the error names it.
    let moved = tmp.path().join("moved");
    std::fs::rename(&model, &moved).unwrap();
    let o = chat(&["--store", &raw], "");
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains(&raw) && e.contains("it does not exist") && e.contains("--model DIR"), "{e}");
    talks_with(&raw, &moved, &["--model", moved.to_str().unwrap()]);
}

#[test]
fn save_refuses_an_existing_file_and_save_bang_replaces_it() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let file = tmp.path().join("conv.json");
    std::fs::write(&file, "my earlier conversation\n").unwrap();
    let f = file.display();
    let fresh = tmp.path().join("new.json");
    let input = format!("/help\n/save {f}\n/save {}\n/save! {f}\n", fresh.display());
    let o = chat(&["--model", model.to_str().unwrap(), "--system", "Be brief.", "--ecap", "4", "--ctx", "64"], &input);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // /help says how to replace a file.
    assert!(out.contains("/save FILE (a new file; /save! FILE replaces one)"), "{out}");
    // /save onto an existing file: refused, naming it and the way to replace it; the file is kept.
    assert!(out.contains(&format!("(could not save: {f} already exists: /save! {f} replaces it")), "{out}");
    // /save to a new name writes it; /save! replaces the existing file.
    assert!(out.contains(&format!("(saved 1 messages to {})", fresh.display())), "{out}");
    assert!(out.contains(&format!("(saved 1 messages to {f})")), "{out}");
    for p in [&file, &fresh] {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        assert_eq!(v["messages"][0]["content"], "Be brief.", "{}", p.display());
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().contains(".tmp-")), "{left:?}");
}
