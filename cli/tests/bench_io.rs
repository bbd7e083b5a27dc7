//! `picchio synth` and the storage experiments of `picchio bench` (qd-sweep, layout, tiers, overhead,
//! env) run through the real binary on a small synthetic store. The reports are checked for their
//! structure and internal consistency — schema, environment, counts, bytes = reads × read size,
//! percentile order, MB/s = bytes / wall — never for speeds. The fio comparison is checked when fio
//! is installed: that test is `#[ignore]`d ("needs fio"), and CI, which installs fio, runs it with
//! `-- --ignored`, as it runs the loop-device tests as root.
#![cfg(target_os = "linux")]

mod common;
use common::{bench_with_report, ok, picchio, strs, synth_custom};
use picchio_testkit::loopdev;

use std::path::{Path, PathBuf};

use serde_json::Value;

/// A 2-layer synthetic store (of a 4-layer model: 8 experts of H 256 × I 128, 55,296-byte Q4
/// payloads) of the calling test's own, on the target directory's file system, removed when dropped.
///
/// Each test has its own image because the experiments drop and fill the image's page cache and
/// report what was resident: on one shared image, one test's buffered reads (or drop) land between
/// another test's drop (or warm-up) and its measurement.
struct Store {
    dir: tempfile::TempDir,
    path: PathBuf,
}

impl Store {
    /// The image's own directory, for the test's other files (removed with it).
    fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl std::ops::Deref for Store {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Store {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

fn store() -> Store {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("synth.picchioflat");
    let mut args = synth_custom(256, 128, 8, 4);
    args.extend(["--layers", "2", "--seed", "7", "--out", path.to_str().unwrap(), "--no-progress"].map(String::from));
    let out = ok(&strs(&args));
    assert!(out.contains("16 entries (2 of 4 layers × 8 experts) of 55296 bytes"), "{out}");
    Store { dir, path }
}

fn report(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Runs `picchio bench EXPERIMENT --store STORE ARGS --json <a temporary file>`, asserts it
/// succeeded, and returns its JSON report and its stdout.
fn bench(experiment: &str, store: &str, args: &[&str]) -> (Value, String) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let json = dir.path().join(format!("{experiment}.json"));
    let mut a = vec!["bench", experiment, "--store", store];
    a.extend(args);
    a.extend(["--json", json.to_str().unwrap()]);
    let stdout = ok(&a);
    (report(&json), stdout)
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// The envelope every report has.
fn check_envelope(r: &Value, experiment: &str, store: &Path) {
    assert_eq!(r["schema"], "picchio-bench/1");
    assert_eq!(r["experiment"], experiment);
    assert!(r["started_at"].as_str().unwrap() <= r["finished_at"].as_str().unwrap());
    assert!(f(r, "wall_s") >= 0.0);
    assert!(r["command_line"].as_array().unwrap().iter().any(|a| a == experiment));
    assert_eq!(r["picchio"]["version"], env!("CARGO_PKG_VERSION"));
    assert!(r["flags"].is_object());
    let e = &r["environment"];
    assert!(u(&e["cpu"], "logical_cpus") >= 1);
    assert!(e["kernel"]["release"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(u(&e["memory"], "total_bytes") > 0);
    for k in ["load_avg_start", "load_avg_end"] {
        assert_eq!(e[k].as_array().map(Vec::len), Some(3), "{k}");
    }
    let t = &e["target"];
    assert!(t["uri"].as_str().unwrap().ends_with(store.to_str().unwrap()), "{t}");
    assert!(t["filesystem"]["fstype"].as_str().is_some_and(|s| !s.is_empty()), "{t}");
}

/// Latency percentiles in order and counted once per read. Ours are HDR bucket upper ends, max
/// included; fio's percentiles are its bins' values, which may lie above its exact max, so for fio
/// only min ≤ p50 ≤ … ≤ p99.9 and min ≤ mean ≤ max are checked.
fn check_latency(l: &Value, count: u64) {
    check_latency_of(l, count, true)
}

fn check_latency_of(l: &Value, count: u64, bucketed_max: bool) {
    assert_eq!(u(l, "count"), count, "{l}");
    let keys: &[&str] = if bucketed_max {
        &["min", "p50", "p90", "p99", "p99_9", "max"]
    } else {
        &["min", "p50", "p90", "p99", "p99_9"]
    };
    let v: Vec<f64> = keys.iter().map(|k| f(l, k)).collect();
    assert!(v.windows(2).all(|w| w[0] <= w[1]), "percentiles out of order: {l}");
    assert!(v[0] > 0.0 && f(l, "mean") >= v[0] && f(l, "mean") <= f(l, "max"), "{l}");
}

/// A point's counters agree with each other: MB/s and IOPS are bytes and reads over the wall time.
fn check_point(p: &Value, bytes_per_read: Option<u64>) {
    let (reads, bytes, wall) = (u(p, "reads"), u(p, "bytes"), f(p, "wall_s"));
    assert!(reads > 0 && wall > 0.0, "{p}");
    if let Some(bs) = bytes_per_read {
        assert_eq!(bytes, reads * bs, "{p}");
    }
    let rel = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    assert!(rel(f(p, "mb_s"), bytes as f64 / wall / 1e6), "{p}");
    assert!(rel(f(p, "iops"), reads as f64 / wall), "{p}");
    assert!(rel(f(p, "units_per_s"), u(p, "units") as f64 / wall), "{p}");
    check_latency(&p["latency_us"], reads);
    check_latency(&p["unit_latency_us"], u(p, "units"));
    let cpu = &p["cpu"];
    assert!(f(cpu, "user_s") >= 0.0 && f(cpu, "sys_s") >= 0.0);
    let per_gb = (f(cpu, "user_s") + f(cpu, "sys_s")) / (bytes as f64 / 1e9);
    assert!(rel(f(cpu, "s_per_gb"), per_gb), "{p}");
    let cache = p["page_cache"]["action"].as_str().unwrap();
    let want = match p["engine"].as_str().unwrap() {
        "psync-buffered" => "dropped",
        "nvme-sim" => "model",
        _ => "bypassed",
    };
    assert_eq!(cache, want, "{p}");
    if let (true, Some(r)) = (cache == "dropped", p["page_cache"]["resident_before"].as_f64()) {
        assert!(r < 0.5, "after posix_fadvise(DONTNEED) {r} of the image is still cached: {p}");
    }
}

#[test]
fn synth_image_verifies_and_refuses_what_pack_refuses() {
    let s = &store();
    let out = ok(&["verify", s.to_str().unwrap(), "--no-progress"]);
    assert!(out.contains("16 entries") && out.contains("OK"), "{out}");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, b"{}").unwrap();
    let o = picchio(&["synth", "--arch", "gpt-oss-20b", "--layers", "1", "--out", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not a .picchioflat image"));
    assert_eq!(std::fs::read(&cfg).unwrap(), b"{}", "the file is untouched");
    let o = picchio(&["synth", "--arch", "gpt-oss-20b", "--experts", "3", "--out", "x"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--experts only applies to --arch custom"));
    let o = picchio(&["synth", "--arch", "qwen3-30b-a3b", "--layers", "49", "--out", "x"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--layers 49: the model has 48 layers"));
}

#[test]
#[ignore = "needs fio (CI installs it and runs ignored tests)"]
fn qd_sweep_report_is_consistent_and_fio_sits_beside_it() {
    let test = "qd_sweep_report_is_consistent_and_fio_sits_beside_it";
    let s = &store();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let args =
        ["bench", "qd-sweep", "--store", s.to_str().unwrap(), "--qd", "1,4", "--threads", "1,2", "--bytes", "2M"];
    let (stdout, r, plots) = bench_with_report(&args, dir.path(), "qd");
    check_envelope(&r, "qd-sweep", s);
    for chart in ["qd-sweep-throughput.svg", "qd-sweep-latency.svg"] {
        common::svg_count(&plots.join(chart), &[]); // parses, and its root is <svg>
    }
    let res = &r["results"];
    assert_eq!(u(res, "bs"), 57_344, "one padded expert entry");
    assert_eq!(res["region"]["pattern"], "expert entries");
    assert_eq!(u(&res["region"], "candidates"), 16);
    let points = res["points"].as_array().unwrap();
    let engines: Vec<&str> = ["psync-buffered", "psync-direct", "uring"]
        .into_iter()
        .filter(|e| *e != "uring" || !res["skipped"].to_string().contains("\"uring\""))
        .collect();
    assert_eq!(points.len(), engines.len() * 2 * 2, "engines × threads × QDs");
    for p in points {
        check_point(p, Some(57_344));
        assert_eq!(u(p, "units"), u(p, "reads"), "one read per unit");
        // The byte budget is reached: every thread submits its share before stopping.
        assert!(u(p, "bytes") >= 2 << 20, "{p}");
        assert!(stdout.contains(&format!(
            "{:<15} {:>3} {:>4}",
            p["engine"].as_str().unwrap(),
            u(p, "threads"),
            u(p, "qd")
        )));
    }
    loopdev::require_tool(test, "fio", &["--version"]);
    assert!(res["fio_version"].as_str().unwrap().starts_with("fio-"));
    for p in points {
        let fio = &p["fio"];
        assert!(fio.is_object(), "fio ran beside every kernel engine: {p}");
        let (reads, bytes) = (u(fio, "reads"), u(fio, "bytes"));
        assert!(reads > 0 && bytes == reads * 57_344, "{fio}");
        check_latency_of(&fio["latency_us"], reads, false);
        let cmd = fio["command"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect::<Vec<_>>().join(" ");
        assert!(cmd.contains(&format!("--filename={}", s.display())) && cmd.contains("--bs=57344"), "{cmd}");
        assert!(cmd.contains("--rw=randread") && cmd.contains("--readonly"), "{cmd}");
        let (threads, qd) = (u(p, "threads"), u(p, "qd"));
        let (jobs, depth) = if p["engine"] == "uring" { (threads, qd) } else { (threads * qd, 1) };
        assert!(cmd.contains(&format!("--numjobs={jobs} ")) && cmd.contains(&format!("--iodepth={depth} ")), "{cmd}");
        let ratio = f(p, "ours_over_fio");
        assert!((ratio - f(p, "mb_s") / f(fio, "mb_s")).abs() < 1e-9 * ratio.max(1.0), "{p}");
    }
    assert!(stdout.contains("fio MB/s") && stdout.contains("ours/fio"));
}

#[test]
fn qd_sweep_with_bs_reads_the_data_region_and_bad_options_are_refused() {
    let s = &store();
    let store_arg = s.to_str().unwrap();
    let (r, _) = bench(
        "qd-sweep",
        store_arg,
        &["--engines", "psync-direct", "--qd", "2", "--threads", "1", "--bs", "16K", "--bytes", "512K", "--no-fio"],
    );
    let res = &r["results"];
    assert_eq!(u(res, "bs"), 16_384);
    assert_eq!(res["region"]["pattern"], "bs-aligned offsets");
    assert_eq!(u(&res["region"], "offset"), 8192, "the data region starts after the superblock and index blocks");
    assert_eq!(u(&res["region"], "candidates"), 16 * 57_344 / 16_384);
    check_point(&res["points"][0], Some(16_384));
    assert!(res["skipped"].to_string().contains("--no-fio"));
    // Refused before anything is measured or printed (usage errors exit 2, others 1).
    for (args, want, code) in [
        (vec!["--bs", "1000"], "not a positive multiple of 4096", 2),
        (vec!["--qd", "0"], "not in 1..=256", 2),
        (vec!["--qd", "100000"], "not in 1..=256", 2),
        (vec!["--threads", "100000"], "not in 1..=256", 2),
        (vec!["--duration=-1"], "must be a positive number of seconds", 1),
    ] {
        let mut a = vec!["bench", "qd-sweep", "--store", store_arg, "--no-fio"];
        a.extend(args);
        let o = picchio(&a);
        assert_eq!(o.status.code(), Some(code));
        assert!(String::from_utf8_lossy(&o.stderr).contains(want), "{want}");
        assert!(o.stdout.is_empty(), "nothing measured");
    }
    let o = picchio(&["bench", "qd-sweep", "--store", "auto"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("bench reads a .picchioflat image"));
    let o = picchio(&["bench", "qd-sweep", "--store", "s3:bucket"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("nvme-sim:PATH") && !e.contains("auto,"), "{e}");
}

#[test]
fn layout_reads_the_same_bytes_scattered_and_contiguous() {
    let s = &store();
    let (r, _) = bench(
        "layout",
        s.to_str().unwrap(),
        &["--engines", "psync-direct,uring", "--qd", "1,4", "--threads", "1", "--bytes", "1M"],
    );
    check_envelope(&r, "layout", s);
    let res = &r["results"];
    assert_eq!((u(res, "hidden"), u(res, "moe_intermediate")), (256, 128));
    let splits = res["splits"].as_array().unwrap();
    assert_eq!(splits.len(), 2);
    let expert_bytes = |pieces: u64| {
        let sp = splits.iter().find(|s| u(s, "pieces") == pieces).unwrap();
        let reads: Vec<u64> = sp["read_bytes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(reads.len() as u64, pieces);
        assert!(reads.iter().all(|b| b % 4096 == 0));
        assert_eq!(reads.iter().sum::<u64>(), u(sp, "expert_bytes"));
        u(sp, "expert_bytes")
    };
    // 3 pieces of 9·H·I/16 = 18,432 bytes, each read as 20,480.
    assert_eq!(expert_bytes(3), 3 * 20_480);
    let points = res["points"].as_array().unwrap();
    assert_eq!(points.len(), 2 * 2 * 2 * 2, "splits × engines × QDs × variants");
    for p in points {
        check_point(p, None);
        let per = u(p, "reads_per_expert");
        assert_eq!(per, if p["variant"] == "contiguous" { 1 } else { u(p, "pieces") });
        assert_eq!(u(p, "reads"), u(p, "units") * per, "{p}");
        assert_eq!(u(p, "bytes"), u(p, "units") * expert_bytes(u(p, "pieces")), "same bytes per expert: {p}");
    }
    let cmp = res["comparisons"].as_array().unwrap();
    assert_eq!(cmp.len(), 2 * 2 * 2);
    for c in cmp {
        let ratio = f(c, "contiguous_over_scattered");
        assert!(
            (ratio - f(c, "contiguous_experts_per_s") / f(c, "scattered_experts_per_s")).abs() < 1e-9 * ratio,
            "{c}"
        );
    }
}

#[test]
fn tiers_table_has_every_tier_of_a_file_store() {
    let s = &store();
    let (r, stdout) = bench("tiers", s.to_str().unwrap(), &["--bytes", "1M"]);
    check_envelope(&r, "tiers", s);
    let res = &r["results"];
    let rows = res["rows"].as_array().unwrap();
    let tiers: Vec<&str> = rows.iter().map(|r| r["tier"].as_str().unwrap()).collect();
    let uring = !res["skipped"].to_string().contains("uring tier");
    assert_eq!(tiers, if uring { vec!["S1", "S2", "S3", "S5"] } else { vec!["S1", "S2", "S5"] });
    for row in rows {
        check_point(row, Some(57_344));
        assert_eq!((u(row, "threads"), u(row, "qd")), (1, 8));
    }
    let s5 = rows.iter().find(|r| r["tier"] == "S5").unwrap();
    assert_eq!(s5["engine"], "nvme-sim");
    assert!(s5["name"].as_str().unwrap().contains("controller model"));
    assert!(res["skipped"].to_string().contains("S4 tier"));
    assert!(stdout.contains("S5") && stdout.contains("controller model"));
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn tiers_on_a_loop_device_are_s4() {
    let test = "tiers_on_a_loop_device_are_s4";
    let s = &store();
    let lo = loopdev::LoopDevice::attach_for_test(test, s, loopdev::LoopOptions::default());
    let uri = format!("raw:{}", lo.dev.display());
    let (r, _) = bench("tiers", &uri, &["--bytes", "512K", "--qd", "2"]);
    let res = &r["results"];
    let rows = res["rows"].as_array().unwrap();
    assert!(rows.len() >= 2 && rows.iter().all(|r| r["tier"] == "S4"), "{res}");
    for row in rows {
        check_point(row, Some(57_344));
    }
    let t = &r["environment"]["target"];
    assert_eq!(t["kind"], "block device");
    assert_eq!(u(t, "size_bytes"), std::fs::metadata(s).unwrap().len());
    assert_eq!(t["device"]["name"].as_str(), Some(lo.name().as_str()));
    assert!(t["device"]["loop_backing_file"].as_str().is_some_and(|b| b.ends_with("synth.picchioflat")), "{t}");
    // Attached with --direct-io=on (when the backing file system allows it): recorded as sysfs says.
    let dio = std::fs::read_to_string(format!("/sys/block/{}/loop/dio", lo.name())).unwrap();
    assert_eq!(t["device"]["loop_direct_io"].as_bool(), Some(dio.trim() == "1"), "{t}");
    assert_eq!(t["note"].is_string(), dio.trim() == "0", "a non-dio loop device is warned about: {t}");
    drop(lo);
    // Without direct I/O the environment warns that figures include the backing file's page cache.
    let opts = loopdev::LoopOptions { direct_io: false, ..loopdev::LoopOptions::default() };
    let lo = loopdev::LoopDevice::attach_for_test(test, s, opts);
    let (r, _) = bench("env", &format!("raw:{}", lo.dev.display()), &[]);
    let t = &r["environment"]["target"];
    assert_eq!(t["device"]["loop_direct_io"].as_bool(), Some(false), "{t}");
    assert!(t["note"].as_str().is_some_and(|n| n.contains("page cache of its backing file")), "{t}");
}

#[test]
fn overhead_rows_add_up() {
    let s = &store();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let json = dir.path().join("overhead.json");
    ok(&[
        "bench",
        "overhead",
        "--store",
        s.to_str().unwrap(),
        "--reads",
        "2000",
        "--range",
        "256K",
        "--json",
        json.to_str().unwrap(),
    ]);
    let r = report(&json);
    check_envelope(&r, "overhead", s);
    let res = &r["results"];
    assert!(f(res, "ticks_per_ns") > 0.0);
    let rows = res["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["engine"].as_str().unwrap()).collect();
    assert!(names.starts_with(&["null", "psync"]) && names.contains(&"nvme-sim"), "{names:?}");
    for row in rows {
        assert_eq!(u(row, "reads"), 2000);
        for k in ["submit_ns", "complete_ns", "total_ns"] {
            let c = &row[k];
            let v: Vec<f64> = ["p50", "p90", "p99", "max"].iter().map(|q| f(c, q)).collect();
            assert!(v[0] > 0.0 && v.windows(2).all(|w| w[0] <= w[1]), "{k}: {c}");
        }
        // Histogram means are exact up to the 3 significant digits of the buckets.
        let (s_, c_, t_) = (f(&row["submit_ns"], "mean"), f(&row["complete_ns"], "mean"), f(&row["total_ns"], "mean"));
        assert!((t_ - (s_ + c_)).abs() <= 0.01 * t_, "{row}");
    }
    let cached = rows.iter().find(|r| r["engine"] == "psync").unwrap();
    assert!(f(cached, "resident_before") > 0.5, "the read range was cached first: {cached}");
}

#[test]
fn env_report_describes_the_store() {
    let s = &store();
    let (r, out) = bench("env", s.to_str().unwrap(), &[]);
    check_envelope(&r, "env", s);
    assert_eq!(u(&r["environment"]["target"], "size_bytes"), std::fs::metadata(s).unwrap().len());
    assert!(out.contains("cpu: ") && out.contains("file system: "), "{out}");
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn synth_writes_a_block_device_after_inspecting_it_and_refuses_a_file_system() {
    let test = "synth_writes_a_block_device_after_inspecting_it_and_refuses_a_file_system";
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = loopdev::sparse_file(&dir.path().join("dev.img"), 4 << 20);
    let lo = loopdev::LoopDevice::attach_for_test(test, &file, loopdev::LoopOptions::default());
    let uri = format!("raw:{}@4096", lo.dev.display());
    let mut args = synth_custom(256, 128, 8, 2);
    args.extend(["--seed", "7", "--out", &uri, "--no-progress"].map(String::from));
    let args = strs(&args);
    let out = ok(&args);
    assert!(out.contains("index and 16 payload hashes OK"), "{out}");
    let out = ok(&["verify", &uri, "--no-progress"]);
    assert!(out.contains("16 entries") && out.contains("OK"), "{out}");
    // The image on the device is the file image shifted by 4096 bytes, byte for byte (same seed).
    let want = std::fs::read(store()).unwrap();
    let dev = std::fs::read(&file).unwrap();
    let (same_layers, n) = (&dev[4096..4096 + want.len()], want.len());
    // store() has 4 model layers in its superblock, this one 2: compare the payload region only.
    assert_eq!(same_layers[8192..], want[8192..n], "payloads and their placement");
    loopdev::require_tool(test, "mkfs.ext4", &["-V"]);
    loopdev::mkfs_ext4(&lo.dev).unwrap();
    let before = std::fs::read(&file).unwrap();
    let o = picchio(&args);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("refusing to write") && e.contains("ext2/3/4 file system"), "{e}");
    assert!(std::fs::read(&file).unwrap() == before, "a refused device is not written");
}

/// `picchio bench …` refused with exit `code`, `want` in stderr, and nothing measured or printed.
fn refused(args: &[&str], want: &str, code: i32) {
    let o = picchio(args);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{e}");
    assert!(e.contains(want), "want {want:?} in {e}");
    assert!(o.stdout.is_empty(), "refused before measuring or printing: {}", String::from_utf8_lossy(&o.stdout));
}

#[test]
fn json_replaces_only_an_earlier_report_and_never_the_store() {
    let s = &store();
    let store_arg = s.to_str().unwrap();
    let image = std::fs::read(s).unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "keep me\n").unwrap();
    let link = dir.path().join("store-link.json");
    std::fs::hard_link(s, &link).unwrap();
    let missing = dir.path().join("no/such/dir/r.json");
    for (json, want) in [
        (store_arg, "is the store being measured"),
        (link.to_str().unwrap(), "is the store being measured"),
        (text.to_str().unwrap(), "exists and is not a picchio-bench report"),
        ("/dev/null", "is not a regular file"),
        (dir.path().to_str().unwrap(), "is a directory"),
        (missing.to_str().unwrap(), "does not exist"),
    ] {
        refused(&["bench", "env", "--store", store_arg, "--json", json], want, 1);
        // A long experiment is refused the same way, before its first point.
        let qd =
            ["bench", "qd-sweep", "--store", store_arg, "--engines", "psync-direct", "--qd", "1", "--threads", "1"];
        let mut a = qd.to_vec();
        a.extend(["--bytes", "64K", "--no-fio", "--json", json]);
        refused(&a, want, 1);
    }
    assert_eq!(std::fs::read(s).unwrap(), image, "the store is untouched");
    assert_eq!(std::fs::read_to_string(&text).unwrap(), "keep me\n");
    assert!(!dir.path().join("no").exists());
    // An earlier report is replaced (atomically, by rename), and so is a missing file.
    let json = dir.path().join("env.json");
    ok(&["bench", "env", "--store", store_arg, "--json", json.to_str().unwrap()]);
    let first = report(&json)["started_at"].clone();
    ok(&["bench", "env", "--store", store_arg, "--json", json.to_str().unwrap()]);
    let r = report(&json);
    assert!(r["started_at"].as_str() >= first.as_str());
    // Every experiment records every option, store and outputs included.
    assert_eq!(r["flags"]["store"], store_arg);
    assert_eq!(r["flags"]["json"], json.to_str().unwrap());
}

#[test]
fn out_of_range_qd_and_threads_are_usage_errors_everywhere() {
    let st = store();
    let s = st.to_str().unwrap();
    let want = "not in 1..=256";
    refused(&["bench", "qd-sweep", "--store", s, "--qd", "100000"], want, 2);
    refused(&["bench", "layout", "--store", s, "--threads", "0"], want, 2);
    refused(&["bench", "tiers", "--store", s, "--qd", "100000"], want, 2);
    refused(&["bench", "tiers", "--store", s, "--threads", "100000"], want, 2);
    refused(&["bench", "tiers", "--store", &format!("nvme-sim:{s}"), "--threads", "100000"], want, 2);
    refused(&["verify", s, "--io-threads", "100000"], want, 2);
    refused(&["verify", s, "--io-threads", "0"], want, 2);
}

#[test]
fn raw_on_a_regular_file_and_unusable_stores_are_refused() {
    let st = store();
    let s = st.to_str().unwrap();
    let not_image = st.dir().join("zeros.bin");
    std::fs::write(&not_image, vec![0u8; 1 << 16]).unwrap();
    let raw_file = format!("raw:{s}");
    refused(&["bench", "tiers", "--store", &raw_file, "--bytes", "64K"], "not a block device", 1);
    refused(&["bench", "qd-sweep", "--store", &raw_file, "--no-fio"], "not a block device", 1);
    refused(&["bench", "env", "--store", &raw_file], "not a block device", 1);
    refused(&["bench", "env", "--store", "/nonexistent"], "/nonexistent", 1);
    refused(&["bench", "env", "--store", "raw:/dev/nonexistent"], "/dev/nonexistent", 1);
    refused(&["bench", "env", "--store", "nvme-sim:/nonexistent"], "/nonexistent", 1);
    refused(&["bench", "env", "--store", st.dir().to_str().unwrap()], "not a regular file", 1);
    refused(&["bench", "env", "--store", not_image.to_str().unwrap()], "zeros.bin", 1);
}

#[test]
fn plot_is_checked_first_and_offered_only_where_there_are_charts() {
    let st = store();
    let s = st.to_str().unwrap();
    let file = st.dir().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let deep = st.dir().join("a/b");
    let args = |plot: &str| {
        [
            "bench",
            "qd-sweep",
            "--store",
            s,
            "--engines",
            "psync-direct",
            "--qd",
            "1",
            "--threads",
            "1",
            "--bytes",
            "64K",
        ]
        .iter()
        .map(|a| a.to_string())
        .chain(["--no-fio".into(), "--plot".into(), plot.into()])
        .collect::<Vec<String>>()
    };
    let a = args(file.to_str().unwrap());
    refused(&a.iter().map(String::as_str).collect::<Vec<_>>(), "exists and is not a directory", 1);
    let a = args(deep.to_str().unwrap());
    refused(&a.iter().map(String::as_str).collect::<Vec<_>>(), "does not exist", 1);
    assert!(!st.dir().join("a").exists(), "no chain of directories is created");
    for exp in ["tiers", "overhead", "env"] {
        refused(&["bench", exp, "--store", s, "--plot", st.dir().to_str().unwrap()], "--plot", 2);
        let help = ok(&["bench", exp, "--help"]);
        assert!(!help.contains("--plot"), "{exp} --help offers --plot: {help}");
    }
    let help = ok(&["bench", "--help"]);
    for exp in ["env", "qd-sweep", "layout", "tiers", "overhead", "trace", "cache", "decode", "plot"] {
        assert!(help.contains(exp), "{exp} missing from bench --help");
    }
    let help = ok(&["bench", "plot", "--help"]);
    assert!(help.contains("layout") && help.contains("qd-sweep"), "{help}");
}

#[test]
fn overhead_defaults_to_a_small_images_size_and_names_the_bad_option() {
    let s = &store();
    let store_arg = s.to_str().unwrap();
    // The store is under 1 MiB: the 64 MiB default range is clamped to it.
    let (r, _) = bench("overhead", store_arg, &["--engines", "null,psync", "--reads", "200"]);
    let range = u(&r["results"], "range");
    let end = 8192 + 16 * 57_344;
    assert!(range > 0 && range <= end && range.is_multiple_of(4096) && range + 4096 > end, "{range}");
    assert_eq!(u(&r["flags"], "range"), range, "flags record the range used");
    refused(&["bench", "overhead", "--store", store_arg, "--range", "64M"], &format!("({end} bytes"), 1);
    refused(&["bench", "overhead", "--store", store_arg, "--range", "4K", "--bs", "8K"], "smaller than one read", 1);
    refused(&["bench", "overhead", "--store", store_arg, "--bs", "1000"], "--bs", 2);
    refused(&["bench", "overhead", "--store", store_arg, "--reads", "0"], "--reads", 2);
    refused(&["bench", "overhead", "--store", store_arg, "--engines", "bogus"], "bogus", 2);
}

#[test]
fn a_cache_drop_that_cannot_take_on_tmpfs_is_labelled_so() {
    let shm = Path::new("/dev/shm");
    assert!(shm.is_dir(), "/dev/shm (a tmpfs on every Linux) is missing here");
    let dir = tempfile::tempdir_in(shm).unwrap();
    let image = dir.path().join("synth.picchioflat");
    std::fs::copy(store(), &image).unwrap();
    let json = dir.path().join("qd.json");
    let o = picchio(&[
        "bench",
        "qd-sweep",
        "--store",
        image.to_str().unwrap(),
        "--engines",
        "psync-buffered",
        "--qd",
        "1",
        "--threads",
        "1",
        "--bytes",
        "256K",
        "--no-fio",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    // The warning is plain text: stderr is a pipe here, not a terminal.
    assert!(err.contains("WARN") && err.contains("still in the page cache"), "{err}");
    assert!(!err.contains('\x1b'), "ANSI escapes in a piped log: {err:?}");
    let p = &report(&json)["results"]["points"][0];
    assert!(f(&p["page_cache"], "resident_before") > 0.99, "tmpfs pages are the file: {p}");
    assert_eq!(p["page_cache"]["action"], "drop-ineffective", "{p}");
    assert!(out.contains("drop-ineffective"), "{out}");
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn a_block_device_given_as_a_path_is_read_as_raw_like_run_and_verify_read_it() {
    let test = "a_block_device_given_as_a_path_is_read_as_raw_like_run_and_verify_read_it";
    loopdev::require_root(test);
    let s = &store();
    let lo = loopdev::LoopDevice::attach_for_test(test, s, loopdev::LoopOptions::default());
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dev = lo.dev.to_str().unwrap();
    // verify accepts the plain path, and so does bench: as the block device it is (the S4 tier).
    ok(&["verify", dev, "--no-progress"]);
    for (name, store) in [("plain", dev.to_string()), ("raw", format!("raw:{dev}"))] {
        let json = dir.path().join(format!("{name}.json"));
        ok(&["bench", "env", "--store", &store, "--json", json.to_str().unwrap()]);
        let t = &report(&json)["environment"]["target"];
        assert_eq!(t["kind"], "block device", "{name}: {t}");
        assert_eq!(t["device"]["name"].as_str(), Some(lo.name().as_str()), "{name}: {t}");
        assert_eq!(u(t, "size_bytes"), std::fs::metadata(s).unwrap().len(), "{name}: {t}");
    }
    let json = dir.path().join("tiers.json");
    ok(&["bench", "tiers", "--store", dev, "--bytes", "512K", "--qd", "2", "--json", json.to_str().unwrap()]);
    let rows = report(&json)["results"]["rows"].as_array().unwrap().clone();
    assert!(!rows.is_empty() && rows.iter().all(|r| r["tier"] == "S4"), "{rows:?}");
}
