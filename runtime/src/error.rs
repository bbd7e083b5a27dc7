//! The error type of `picchio-runtime`: one variant per failing operation, each naming the file (and
//! tensor, key or expert) and what was expected.

use std::path::PathBuf;

/// Result alias for `picchio-runtime`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong converting, packing, loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {what}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operation ("read", "create", ...).
        what: &'static str,
        /// The OS error.
        #[source]
        cause: std::io::Error,
    },
    /// config.json is not valid JSON or lacks a required key.
    #[error("{path}: invalid config")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The JSON error (names the key or line).
        #[source]
        cause: serde_json::Error,
    },
    /// A config value is out of range or inconsistent.
    #[error("{path}: config key `{key}`: {message}")]
    ConfigValue {
        /// The config file.
        path: PathBuf,
        /// The key, spelled as in config.json.
        key: &'static str,
        /// What was expected.
        message: String,
    },
    /// A config.json key holds a value of the wrong JSON type (a string where a number is expected).
    #[error("{path}: config key `{key}`: {message}")]
    ConfigKey {
        /// The config file.
        path: PathBuf,
        /// The key's path in config.json (`hidden_size`, `rope_scaling.factor`, `layer_types[2]`).
        key: String,
        /// What was found and expected (serde's words: `invalid type: string "64", expected usize`).
        message: String,
    },
    /// `model_type` is not one this runtime implements.
    #[error("{path}: unsupported model_type {model_type:?} (supported: qwen3_moe, gpt_oss)")]
    UnsupportedModel {
        /// The config file.
        path: PathBuf,
        /// The value found.
        model_type: String,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: not a valid safetensors file")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        cause: safetensors::SafeTensorError,
    },
    /// A safetensors file whose header names a tensor its data does not match: the tensor's
    /// `data_offsets` span other than its dtype and shape need, or the file ends before its data does.
    #[error("{path}: not a valid safetensors file: {detail}")]
    SafetensorsTensor {
        /// The file.
        path: PathBuf,
        /// The tensor, its expected and found byte counts, or "truncated: N of M bytes".
        detail: String,
    },
    /// An output path (convert's OUT_DIR, pack's or synth's image file) whose parent directory does
    /// not exist: outputs are written beside their final name, never into directories made up on the way.
    #[error("{}: its parent directory {} does not exist (create it first)", path.display(), parent.display())]
    NoParentDir {
        /// The output path.
        path: PathBuf,
        /// Its missing parent directory.
        parent: PathBuf,
    },
    /// `model.safetensors.index.json` is malformed.
    #[error("{path}: invalid safetensors index: {message}")]
    ShardIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A directory holds no weights.
    #[error("{dir}: no model.safetensors.index.json, model.safetensors or model-*.safetensors found")]
    NoWeights {
        /// The directory.
        dir: PathBuf,
    },
    /// A tensor the model needs is absent.
    #[error("{dir}: tensor `{name}` not found in {files}")]
    MissingTensor {
        /// The model directory.
        dir: PathBuf,
        /// The checkpoint tensor name.
        name: String,
        /// The files searched.
        files: String,
    },
    /// The same tensor appears in two files.
    #[error("tensor `{name}` is in both {first} and {second}")]
    DuplicateTensor {
        /// The tensor.
        name: String,
        /// One file.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// A tensor has a shape other than the config implies.
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        /// The file holding it.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor has a dtype this operation cannot use.
    #[error("{path}: tensor `{name}` has dtype {found}, expected {expected}")]
    TensorDtype {
        /// The file holding it.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The accepted dtypes.
        expected: String,
        /// The dtype in the file.
        found: String,
    },
    /// An expert could not be loaded (by the store nor its fallback) during a forward pass.
    #[error("loading expert {key}")]
    ExpertLoad {
        /// The expert.
        key: picchio_core::ExpertKey,
        /// The loader's error.
        #[source]
        cause: picchio_core::LoadError,
    },
    /// An I/O engine could not open its target.
    #[error(transparent)]
    Engine(#[from] picchio_blockdev::Error),
    /// The expert store failed as a whole (bad header, index hash, dimensions).
    #[error(transparent)]
    Store(#[from] picchio_core::Error),
    /// The tokenizer could not be loaded or used.
    #[error("{path}: tokenizer: {message}")]
    Tokenizer {
        /// tokenizer.json.
        path: PathBuf,
        /// The tokenizers crate's message.
        message: String,
    },
    /// A chat template failed to compile or to render (a Jinja syntax error, an undefined call, the
    /// template's own `raise_exception`), naming the line of the template.
    #[error("{path}: chat template{}: {message}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Template {
        /// tokenizer_config.json or chat_template.jinja.
        path: PathBuf,
        /// 1-based line of the template where rendering failed, when known.
        line: Option<usize>,
        /// minijinja's message.
        message: String,
    },
    /// An option has a value the operation does not accept. `option` is the command-line flag that
    /// sets it (`--ecap` for [`crate::run::SessionOptions::ecap`], `--prefill-chunk`), as the user
    /// typed it, never the options struct's field name.
    #[error("{option} {value}: {expected}")]
    BadOption {
        /// The flag (`--ecap`).
        option: &'static str,
        /// The value given.
        value: String,
        /// What is accepted (the range, or why this value cannot work).
        expected: String,
    },
    /// The destination of a write exists and is not replaced.
    #[error(
        "{}: {what} already exists: choose another {what}{}",
        path.display(),
        replace_with.map(|o| format!(", or pass {o} to replace it")).unwrap_or_default()
    )]
    Exists {
        /// The file or directory.
        path: PathBuf,
        /// What it is to this operation (`destination`, `directory`).
        what: &'static str,
        /// The command-line flag that replaces it, when there is one (`--force`).
        replace_with: Option<&'static str>,
    },
    /// A synthetic model's vocabulary is smaller than the tokenizer it would be given
    /// ([`crate::image::synthetic_model::write_synthetic`]): ids the tokenizer produces would have no
    /// embedding row.
    #[error("{}: the tokenizer has {ids} ids but the synthetic model's vocabulary is {vocab}", path.display())]
    VocabBelowTokenizer {
        /// The tokenizer.json.
        path: PathBuf,
        /// Ids the tokenizer has (its vocabulary with the added tokens).
        ids: usize,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// The prompt holds no token.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A token id is not in the vocabulary.
    #[error("{what} {id} is outside the vocabulary (size {vocab})")]
    OutOfVocabulary {
        /// `prompt id`, `token id`.
        what: &'static str,
        /// The id.
        id: u64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The prompt and the tokens to generate need more positions than the context holds.
    #[error("{}", context_overflow(*needed, *context, config.as_deref()))]
    ContextOverflow {
        /// Positions needed (prompt + tokens to generate).
        needed: usize,
        /// Positions the model or its KV cache holds.
        context: usize,
        /// The config.json whose `max_position_embeddings` is the limit, when that is the limit.
        config: Option<PathBuf>,
    },
    /// A quantization check failed (shape or name); the [`crate::quant::QuantError`] names it.
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
    /// The NVMe driver failed on `target` (the driver's error is the `source()`). Linux only, as the
    /// driver is.
    #[cfg(target_os = "linux")]
    #[error("{target}")]
    Nvme {
        /// The store or controller (`nvme:0000:01:00.0/1`, `nvme-sim:/tmp/ns.img`).
        target: String,
        /// The driver's error.
        #[source]
        cause: picchio_nvme::Error,
    },
    /// The NVMe/TCP initiator failed on `target` (`nvme-tcp://HOST:PORT/NQN/NSID`); its error,
    /// naming the address, queue, step and status, is the `source()`.
    #[cfg(target_os = "linux")]
    #[error("{target}")]
    NvmeTcp {
        /// The store.
        target: String,
        /// The initiator's error.
        #[source]
        cause: picchio_nvme::tcp::TcpError,
    },
    /// Host management of an NVMe controller failed for `target` (the [`AdminError`] is the
    /// `source()`).
    ///
    /// [`AdminError`]: crate::nvme_admin::AdminError
    #[error("{target}")]
    Admin {
        /// The store or controller.
        target: String,
        /// The admin error.
        #[source]
        cause: crate::nvme_admin::AdminError,
    },
    /// A store URI given where it cannot be used: `auto` as a place to write, `nvme-sim:` for a run,
    /// an unknown scheme where bench reads ([`crate::expert::open`]).
    #[error("{option} {uri}: {reason}")]
    StoreNotAccepted {
        /// The option or argument it was given as (`--store`, `--out`).
        option: &'static str,
        /// The URI as given (quoted when it did not parse).
        uri: String,
        /// Why it is refused, and the forms accepted there.
        reason: String,
    },
    /// `picchio transcode` between two expert quantizations it does not convert between (the same
    /// one, Q3 → Q4, or to `none`); nothing was written.
    #[error("{}: its routed experts are {from}: refusing to transcode them to {to}: {why}", dir.display())]
    TranscodeRefused {
        /// The converted directory.
        dir: PathBuf,
        /// Its expert quantization.
        from: crate::quant::QuantKind,
        /// The one asked for.
        to: crate::quant::QuantKind,
        /// Why, and what to do instead.
        why: &'static str,
    },
    /// A write ran out of space on its file system (`ENOSPC`, `EDQUOT`) after the free-space check
    /// before it had passed ([`crate::image::write::out_of_space`]); the partial output was removed.
    #[error(
        "{}: the file system ran out of space while writing it: it needs {needed} bytes ({:.2} GB) and {} \
         available now; the free-space check before the write passed, so something else used the space \
         meanwhile; the partial output was removed and {} was left as it was: free space and run again",
        path.display(),
        *needed as f64 / 1e9,
        available.map_or("an unknown number of bytes are".to_string(), |a| format!("{a} bytes ({:.2} GB) are", a as f64 / 1e9)),
        path.display()
    )]
    NoSpace {
        /// The output (image file or model directory), by its final name.
        path: PathBuf,
        /// Bytes the whole output needs.
        needed: u64,
        /// Bytes available on its file system after the failure (`statvfs`), if known.
        available: Option<u64>,
        /// The write error, naming the file being written when it failed.
        #[source]
        cause: Box<Error>,
    },
    /// An image was written to a device or NVMe namespace (`dest`, as a store URI) and reading it
    /// back did not give it: a read failed or the superblock or index was not what was written (the
    /// `source()`), or entries failed their hash (`report`, the read-back's verify report). The
    /// device did not keep the writes (writes dropped or failed silently, failing media, another
    /// writer): what is there must not be used as an image.
    #[error(
        "{dest}: the image was written, but reading it back did not give it: the device did not keep \
         what was written{}",
        report.as_deref().map(|r| format!(":\n{r}")).unwrap_or_default()
    )]
    ReadBack {
        /// The target, e.g. `raw:/dev/sdb@1048576`, `nvme:0000:01:00.0/1`.
        dest: String,
        /// The read-back's report when it got as far as the payloads.
        report: Option<String>,
        /// Why the read-back stopped before the payloads.
        #[source]
        cause: Option<Box<Error>>,
    },
    /// A user request cannot be satisfied (bad flag combination, empty prompt, ...).
    #[error("{0}")]
    Invalid(String),
    /// SIGINT or SIGTERM asked the command to stop ([`crate::interrupt`]); what was open is closed
    /// as the error unwinds (an image writer removes its temporary file).
    #[error("interrupted by {signal} after {done} of {wanted} {unit}")]
    Interrupted {
        /// `SIGINT`, `SIGTERM`.
        signal: String,
        /// Units done before the stop.
        done: usize,
        /// Units asked for.
        wanted: usize,
        /// What was counted: `tokens` (run), `payloads` (synth, pack), `tensors` (convert, transcode).
        unit: &'static str,
    },
}

/// The message of [`Error::ContextOverflow`]: against the model's `max_position_embeddings` when
/// `config` names it, else against the context the model was loaded with.
fn context_overflow(needed: usize, context: usize, config: Option<&std::path::Path>) -> String {
    // `needed` is a `saturating_add` sum: `usize::MAX` is where it stopped, not what it was.
    let needed = if needed == usize::MAX { format!("more than {}", usize::MAX - 1) } else { needed.to_string() };
    match config {
        Some(c) => format!(
            "prompt + generated tokens = {needed} exceed the model's context of {context} positions \
             (max_position_embeddings in {})",
            c.display()
        ),
        None => format!("prompt + generated = {needed} tokens exceeds the context of {context} positions"),
    }
}

impl Error {
    /// Wraps an I/O error with its path and operation.
    pub fn io(path: impl Into<PathBuf>, what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |cause| Error::Io { path, what, cause }
    }

    /// Wraps an NVMe driver error with the store or controller it happened on.
    #[cfg(target_os = "linux")]
    pub fn nvme(target: impl Into<String>) -> impl FnOnce(picchio_nvme::Error) -> Error {
        let target = target.into();
        move |cause| Error::Nvme { target, cause }
    }

    /// Wraps an NVMe admin error with the store or controller it happened on.
    pub fn admin(target: impl Into<String>) -> impl FnOnce(crate::nvme_admin::AdminError) -> Error {
        let target = target.into();
        move |cause| Error::Admin { target, cause }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn display_names_file_and_tensor_and_keeps_cause() {
        let e = Error::TensorShape {
            path: "/m/model.safetensors".into(),
            name: "model.norm.weight".into(),
            expected: vec![64],
            found: vec![65],
        };
        assert_eq!(e.to_string(), "/m/model.safetensors: tensor `model.norm.weight` has shape [65], expected [64]");
        let e = Error::io("/m/config.json", "read")(std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(picchio_core::error::chain(&e).to_string().starts_with("/m/config.json: read: "));
        assert!(e.source().is_some());
    }

    /// Each cause is printed once: in the message or as `source()`, never both (vfio-ioctls'
    /// `test_vfio_error_fmt`); [`picchio_core::error::chain`] prints the whole chain.
    #[test]
    fn a_cause_is_in_the_message_or_the_source_not_both() {
        use crate::nvme_admin::AdminError;
        use picchio_core::error::chain;
        let busy = || std::io::Error::from_raw_os_error(libc::EBUSY);
        let os = busy().to_string();
        let json = || serde_json::from_str::<u32>("{").unwrap_err();
        let key = picchio_core::ExpertKey { layer: 2, expert: 6 };
        let load = || picchio_core::LoadError::Io { source_name: "img".into(), key, offset: 0x3000, cause: busy() };
        #[allow(unused_mut)] // the NVMe driver's error exists on Linux only
        let mut errors: Vec<Error> = vec![
            Error::io("/m/config.json", "read")(busy()),
            Error::Config { path: "/m/config.json".into(), cause: json() },
            Error::ExpertLoad { key, cause: load() },
            Error::admin("nvme:0000:01:00.0/1")(AdminError::Io { path: "/sys/x".into(), what: "write", cause: busy() }),
        ];
        #[cfg(target_os = "linux")]
        errors.push(Error::nvme("nvme:0000:01:00.0/1")(picchio_nvme::Error::Vfio {
            op: "open",
            what: "/dev/vfio/7".into(),
            source: busy(),
        }));
        for e in &errors {
            let src = e.source().expect("the cause is the source").to_string();
            assert!(!e.to_string().contains(&src), "{e} repeats its source {src}");
            assert!(chain(e).to_string().starts_with(&format!("{e}: {src}")), "{}", chain(e));
        }
        assert_eq!(errors[0].to_string(), "/m/config.json: read");
        assert_eq!(chain(&errors[0]).to_string(), format!("/m/config.json: read: {os}"));
        assert_eq!(chain(&errors[1]).to_string(), format!("/m/config.json: invalid config: {}", json()));
        assert_eq!(
            chain(&errors[2]).to_string(),
            format!("loading expert (layer 2, expert 6): img: reading (layer 2, expert 6) at offset 0x3000: {os}")
        );
        assert_eq!(
            chain(&errors[3]).to_string(),
            format!("nvme:0000:01:00.0/1: cannot write /sys/x (writing sysfs needs root): {os}")
        );
        #[cfg(target_os = "linux")]
        assert_eq!(chain(&errors[4]).to_string(), format!("nvme:0000:01:00.0/1: VFIO open on /dev/vfio/7: {os}"));
        // Transparent variants add nothing: the inner error's message, then its source.
        let e = Error::Engine(picchio_blockdev::Error::Stat { path: "/f".into(), cause: busy() });
        assert_eq!(chain(&e).to_string(), format!("/f: fstat: {os}"));
    }

    #[test]
    fn typed_request_errors_name_the_option_and_the_limit() {
        let e = Error::BadOption { option: "--ecap", value: "0".into(), expected: "must be at least 1".into() };
        assert_eq!(e.to_string(), "--ecap 0: must be at least 1");
        let e = Error::Exists { path: "/o".into(), what: "destination", replace_with: Some("--force") };
        assert_eq!(
            e.to_string(),
            "/o: destination already exists: choose another destination, or pass --force to replace it"
        );
        let e = Error::Exists { path: "/o".into(), what: "directory", replace_with: None };
        assert_eq!(e.to_string(), "/o: directory already exists: choose another directory");
        let e = Error::ContextOverflow { needed: 50, context: 40, config: Some("/m/config.json".into()) };
        assert_eq!(
            e.to_string(),
            "prompt + generated tokens = 50 exceed the model's context of 40 positions (max_position_embeddings \
             in /m/config.json)"
        );
        let e = Error::VocabBelowTokenizer { path: "/t/tokenizer.json".into(), ids: 300, vocab: 256 };
        assert_eq!(
            e.to_string(),
            "/t/tokenizer.json: the tokenizer has 300 ids but the synthetic model's vocabulary is 256"
        );
        let e = Error::OutOfVocabulary { what: "prompt id", id: 9, vocab: 8 };
        assert_eq!(e.to_string(), "prompt id 9 is outside the vocabulary (size 8)");
    }
}
