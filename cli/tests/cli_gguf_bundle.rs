//! `picchio pack X.gguf` and a run beside its bundle, as a user runs them: the bundle goes to
//! `X.gguf.picchioflat`, `run --store auto` uses it and prints what the run in place prints, a
//! stale bundle (the GGUF's metadata rewritten) is reported in exactly one line on stderr and the
//! run reads its experts from the GGUF instead, `pack --force` rebuilds it, and `verify` compares it
//! with the GGUF.

mod common;

use std::path::Path;

use common::{picchio, scratch};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run(gguf: &Path, store: &str) -> (String, String) {
    let o = picchio(&["run", "--model", s(gguf), "--store", store, "--prompt-ids", "1,17,300,4000", "-n", "6"]);
    assert!(o.status.success(), "run --store {store} failed");
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The generated ids of a run's stdout (the lines that carry them; timings differ run to run).
fn ids(stdout: &str) -> Vec<&str> {
    stdout.lines().filter(|l| !l.contains(" ms") && !l.contains("tok/s") && !l.contains("MB")).collect()
}

#[test]
fn pack_a_gguf_run_beside_its_bundle_and_a_stale_bundle_in_one_line() {
    let tmp = scratch();
    let gguf = tmp.path().join("tiny_moe.gguf");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf_bundle/tiny_moe.gguf"), &gguf)
        .unwrap();
    let bundle = tmp.path().join("tiny_moe.gguf.picchioflat");
    let o = picchio(&["pack", s(&gguf), "--no-progress"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("expert bundle, format version 3") && out.contains(s(&bundle)), "{out}");

    let (in_place, _) = run(&gguf, "safetensors");
    let (through, err) = run(&gguf, "auto");
    assert_eq!(ids(&through), ids(&in_place));
    assert!(!err.contains("stale or foreign"), "{err}");

    // The GGUF changes after packing: one line says so, and the run is the run in place.
    let mut b = std::fs::read(&gguf).unwrap();
    let key = b"qwen3moe.context_length";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
    b[at..at + 4].copy_from_slice(&1024u32.to_le_bytes());
    std::fs::write(&gguf, &b).unwrap();
    let (stale, err) = run(&gguf, "auto");
    assert_eq!(ids(&stale), ids(&in_place));
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("bundle")).collect();
    assert_eq!(lines.len(), 1, "one line about the bundle:\n{err}");
    assert!(lines[0].contains("stale or foreign bundle") && lines[0].contains("fingerprint"), "{err}");
    assert!(lines[0].contains("pack") && lines[0].contains("--force"), "{err}");
    // An explicit store is refused, naming what differs.
    let o = picchio(&["run", "--model", s(&gguf), "--store", s(&bundle), "--prompt-ids", "1", "-n", "1"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not the expert bundle of this model"));

    // pack --force rebuilds it; verify compares it with the GGUF.
    assert!(picchio(&["pack", s(&gguf), "--force", "--no-progress"]).status.success());
    let (_, err) = run(&gguf, "auto");
    assert!(!err.contains("stale or foreign"), "{err}");
    let o = picchio(&["verify", s(&bundle), "--model", s(&gguf), "--no-progress"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("compared with"));
}
