//! The error type of `picchio-bench`: one variant per failing operation of an experiment — an
//! option value it does not accept, an engine that cannot read the store, a report or trace of the
//! wrong shape, an output path it will not write, fio failing — each naming the option, path or
//! field and what was expected. Errors of the libraries the experiments run on (opening a session,
//! a store, an engine) pass through unchanged as [`Error::Runtime`], [`Error::Store`] and
//! [`Error::Engine`]; a kept cause is the `#[source]`, never repeated in the message.

use std::path::PathBuf;

/// Result alias for `picchio-bench`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong setting up, running or writing out a `picchio bench` experiment.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened, read or written.
    #[error("{}: {what}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operation ("open the trace", "write the bench report", ...).
        what: &'static str,
        /// The OS error.
        #[source]
        cause: std::io::Error,
    },
    /// An option has a value the experiment does not accept. `option` is the flag as the user
    /// types it (`--bs`, `-n`).
    #[error("{}{option} {value}: {expected}", experiment.map(|e| format!("{e}: ")).unwrap_or_default())]
    BadOption {
        /// The experiment the option belongs to, when the message names it (`overhead`, `bench cache`).
        experiment: Option<&'static str>,
        /// The flag (`--bs`), or what is being chosen (`read mode`).
        option: &'static str,
        /// The value given.
        value: String,
        /// What is accepted (the range, or why this value cannot work).
        expected: String,
    },
    /// List options that were given no value, or a zero where each value must be at least 1.
    #[error("{options} {need}")]
    NoValues {
        /// The options (`--qd and --threads`), prefixed with the experiment where that helps.
        options: &'static str,
        /// What they need.
        need: &'static str,
    },
    /// The prompt an experiment decodes from holds no token.
    #[error("bench {experiment}: the prompt is empty")]
    EmptyPrompt {
        /// `cache`, `decode`.
        experiment: &'static str,
    },
    /// An engine asked for cannot read this kind of store.
    #[error("engine {engine} {needs}, not {store}")]
    EngineStore {
        /// The engine (`psync`, `nvme-sim`).
        engine: String,
        /// What it reads (`reads a file or block device`, `needs an nvme:BDF store`).
        needs: &'static str,
        /// The store given.
        store: String,
    },
    /// Every engine asked for was skipped for this store (the reasons are in the report's `skipped`).
    #[error("{store}: no engine to run")]
    NoEngine {
        /// The store.
        store: String,
    },
    /// A file store path that is not a regular file.
    #[error("{store}: is not a regular file (a .picchioflat image; for a block device use raw:)")]
    NotRegularFile {
        /// The store.
        store: String,
    },
    /// The image holds no entry an experiment can read.
    #[error("{store}: the image has no usable entry to read")]
    NoUsableEntry {
        /// The store.
        store: String,
    },
    /// The layout experiment's split of one expert does not fit the image's data region.
    #[error(
        "{store}: the data region ({region} bytes) is smaller than one expert of the split ({expert_bytes} bytes)"
    )]
    SplitTooLarge {
        /// The store.
        store: String,
        /// Bytes of the data region.
        region: u64,
        /// Bytes of one expert as the largest split reads it.
        expert_bytes: u64,
    },
    /// A point's read buffers would take more than half of the memory available.
    #[error(
        "{threads} threads × QD {qd} × {max_read}-byte reads need {need} bytes of read buffers, more than half of \
         the {available} bytes of memory available: use fewer --threads or a lower --qd"
    )]
    BufferMemory {
        /// Threads of the point.
        threads: u32,
        /// Reads in flight per thread.
        qd: u32,
        /// The largest read, in bytes.
        max_read: u32,
        /// Bytes of read buffers the point needs.
        need: u64,
        /// Bytes of memory available (`MemAvailable`).
        available: u64,
    },
    /// A measuring thread could not be started.
    #[error("bench: cannot start measuring thread {index}")]
    SpawnMeasure {
        /// Thread number (0-based).
        index: usize,
        /// The OS error.
        #[source]
        cause: std::io::Error,
    },
    /// A measuring thread stopped where it should not have (a bug or a failed allocation).
    #[error("bench: a measuring thread {what}")]
    MeasureThread {
        /// `ended before the start`, `panicked`.
        what: &'static str,
    },
    /// A read of a measured point failed.
    #[error("{store}: {engine} at {threads}×QD {qd}: {reason}")]
    PointRead {
        /// The store.
        store: String,
        /// The engine.
        engine: String,
        /// Threads of the point.
        threads: u32,
        /// Reads in flight per thread.
        qd: u32,
        /// The failed read, as the measuring thread reported it.
        reason: String,
    },
    /// A read of the overhead experiment failed.
    #[error("overhead {engine}: read at {offset:#x}")]
    OverheadRead {
        /// The engine.
        engine: String,
        /// Byte offset of the read.
        offset: u64,
        /// The engine's error.
        #[source]
        cause: std::io::Error,
    },
    /// A read of the overhead experiment completed with fewer bytes than asked for.
    #[error("overhead {engine}: short read at {offset:#x}: {got} of {len} bytes")]
    ShortRead {
        /// The engine.
        engine: String,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes read.
        got: u32,
        /// Bytes asked for.
        len: u32,
    },
    /// fio could not be started.
    #[error("fio: cannot run it")]
    FioSpawn {
        /// The OS error.
        #[source]
        cause: std::io::Error,
    },
    /// fio exited with a failure status.
    #[error("`{command}` failed ({status}): {stderr}")]
    FioFailed {
        /// The command line run.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
    /// fio's `--output-format=json` output does not parse.
    #[error("fio JSON")]
    FioJson {
        /// The JSON error.
        #[source]
        cause: serde_json::Error,
    },
    /// fio's JSON lacks a field the result needs.
    #[error("fio JSON: {field} missing")]
    FioField {
        /// The field (`jobs[0]`, `read.lat_ns.percentile[99.000000]`).
        field: String,
    },
    /// fio's job reported an error.
    #[error("fio reported error {error} ({command})")]
    FioJob {
        /// fio's error number.
        error: i64,
        /// The command line run.
        command: String,
    },
    /// A routing trace line that is not what the trace format says.
    #[error("{}: line {line}: {what}", path.display())]
    TraceLine {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What was found and expected.
        what: String,
    },
    /// A routing trace without a record to analyse.
    #[error("{}: the trace has no routing records", path.display())]
    EmptyTrace {
        /// The trace file.
        path: PathBuf,
    },
    /// The flags of a report do not serialize to JSON (a bug in the options type).
    #[error("{what}: flags")]
    FlagsJson {
        /// `bench EXPERIMENT`, or `bench` when merging flags.
        what: String,
        /// The JSON error.
        #[source]
        cause: serde_json::Error,
    },
    /// The flags of a report serialize to something other than a JSON object (a bug in the options type).
    #[error("bench flags: {found} is not an object")]
    FlagsNotObject {
        /// The JSON they gave.
        found: String,
    },
    /// `--plot` for an experiment that has no charts.
    #[error("--plot: no charts are drawn for `{experiment}` (charts exist for {})", crate::plot::PLOTTED.join(", "))]
    NoCharts {
        /// The experiment.
        experiment: String,
    },
    /// A report's results lack a field a chart needs.
    #[error("report results: missing {kind} `{key}` in {found}")]
    ReportField {
        /// `number`, `array`.
        kind: &'static str,
        /// The field.
        key: String,
        /// The JSON it was looked up in (cut at 120 characters).
        found: String,
    },
    /// A report whose results have another shape than its experiment's charts need.
    #[error("{report} report: {what}")]
    ReportShape {
        /// The experiment (`decode`, `layout`).
        report: &'static str,
        /// What is missing.
        what: &'static str,
    },
    /// A chart with no finite point to draw.
    #[error("{}: no data points to draw for {title:?}", path.display())]
    NoDataPoints {
        /// The chart file.
        path: PathBuf,
        /// The chart's title.
        title: String,
    },
    /// An output path that exists and is not what this option would replace.
    #[error("{}: {what}; {option} will not replace it: remove it or choose another path", path.display())]
    NotReplaced {
        /// The path.
        path: PathBuf,
        /// The option naming it (`--json`, `--trace`).
        option: String,
        /// What it is instead (`is a directory (--json takes a file path)`).
        what: String,
    },
    /// An output path whose parent is not a directory.
    #[error("{option} {}: {} is not a directory", path.display(), parent.display())]
    ParentNotDir {
        /// The option naming it.
        option: String,
        /// The path.
        path: PathBuf,
        /// Its parent.
        parent: PathBuf,
    },
    /// An output path whose parent directory cannot be found.
    #[error("{option} {}: the directory {} does not exist; create it first", path.display(), parent.display())]
    ParentMissing {
        /// The option naming it.
        option: String,
        /// The path.
        path: PathBuf,
        /// Its parent.
        parent: PathBuf,
        /// The error of looking it up.
        #[source]
        cause: std::io::Error,
    },
    /// `--json` names the store being measured.
    #[error("--json {}: is the store being measured ({}); choose another path", path.display(), store.display())]
    ReportIsStore {
        /// The report path.
        path: PathBuf,
        /// The store.
        store: PathBuf,
    },
    /// `--plot DIR` exists and is not a directory.
    #[error("--plot {}: exists and is not a directory", dir.display())]
    PlotDirNotDir {
        /// The path given.
        dir: PathBuf,
    },
    /// Opening a model, session or store through the runtime failed (its error names it). Boxed:
    /// the runtime's error is large, and every bench `Result` would carry its size.
    #[error(transparent)]
    Runtime(Box<picchio_runtime::Error>),
    /// The expert store failed as a whole (bad header, index hash, dimensions).
    #[error(transparent)]
    Store(#[from] picchio_core::Error),
    /// An I/O engine could not open its target.
    #[error(transparent)]
    Engine(#[from] picchio_blockdev::Error),
}

impl From<picchio_runtime::Error> for Error {
    fn from(e: picchio_runtime::Error) -> Error {
        Error::Runtime(Box::new(e))
    }
}

impl Error {
    /// Wraps an I/O error with its path and operation.
    pub fn io(path: impl Into<PathBuf>, what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |cause| Error::Io { path, what, cause }
    }

    /// The runtime error inside, when this is one passed through ([`Error::Runtime`]).
    pub fn runtime(&self) -> Option<&picchio_runtime::Error> {
        match self {
            Error::Runtime(r) => Some(r.as_ref()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::error::chain;
    use std::error::Error as _;

    /// Each cause is printed once: in the message or as `source()`, never both (vfio-ioctls'
    /// `test_vfio_error_fmt`).
    #[test]
    fn a_cause_is_in_the_message_or_the_source_not_both() {
        let busy = || std::io::Error::from_raw_os_error(libc::EBUSY);
        let os = busy().to_string();
        let json = || serde_json::from_str::<u32>("{").unwrap_err();
        let errors = [
            Error::io("/r/report.json", "write the bench report")(busy()),
            Error::SpawnMeasure { index: 3, cause: busy() },
            Error::OverheadRead { engine: "psync".into(), offset: 0x2000, cause: busy() },
            Error::FioSpawn { cause: busy() },
            Error::ParentMissing {
                option: "--json".into(),
                path: "/no/r.json".into(),
                parent: "/no".into(),
                cause: busy(),
            },
        ];
        for e in &errors {
            let src = e.source().expect("the cause is the source").to_string();
            assert_eq!(src, os);
            assert!(!e.to_string().contains(&src), "{e} repeats its source");
            assert_eq!(chain(e).to_string(), format!("{e}: {os}"));
        }
        assert_eq!(errors[0].to_string(), "/r/report.json: write the bench report");
        assert_eq!(errors[1].to_string(), "bench: cannot start measuring thread 3");
        assert_eq!(errors[2].to_string(), "overhead psync: read at 0x2000");
        assert_eq!(errors[4].to_string(), "--json /no/r.json: the directory /no does not exist; create it first");
        let e = Error::FioJson { cause: json() };
        assert_eq!(chain(&e).to_string(), format!("fio JSON: {}", json()));
        let e = Error::FlagsJson { what: "bench qd".into(), cause: json() };
        assert_eq!(chain(&e).to_string(), format!("bench qd: flags: {}", json()));
    }

    #[test]
    fn option_errors_name_the_option_the_value_and_what_is_accepted() {
        let e = Error::BadOption {
            experiment: None,
            option: "--bs",
            value: "100".into(),
            expected: "must be a positive multiple of 4096 bytes".into(),
        };
        assert_eq!(e.to_string(), "--bs 100: must be a positive multiple of 4096 bytes");
        assert!(e.source().is_none());
        let e = Error::BadOption {
            experiment: Some("overhead"),
            option: "--reads",
            value: "0".into(),
            expected: "must be positive".into(),
        };
        assert_eq!(e.to_string(), "overhead: --reads 0: must be positive");
        let e = Error::NoValues { options: "--qd and --threads", need: "need at least one value, each at least 1" };
        assert_eq!(e.to_string(), "--qd and --threads need at least one value, each at least 1");
        let e = Error::EngineStore { engine: "nvme".into(), needs: "needs an nvme:BDF store", store: "/f".into() };
        assert_eq!(e.to_string(), "engine nvme needs an nvme:BDF store, not /f");
        let e = Error::BufferMemory { threads: 4, qd: 8, max_read: 4096, need: 131072, available: 100000 };
        assert_eq!(
            e.to_string(),
            "4 threads × QD 8 × 4096-byte reads need 131072 bytes of read buffers, more than half of the 100000 bytes \
             of memory available: use fewer --threads or a lower --qd"
        );
        let e = Error::EmptyPrompt { experiment: "cache" };
        assert_eq!(e.to_string(), "bench cache: the prompt is empty");
    }

    #[test]
    fn report_trace_and_output_errors_name_the_file_line_and_field() {
        let e = Error::TraceLine { path: "/t/bad.jsonl".into(), line: 2, what: "expected a record".into() };
        assert_eq!(e.to_string(), "/t/bad.jsonl: line 2: expected a record");
        let e = Error::ReportField { kind: "number", key: "mb_s".into(), found: "{}".into() };
        assert_eq!(e.to_string(), "report results: missing number `mb_s` in {}");
        let e = Error::NoCharts { experiment: "nope".into() };
        assert!(e.to_string().starts_with("--plot: no charts are drawn for `nope` (charts exist for "), "{e}");
        let e = Error::NotReplaced { path: "/r".into(), option: "--json".into(), what: "is a directory".into() };
        assert_eq!(e.to_string(), "/r: is a directory; --json will not replace it: remove it or choose another path");
        let e = Error::ShortRead { engine: "uring".into(), offset: 0x1000, got: 512, len: 4096 };
        assert_eq!(e.to_string(), "overhead uring: short read at 0x1000: 512 of 4096 bytes");
    }

    #[test]
    fn library_errors_pass_through_unchanged() {
        let r = picchio_runtime::Error::EmptyPrompt;
        let want = r.to_string();
        let e = Error::from(r);
        assert_eq!(e.to_string(), want);
        assert!(matches!(e.runtime(), Some(picchio_runtime::Error::EmptyPrompt)));
        let b =
            picchio_blockdev::Error::Stat { path: "/f".into(), cause: std::io::Error::from_raw_os_error(libc::EIO) };
        let e = Error::from(b);
        assert!(chain(&e).to_string().starts_with("/f: fstat: "), "{}", chain(&e));
        assert!(e.runtime().is_none());
    }
}
