//! `picchio nvme` as a user runs it: `list` succeeds on any machine (with or without NVMe
//! controllers), and a malformed address is refused before anything is touched.
#![cfg(target_os = "linux")]

use std::process::Output;

fn picchio(args: &[&str]) -> Output {
    picchio_testkit::bin::Bin::new("picchio", env!("CARGO_BIN_EXE_picchio")).run(args)
}

#[test]
fn list_exits_zero() {
    let out = picchio(&["nvme", "list"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("no NVMe controller found") || stdout.starts_with("BDF"), "{stdout}");
    let out = picchio(&["nvme", "list", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("list --json prints JSON");
    assert!(v.is_array());
}

#[test]
fn bind_rejects_a_malformed_bdf() {
    for cmd in ["bind", "unbind", "identify"] {
        let out = picchio(&["nvme", cmd, "0000:zz:00.0"]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("0000:zz:00.0") && stderr.contains("not a PCI address"), "{stderr}");
    }
}
