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
    /// A GGUF file is not valid (its header, metadata or tensor infos), naming the file, the offset
    /// and the field ([`picchio_core::format::gguf::GgufError`]).
    #[error(transparent)]
    Gguf(#[from] picchio_core::format::gguf::GgufError),
    /// A valid GGUF holds a model this runtime cannot run as it is (another architecture, a tensor
    /// of a type with no kernel, an expert outside its tensor), naming the file and what differs.
    #[error("{path}: {message}")]
    GgufModel {
        /// The GGUF file.
        path: PathBuf,
        /// What was found and what was expected.
        message: String,
    },
    /// A GGUF's tokenizer metadata (`tokenizer.ggml.*`) is missing, of the wrong type, inconsistent,
    /// or names a tokenizer this runtime does not build.
    #[error("{path}: tokenizer metadata `{key}`: {message}")]
    GgufTokenizer {
        /// The GGUF file.
        path: PathBuf,
        /// The metadata key, as spelled in the file (`tokenizer.ggml.pre`).
        key: String,
        /// What was found and what was expected.
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
    /// Dequantizing GGUF tensor bytes failed (an unsupported type or a length that is not whole
    /// blocks); the [`crate::kernels::ggml::DequantError`] names the type and lengths.
    #[error(transparent)]
    Dequant(#[from] crate::kernels::ggml::DequantError),
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
    /// A Hugging Face checkpoint given where a converted directory is needed (`picchio pack`,
    /// `Model::load`): its experts are still in the checkpoint's layout.
    #[error(
        "{} is a Hugging Face checkpoint{}, not a converted directory: run `picchio convert` on it first{}",
        dir.display(),
        tensor.as_deref().map(|t| format!(" (it has `{t}`)")).unwrap_or_default(),
        if *pack { " and pack the converted directory" } else { "" }
    )]
    NotConverted {
        /// The directory.
        dir: PathBuf,
        /// The checkpoint tensor that shows it, when named.
        tensor: Option<String>,
        /// Whether `pack` refused it (the message then says to pack the converted directory).
        pack: bool,
    },
    /// `picchio convert` given a directory it already wrote (it has a converted expert tensor).
    #[error(
        "{}: already a converted Picchio directory (it has `{tensor}`); convert reads a Hugging Face checkpoint",
        dir.display()
    )]
    AlreadyConverted {
        /// The directory.
        dir: PathBuf,
        /// The converted expert tensor found.
        tensor: String,
    },
    /// A checkpoint layer with both fused and per-expert routed-expert tensors.
    #[error("{}: tensor `{name}`: layer {layer} has both fused (`{fused}`) and per-expert expert tensors", path.display())]
    MixedExpertTensors {
        /// The file holding the per-expert tensor.
        path: PathBuf,
        /// The per-expert tensor.
        name: String,
        /// The layer.
        layer: usize,
        /// The fused tensor.
        fused: String,
    },
    /// A routed-expert tensor that config.json does not account for.
    #[error("{}: unexpected routed-expert tensor `{name}`: config.json ({config}) has no such expert", path.display())]
    UnexpectedExpertTensor {
        /// The file holding it.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The config keys that decide the experts, with their values.
        config: String,
    },
    /// A layer's expert tensors were planned in a layout this architecture does not have (a bug).
    #[error("layer {layer}: {source_layout} is not a {arch} expert layout")]
    ExpertSourceArch {
        /// The layer.
        layer: usize,
        /// The planned layout (`PerExpert`, `Fused`).
        source_layout: String,
        /// The architecture (`GPT-OSS`).
        arch: &'static str,
    },
    /// An expert matrix handed to the quantizer has another number of weights than the layout.
    #[error("expert {what} matrix has {len} weights, the layout needs {want}")]
    ExpertMatrixLen {
        /// `gate`, `up`, `down`.
        what: &'static str,
        /// Weights given.
        len: usize,
        /// Weights the layout needs (rows × cols).
        want: usize,
    },
    /// A checkpoint weight that is NaN or infinite.
    #[error("{}: tensor `{name}`{part}: weight {index} is {value} (a checkpoint's weights must be finite)", path.display())]
    NonFiniteWeight {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The expert's part of a fused tensor (` expert 3`), or empty.
        part: String,
        /// The weight's index in the tensor (row-major).
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A written shard holds another number of tensor bytes than its plan (a bug in the writer).
    #[error("{}: wrote {written} tensor bytes, planned {planned}", path.display())]
    ShardBytes {
        /// The shard.
        path: PathBuf,
        /// Bytes written.
        written: u64,
        /// Bytes planned.
        planned: u64,
    },
    /// A tensor whose bytes do not match its dtype and shape (a synthetic model's writer).
    #[error("{}: tensor `{name}` {dtype} {shape:?} needs {want} bytes (a multiple of 4), has {found}", path.display())]
    TensorBytes {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes the dtype and shape need.
        want: usize,
        /// Bytes given.
        found: usize,
    },
    /// A rayon pool of `threads` worker threads could not be started.
    #[error("cannot start {threads} {what} threads")]
    ThreadPool {
        /// Threads asked for.
        threads: usize,
        /// `conversion`, `transcoding`.
        what: &'static str,
        /// rayon's error.
        #[source]
        cause: rayon::ThreadPoolBuildError,
    },
    /// An image of `layers × experts` entries, more than the index's u32 count holds.
    #[error("{layers} layers × {experts} experts exceed u32 entries")]
    TooManyEntries {
        /// Layers to write.
        layers: u64,
        /// Experts per layer.
        experts: u64,
    },
    /// A payload length that does not fit this machine's address space.
    #[error("{bytes}-byte payloads do not fit this machine's memory")]
    PayloadTooLarge {
        /// The payload length.
        bytes: u64,
    },
    /// `picchio convert`'s source is not a directory.
    #[error("{}: not a directory (convert reads a model directory)", path.display())]
    SourceNotDir {
        /// The source path.
        path: PathBuf,
    },
    /// A destination that is, is inside, or contains the source directory.
    #[error("{}", overlap_message(dst, src, *overlap))]
    DestinationOverlapsSource {
        /// The destination.
        dst: PathBuf,
        /// The source directory.
        src: PathBuf,
        /// How they overlap.
        overlap: Overlap,
    },
    /// A destination directory path that exists as something else.
    #[error("destination {} exists and is not a directory", dst.display())]
    DestinationNotDir {
        /// The destination.
        dst: PathBuf,
    },
    /// An existing synthetic-model destination that `picchio synth --model-out` did not write.
    #[error(
        "{}: exists and is not a synthetic model (no `picchio_synthetic` in its config.json): refusing to overwrite \
         it; choose another directory",
        dir.display()
    )]
    NotSynthetic {
        /// The directory.
        dir: PathBuf,
    },
    /// A directory without the tokenizer.json it is given for.
    #[error("{}: no tokenizer.json", dir.display())]
    NoTokenizer {
        /// The directory.
        dir: PathBuf,
    },
    /// An image output that exists and is not an image this command replaces.
    #[error("{}: {what}; {command} will not replace it: remove it or choose another --out", path.display())]
    NotReplaced {
        /// The output path.
        path: PathBuf,
        /// The command (`pack`, `synth`).
        command: String,
        /// What the path is instead.
        what: &'static str,
    },
    /// The output's file system has less free space than the write needs (checked before writing).
    #[error(
        "{}: writing it needs {needed} bytes ({:.2} GB) but its file system has {available} bytes ({:.2} GB) \
         available: free space or choose another --out",
        path.display(),
        *needed as f64 / 1e9,
        *available as f64 / 1e9
    )]
    NotEnoughSpace {
        /// The output.
        path: PathBuf,
        /// Bytes the output needs.
        needed: u64,
        /// Bytes available (`statvfs`).
        available: u64,
    },
    /// An NVMe controller to be written through the user-space driver is not bound to vfio-pci.
    #[error(
        "{target}: the controller is bound to {}, not vfio-pci: run `picchio nvme bind {bdf}` first (it refuses a \
         controller with mounted namespaces); nothing was written",
        driver.as_deref().map_or("no driver".to_string(), |d| format!("the `{d}` driver"))
    )]
    NotVfio {
        /// The store (`nvme:0000:01:00.0/1`).
        target: String,
        /// The controller's PCI address.
        bdf: String,
        /// The driver it is bound to, if any.
        driver: Option<String>,
    },
    /// A target another picchio process is writing.
    #[error("{target} is being written by another picchio process{holders}; wait until it has finished")]
    BeingWritten {
        /// The image, device or namespace.
        target: String,
        /// ` (pid N)` when the lock holders are known, else empty.
        holders: String,
    },
    /// A target another picchio process is reading, which a write would change under it.
    #[error("{target} is being read by another picchio process{holders}; stop it or use --force")]
    BeingRead {
        /// The image, device or namespace.
        target: String,
        /// ` (pid N)` when the readers are known, else empty.
        holders: String,
    },
    /// An image whose model record (in the superblock's reserved bytes) does not parse.
    #[error(
        "{image}: the model record in its superblock is damaged, so it names no model directory: give the converted \
         directory with --model DIR (or set PICCHIO_MODEL); `picchio pack` writes the record again"
    )]
    RecordDamaged {
        /// The image.
        image: String,
        /// The record's parse error (boxed: it would make every runtime `Result` larger).
        #[source]
        cause: Box<picchio_core::Error>,
    },
    /// The GGUF an expert bundle records is gone (or changed), and none beside the bundle matches.
    #[error(
        "{image} is the expert bundle of the GGUF {} (fingerprint {fingerprint_8}…), which was not found: {why}. \
         Give the GGUF with --model X.gguf",
        gguf.display()
    )]
    BundleGgufMissing {
        /// The bundle.
        image: String,
        /// The recorded GGUF.
        gguf: PathBuf,
        /// The first 8 bytes of the recorded fingerprint, in hex.
        fingerprint_8: String,
        /// What was looked at and found instead.
        why: String,
    },
    /// The model directory an image records is gone (or changed), and none beside the image matches.
    #[error(
        "{image} was written for the model directory {} (config.json SHA-256 {sha256_8}…), which was not found: \
         {why}. Give the converted directory with --model DIR (or set PICCHIO_MODEL)",
        dir.display()
    )]
    RecordedModelMissing {
        /// The image.
        image: String,
        /// The recorded directory.
        dir: PathBuf,
        /// The first 8 bytes of the recorded config.json SHA-256, in hex.
        sha256_8: String,
        /// What was looked at and found instead.
        why: String,
    },
    /// An image without a model record, and no config.json beside it.
    #[error(
        "{image} records no model directory (an image written by Picchio (C), or packed before picchio recorded the \
         model in the superblock): give the converted directory with --model DIR (or set PICCHIO_MODEL), or pack \
         the image again"
    )]
    NoModelRecord {
        /// The image.
        image: String,
    },
    /// A model loaded with room for no position (`max_seq` 0).
    #[error("{}: max_seq must be at least 1", dir.display())]
    ZeroContext {
        /// The model directory.
        dir: PathBuf,
    },
    /// A forward pass at a position past the KV cache.
    #[error("position {position} is beyond the context of {context} positions")]
    BeyondContext {
        /// The 0-based position asked for.
        position: usize,
        /// Positions the KV cache holds.
        context: usize,
    },
    /// An expert cache whose slots hold another payload size than the model's experts.
    #[error("the expert cache holds {cache}-byte payloads, this model's experts are {model} bytes")]
    CachePayload {
        /// The cache's payload length.
        cache: usize,
        /// The model's expert payload length.
        model: usize,
    },
    /// An expert payload shorter than its layout.
    #[error("expert payload of {len} bytes is shorter than the {quant} layout ({need} bytes)")]
    PayloadShort {
        /// Bytes in the payload.
        len: usize,
        /// The expert quantization.
        quant: crate::quant::QuantKind,
        /// Bytes the layout needs.
        need: usize,
    },
    /// An f32 part of an expert payload that is not a 4-byte-aligned f32 array (a bug: slots are aligned).
    #[error("expert payload: {what} at bytes {range:?} is not an f32 array: {cause}")]
    PayloadF32 {
        /// The part (`gate_up scales`).
        what: String,
        /// Its byte range in the payload.
        range: std::ops::Range<usize>,
        /// bytemuck's error (in the message: it is not a `std::error::Error` here).
        cause: bytemuck::PodCastError,
    },
    /// A chat request for a model without a chat template.
    #[error("{} has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)", dir.display())]
    NoChatTemplate {
        /// The model directory.
        dir: PathBuf,
    },
    /// A chat request with an empty stop string.
    #[error("stop strings must not be empty (got {got:?})")]
    EmptyStop {
        /// The stop string given.
        got: String,
    },
    /// A chat request's `max_tokens` of 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// A chat request with no message.
    #[error("the message list is empty: give at least one message")]
    NoMessages,
    /// A chat message with a role the templates do not know.
    #[error("message {index} has role `{role}`; the roles are {}", crate::chat::template::ROLES.join(", "))]
    UnknownRole {
        /// 0-based message index.
        index: usize,
        /// The role given.
        role: String,
    },
    /// A `tool` message that names no function and answers no earlier call.
    #[error("{}", tool_message(*index, call_id.as_deref()))]
    ToolMessage {
        /// 0-based message index.
        index: usize,
        /// The `tool_call_id` it gives, which no earlier assistant message made; `None` when it
        /// gives neither that nor a `name`.
        call_id: Option<String>,
    },
    /// A tool call whose arguments do not serialize.
    #[error("message {index}: tool call arguments")]
    ToolCallArguments {
        /// 0-based message index.
        index: usize,
        /// The JSON error.
        #[source]
        cause: serde_json::Error,
    },
    /// A `tools[i]` entry that cannot be rendered.
    #[error("tools[{index}]: {why}")]
    BadTool {
        /// 0-based index in `tools`.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// An MXFP4 tensor that cannot be dequantized; the [`crate::image::convert::mxfp4::Mxfp4Error`]
    /// names it.
    #[error(transparent)]
    Mxfp4(#[from] crate::image::convert::mxfp4::Mxfp4Error),
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

/// How an output directory overlaps its source ([`Error::DestinationOverlapsSource`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// The destination is the source.
    Same,
    /// The destination is inside the source.
    Inside,
    /// The destination contains the source.
    Contains,
}

/// The message of [`Error::DestinationOverlapsSource`].
fn overlap_message(dst: &std::path::Path, src: &std::path::Path, overlap: Overlap) -> String {
    let (dst, src) = (dst.display(), src.display());
    match overlap {
        Overlap::Same => format!(
            "destination {dst} is the source directory: convert never writes into its source; choose another \
             destination"
        ),
        Overlap::Inside => format!(
            "destination {dst} is inside the source directory {src}: convert never writes into its source; choose a \
             destination outside it"
        ),
        Overlap::Contains => {
            format!("destination {dst} contains the source directory {src}: choose another destination")
        }
    }
}

/// The message of [`Error::ToolMessage`].
fn tool_message(index: usize, call_id: Option<&str>) -> String {
    match call_id {
        Some(id) => format!("message {index} (tool) answers the call `{id}`, which no earlier assistant message made"),
        None => format!("message {index} (tool) names no function: give its `name` or the `tool_call_id` it answers"),
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

    /// The variants that replaced `Invalid(String)` carry their fields and say what the strings said
    /// (CLI tests match parts of these messages).
    #[test]
    fn typed_variants_name_the_path_the_fields_and_the_fix() {
        let e = Error::BeyondContext { position: 40, context: 40 };
        assert_eq!(e.to_string(), "position 40 is beyond the context of 40 positions");
        let e = Error::NotConverted {
            dir: "/hf".into(),
            tensor: Some("model.layers.0.mlp.experts.gate_up_proj".into()),
            pack: false,
        };
        assert_eq!(
            e.to_string(),
            "/hf is a Hugging Face checkpoint (it has `model.layers.0.mlp.experts.gate_up_proj`), not a converted \
             directory: run `picchio convert` on it first"
        );
        let e = Error::NotConverted { dir: "/hf".into(), tensor: None, pack: true };
        assert!(e.to_string().ends_with("first and pack the converted directory"), "{e}");
        let e = Error::AlreadyConverted { dir: "/c".into(), tensor: "t".into() };
        assert!(e.to_string().starts_with("/c: already a converted Picchio directory (it has `t`)"), "{e}");
        let overlap = |overlap| Error::DestinationOverlapsSource { dst: "/s/o".into(), src: "/s".into(), overlap };
        assert!(overlap(Overlap::Same).to_string().contains("is the source directory"));
        assert!(overlap(Overlap::Inside).to_string().contains("/s/o is inside the source directory /s"));
        assert!(overlap(Overlap::Contains).to_string().contains("contains the source directory /s"));
        let e = Error::BeingRead { target: "/i.pf".into(), holders: " (pid 7)".into() };
        assert_eq!(e.to_string(), "/i.pf is being read by another picchio process (pid 7); stop it or use --force");
        let e = Error::BeingWritten { target: "/i.pf".into(), holders: String::new() };
        assert_eq!(e.to_string(), "/i.pf is being written by another picchio process; wait until it has finished");
        let e = Error::NotReplaced { path: "/m/config.json".into(), command: "pack".into(), what: "is not an image" };
        assert_eq!(
            e.to_string(),
            "/m/config.json: is not an image; pack will not replace it: remove it or choose another --out"
        );
        let e = Error::NotEnoughSpace { path: "/o".into(), needed: 2_000_000_000, available: 1_000_000_000 };
        assert!(
            e.to_string().contains("needs 2000000000 bytes (2.00 GB)") && e.to_string().contains("(1.00 GB)"),
            "{e}"
        );
        let e = Error::NotVfio {
            target: "nvme:0000:01:00.0/1".into(),
            bdf: "0000:01:00.0".into(),
            driver: Some("nvme".into()),
        };
        assert!(
            e.to_string().contains("bound to the `nvme` driver, not vfio-pci: run `picchio nvme bind 0000:01:00.0`"),
            "{e}"
        );
        let e = Error::CachePayload { cache: 4096, model: 8192 };
        assert_eq!(e.to_string(), "the expert cache holds 4096-byte payloads, this model's experts are 8192 bytes");
        let e = Error::TooManyEntries { layers: 1 << 20, experts: 1 << 20 };
        assert_eq!(e.to_string(), "1048576 layers × 1048576 experts exceed u32 entries");
        let e = Error::UnknownRole { index: 0, role: "wizard".into() };
        assert!(e.to_string().starts_with("message 0 has role `wizard`; the roles are system, "), "{e}");
        let e = Error::ToolMessage { index: 2, call_id: Some("c1".into()) };
        assert!(e.to_string().contains("answers the call `c1`, which no earlier assistant message made"), "{e}");
        let e = Error::ToolMessage { index: 2, call_id: None };
        assert!(e.to_string().contains("message 2 (tool) names no function"), "{e}");
        let e = Error::ShardBytes { path: "/o/model-1.safetensors".into(), written: 10, planned: 12 };
        assert_eq!(e.to_string(), "/o/model-1.safetensors: wrote 10 tensor bytes, planned 12");
    }

    /// The new variants that keep a cause keep it as `source()` only.
    #[test]
    fn typed_variants_keep_their_cause_as_the_source() {
        let json = || serde_json::from_str::<u32>("{").unwrap_err();
        let damaged = picchio_core::Error::BadMagic { source_name: "img".into(), found: "x".into() };
        let errors = [
            Error::RecordDamaged { image: "/i.pf".into(), cause: Box::new(damaged) },
            Error::ToolCallArguments { index: 1, cause: json() },
        ];
        for e in &errors {
            let src = e.source().expect("the cause is the source").to_string();
            assert!(!e.to_string().contains(&src), "{e} repeats its source {src}");
            assert_eq!(picchio_core::error::chain(e).to_string(), format!("{e}: {src}"));
        }
        assert!(errors[0].to_string().starts_with("/i.pf: the model record in its superblock is damaged"));
        assert_eq!(errors[1].to_string(), "message 1: tool call arguments");
        let cause = bytemuck::try_cast_slice::<u8, f32>(&[0u8; 3]).unwrap_err();
        let e = Error::PayloadF32 { what: "gate_up scales".into(), range: 1..5, cause };
        assert_eq!(e.to_string(), format!("expert payload: gate_up scales at bytes 1..5 is not an f32 array: {cause}"));
        assert!(e.source().is_none());
        // A transparent MXFP4 error shows its own message.
        let m = crate::image::convert::mxfp4::Mxfp4Error::NotWholeBlocks { what: "t".into(), cols: 48 };
        assert_eq!(Error::from(m).to_string(), "t: 48 inputs are not whole MXFP4 blocks of 32");
    }
}
