//! A release build of `picchio` has no test hooks: the `test-hooks` features of picchio-core (stop
//! points) and picchio-serve (hold points, the sampling mock) are enabled only from cli's
//! `[dev-dependencies]`, and with resolver 2 those reach the binary only when tests are built.
//! Checked with cargo's own feature resolution, without building a release binary: `cargo tree` over
//! normal and build edges (what `cargo build --release -p picchio` resolves, on every target) must
//! show no `test-hooks`, while over the dev edges too (what `cargo test` resolves) both crates have
//! it, so the check would see the feature were it enabled.

use std::process::Command;

/// `cargo tree -p picchio -e EDGES -f '{p} {f}'` in this workspace, offline, for the targets CI
/// builds (Linux, and Windows, whose dependencies its cross-check fetches); `--target all` would
/// need the sources of every platform's dependencies, which an offline machine does not have.
fn tree(edges: &str) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let o = Command::new(&cargo)
        .args(["tree", "--manifest-path", manifest, "-p", "picchio", "-e", edges])
        .args(["--target", "x86_64-unknown-linux-gnu", "--target", "x86_64-pc-windows-gnu"])
        .args(["-f", "{p} {f}", "--prefix", "none", "--offline", "--locked"])
        .output()
        .unwrap_or_else(|e| panic!("running {cargo} tree: {e}"));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "cargo tree -e {edges} failed: {}{out}", String::from_utf8_lossy(&o.stderr));
    out
}

/// The features cargo enables on workspace crate `name`, from a tree's lines `NAME vX (PATH) F1,F2`.
fn features<'a>(tree: &'a str, name: &str) -> Vec<&'a str> {
    let line = tree
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("{name} is not in the tree:\n{tree}"));
    // After the path in parentheses come the features, comma-separated (then ` (*)` on a repeat).
    let line = line.trim_end().trim_end_matches("(*)");
    line.rsplit_once(')').map_or("", |(_, f)| f.trim()).split(',').filter(|f| !f.is_empty()).collect()
}

#[test]
fn a_release_build_of_picchio_has_no_test_hooks() {
    let release = tree("normal,build");
    for name in ["picchio-core", "picchio-serve"] {
        assert!(!features(&release, name).contains(&"test-hooks"), "{name} has test-hooks in a release build");
    }
    assert!(!release.contains("test-hooks"), "a crate of the release build has test-hooks:\n{release}");
    let tests = tree("normal,build,dev");
    for name in ["picchio-core", "picchio-serve"] {
        assert!(features(&tests, name).contains(&"test-hooks"), "{name} lacks test-hooks when tests are built");
    }
}
