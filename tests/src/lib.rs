//! Helpers shared by the cross-crate integration tests: fixture paths, reference files, and running a
//! model through a chosen store.

use std::path::{Path, PathBuf};

use picchio_core::StoreUri;
use picchio_runtime::chat::{Message, RenderOptions, TemplateValue};
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::run::{GenerateOptions, Generation, Session, SessionOptions};

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// A fixture's `reference.json` or `reference_q4.json`.
pub fn reference_json(dir: &Path, file: &str) -> serde_json::Value {
    let p = dir.join(file);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A chat rendering case of `fixtures/chat/*_rendering.json`, read straight from the JSON text so
/// that tools and tool-call arguments keep their key order (serde_json's own maps sort their keys).
#[derive(serde::Deserialize)]
pub struct ChatCase {
    /// The case's name.
    pub name: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// The tools offered, as the template sees them.
    #[serde(default)]
    pub tools: Vec<TemplateValue>,
    /// Whether the assistant's header is appended.
    pub add_generation_prompt: bool,
    /// Qwen3's `enable_thinking`, when the case sets it.
    pub enable_thinking: Option<bool>,
    /// The text the reference renderer gave.
    pub text: String,
    /// Its ids, from the reference tokenizer.
    pub ids: Vec<u32>,
}

impl ChatCase {
    /// The render options of this case.
    pub fn opts(&self) -> RenderOptions<'_> {
        RenderOptions {
            add_generation_prompt: self.add_generation_prompt,
            enable_thinking: self.enable_thinking,
            tools: &self.tools,
        }
    }
}

/// The cases of `fixtures/chat/<file>`.
pub fn chat_cases(file: &str) -> Vec<ChatCase> {
    #[derive(serde::Deserialize)]
    struct Rendering {
        cases: Vec<ChatCase>,
    }
    let path = fixture("chat").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str::<Rendering>(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())).cases
}

/// An id array of a reference JSON (`prompt_ids`, `greedy_ids`).
pub fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key].as_array().unwrap_or_else(|| panic!("no {key}")).iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The greedy tokens Picchio (C) v0.8.0 printed for `fixtures/picchio_c/qwen3_moe` on the 12
/// `qwen3_moe/reference.json` prompt ids (fixtures/picchio_c/README.md).
pub const PICCHIO_C_TOKENS: [u32; 16] =
    [731, 1930, 347, 2860, 3377, 3184, 3525, 2504, 41, 2411, 547, 193, 3590, 3840, 3815, 1426];

/// Generates `n` greedy tokens after `prompt` from `model_dir` with experts from `store`, read by
/// `engine` under the default decode schedule.
pub fn greedy(
    model_dir: &Path,
    store: StoreUri,
    engine: EngineOptions,
    ecap: Option<usize>,
    prompt: &[u32],
    n: usize,
) -> picchio_runtime::Result<(Generation, Session)> {
    let opts = SessionOptions {
        model: picchio_runtime::ModelDir::open(model_dir)?,
        store,
        engine,
        schedule: Default::default(),
        verify: false,
        ecap,
        max_seq: prompt.len() + n,
        dense: Default::default(),
    };
    greedy_with(&opts, prompt, n)
}

/// [`greedy`] with every session option given (`max_seq` at least `prompt.len() + n`).
pub fn greedy_with(opts: &SessionOptions, prompt: &[u32], n: usize) -> picchio_runtime::Result<(Generation, Session)> {
    let mut s = Session::open(opts, Tokenizer::from_dir(opts.model.path())?)?;
    let g = s.generate(prompt, &GenerateOptions { max_new: n, keep_logits: true, ..Default::default() })?;
    Ok((g, s))
}

/// Copies every regular file of `src` into a new directory `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// A scratch directory on a file system that supports O_DIRECT (under the target directory, not
/// /tmp, which may be tmpfs).
pub fn scratch() -> tempfile::TempDir {
    picchio_testkit::scratch::dir_in(Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch"))
}

/// A model directory holding a packed `experts.picchioflat`, with the prompt and the greedy tokens
/// every tier must give for it: what the tier tests (raw devices, the NVMe controller model) run
/// over, so each runs every architecture.
pub struct TierModel {
    /// Short name for messages: `picchio_c` or `gpt_oss`.
    pub name: &'static str,
    /// The model directory.
    pub dir: PathBuf,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// The expected greedy tokens after `prompt`.
    pub tokens: Vec<u32>,
    /// Index entries of the image (layers × experts).
    pub entries: usize,
    /// Keeps a converted model's scratch directory alive.
    _scratch: Option<tempfile::TempDir>,
}

impl TierModel {
    /// The packed image in the model directory.
    pub fn image(&self) -> PathBuf {
        self.dir.join("experts.picchioflat")
    }

    /// Picchio (C)'s directory and image as Picchio (C) wrote them, with the tokens it printed.
    pub fn picchio_c() -> Self {
        TierModel {
            name: "picchio_c",
            dir: fixture("picchio_c/qwen3_moe"),
            prompt: ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids"),
            tokens: PICCHIO_C_TOKENS.to_vec(),
            entries: 48,
            _scratch: None,
        }
    }

    /// GPT-OSS: `gpt_oss_mxfp4` converted to Q4 and packed in a scratch directory, with
    /// transformers' Q4 tokens (`reference_q4.json`, which every file tier gives:
    /// `gpt_oss_tiers.rs`).
    pub fn gpt_oss() -> Self {
        use picchio_runtime::image::convert::{convert, ConvertOptions};
        use picchio_runtime::image::pack::{pack, PackOptions};
        let tmp = scratch();
        let dir = tmp.path().join("gpt_oss_mxfp4-q4");
        convert(&fixture("gpt_oss_mxfp4"), &dir, &ConvertOptions { progress: false, ..Default::default() })
            .expect("convert gpt_oss_mxfp4");
        // Without a model record, as Picchio (C)'s fixture image: the tier tests compare what a
        // transport wrote with this file byte for byte.
        let record = picchio_runtime::image::record::RecordModel::Nothing;
        pack(&dir, &dir.join("experts.picchioflat"), &PackOptions { progress: false, record, ..Default::default() })
            .expect("pack gpt_oss_mxfp4-q4");
        let reference = reference_json(&fixture("gpt_oss_mxfp4"), "reference_q4.json");
        TierModel {
            name: "gpt_oss",
            dir,
            prompt: ids(&reference, "prompt_ids"),
            tokens: ids(&reference, "greedy_ids"),
            entries: 4 * 8,
            _scratch: Some(tmp),
        }
    }

    /// Every tier model: Picchio (C)'s Qwen3-MoE and GPT-OSS.
    pub fn all() -> Vec<Self> {
        vec![Self::picchio_c(), Self::gpt_oss()]
    }

    /// Runs `case(model, image, lba, what)` for every tier model at 512- and 4096-byte LBAs, where
    /// `image` is the bytes of the model's packed file-tier image and `what` ("NAME lba N") names
    /// the case in messages. For the tests that write the image onto a device of either LBA size.
    pub fn each_at_both_lbas(mut case: impl FnMut(&TierModel, &[u8], u32, &str)) {
        for m in Self::all() {
            let image = std::fs::read(m.image()).unwrap_or_else(|e| panic!("{}: {e}", m.image().display()));
            for lba in [512u32, 4096] {
                case(&m, &image, lba, &format!("{} lba {lba}", m.name));
            }
        }
    }
}
