//! Writers killed mid-write and writers meeting readers, through the real binary:
//! - `kill -9` of `picchio synth` (the image writer pack shares) at a few points of its write leaves
//!   the previous image byte-identical and a `<image>.tmp-<pid>` leftover, which the next writer
//!   removes and names; a live process's temporary file is kept.
//! - A `picchio run` reading an image makes `pack --out` onto it refuse (naming the run's pid) and
//!   `--force` proceed; two writers of one output: the second is refused while the first writes.
//! - The same on a loop device (root).
//! - An image overwritten in place under a `--verify` run: the run gives the same tokens (each payload
//!   of the other image fails its hash; the changed superblock is found and the rest falls back).
#![cfg(target_os = "linux")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use common::stop::{self, assert_leftover_removed, kill9, kill_writer_at, resume, spawn_stopped, tmp_of, LIMIT};
use common::{assert_packed_image, model, picchio, private_model, scratch, strs, synth_custom};
use picchio_testkit::bin::stderr;
use picchio_testkit::loopdev::{self, LoopDevice, LoopOptions};

/// `picchio synth` arguments for a custom image of 16 × 4 experts of 110,592 bytes (~7 MB): many
/// payload writes, so a stop point a quarter or half through lands in the middle of the write.
fn synth_args(out: &Path) -> Vec<String> {
    let mut args = synth_custom(256, 256, 16, 4);
    args.extend(["--no-progress".into(), "--out".into(), out.display().to_string()]);
    args
}

fn len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

#[test]
fn kill_9_of_a_writer_keeps_the_old_image_and_the_next_writer_removes_its_leftover() {
    let dir = scratch();
    let out = dir.path().join("experts.picchioflat");
    let args = synth_args(&out);
    // The complete output's size, from a complete synth elsewhere.
    let whole = dir.path().join("whole.picchioflat");
    let o = picchio(&strs(&synth_args(&whole)));
    assert!(o.status.success(), "{}", stderr(&o));
    let total = len(&whole);
    std::fs::copy(model().join("experts.picchioflat"), &out).unwrap();
    let old = std::fs::read(&out).unwrap();
    // A live process's temporary file (ours: this test is running) is another writer's, kept.
    let live = tmp_of(&out, std::process::id());
    std::fs::write(&live, b"a writer at work").unwrap();
    let mut leftover: Option<(PathBuf, u64)> = None;
    // Killed after its first write, a quarter through, half through; each writer removes the
    // previous one's leftover.
    for (i, at) in [1, total / 4, total / 2].into_iter().enumerate() {
        let log = dir.path().join(format!("synth-{i}.log"));
        let killed =
            kill_writer_at(&args, at, &log).unwrap_or_else(|e| panic!("the writer never wrote {at} bytes: {e}"));
        let tmp = tmp_of(&out, killed.pid);
        assert!(std::fs::read(&out).unwrap() == old, "the killed write changed the old image");
        assert!(tmp.exists(), "kill -9 leaves the temporary file (nothing can remove it)");
        assert!(len(&tmp) >= at, "{} has {} bytes, the writer had written {at}", tmp.display(), len(&tmp));
        if let Some((prev, bytes)) = &leftover {
            assert_leftover_removed(&killed.stderr, prev, *bytes);
        }
        leftover = Some((tmp.clone(), len(&tmp)));
    }
    // The next writer removes each dead one and says so, with its size.
    let mut small = synth_custom(64, 64, 4, 2);
    small.extend(["--no-progress".into(), "--out".into(), out.display().to_string()]);
    let o = picchio(&strs(&small));
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    let (prev, bytes) = leftover.unwrap();
    assert_leftover_removed(&e, &prev, bytes);
    assert!(std::fs::read(&out).unwrap() != old, "the small synth replaced the image");
    assert!(live.exists(), "the live process's temporary file was removed");
    assert!(!e.contains(&live.display().to_string()), "{e}");
    std::fs::remove_file(&live).unwrap();
}

/// The 12 prompt ids of the qwen3_moe reference.
fn prompt_ids() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe/reference.json");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    let ids: Vec<String> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    ids.join(",")
}

/// Tokens asked for: far more than the run produces before the test stops it.
const TOKENS: usize = 100_000;

/// A private copy of the fixture whose config allows [`TOKENS`] positions.
fn long_context_model(dir: &Path) -> PathBuf {
    let m = private_model(dir);
    let cfg = m.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v["max_position_embeddings"] = serde_json::json!(TOKENS + 1024);
    std::fs::write(&cfg, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    m
}

/// A long `picchio -v run` on `model` reading `store`, returned once it has opened the store (its
/// "experts from" line), with its stderr collected by a thread.
fn start_run(model: &Path, store: &str) -> (Child, std::thread::JoinHandle<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["-v", "run", "--model"])
        .arg(model)
        .args(["--store", store, "--prompt-ids", &prompt_ids(), "-n", &TOKENS.to_string(), "--json"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run picchio");
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(err).lines() {
            let line = line.unwrap();
            if line.contains("experts from") {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    if rx.recv_timeout(LIMIT).is_err() {
        let _ = child.kill();
        panic!("the run never opened its store:\n{}", reader.join().unwrap());
    }
    (child, reader)
}

fn stop_run(child: Child, reader: std::thread::JoinHandle<String>) -> String {
    kill9(child);
    reader.join().unwrap()
}

#[test]
fn pack_onto_an_image_a_run_reads_refuses_naming_the_run_and_force_replaces_it() {
    let dir = scratch();
    let m = long_context_model(dir.path());
    let img = m.join("experts.picchioflat");
    let before = std::fs::read(&img).unwrap();
    let (run, reader) = start_run(&m, &format!("file:{}", img.display()));
    let pid = run.id();
    let (ms, is) = (m.to_str().unwrap(), img.to_str().unwrap());

    let o = picchio(&["pack", ms, "--out", is, "--no-progress"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&format!("{is} is being read by another picchio process (pid {pid}); stop it or use --force")),
        "{e}"
    );
    assert!(std::fs::read(&img).unwrap() == before, "a refused pack changed the image");

    // --force replaces it by rename; the run goes on reading its open (old) file.
    let o = picchio(&["pack", ms, "--out", is, "--force", "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The refusal said "use --force": it works without --out too (the default --out is this image).
    let o = picchio(&["pack", ms, "--force", "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stop_run(run, reader);
    assert!(!log.contains("Error"), "{log}");
    // The default --out is the same image.
    let o = picchio(&["pack", ms, "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn two_writers_of_one_output_the_second_is_refused_while_the_first_writes() {
    let dir = scratch();
    let out = dir.path().join("e.picchioflat");
    // Stopped mid-write (after its first bytes), holding its claim, until the test kills it.
    let first = stop::writer_stopped_at(&synth_args(&out), 1, &dir.path().join("first.log"))
        .unwrap_or_else(|e| panic!("the first writer never wrote a byte: {e}"));
    let first_pid = first.id();
    let tmp = tmp_of(&out, first_pid);
    assert!(tmp.exists(), "the stopped synth has no temporary file {}", tmp.display());
    let m = model();
    let o = picchio(&["pack", m.to_str().unwrap(), "--out", out.to_str().unwrap(), "--no-progress"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&format!("{} is being written by another picchio process (pid {first_pid})", out.display())),
        "{e}"
    );
    assert!(tmp.exists(), "the refused writer touched the first one's temporary file");
    // Even --force does not let two writers write one file at once.
    let o = picchio(&["pack", m.to_str().unwrap(), "--out", out.to_str().unwrap(), "--force", "--no-progress"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    kill9(first);
    // Once the first writer is gone its lock is too: the next one writes (and removes its leftover).
    let o = picchio(&["pack", m.to_str().unwrap(), "--out", out.to_str().unwrap(), "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("removed {}", tmp.display())), "{}", stderr(&o));
    assert_packed_image(&std::fs::read(&out).unwrap(), &std::fs::read(m.join("experts.picchioflat")).unwrap(), &m);
}

/// For root test `test`: a scratch directory, the model `model` makes in it, and a 4 MiB loop device
/// (over a sparse file in the directory) with that model packed onto it as `raw:DEV`, the returned
/// store URI.
fn packed_loop_device(test: &str, model: fn(&Path) -> PathBuf) -> (tempfile::TempDir, PathBuf, LoopDevice, String) {
    loopdev::require_root(test);
    let dir = scratch();
    let m = model(dir.path());
    let lo = LoopDevice::sparse_for_test(test, &dir.path().join("dev.img"), 4 << 20, LoopOptions::default());
    let raw = format!("raw:{}", lo.dev.display());
    let o = picchio(&["pack", m.to_str().unwrap(), "--out", &raw, "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    (dir, m, lo, raw)
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn pack_onto_a_loop_device_a_run_reads_refuses_and_force_writes_it() {
    let test = "pack_onto_a_loop_device_a_run_reads_refuses_and_force_writes_it";
    let (_dir, m, lo, raw) = packed_loop_device(test, long_context_model);
    let ms = m.to_str().unwrap();
    let before = std::fs::read(&lo.backing).unwrap();

    let (run, reader) = start_run(&m, &raw);
    let pid = run.id();
    let o = picchio(&["pack", ms, "--out", &raw, "--no-progress"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&format!(
            "{} is being read by another picchio process (pid {pid}); stop it or use --force",
            lo.dev.display()
        )),
        "{e}"
    );
    assert!(std::fs::read(&lo.backing).unwrap() == before, "a refused pack wrote the device");
    let o = picchio(&["pack", ms, "--out", &raw, "--force", "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    stop_run(run, reader);
}

/// `picchio synth` arguments for another image of the fixture's geometry (other payloads, index and
/// superblock) at `out`.
fn other_image_args(out: &str) -> Vec<String> {
    let mut args = synth_custom(64, 64, 16, 3);
    args.extend(["--seed", "9", "--no-progress", "--out", out].map(String::from));
    args
}

/// `picchio run --verify --json` of `model` on `store` with a cache of 4 experts (3 layers × top-4:
/// every layer of every token reads from the image): first untouched for the reference tokens, then
/// stopped after its second batch of expert reads (`PICCHIO_STOP_AFTER_LOADS`) while `change`
/// rewrites the image under it. Asserts the second run gives the same tokens, served partly by the
/// fallback, and says the image changed; returns its stderr.
fn same_tokens_when_changed_under_a_verifying_run(
    dir: &Path,
    model: &Path,
    store: &str,
    change: impl FnOnce(),
) -> String {
    let ids = prompt_ids();
    let args = ["run", "--model", model.to_str().unwrap(), "--store", store, "--verify", "--ecap", "4"];
    let args: Vec<&str> = args.into_iter().chain(["--prompt-ids", &ids, "-n", "12", "--json"]).collect();
    let json = |out: &[u8]| -> serde_json::Value { serde_json::from_slice(out).expect("run --json") };
    let reference = json(&picchio(&args).stdout);
    assert_eq!(reference["stats"]["fallbacks"], 0, "{reference}");
    let log = dir.join("run.log");
    let child = spawn_stopped(
        Command::new(env!("CARGO_BIN_EXE_picchio")).args(&args).env(picchio_core::stop_point::LOADS_ENV, "2"),
        &log,
    )
    .unwrap_or_else(|e| panic!("the run never finished its second load batch: {e}"));
    change();
    let o = resume(child);
    let e = stop::read(&log);
    assert!(o.status.success(), "{e}");
    let got = json(&o.stdout);
    assert_eq!(got["tokens"], reference["tokens"], "mixed tokens: {e}");
    assert!(got["stats"]["fallbacks"].as_u64().unwrap() > 0, "{got}");
    assert!(e.contains("the image changed under this run"), "{e}");
    e
}

#[test]
fn an_image_overwritten_in_place_under_a_verifying_run_gives_the_same_tokens() {
    let dir = scratch();
    let m = private_model(dir.path());
    let img = m.join("experts.picchioflat");
    let other = dir.path().join("other.picchioflat");
    let o = picchio(&strs(&other_image_args(other.to_str().unwrap())));
    assert!(o.status.success(), "{}", stderr(&o));
    // Overwritten in place (same inode, as a program writing the file would); the run goes on
    // reading it.
    let e = same_tokens_when_changed_under_a_verifying_run(dir.path(), &m, &format!("file:{}", img.display()), || {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all(&std::fs::read(&other).unwrap()).unwrap();
        f.sync_all().unwrap();
    });
    assert!(e.contains("nothing more is read from it"), "{e}");
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn force_onto_a_loop_device_under_a_verifying_run_gives_the_same_tokens() {
    let test = "force_onto_a_loop_device_under_a_verifying_run_gives_the_same_tokens";
    let (dir, m, _lo, raw) = packed_loop_device(test, private_model);
    // The run holds the device: without --force the writer refuses; with it, it writes another
    // image under the run.
    same_tokens_when_changed_under_a_verifying_run(dir.path(), &m, &raw, || {
        let synth = other_image_args(&raw);
        let synth = strs(&synth);
        assert_eq!(picchio(&synth).status.code(), Some(1));
        let forced: Vec<&str> = synth.into_iter().chain(["--force"]).collect();
        let o = picchio(&forced);
        assert!(o.status.success(), "{}", stderr(&o));
    });
}
