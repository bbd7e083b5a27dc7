//! `picchio bench`: reproducible storage experiments with one JSON report per run.
//!
//! Every experiment writes the same envelope, [`Report`], whose `schema` string is
//! [`SCHEMA`] (`picchio-bench/1`): what ran (experiment, command line, flags, our version), where
//! ([`env::Environment`]: CPU, kernel, memory, load average at start and end, and the store's file or
//! device as sysfs and `/proc/self/mountinfo` describe it), and the experiment's own `results`.
//! `docs/experiments.md` documents every field and its unit. Field names and units only change with a
//! new schema string; fields may be added within a version (readers must ignore unknown fields).
//!
//! Figures are measured, never derived from something else that could hide a mistake: throughput
//! is bytes / wall time of the whole point (not a sum of per-read latencies), latency percentiles
//! come from an HDR histogram of per-read submit-to-completion times, CPU time from `getrusage`.
#![deny(missing_docs)]

pub mod cache;
pub mod decode;
pub mod env;
pub mod error;
pub mod fio;
pub mod layout;
pub mod measure;
pub mod null;
pub mod output;
pub mod overhead;
pub mod plot;
pub mod qd_sweep;
pub mod tiers;
pub mod trace;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The schema identifier every report carries in `schema`. Bumped when a field changes meaning,
/// unit or name (adding fields keeps it).
pub const SCHEMA: &str = "picchio-bench/1";

/// Our build: the crate version, and `git describe` of the source checkout when it can be read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    /// `CARGO_PKG_VERSION` of picchio-bench (the workspace version), e.g. `0.1.0`.
    pub version: String,
    /// `git describe --always --dirty --tags` run in the checkout the binary was built from, when
    /// the report is made (`None` when git or the checkout is not there). A `-dirty` suffix means
    /// the working tree differed from the commit at that moment.
    pub git_describe: Option<String>,
}

impl VersionInfo {
    /// Reads the version of this build (see the field docs for where `git_describe` comes from).
    pub fn current() -> Self {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let git_describe = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["describe", "--always", "--dirty", "--tags"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .filter(|s| !s.is_empty());
        VersionInfo { version: env!("CARGO_PKG_VERSION").to_string(), git_describe }
    }
}

/// The report of one `picchio bench` run: the envelope around an experiment's `results` (`R`, the
/// experiment's own serde type; `serde_json::Value` reads any report).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report<R> {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// The experiment, as named on the command line (`qd-sweep`, `layout`, `tiers`, `overhead`, …).
    pub experiment: String,
    /// When the run started, RFC 3339 UTC with milliseconds (`2026-11-30T02:41:07.123Z`).
    pub started_at: String,
    /// When the run ended (same format).
    pub finished_at: String,
    /// Wall time of the whole run in seconds (including setup such as cache drops and fio).
    pub wall_s: f64,
    /// The process's arguments, `argv[0]` first.
    pub command_line: Vec<String>,
    /// Our version.
    pub picchio: VersionInfo,
    /// Every option the experiment ran with, defaults included (an object: option name → value).
    pub flags: serde_json::Value,
    /// Where it ran.
    pub environment: env::Environment,
    /// The experiment's results (documented per experiment in docs/experiments.md).
    pub results: R,
}

/// The part of a [`Report`] known before the experiment runs; [`Run::finish`] completes it.
#[derive(Debug)]
pub struct Run {
    experiment: String,
    started: SystemTime,
    command_line: Vec<String>,
    flags: serde_json::Value,
    environment: env::Environment,
}

impl Run {
    /// Starts a report for `experiment` run with `flags` (any serializable options struct) on
    /// `target` (the store being measured, when there is one): records the time, the command line
    /// and the environment (including the load average now).
    ///
    /// # Errors
    /// [`Error::FlagsJson`] if `flags` does not serialize (a bug in the options type).
    pub fn start(experiment: &str, flags: &impl Serialize, target: Option<&picchio_core::StoreUri>) -> Result<Self> {
        let flags = serde_json::to_value(flags)
            .map_err(|cause| Error::FlagsJson { what: format!("bench {experiment}"), cause })?;
        Ok(Run {
            experiment: experiment.into(),
            started: SystemTime::now(),
            command_line: std::env::args().collect(),
            flags,
            environment: env::Environment::capture(target),
        })
    }

    /// The environment captured at start (e.g. to print it before a long run).
    pub fn environment(&self) -> &env::Environment {
        &self.environment
    }

    /// Completes the report with `results`, recording the end time and the load average now.
    pub fn finish<R>(mut self, results: R) -> Report<R> {
        let finished = SystemTime::now();
        self.environment.load_avg_end = env::load_average();
        Report {
            schema: SCHEMA.into(),
            experiment: self.experiment,
            started_at: rfc3339(self.started),
            finished_at: rfc3339(finished),
            wall_s: finished.duration_since(self.started).unwrap_or_default().as_secs_f64(),
            command_line: self.command_line,
            picchio: VersionInfo::current(),
            flags: self.flags,
            environment: self.environment,
            results,
        }
    }
}

impl<R: Serialize> Report<R> {
    /// The report as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report types serialize")
    }

    /// Writes the report as JSON to `path` (atomically: a temporary file beside it, then rename).
    /// An existing `path` is replaced only when it is an earlier report
    /// ([`output::check_replaceable`] with [`output::is_bench_report`]): never the store, a text
    /// file, a directory or a device node.
    ///
    /// # Errors
    /// [`Error::NotReplaced`] (and the other [`output::check_replaceable`] errors) when `path` may not be replaced; [`Error::Io`] naming the path.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        output::check_replaceable(path, "--json", "a picchio-bench report", output::is_bench_report)?;
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp = path.with_file_name(name);
        std::fs::write(&tmp, self.to_json() + "\n").map_err(Error::io(&tmp, "write the bench report"))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(path, "rename the bench report into place")(e)
        })
    }

    /// The report with its results as a generic JSON value (what plotting reads).
    pub fn to_value_report(&self) -> Report<serde_json::Value> {
        Report {
            schema: self.schema.clone(),
            experiment: self.experiment.clone(),
            started_at: self.started_at.clone(),
            finished_at: self.finished_at.clone(),
            wall_s: self.wall_s,
            command_line: self.command_line.clone(),
            picchio: self.picchio.clone(),
            flags: self.flags.clone(),
            environment: self.environment.clone(),
            results: serde_json::to_value(&self.results).expect("report types serialize"),
        }
    }
}

/// The `flags` of a report: every option of the command line (`cli`, e.g. the clap arguments with
/// `store`, `json` and `plot`), overlaid with the options as the experiment resolved them
/// (`resolved`: defaults filled in, e.g. the thread list or the clamped read range). Both must
/// serialize to JSON objects; a key in both takes `resolved`'s value.
///
/// # Errors
/// [`Error::FlagsJson`] or [`Error::FlagsNotObject`] when either does not serialize to an object (a bug in the options type).
pub fn flags(cli: &impl Serialize, resolved: &impl Serialize) -> Result<serde_json::Value> {
    let object = |v: serde_json::Result<serde_json::Value>| match v {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(other) => Err(Error::FlagsNotObject { found: other.to_string() }),
        Err(cause) => Err(Error::FlagsJson { what: "bench".into(), cause }),
    };
    let mut m = object(serde_json::to_value(cli))?;
    m.extend(object(serde_json::to_value(resolved))?);
    Ok(serde_json::Value::Object(m))
}

/// Draws the charts of `report` into `dir` (`--plot DIR`) and returns the files written; the
/// renderers are in [`plot`] (SVG via plotters).
///
/// # Errors
/// As [`plot::render`]:
/// [`Error::Io`] writing them.
pub fn render_plots(report: &Report<serde_json::Value>, dir: &Path) -> Result<Vec<PathBuf>> {
    plot::render(report, dir)
}

/// Whether `--plot` can draw charts for `experiment`; called before the run so that a long
/// measurement is not lost to a refusal at the end.
///
/// # Errors
/// [`Error::NoCharts`] naming the experiment.
pub fn check_plot_supported(experiment: &str) -> Result<()> {
    if plot::PLOTTED.contains(&experiment) {
        Ok(())
    } else {
        Err(Error::NoCharts { experiment: experiment.into() })
    }
}

/// `t` as RFC 3339 UTC with milliseconds, e.g. `2026-11-30T02:41:07.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // `date -u -d @951782400` = 2000-02-29 00:00:00 (a leap day of a 400-year leap year).
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000Z");
        // `date -u -d @1796006467` = 2026-11-30T02:41:07Z.
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_millis(1_796_006_467_123)), "2026-11-30T02:41:07.123Z");
    }

    #[test]
    fn report_round_trips_with_schema_and_flags() {
        #[derive(Serialize)]
        struct Flags {
            bs: u32,
        }
        let run = Run::start("unit", &Flags { bs: 4096 }, None).unwrap();
        let report = run.finish(vec![1u32, 2, 3]);
        assert_eq!(report.schema, SCHEMA);
        let back: Report<serde_json::Value> = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(back.flags["bs"], 4096);
        assert_eq!(back.results, serde_json::json!([1, 2, 3]));
        assert!(back.wall_s >= 0.0 && back.started_at <= back.finished_at);
        assert!(!back.environment.cpu.logical_cpus.eq(&0));
    }
}
