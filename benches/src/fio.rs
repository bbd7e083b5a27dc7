//! fio beside our engines: the same random-read pattern run by `fio` (when it is on `PATH`), its
//! `--output-format=json` parsed, so each `qd-sweep` point shows our figure next to fio's.
//!
//! | our engine | fio |
//! | --- | --- |
//! | `psync-buffered` at T threads × QD q | `--ioengine=psync --direct=0 --numjobs=T·q --iodepth=1` (fio's default `invalidate=1` drops the file's page cache at job start, as we do) |
//! | `psync-direct` | `--ioengine=psync --direct=1 --numjobs=T·q --iodepth=1` |
//! | `uring` | `--ioengine=io_uring --direct=1 --registerfiles=1 --numjobs=T --iodepth=q` |
//!
//! Common to all: `--rw=randread --bs=B --offset=O --size=S --readonly --thread --group_reporting
//! --lat_percentiles=1 --randrepeat=0`, the same file or device, and `--time_based --runtime=Nms` or
//! `--io_size` (per job) for a byte budget. fio's offsets are deliberately **not** seeded: with
//! `--randseed` every clone of a `numjobs` job draws the same offset sequence, so buffered clones
//! read pages a sibling has just cached (measured here: 16 psync jobs, 2.6 MB buffered reads of a
//! 16 GB file, cache dropped: 3883 MB/s with `--randseed=0`, 1308 MB/s with `--randrepeat=0`), while
//! each of our threads and workers draws its own reads. Our psync engine keeps `q` reads in flight with `q` worker
//! threads doing `pread`, which is what fio's `q` psync jobs do; io_uring's depth is the ring's.
//! fio's offsets are `O + k·B`, uniformly random: for a synthetic image (contiguous entries of
//! one padded length) these are exactly the expert entries our engines read.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::measure::{Engine, LatencyUs, Stop};
use crate::error::{Error, Result};

/// fio's version when `fio` runs from `PATH` (`fio --version`), else `None`.
pub fn version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// One fio run's parameters.
#[derive(Clone, Debug)]
pub struct FioJob<'a> {
    /// File or device.
    pub filename: &'a Path,
    /// Our engine this run mirrors.
    pub engine: Engine,
    /// Our submitting threads.
    pub threads: u32,
    /// Our reads in flight per thread.
    pub qd: u32,
    /// Read size, bytes.
    pub bs: u32,
    /// First byte of the region read (on the file or device).
    pub offset: u64,
    /// Bytes of the region.
    pub size: u64,
    /// When to stop.
    pub stop: Stop,
}

/// What fio measured for one point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FioResult {
    /// The fio command line, as run.
    pub command: Vec<String>,
    /// Reads completed (`read.total_ios`).
    pub reads: u64,
    /// Bytes read (`read.io_bytes`).
    pub bytes: u64,
    /// `read.runtime`, seconds.
    pub runtime_s: f64,
    /// `read.bw_bytes` / 10⁶.
    pub mb_s: f64,
    /// `read.iops`.
    pub iops: f64,
    /// Total latency (`read.lat_ns`, submission to completion) in microseconds.
    pub latency_us: LatencyUs,
    /// fio's `usr_cpu`, percent (of the group's runtime, as fio reports it).
    pub usr_cpu_pct: f64,
    /// fio's `sys_cpu`, percent.
    pub sys_cpu_pct: f64,
}

/// The fio arguments for `job`, or `None` when fio has no engine for ours (the NVMe driver).
pub fn args(job: &FioJob<'_>) -> Option<Vec<String>> {
    let (ioengine, direct, numjobs, iodepth) = match job.engine {
        Engine::PSYNC_BUFFERED => ("psync", 0, job.threads * job.qd, 1),
        Engine::PSYNC_DIRECT => ("psync", 1, job.threads * job.qd, 1),
        Engine::URING => ("io_uring", 1, job.threads, job.qd),
        _ => return None, // nvme-sim, nvme: our driver
    };
    let mut a = vec![
        "--name=picchio-bench".to_string(),
        format!("--filename={}", job.filename.display()),
        "--readonly".into(),
        format!("--ioengine={ioengine}"),
        format!("--direct={direct}"),
        "--rw=randread".into(),
        format!("--bs={}", job.bs),
        format!("--iodepth={iodepth}"),
        format!("--numjobs={numjobs}"),
        "--thread".into(),
        "--group_reporting".into(),
        format!("--offset={}", job.offset),
        format!("--size={}", job.size),
        "--lat_percentiles=1".into(),
        "--randrepeat=0".into(),
        "--output-format=json".into(),
    ];
    if job.engine == Engine::URING {
        a.push("--registerfiles=1".into());
    }
    match job.stop {
        Stop::Duration(s) => {
            a.push("--time_based".into());
            a.push(format!("--runtime={}ms", (s * 1000.0).ceil().max(1.0) as u64));
        }
        Stop::Bytes(b) => {
            let per_job = b.div_ceil(u64::from(numjobs)).div_ceil(u64::from(job.bs)).max(1) * u64::from(job.bs);
            a.push(format!("--io_size={per_job}"));
        }
    }
    Some(a)
}

/// Runs fio for `job` and parses its JSON.
///
/// # Errors
/// [`Error::FioSpawn`] when fio cannot start, [`Error::FioFailed`] when it exits non-zero (its stderr is quoted), as [`parse`] when it reports a job
/// error, or prints JSON without the fields used.
pub fn run(job: &FioJob<'_>) -> Result<Option<FioResult>> {
    let Some(args) = args(job) else { return Ok(None) };
    let out = Command::new("fio").args(&args).output().map_err(|cause| Error::FioSpawn { cause })?;
    let mut command = vec!["fio".to_string()];
    command.extend(args);
    if !out.status.success() {
        return Err(Error::FioFailed {
            command: command.join(" "),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    parse(&String::from_utf8_lossy(&out.stdout), command).map(Some)
}

/// fio's JSON (`--output-format=json`, one group-reported job) as a [`FioResult`]. fio may print
/// notes before the JSON object; everything before the first `{` is skipped.
///
/// # Errors
/// [`Error::FioJson`], [`Error::FioField`] naming the missing field, [`Error::FioJob`] with the job's error code.
pub fn parse(stdout: &str, command: Vec<String>) -> Result<FioResult> {
    #[derive(Deserialize)]
    struct Out {
        jobs: Vec<Job>,
    }
    #[derive(Deserialize)]
    struct Job {
        error: i64,
        usr_cpu: f64,
        sys_cpu: f64,
        read: Read,
    }
    #[derive(Deserialize)]
    struct Read {
        io_bytes: u64,
        bw_bytes: u64,
        iops: f64,
        runtime: u64,
        total_ios: u64,
        lat_ns: Lat,
    }
    #[derive(Deserialize)]
    struct Lat {
        min: u64,
        max: u64,
        mean: f64,
        #[serde(default)]
        percentile: std::collections::BTreeMap<String, u64>,
    }
    let json = stdout.find('{').map_or(stdout, |i| &stdout[i..]);
    let o: Out = serde_json::from_str(json).map_err(|cause| Error::FioJson { cause })?;
    let j = o.jobs.into_iter().next().ok_or_else(|| Error::FioField { field: "jobs[0]".into() })?;
    if j.error != 0 {
        return Err(Error::FioJob { error: j.error, command: command.join(" ") });
    }
    let r = j.read;
    let pct = |k: &str| -> Result<f64> {
        r.lat_ns
            .percentile
            .get(k)
            .map(|&v| v as f64 / 1000.0)
            .ok_or_else(|| Error::FioField { field: format!("read.lat_ns.percentile[{k}]") })
    };
    Ok(FioResult {
        command,
        reads: r.total_ios,
        bytes: r.io_bytes,
        runtime_s: r.runtime as f64 / 1000.0,
        mb_s: r.bw_bytes as f64 / 1e6,
        iops: r.iops,
        latency_us: LatencyUs {
            count: r.total_ios,
            min: r.lat_ns.min as f64 / 1000.0,
            mean: r.lat_ns.mean / 1000.0,
            p50: pct("50.000000")?,
            p90: pct("90.000000")?,
            p99: pct("99.000000")?,
            p99_9: pct("99.900000")?,
            max: r.lat_ns.max as f64 / 1000.0,
        },
        usr_cpu_pct: j.usr_cpu,
        sys_cpu_pct: j.sys_cpu,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_mirror_each_engine() {
        let p = Path::new("/x/img");
        let job = FioJob {
            filename: p,
            engine: Engine::URING,
            threads: 2,
            qd: 16,
            bs: 4096,
            offset: 8192,
            size: 1 << 20,
            stop: Stop::Duration(0.25),
        };
        let a = args(&job).unwrap().join(" ");
        for want in [
            "--ioengine=io_uring",
            "--direct=1",
            "--numjobs=2",
            "--iodepth=16",
            "--runtime=250ms",
            "--registerfiles=1",
            "--offset=8192",
            "--readonly",
        ] {
            assert!(a.contains(want), "{want}: {a}");
        }
        let a = args(&FioJob { engine: Engine::PSYNC_BUFFERED, stop: Stop::Bytes(1 << 20), ..job.clone() })
            .unwrap()
            .join(" ");
        for want in ["--ioengine=psync", "--direct=0", "--numjobs=32", "--iodepth=1", "--io_size=32768"] {
            assert!(a.contains(want), "{want}: {a}");
        }
        assert!(args(&FioJob { engine: Engine::NVME_SIM, ..job }).is_none());
    }

    #[test]
    fn parses_fio_json() {
        let json = r#"note: both iodepth >= 1 and synchronous I/O engine are selected
{"fio version":"fio-3.33","jobs":[{"jobname":"p","error":0,"usr_cpu":1.5,"sys_cpu":4.25,
 "read":{"io_bytes":8192000,"bw_bytes":16384000,"iops":4000.0,"runtime":500,"total_ios":2000,
  "lat_ns":{"min":1000,"max":900000,"mean":25000.5,"stddev":1.0,"N":2000,
   "percentile":{"50.000000":20000,"90.000000":40000,"99.000000":80000,"99.900000":120000}}}}]}"#;
        let r = parse(json, vec!["fio".into()]).unwrap();
        assert_eq!((r.reads, r.bytes, r.runtime_s, r.mb_s), (2000, 8_192_000, 0.5, 16.384));
        assert_eq!((r.latency_us.p50, r.latency_us.p99_9, r.latency_us.max), (20.0, 120.0, 900.0));
        assert!(parse(&json.replace("\"error\":0", "\"error\":5"), vec![]).is_err());
        assert!(parse("{}", vec![]).is_err());
    }
}
