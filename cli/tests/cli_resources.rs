//! Resource exhaustion through the real binary:
//! - ENOSPC in the middle of `pack`, `synth` (an image, and `--model-out`), `convert` and `transcode`
//!   on a small ext4 file system on a loop device (root): the writer is stopped after its first bytes
//!   (`PICCHIO_STOP_AFTER_BYTES`), the test fills the file system, and the writer goes on into a real
//!   `ENOSPC`. Then: exit 1, an error naming the output, the bytes it needs and the bytes available,
//!   nothing at the final name (or the old output untouched), no temporary output left.
//! - EMFILE: `run` and `pack` with `RLIMIT_NOFILE` lowered to 4 for the child: `run` reads with psync
//!   (no fd for an io_uring ring), saying so with the limit; `pack` stops with an error naming the
//!   file and a hint naming the limit.
//! - RLIMIT_MEMLOCK at 0 (and, as root, without CAP_IPC_LOCK) for `run --io uring`: io_uring needs
//!   no locked memory here (no registered buffers; rings are not charged to it since Linux 5.12), so
//!   the tokens are the same; an engine that fell back names the limit.
//! - A memory cgroup (root) whose limit is below the expert cache asked for: `run --ecap N` refuses
//!   before loading, naming the figures and the cgroup file.
#![cfg(target_os = "linux")]

mod common;

use std::ffi::CString;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::stop::{resume, writer_stopped_at, LIMIT};
use common::{model, ok, scratch, synth_custom};
use picchio_testkit::bin::{stderr, wait_bounded};
use picchio_testkit::loopdev::{self, sparse_file, LoopDevice, LoopOptions, Mounted};

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn hf_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe")
}

/// Fills the file system of `dir` to the last block with one file (`fallocate`, halving the request
/// on ENOSPC down to one block), so the next allocation of anyone fails with ENOSPC.
fn fill(dir: &Path) -> PathBuf {
    use std::os::fd::AsRawFd;
    let p = dir.join("filler");
    let f = File::create(&p).unwrap();
    let (mut off, mut chunk) = (0i64, 1i64 << 30);
    while chunk >= 4096 {
        // SAFETY: fallocate on a file we own; no memory is passed.
        if unsafe { libc::fallocate(f.as_raw_fd(), 0, off, chunk) } == 0 {
            off += chunk;
        } else {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "fallocate {}: {e}", p.display());
            chunk /= 2;
        }
    }
    p
}

/// Runs `picchio ARGS`, stopped after its first written byte; fills `fs`; lets it go on.
fn run_into_full_disk(args: &[String], fs: &Path, log: &Path) -> Output {
    let child = writer_stopped_at(args, 1, log).unwrap_or_else(|e| panic!("the writer never wrote a byte: {e}"));
    let filler = fill(fs);
    let mut o = resume(child);
    o.stderr = std::fs::read(log).unwrap();
    std::fs::remove_file(filler).unwrap();
    eprintln!("$ picchio {}\n[{}]\n{}", args.join(" "), o.status, stderr(&o));
    o
}

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
#[ignore = "needs root: losetup, mkfs.ext4, mount (CI runs ignored tests as root)"]
fn enospc_in_the_middle_of_every_writer_is_a_clear_error_and_leaves_nothing_half_written() {
    let test = "enospc_in_the_middle_of_every_writer_is_a_clear_error_and_leaves_nothing_half_written";
    loopdev::require_root(test);
    let dir = scratch();
    // 2 GiB, sparse: room for the synthetic model's 0.6 GB of embeddings + one layer (the free-space
    // check must pass); the filler is fallocated, so the backing file stays small.
    let backing = sparse_file(&dir.path().join("fs.img"), 2 << 30);
    let lo = LoopDevice::attach_for_test(test, &backing, LoopOptions::default());
    loopdev::mkfs_ext4(&lo.dev).unwrap_or_else(|e| panic!("{test}: mkfs.ext4: {e}"));
    let mnt = Mounted::mount(&lo.dev, &dir.path().join("mnt")).unwrap_or_else(|e| panic!("{test}: mount: {e}"));
    let fs = mnt.dir.clone();
    let lost_found = names(&fs);

    // Inputs live on the build disk; outputs on the small file system.
    let converted = dir.path().join("converted");
    ok(&["convert", &s(&hf_fixture()), &s(&converted), "--no-progress"]);
    let old_image = fs.join("old.picchioflat");
    std::fs::copy(model().join("experts.picchioflat"), &old_image).unwrap();
    let old = std::fs::read(&old_image).unwrap();
    let synth_args = |out: &Path| -> Vec<String> {
        let mut args = synth_custom(256, 256, 8, 4);
        args.extend(["--no-progress".into(), "--out".into(), s(out)]);
        args
    };
    let cases: Vec<(&str, Vec<String>, PathBuf)> = vec![
        (
            "pack over an old image",
            vec!["pack".into(), s(&model()), "--out".into(), s(&old_image), "--no-progress".into()],
            old_image.clone(),
        ),
        ("synth", synth_args(&fs.join("s.picchioflat")), fs.join("s.picchioflat")),
        ("convert", vec!["convert".into(), s(&hf_fixture()), s(&fs.join("c")), "--no-progress".into()], fs.join("c")),
        (
            "transcode",
            ["transcode", &s(&converted), "--to", "q3", "--out", &s(&fs.join("t")), "--no-progress"]
                .map(String::from)
                .into(),
            fs.join("t"),
        ),
        (
            "synth --model-out",
            ["synth", "--model-out", &s(&fs.join("m")), "--arch", "qwen3-30b-a3b", "--layers", "1", "--no-progress"]
                .map(String::from)
                .into(),
            fs.join("m"),
        ),
    ];
    for (what, args, out) in cases {
        let o = run_into_full_disk(&args, &fs, &dir.path().join("log"));
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{what}: {e}");
        assert!(
            e.contains(&format!(
                "Error: {}: the file system ran out of space while writing it: it needs ",
                out.display()
            )) && e.contains("are available now")
                && e.contains("No space left on device"),
            "{what}: {e}"
        );
        if out == old_image {
            assert!(std::fs::read(&out).unwrap() == old, "{what}: the old image changed");
        } else {
            assert!(!out.exists(), "{what}: {} exists after a failed write", out.display());
        }
        let mut expected = lost_found.clone();
        expected.extend(
            [&old_image].iter().filter(|p| p.exists()).map(|p| p.file_name().unwrap().to_string_lossy().into_owned()),
        );
        expected.sort();
        expected.dedup();
        assert_eq!(names(&fs), expected, "{what}: something was left on the file system");
    }
    drop(mnt);
}

/// `picchio ARGS` with `resource` lowered to `value` (soft and hard) in the child before exec.
fn with_rlimit(args: &[&str], resource: libc::__rlimit_resource_t, value: u64) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picchio"));
    cmd.args(args).env_remove("RUST_LOG").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: the closure runs in the forked child before exec and calls only setrlimit, which is
    // async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
            if libc::setrlimit(resource, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = wait_bounded(cmd.spawn().expect("start picchio"), LIMIT).expect("picchio ends");
    eprintln!("$ picchio {} (limit {value})\n[{}]\n{}", args.join(" "), o.status, stderr(&o));
    o
}

#[test]
fn too_few_file_descriptors_for_run_and_pack_is_a_clear_error_naming_the_limit() {
    let dir = scratch();
    let m = model();
    let out = dir.path().join("e.picchioflat");
    let run = ["run", "--model", m.to_str().unwrap(), "--prompt-ids", "1,2,3", "-n", "2"];
    // One descriptor beside stdin/out/err: no io_uring ring (it needs one more), so the run reads
    // with psync, saying why.
    let o = with_rlimit(&run, libc::RLIMIT_NOFILE, 4);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("EMFILE") && e.contains("RLIMIT_NOFILE") && e.contains("psync"), "{e}");
    // The same one descriptor is too few for pack: a clear error naming the file and the limit.
    // (Fewer than 4 is too few for the dynamic loader: the program never starts.)
    let o = with_rlimit(
        &["pack", m.to_str().unwrap(), "--out", out.to_str().unwrap(), "--no-progress"],
        libc::RLIMIT_NOFILE,
        4,
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("Too many open files"), "{e}");
    assert!(
        e.contains("hint: picchio may have at most 4 files open at once (RLIMIT_NOFILE"),
        "the limit is not named: {e}"
    );
    assert!(!out.exists() && names(dir.path()).is_empty(), "left {:?}", names(dir.path()));
}

#[test]
fn uring_needs_no_locked_memory_and_gives_the_same_tokens_with_memlock_at_zero() {
    let m = model();
    let args = ["run", "--model", m.to_str().unwrap(), "--prompt-ids", "1,2,3", "-n", "8", "--io", "uring", "--json"];
    let reference = ok(&args);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picchio"));
    cmd.args(args).env_remove("RUST_LOG").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: async-signal-safe calls only (setrlimit, prctl) in the forked child, no allocation.
    unsafe {
        cmd.pre_exec(|| {
            let zero = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &zero) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // As root, CAP_IPC_LOCK would exempt the process from the limit: drop it from the
            // bounding set so the exec'd program does not get it (EPERM without CAP_SETPCAP:
            // then the process is not root and has no CAP_IPC_LOCK anyway).
            libc::prctl(libc::PR_CAPBSET_DROP, 14 /* CAP_IPC_LOCK */, 0, 0, 0);
            Ok(())
        });
    }
    let o = wait_bounded(cmd.spawn().unwrap(), LIMIT).unwrap();
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    let tokens =
        |out: &str| -> serde_json::Value { serde_json::from_str::<serde_json::Value>(out).unwrap()["tokens"].clone() };
    let got: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(got["tokens"], tokens(&reference), "{e}");
    let engine = got["stats"]["engine"].as_str().unwrap_or_default().to_string();
    assert!(engine.contains("uring") || e.contains("RLIMIT_MEMLOCK"), "engine {engine}, but no word of the limit: {e}");
}

/// This process's memory cgroup directory and the file that limits it: cgroup v2 (`memory.max`,
/// when the unified hierarchy at /sys/fs/cgroup has the memory controller) or v1
/// (`memory.limit_in_bytes` under /sys/fs/cgroup/memory).
fn own_memory_cgroup() -> Option<(PathBuf, &'static str)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        if id == "0"
            && controllers.is_empty()
            && std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").is_ok_and(|c| c.contains("memory"))
        {
            return Some((Path::new("/sys/fs/cgroup").join(rel), "memory.max"));
        }
        if controllers.split(',').any(|c| c == "memory") {
            return Some((Path::new("/sys/fs/cgroup/memory").join(rel), "memory.limit_in_bytes"));
        }
    }
    None
}

#[test]
#[ignore = "needs root and a writable memory cgroup (v2 memory.max or v1 memory.limit_in_bytes)"]
fn a_memory_cgroup_below_the_expert_cache_asked_for_is_refused_before_loading() {
    let (parent, file) = own_memory_cgroup().expect("no memory cgroup in /proc/self/cgroup");
    let cg = parent.join(format!("picchio-test-{}", std::process::id()));
    std::fs::create_dir(&cg).unwrap_or_else(|e| panic!("create {}: {e} (cgroup not writable?)", cg.display()));
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _remove = Remove(cg.clone());
    // 48 MiB: enough to start and plan, below the plan's 64 MiB for the program alone.
    let limit = 48u64 << 20;
    std::fs::write(cg.join(file), limit.to_string()).unwrap_or_else(|e| panic!("{}: {e}", cg.join(file).display()));
    let procs = CString::new(cg.join("cgroup.procs").as_os_str().as_encoded_bytes()).unwrap();
    let m = model();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picchio"));
    cmd.args(["run", "--model", m.to_str().unwrap(), "--ecap", "8", "--prompt-ids", "1,2,3", "-n", "2"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: open/write/close only (async-signal-safe) on a path made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0": the writing process itself.
            let r = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if r != 1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = wait_bounded(cmd.spawn().expect("start picchio in the cgroup"), LIMIT).unwrap();
    let e = stderr(&o);
    eprintln!("{e}");
    assert_eq!(o.status.code(), Some(1), "not refused (an OOM kill shows as no exit code): {e}");
    assert!(
        e.contains("--ecap 8: the plan needs")
            && e.contains("over this process's cgroup limit of 50.3 MB (")
            && e.contains(&cg.join(file).display().to_string()),
        "{e}"
    );
}
