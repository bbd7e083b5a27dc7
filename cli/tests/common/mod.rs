//! Helpers shared by the `picchio` CLI tests: the vendored Picchio (C) fixture, a scratch directory
//! on the target's file system, and running the real binary with its output echoed to the test log.
#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::process::Output;

#[cfg(target_os = "linux")]
pub mod opens;
pub mod serve;
#[cfg(unix)]
pub mod stop;

/// Picchio (C)'s fixture model directory (config, safetensors, `experts.picchioflat`).
pub fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe")
}

/// The fixture's packed image as a `file:` store URI.
pub fn image() -> String {
    format!("file:{}", model().join("experts.picchioflat").display())
}

/// A fresh directory under the target's temporary directory (removed when dropped).
pub fn scratch() -> tempfile::TempDir {
    picchio_testkit::scratch!()
}

/// A private copy of Picchio (C)'s fixture model directory in `dir`, written through and `fsync`ed so
/// its pages are clean. A test whose result depends on the page cache of the image (device bytes of a
/// cold run, what a drop leaves resident) uses its own copy: the shared fixture's pages are loaded by
/// every other test reading it at the same time, so its page-cache state is no test's own.
pub fn private_model(dir: &Path) -> PathBuf {
    let dst = dir.join("qwen3_moe");
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(model()).unwrap() {
        let src = entry.unwrap().path();
        let to = dst.join(src.file_name().unwrap());
        std::fs::copy(&src, &to).unwrap_or_else(|e| panic!("copy {} -> {}: {e}", src.display(), to.display()));
        std::fs::File::open(&to).and_then(|f| f.sync_all()).unwrap();
    }
    dst
}

/// `picchio synth --arch custom` arguments for a custom geometry: `--hidden`, `--moe-intermediate`
/// (the model's `moe_intermediate_size`), `--experts` (routed experts per layer) and
/// `--model-layers`. The image holds `model_layers` × `experts` entries unless the caller adds
/// `--layers`; callers append the rest (`--seed`, `--expert-bytes`, `--no-progress`, `--out`, ...).
pub fn synth_custom(hidden: u64, moe_intermediate: u64, experts: u64, model_layers: u64) -> Vec<String> {
    let flags = ["--hidden", "--moe-intermediate", "--experts", "--model-layers"];
    let values = [hidden, moe_intermediate, experts, model_layers];
    let geometry = flags.into_iter().zip(values).flat_map(|(f, v)| [f.to_string(), v.to_string()]);
    ["synth", "--arch", "custom"].map(String::from).into_iter().chain(geometry).collect()
}

/// `picchio synth` arguments for one layer of Qwen3-30B-A3B's geometry whose 8 experts per token are
/// its only experts, with a vocabulary of `vocab` and no tokenizer (about 120 MB with
/// `--model-out`, 75 MB of it the layer's F32 attention); callers append the rest (`--seed`,
/// `--no-progress`, `--model-out`, ...).
pub fn synth_one_layer(vocab: u32) -> Vec<String> {
    let args = ["synth", "--arch", "qwen3-30b-a3b", "--layers", "1", "--experts", "8", "--vocab"];
    args.map(String::from).into_iter().chain([vocab.to_string(), "--no-tokenizer".into()]).collect()
}

/// Starts `picchio ARGS` in `dir` (stdin closed, stdout and stderr piped), polls until
/// `writing(pid)` says its write is under way, sends it `signal` (`libc::SIGINT`, ...) and waits for
/// its output. Each wait is bounded by the test kit's hang limit (a hang fails the test naming
/// `args[0]`; not a timing assertion).
#[cfg(unix)]
pub fn signal_once_writing(dir: &Path, args: &[&str], writing: impl Fn(u32) -> bool, signal: libc::c_int) -> Output {
    use picchio_testkit::bin::{wait_bounded, HANG_LIMIT};
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start picchio");
    let pid = child.id();
    if !picchio_testkit::wait_until(HANG_LIMIT, || writing(pid)) {
        // SAFETY: signals our own child, not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        panic!("picchio {} never started writing in {HANG_LIMIT:?}", args[0]);
    }
    // SAFETY: signals our own child, which is still running (not reaped).
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
    wait_bounded(child, HANG_LIMIT).expect("the signalled process exits")
}

/// The names in `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// `CMD... --model MODEL --store STORE REST...`: the arguments of `picchio CMD` on `model` with its
/// experts read from `store`.
pub fn on_model<'a>(cmd: &[&'a str], model: &'a Path, store: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    let model = model.to_str().expect("a UTF-8 model path");
    [cmd, &["--model", model, "--store", store][..], rest].concat()
}

/// A JSON file's value (a `--json` report).
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON ({e})", path.display()))
}

/// How many elements of the SVG document at `path` have one of `tags`, after asserting that it
/// parses as XML and its root is `<svg>` (the message names the file).
pub fn svg_count(path: &Path, tags: &[&str]) -> usize {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{}: not XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg", "{}", path.display());
    doc.descendants().filter(|n| tags.contains(&n.tag_name().name())).count()
}

/// Runs `picchio ARGS --json DIR/NAME.json --plot DIR/NAME-plots` (a `picchio bench` run with its
/// report and charts), asserts it succeeded, and returns its stdout, its report and the charts'
/// directory.
pub fn bench_with_report(args: &[&str], dir: &Path, name: &str) -> (String, serde_json::Value, PathBuf) {
    let (json, plots) = (dir.join(format!("{name}.json")), dir.join(format!("{name}-plots")));
    let out = ok(&[args, &["--json", json.to_str().unwrap(), "--plot", plots.to_str().unwrap()][..]].concat());
    (out, read_json(&json), plots)
}

/// `args` as the `&str`s [`picchio`] takes.
pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Runs `picchio ARGS`, echoing the command, its status and its output to the test log (the test
/// kit's runner: stdin closed, a hang fails the test).
pub fn picchio(args: &[&str]) -> Output {
    picchio_testkit::bin::Bin::new("picchio", env!("CARGO_BIN_EXE_picchio")).run(args)
}

/// Runs `picchio ARGS`, asserts it succeeded, and returns its stdout.
pub fn ok(args: &[&str]) -> String {
    let o = picchio(args);
    assert!(o.status.success(), "picchio {} failed", args.join(" "));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts that `text` (a command's output) contains each of `parts`; a failure names the first part
/// missing and shows `text`.
pub fn assert_contains_all(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "no {part:?} in:\n{text}");
    }
}

/// Asserts that `written` (the first bytes of what `picchio pack DIR` wrote, at least as long as
/// `fixture`) is the fixture image Picchio (C) packed from `dir`, with `picchio pack`'s model record
/// naming `dir` in the superblock's reserved bytes 96..4096 (docs/format.md, "Model record"): every
/// other byte equal, the record's magic at 96 and `dir`'s canonical path at 144.
pub fn assert_packed_image(written: &[u8], fixture: &[u8], dir: &Path) {
    const RECORD: std::ops::Range<usize> = 96..4096;
    assert!(written.len() >= fixture.len(), "{} bytes written, the image has {}", written.len(), fixture.len());
    let written = &written[..fixture.len()];
    assert!(written[..RECORD.start] == fixture[..RECORD.start], "the superblock fields differ from the fixture's");
    assert!(written[RECORD.end..] == fixture[RECORD.end..], "the index or payloads differ from the fixture's");
    assert_eq!(&written[96..104], b"PCHMODEL", "no model record at superblock byte 96");
    let path = std::fs::canonicalize(dir).unwrap();
    let path = path.to_str().unwrap().as_bytes();
    assert_eq!(&written[144..144 + path.len()], path, "the record names {}", dir.display());
}
