//! The error type of `picchio-runtime`: one variant per failing operation, each naming the file (and
//! tensor, key or expert) and what was expected.

use std::path::PathBuf;

/// Result alias for `picchio-runtime`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong converting, packing, loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {what}: {cause}")]
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
    #[error("{path}: invalid config: {cause}")]
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
    /// `model_type` is not one this runtime implements.
    #[error("{path}: unsupported model_type {model_type:?} (supported: qwen3_moe)")]
    UnsupportedModel {
        /// The config file.
        path: PathBuf,
        /// The value found.
        model_type: String,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: not a valid safetensors file: {cause}")]
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
    #[error("loading expert {key}: {cause}")]
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
        /// What was counted: `tokens` (run), `payloads` (synth, pack), `tensors` (convert).
        unit: &'static str,
    },
}

impl Error {
    /// Wraps an I/O error with its path and operation.
    pub fn io(path: impl Into<PathBuf>, what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |cause| Error::Io { path, what, cause }
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
        assert!(e.to_string().starts_with("/m/config.json: read: "));
        assert!(e.source().is_some());
    }
}
