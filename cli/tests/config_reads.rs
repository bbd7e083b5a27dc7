//! `config.json` is read once per command (issue 21): the command opens the model directory once
//! (`ModelDir::open`) and hands the parsed config down to the plan, the usage profile, the model and
//! the session. The reads are counted with inotify (`IN_OPEN` on a private copy of the model
//! directory, [`common::opens`]): what the kernel saw the `picchio` process open, not what the code
//! says it did. Linux only (inotify).
#![cfg(target_os = "linux")]

mod common;

use std::path::Path;

use common::opens::OpenWatch;

/// Runs `picchio ARGS` (asserting success) while watching `dir`: the opens of `dir/config.json`
/// and the stderr.
fn config_opens(dir: &Path, args: &[&str]) -> (usize, String) {
    let mut watch = OpenWatch::new(dir);
    let o = common::picchio(args);
    assert!(o.status.success(), "picchio {} failed", args.join(" "));
    let opens = watch.take();
    (opens.get("config.json").copied().unwrap_or(0), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// A private copy of the fixture (no other test opens its files) whose config.json lacks
/// `rms_norm_eps`: its transformers default (1e-6) is the fixture's own value, so the tokens are the
/// same, and reading the file says so in a warning.
fn model_without_eps(scratch: &Path) -> std::path::PathBuf {
    let m = common::private_model(scratch);
    let p = m.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(v["rms_norm_eps"], 1e-6);
    v.as_object_mut().unwrap().remove("rms_norm_eps");
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    m
}

const WARNING: &str = "no rms_norm_eps; using transformers' Qwen3MoeConfig defaults (rms_norm_eps 1e-6)";

#[test]
fn run_reads_config_json_once() {
    let tmp = common::scratch();
    let m = model_without_eps(tmp.path());
    let usage = tmp.path().join("usage.txt");
    // Every option that read the config on its own before: --usage-out, --ctx, --ecap (the plan),
    // then the session (the context check and the model).
    let args = [
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "-n",
        "2",
        "--ctx",
        "8",
        "--ecap",
        "8",
        "--usage-out",
        usage.to_str().unwrap(),
        "--json",
    ];
    let (opens, stderr) = config_opens(&m, &args);
    assert_eq!(opens, 1, "picchio run opened config.json {opens} times");
    // The missing key's default is said once, because the file is parsed once.
    assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
    assert!(usage.is_file(), "the usage profile was written");
    // --mem: the plan from the budget instead of --ecap.
    let args = ["run", "--model", m.to_str().unwrap(), "--prompt-ids", "1,2,3", "-n", "2", "--mem", "50%"];
    let (opens, stderr) = config_opens(&m, &args);
    assert_eq!(opens, 1, "picchio run --mem opened config.json {opens} times");
    assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
}

#[test]
fn plan_pack_and_verify_read_config_json_once() {
    let tmp = common::scratch();
    let m = model_without_eps(tmp.path());
    let model = m.to_str().unwrap();
    let (opens, stderr) = config_opens(&m, &["plan", "--model", model, "--ctx", "8", "--ecap", "8"]);
    assert_eq!(opens, 1, "picchio plan opened config.json {opens} times");
    assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
    // pack records the config's SHA-256 from the bytes it parsed.
    let image = tmp.path().join("packed.picchioflat");
    let (opens, _) = config_opens(&m, &["pack", model, "--out", image.to_str().unwrap(), "--no-progress"]);
    assert_eq!(opens, 1, "picchio pack opened config.json {opens} times");
    let (opens, _) = config_opens(&m, &["verify", image.to_str().unwrap(), "--model", model, "--no-progress"]);
    assert_eq!(opens, 1, "picchio verify --model opened config.json {opens} times");
}
