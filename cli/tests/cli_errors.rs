//! `picchio` as a fresh user runs it, on the defects a trial found: exit status and the message on
//! stderr (results on stdout) when an output path names a model file, when stdout is a closed pipe,
//! for `convert --force`, for superblock dimensions no hash covers, and for stores that are not files.

use std::path::{Path, PathBuf};
#[cfg_attr(not(target_os = "linux"), allow(unused_imports))] // the Linux-only cases use the rest
use std::process::{Command, Output, Stdio};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}

fn scratch() -> tempfile::TempDir {
    picchio_testkit::scratch!()
}

/// A writable copy of the Picchio (C) converted directory (with its image) under `dir`.
fn model_copy(dir: &Path) -> PathBuf {
    let m = dir.join("m");
    std::fs::create_dir(&m).unwrap();
    for e in std::fs::read_dir(fixture("picchio_c/qwen3_moe")).unwrap() {
        let p = e.unwrap().path();
        std::fs::write(m.join(p.file_name().unwrap()), std::fs::read(&p).unwrap()).unwrap();
    }
    m
}

fn picchio(args: &[&str]) -> Output {
    picchio_with(args, Stdio::piped())
}

/// Runs `picchio args` with `stdout` (the test kit's runner: stdin closed, output echoed, a hang
/// fails the test after `picchio_testkit::bin::HANG_LIMIT`).
fn picchio_with(args: &[&str], stdout: impl Into<Stdio>) -> Output {
    picchio_testkit::bin::Bin::new("picchio", env!("CARGO_BIN_EXE_picchio")).run_with(args, stdout)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn pack_refuses_to_replace_a_model_file_and_prints_its_summary_on_stdout() {
    let tmp = scratch();
    let m = model_copy(tmp.path());
    for victim in ["model-00001.safetensors", "config.json"] {
        let path = m.join(victim);
        let before = std::fs::read(&path).unwrap();
        let o = picchio(&["pack", s(&m), "--out", s(&path), "--no-progress"]);
        assert_eq!(o.status.code(), Some(1));
        let e = stderr(&o);
        assert!(
            e.contains(&format!("Error: {}: exists and is not a .picchioflat image", path.display()))
                && e.contains("remove it or choose another --out"),
            "{e}"
        );
        assert!(std::fs::read(&path).unwrap() == before, "{victim} was replaced");
    }
    // Re-packing over an image is the normal case; the summary is a result: stdout, also under -q.
    let o = picchio(&["pack", s(&m), "--no-progress", "-q"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(&format!("packed {} -> ", m.display())), "{}", stdout(&o));
    assert_eq!(stderr(&o), "", "-q: nothing but errors on stderr");
}

#[test]
fn dump_logits_refuses_a_model_shard_and_replaces_only_a_previous_dump() {
    let tmp = scratch();
    let m = model_copy(tmp.path());
    let shard = m.join("model-00001.safetensors");
    let before = std::fs::read(&shard).unwrap();
    let run =
        |dump: &Path| picchio(&["run", "--model", s(&m), "--prompt-ids", "1,2,3", "-n", "2", "--dump-logits", s(dump)]);
    let o = run(&shard);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains(&format!("{}: exists and is not a logits dump", shard.display())), "{e}");
    assert!(std::fs::read(&shard).unwrap() == before, "the model shard was replaced");
    let o = run(&m.join("config.json"));
    assert_eq!(o.status.code(), Some(1));

    let dump = tmp.path().join("logits.safetensors");
    for _ in 0..2 {
        let o = run(&dump);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "no temporary file is left: {names:?}");
    let bytes = std::fs::read(&dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names(), [&"logits".to_string()]);
}

#[test]
fn a_closed_stdout_ends_the_process_quietly() {
    let img = fixture("picchio_c/qwen3_moe/experts.picchioflat");
    let m = fixture("picchio_c/qwen3_moe");
    let cases: [&[&str]; 2] = [
        &["verify", s(&img), "--no-progress"],
        &["run", "--json", "--model", s(&m), "--prompt-ids", "1,2,3", "-n", "2"],
    ];
    for args in cases {
        // The reading end is closed before picchio starts, so its first write meets a broken pipe.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = picchio_with(args, writer);
        let e = stderr(&o);
        assert!(!e.contains("panicked") && !e.contains("failed printing"), "{e}");
        assert_ne!(o.status.code(), Some(101), "{e}");
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(o.status.signal(), Some(libc::SIGPIPE), "ends like other Unix tools: {}", o.status);
        }
    }
}

#[test]
fn convert_force_replaces_an_existing_directory() {
    let tmp = scratch();
    let src = fixture("qwen3_moe");
    let out = tmp.path().join("out");
    let o = picchio(&["convert", s(&src), s(&out), "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(&format!("converted {} -> {}", src.display(), out.display())), "{}", stdout(&o));
    std::fs::write(out.join("stale"), b"from before").unwrap();

    let o = picchio(&["convert", s(&src), s(&out), "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("already exists") && stderr(&o).contains("pass --force"), "{}", stderr(&o));
    assert!(out.join("stale").exists());

    let o = picchio(&["convert", s(&src), s(&out), "--force", "--no-progress", "-q"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("converted "), "the summary is on stdout: {}", stdout(&o));
    assert!(!out.join("stale").exists() && out.join("config.json").exists(), "the old directory was replaced");

    let o = picchio(&["convert", "--help"]);
    assert!(o.status.success() && stdout(&o).contains("--force"), "{}", stdout(&o));
}

#[test]
fn superblock_dimensions_are_checked_only_with_the_model_and_both_counts_end_the_error() {
    let tmp = scratch();
    let m = model_copy(tmp.path());
    let img = m.join("experts.picchioflat");
    let mut b = std::fs::read(&img).unwrap();
    b[16] ^= 0x80; // hidden 64 -> 192
    b[28] = 2; // topk 4 -> 2
    std::fs::write(&img, &b).unwrap();

    let o = picchio(&["verify", s(&img), "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("superblock dimensions (hidden 192, n_layers 3, n_experts 16, topk 2"), "{out}");
    assert!(out.contains("not hash-protected") && out.contains("--model"), "{out}");

    let o = picchio(&["verify", s(&img), "--model", s(&m), "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    assert!(out.contains("hidden is 192 in the store, 64 in the model"), "{out}");
    assert!(out.contains("topk is 2 in the store, 4 in the model"), "{out}");
    assert!(!out.contains("not hash-protected"), "{out}");
    let e = stderr(&o);
    assert!(e.contains("verification failed: 2 image-level problem(s), 0 expert(s) failed"), "{e}");

    // moe_inter is 2 × moe_intermediate_size, and the message says so.
    let mut b = std::fs::read(fixture("picchio_c/qwen3_moe/experts.picchioflat")).unwrap();
    b[32..36].copy_from_slice(&64u32.to_le_bytes());
    std::fs::write(&img, &b).unwrap();
    let o = picchio(&["run", "--model", s(&m), "--store", &format!("file:{}", img.display()), "--prompt-ids", "1"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("moe_inter (2 × moe_intermediate_size) is 64 in the store, 128 in the model"), "{e}");
}

#[cfg(unix)]
#[test]
fn stores_that_are_not_files_are_named_and_a_fifo_does_not_block() {
    let tmp = scratch();
    let fifo = tmp.path().join("fifo");
    let st = Command::new("mkfifo").arg(&fifo).status().expect("run mkfifo");
    assert!(st.success());
    let m = fixture("picchio_c/qwen3_moe");
    let cases =
        [(fifo.clone(), "FIFO"), (tmp.path().to_path_buf(), "directory"), ("/dev/null".into(), "character device")];
    for (path, kind) in &cases {
        let want = format!("{}: is a {kind}; expected a regular file or a block device", path.display());
        let o = picchio(&["verify", s(path), "--buffered", "--no-progress"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(&want), "{}", stderr(&o));
        for mode in ["--buffered", "--direct"] {
            let store = format!("file:{}", path.display());
            let o = picchio(&["run", "--model", s(&m), "--store", &store, mode, "--prompt-ids", "1"]);
            assert_eq!(o.status.code(), Some(1));
            assert!(stderr(&o).contains(&want) && !stderr(&o).contains("O_DIRECT"), "{}", stderr(&o));
        }
    }
}

#[test]
fn generation_beyond_the_context_and_bad_sampling_values_are_refused() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "--store", "safetensors", "--prompt-ids", "1,2"];
        args.extend_from_slice(extra);
        let out = picchio(&args);
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (args, want) in [
        (&["-n", "18446744073709551615"][..], "max_position_embeddings"),
        (&["-n", "600"][..], "exceed the model's context of 512"),
        (&["-n", "2", "--ctx", "100000"][..], "--ctx 100000: the model's context is 1..=512 positions"),
        (&["--temperature", "nan"][..], "--temperature must be a finite number"),
        (&["--temperature", "inf"][..], "--temperature must be a finite number"),
        (&["--io-threads", "0"][..], "--io-threads"),
        (&["--io-threads", "100000"][..], "--io-threads"),
    ] {
        let (code, err) = run(args);
        assert_eq!(code, Some(if want.starts_with("--io") { 2 } else { 1 }), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[cfg(target_os = "linux")]
#[test]
fn verify_reads_every_store_scheme_and_names_an_unknown_one() {
    let image = fixture("picchio_c/qwen3_moe").join("experts.picchioflat");
    // The driver on its controller model reads the image as verify's file reader does.
    let o = picchio(&["verify", &format!("nvme-sim:{}", image.display()), "--no-progress"]);
    assert!(o.status.success() && stdout(&o).contains("OK"), "{}", stderr(&o));
    // Not a file called "bogus:/x": a scheme, named as run, pack and synth name it.
    let o = picchio(&["verify", "bogus:/x", "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("unknown scheme \"bogus:\"") && stderr(&o).contains("nvme-sim:PATH"), "{}", stderr(&o));
    for store in ["auto", "safetensors"] {
        let o = picchio(&["verify", store, "--no-progress"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(&format!("{store}: names no image to verify")), "{}", stderr(&o));
    }
}

#[test]
fn usage_out_is_claimed_before_the_model_loads_and_names_the_flag_and_path() {
    let tmp = scratch();
    let m = model_copy(tmp.path());
    let run = |store: &str, usage: &Path| {
        picchio(&["run", "--model", s(&m), "--store", store, "--prompt-ids", "1,2", "-n", "2", "--usage-out", s(usage)])
    };
    // A directory that does not exist: refused before the store is opened (a store that cannot open
    // would otherwise be the error) and before any output.
    let missing_store = format!("file:{}", tmp.path().join("no-image.picchioflat").display());
    let nowhere = tmp.path().join("no-such-dir").join("usage.txt");
    let o = run(&missing_store, &nowhere);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains(&format!("--usage-out {}: cannot save the usage profile there", nowhere.display())), "{e}");
    assert!(!e.contains("no-image.picchioflat"), "the model was opened before --usage-out was checked: {e}");
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    // A file that is not a usage profile: refused before the run, and left as it was.
    let other = tmp.path().join("notes.txt");
    std::fs::write(&other, "my notes\n").unwrap();
    let o = run(&missing_store, &other);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("--usage-out") && e.contains(s(&other)) && e.contains("will not replace it"), "{e}");
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "my notes\n");
    // A good path: the run prints its tokens and saves the profile; nothing else is left beside it.
    let good = tmp.path().join("usage.txt");
    let o = run(&common_image(&m), &good);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&good).unwrap().starts_with("picchio-usage/1\n"));
    let names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "a temporary file was left: {names:?}");
}

/// The image of the model directory `m` as a `file:` store.
fn common_image(m: &Path) -> String {
    format!("file:{}", m.join("experts.picchioflat").display())
}

#[test]
fn config_values_out_of_range_or_of_the_wrong_type_name_the_file_key_and_value() {
    let tmp = scratch();
    let m = model_copy(tmp.path());
    let cfg = m.join("config.json");
    let original: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    for (key, value, want) in [
        (
            "rope_theta",
            serde_json::json!(-1.0),
            "config key `rope_theta`: -1 is out of range: expected a finite number > 0",
        ),
        (
            "rms_norm_eps",
            serde_json::json!(0.0),
            "config key `rms_norm_eps`: 0 is out of range: expected a finite number > 0",
        ),
        (
            "num_experts_per_tok",
            serde_json::json!(17),
            "config key `num_experts_per_tok`: 17 is out of range: expected 1..=16",
        ),
        (
            "hidden_size",
            serde_json::json!("64"),
            "config key `hidden_size`: invalid type: string \"64\", expected usize",
        ),
    ] {
        let mut v = original.clone();
        v[key] = value;
        std::fs::write(&cfg, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
        let o = picchio(&["run", "--model", s(&m), "--prompt-ids", "1,2", "-n", "2"]);
        assert_eq!(o.status.code(), Some(1), "{key}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(&format!("{}: {want}", cfg.display())), "{key}: {e}");
        assert!(!e.contains("panicked"), "{e}");
    }
}

#[test]
fn errors_name_the_flag_the_user_typed_not_a_library_field() {
    let tmp = scratch();
    let m = model_copy(tmp.path());
    // --ecap 0: the flag, not the options struct's `ecap`.
    let o = picchio(&["run", "--model", s(&m), "--store", &common_image(&m), "--prompt-ids", "1,2", "--ecap", "0"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("--ecap") && e.contains("at least 1") && !e.contains("`ecap`"), "{e}");
    // An existing destination: --force, not the options struct's `overwrite`.
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let o = picchio(&["convert", s(&fixture("qwen3_moe")), s(&out), "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("already exists") && e.contains("pass --force to replace it"), "{e}");
    assert!(!e.contains("`overwrite`") && !e.contains("`force`"), "{e}");
    assert_eq!(e.matches("--force").count(), 1, "said once, not again as a hint: {e}");
}
