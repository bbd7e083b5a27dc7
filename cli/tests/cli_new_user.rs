//! `picchio` as a new user runs it (issue 9, "found by the same new-user pass"): each defect the pass
//! found, as the exit status and the message on stderr.

mod common;

use common::{assert_packed_image, model, picchio, scratch};
use std::process::Output;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn m() -> String {
    model().to_str().unwrap().to_owned()
}

#[test]
fn a_context_overflow_is_one_sentence_and_a_saturated_sum_is_not_printed_as_a_count() {
    let max = u64::MAX.to_string();
    let o = picchio(&["run", "--model", &m(), "--prompt-ids", "1,2", "-n", &max, "--store", "safetensors"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("exceed the model's context of") && !err.contains("  "), "{err}");
    assert!(err.contains(&format!("more than {}", u64::MAX - 1)), "{err}");
    assert!(!err.contains(&format!("= {max}")), "{err}");
}

#[test]
fn another_os_engine_is_a_usage_error_naming_the_flag_and_the_engines_here() {
    let other = if cfg!(windows) { "uring" } else { "iocp" };
    let o = picchio(&["run", "--model", &m(), "--prompt-ids", "1", "-n", "1", "--io", other]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--io") && err.contains("psync") && err.contains(std::env::consts::OS), "{err}");
    assert!(o.stdout.is_empty(), "nothing was generated");
}

#[test]
fn negative_numbers_are_range_errors_naming_the_flag() {
    let mm = m();
    let run = |extra: &[&'static str]| {
        let mut v = vec!["run", "--model", mm.as_str(), "--prompt-ids", "1"];
        v.extend_from_slice(extra);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let cases: Vec<(Vec<String>, &str, &str, i32)> = vec![
        (run(&["--temperature", "-1"]), "--temperature", ">= 0", 1),
        (run(&["--top-p", "-0.5"]), "--top-p", "(0, 1]", 1),
        (run(&["--temperature", "1e300"]), "--temperature", "1e300 is beyond the largest magnitude accepted", 2),
        (run(&["--seed", "-1"]), "--seed", ">= 0", 2),
        (run(&["-n", "-3"]), "--max-new-tokens", ">= 0", 2),
        (run(&["--ecap", "-1"]), "--ecap", ">= 0", 2),
        (run(&["--qd", "-4"]), "--qd", "1..=256", 2),
        (run(&["--io-threads", "-2"]), "--io-threads", "1..=256", 2),
        (run(&["--prefill-chunk", "-1"]), "--prefill-chunk", "-1 is less than 1", 2),
        (vec!["serve".into(), "--body-timeout".into(), "-1".into()], "--body-timeout", "-1 is not in 1..=86400", 2),
        (
            vec!["serve".into(), "--idle-timeout".into(), "1e3".into()],
            "--idle-timeout",
            "is not an integer in 1..=86400",
            2,
        ),
        (
            vec!["verify".into(), mm.clone(), "--io-threads".into(), "-2".into()],
            "--io-threads",
            "-2 is not in 1..=256",
            2,
        ),
        (vec!["bench".into(), "qd-sweep".into(), "--qd".into(), "-1".into()], "--qd", "-1 is not in 1..=", 2),
        (vec!["pack".into(), mm.clone(), "--layers".into(), "-1".into()], "--layers", ">= 0", 2),
        (vec!["synth".into(), "--out".into(), "x".into(), "--seed".into(), "-7".into()], "--seed", ">= 0", 2),
        (vec!["demo".into(), "--cache-percent".into(), "-5".into()], "--cache-percent", "(0, 100]", 1),
        (
            vec!["bench".into(), "cache".into(), "--model".into(), mm.clone(), "--cache-percent".into(), "-5".into()],
            "--cache-percent",
            "(0, 100]",
            1,
        ),
    ];
    for (args, flag, range, code) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = picchio(&args);
        let err = stderr(&o);
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains(range), "{args:?}: {err}");
    }
}

#[test]
fn verify_of_a_foreign_file_says_it_is_not_an_image() {
    for f in ["config.json", "model-00001.safetensors"] {
        let p = model().join(f);
        let o = picchio(&["verify", p.to_str().unwrap()]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("not a .picchioflat image") && !err.contains("truncated"), "{err}");
    }
    // A short file that starts like an image is truncated.
    let tmp = scratch();
    let p = tmp.path().join("short.picchioflat");
    std::fs::write(&p, b"PCHIOFL1 and then nothing").unwrap();
    let err = stderr(&picchio(&["verify", p.to_str().unwrap()]));
    assert!(err.contains("truncated"), "{err}");
}

#[test]
fn the_help_headline_says_what_picchio_is() {
    let o = picchio(&["--help"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success());
    let headline = out.lines().next().unwrap();
    assert!(headline.starts_with("picchio runs Mixture-of-Experts models larger than RAM"), "{out}");
    assert!(!out.contains("Picchio runtime: convert, pack, verify"), "the crate description: {out}");
}

#[test]
fn an_expert_cache_larger_than_the_model_is_refused_as_bench_cache_refuses_it() {
    let o = picchio(&["run", "--model", &m(), "--prompt-ids", "1", "-n", "1", "--ecap", "1000000"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--ecap 1000000: the model has only") && err.contains("routed experts"), "{err}");
}

#[test]
fn an_absent_nvme_device_is_no_pci_device_for_every_command() {
    let store = "nvme:0000:7f:1f.7";
    let cases: Vec<Vec<&str>> = vec![
        vec!["run", "--model", "M", "--prompt-ids", "1", "-n", "1", "--store", store],
        vec!["verify", store],
        vec!["pack", "M", "--out", store, "--no-progress"],
        vec!["synth", "--arch", "qwen3-30b-a3b", "--out", store, "--layers", "1"],
        vec!["bench", "qd-sweep", "--store", store, "--duration", "0.1", "--engines", "nvme"],
    ];
    let mm = m();
    for args in cases {
        let args: Vec<&str> = args.iter().map(|a| if *a == "M" { mm.as_str() } else { a }).collect();
        let r = picchio(&args);
        let err = stderr(&r);
        assert!(!r.status.success(), "{args:?}");
        assert!(err.contains("no PCI device 0000:7f:1f.7") && err.contains("picchio nvme list"), "{args:?}: {err}");
        assert!(!err.contains("iommu_group"), "{args:?}: {err}");
    }
}

#[test]
fn convert_pack_and_synth_refuse_a_missing_parent_directory_alike() {
    let tmp = scratch();
    let missing = tmp.path().join("no/such");
    let out = missing.join("m");
    let img = missing.join("x.picchioflat");
    let src = model().join("../../qwen3_moe").canonicalize().unwrap();
    let mm = m();
    let cases: Vec<Vec<&str>> = vec![
        vec!["convert", src.to_str().unwrap(), out.to_str().unwrap(), "--no-progress"],
        vec!["pack", &mm, "--out", img.to_str().unwrap(), "--no-progress"],
        vec!["synth", "--arch", "qwen3-30b-a3b", "--layers", "1", "--out", img.to_str().unwrap()],
    ];
    for args in cases {
        let o = picchio(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        let want = format!("its parent directory {} does not exist", missing.display());
        assert!(err.contains(&want) && !err.contains("statvfs"), "{args:?}: {err}");
        assert!(!tmp.path().join("no").exists(), "{args:?} created the parent");
    }
}

#[test]
fn the_demo_reuses_its_converted_model_and_rebuilds_when_the_stamp_differs() {
    let tmp = scratch();
    let wd = tmp.path().join("cache");
    let w = wd.to_str().unwrap();
    let first = picchio(&["demo", "--workdir", w, "--buffered"]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(stderr(&first).contains("converting"), "{}", stderr(&first));
    let image = wd.join("qwen3_moe_text-q4/experts.picchioflat");
    let mtime = || std::fs::metadata(&image).unwrap().modified().unwrap();
    let before = mtime();
    let second = picchio(&["demo", "--workdir", w, "--buffered"]);
    let err = stderr(&second);
    assert!(second.status.success(), "{err}");
    assert!(err.contains("reusing") && !err.contains("converting") && !err.contains("packing"), "{err}");
    assert_eq!(mtime(), before, "the image was rewritten");
    // A stamp that does not match (an older binary, another fixture, an interrupted build) rebuilds.
    std::fs::write(wd.join("qwen3_moe_text-q4.stamp"), "picchio 0.0.0\n").unwrap();
    let third = picchio(&["demo", "--workdir", w, "--buffered"]);
    assert!(third.status.success() && stderr(&third).contains("converting"), "{}", stderr(&third));
}

#[test]
fn the_demo_work_directory_defaults_to_the_user_cache_directory() {
    let tmp = scratch();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["demo", "--buffered", "-n", "1"])
        .env_remove("PICCHIO_WORKDIR")
        .env("XDG_CACHE_HOME", tmp.path())
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(tmp.path().join("picchio/qwen3_moe_text-q4/experts.picchioflat").is_file(), "{}", stderr(&o));
    assert!(tmp.path().join("picchio/qwen3_moe_text-q4.stamp").is_file());
}

fn json_stats(o: &Output) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(o)));
    v["stats"].clone()
}

#[test]
fn a_prefix_store_counts_missing_experts_apart_from_errors_and_logs_them_once() {
    let tmp = scratch();
    let img = tmp.path().join("prefix.picchioflat");
    let i = img.to_str().unwrap();
    assert!(picchio(&["pack", &m(), "--out", i, "--layers", "1", "--no-progress"]).status.success());
    let store = format!("file:{i}");
    let o = picchio(&["-v", "run", "--model", &m(), "--prompt-ids", "1,2,3", "-n", "6", "--store", &store, "--json"]);
    let (err, st) = (stderr(&o), json_stats(&o));
    assert!(o.status.success(), "{err}");
    assert_eq!(st["store_errors"], 0, "{st}");
    assert!(st["store_missing"].as_u64().unwrap() > 0 && st["fallbacks"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(err.matches("a prefix store; experts it has no entry for").count(), 1, "{err}");
    assert!(err.contains("not in the store (prefix image)"), "the summary: {err}");
}

#[test]
fn a_corrupt_expert_is_logged_once_however_often_it_is_requested() {
    let tmp = scratch();
    let img = tmp.path().join("bad.picchioflat");
    let mut b = std::fs::read(model().join("experts.picchioflat")).unwrap();
    let sb = picchio_core::Superblock::decode(&b, "img", b.len() as u64).unwrap();
    for off in (sb.data_offset as usize..b.len()).step_by(4096) {
        b[off + 7] ^= 0x5a;
    }
    std::fs::write(&img, &b).unwrap();
    let store = format!("file:{}", img.display());
    let args = ["run", "--model", &m(), "--prompt-ids", "1,2,3", "-n", "12", "--store", &store, "--verify"];
    let o = picchio(&[&args[..], &["--ecap", "1", "--json"]].concat());
    let (err, st) = (stderr(&o), json_stats(&o));
    assert!(o.status.success(), "{err}");
    let warned: Vec<&str> = err.lines().filter(|l| l.contains("logged once per expert")).collect();
    let distinct: std::collections::HashSet<&str> =
        warned.iter().map(|l| l.split("; serving ").nth(1).unwrap_or(l)).collect();
    assert_eq!(warned.len(), distinct.len(), "an expert was logged twice: {err}");
    assert!(st["fallbacks"].as_u64().unwrap() > warned.len() as u64, "each expert was requested once only: {st}");
    assert!(err.contains("distinct experts) were served by the fallback") && err.contains("hash mismatch"), "{err}");
}

#[test]
fn pack_records_its_model_directory_unless_told_not_to() {
    let dir = scratch();
    let fixture = std::fs::read(model().join("experts.picchioflat")).unwrap();
    let with = dir.path().join("with.picchioflat");
    let o = picchio(&["pack", &m(), "--out", with.to_str().unwrap(), "--no-progress"]);
    assert!(o.status.success());
    assert_packed_image(&std::fs::read(&with).unwrap(), &fixture, &model());
    // --no-model-record: Picchio (C)'s packer's bytes, naming no local path.
    let without = dir.path().join("without.picchioflat");
    let o = picchio(&["pack", &m(), "--out", without.to_str().unwrap(), "--no-progress", "--no-model-record"]);
    assert!(o.status.success());
    assert!(std::fs::read(&without).unwrap() == fixture, "--no-model-record writes the fixture image byte for byte");
}
