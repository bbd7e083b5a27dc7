//! The model and store options of the long-running front ends (`chat`, `serve`): one model, one
//! KV cache sized for `--ctx` positions, opened once.

use std::path::PathBuf;

use anyhow::Context;
use picchio_core::StoreUri;
use picchio_runtime::chat::engine::Engine;
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::image::record::find_model_dir;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::run::{Session, SessionOptions};
use picchio_runtime::ModelDir;

/// Options naming the model and how its experts are read.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Converted model directory (from `picchio convert`), or a GGUF file (`qwen3moe` or `gpt-oss`,
    /// read in place) [default: $PICCHIO_MODEL, else the
    /// directory the --store image records (`picchio pack` and `synth --model-out` record it in
    /// the superblock), else the directory holding a file image; for a GGUF's expert bundle, the
    /// GGUF it records, else X.gguf beside X.gguf.picchioflat].
    #[arg(long, value_name = "DIR|GGUF", env = "PICCHIO_MODEL")]
    pub model: Option<PathBuf>,
    /// Where routed experts come from (as `picchio run --store`): `auto`, `safetensors`,
    /// `file:PATH`, `raw:/dev/X[@BYTES]`, `nvme:BDF[/NSID]`, `nvme-tcp://HOST:PORT/NQN[/NSID]`, or
    /// `nvme-sim:PATH` (the user-space NVMe driver against its software controller model reading the
    /// image file).
    #[arg(long, value_name = "URI", default_value = "auto")]
    pub store: StoreUri,
    #[command(flatten)]
    pub engine: super::run::EngineArgs,
    #[command(flatten)]
    pub compute: super::compute_args::ComputeArgs,
    /// Expert-cache capacity in experts [default: all experts that fit in half the available memory].
    #[arg(long, value_name = "N")]
    pub ecap: Option<usize>,
    /// Context: positions of the KV cache (prompt + answer of a request, the whole conversation of a
    /// chat) [default: 4096, or the model's max_position_embeddings when smaller].
    #[arg(long, value_name = "N", value_parser = super::int_in::<u64>(1, None))]
    pub ctx: Option<u64>,
}

impl ModelArgs {
    /// The engine options of these arguments.
    fn io(&self) -> EngineOptions {
        self.engine.options()
    }

    /// The model directory: `--model` (or $PICCHIO_MODEL), else the one the `--store` image names
    /// ([`find_model_dir`]), stored in `self.model`.
    ///
    /// # Errors
    /// Neither given nor found: the error names the store, what it records, and suggests --model.
    pub fn resolve_model(&mut self) -> anyhow::Result<PathBuf> {
        if let Some(m) = &self.model {
            return Ok(m.clone());
        }
        if matches!(self.store, StoreUri::Auto | StoreUri::Safetensors) {
            anyhow::bail!(
                "no model: give --model DIR (or set PICCHIO_MODEL), or --store naming an image (file:PATH, \
                 raw:/dev/X[@BYTES], nvme:BDF[/NSID]) packed by `picchio pack`, which records its model directory"
            );
        }
        let found = find_model_dir(&self.store, self.io())
            .with_context(|| format!("finding the model directory of {} (no --model given)", self.store))?;
        tracing::info!("model {} ({})", found.dir.display(), found.how);
        self.model = Some(found.dir.clone());
        Ok(found.dir)
    }

    /// Opens the session and its chat engine (finding the model first when no `--model` was given:
    /// [`ModelArgs::resolve_model`]).
    ///
    /// # Errors
    /// Model, store and template errors, with the model directory named.
    pub fn open(&mut self) -> anyhow::Result<Engine> {
        let model = self.resolve_model()?;
        // config.json is read here, once, and handed down to the session.
        let dir = ModelDir::open(&model).with_context(|| format!("opening model {}", model.display()))?;
        let ctx = match self.ctx {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => 4096.min(dir.config().max_position_embeddings),
        };
        super::plan::check_ctx(ctx, dir.config())?;
        let opts = SessionOptions {
            model: dir,
            store: self.store.clone(),
            engine: self.io(),
            schedule: self.engine.schedule(),
            verify: false,
            ecap: self.ecap,
            max_seq: ctx,
            dense: self.compute.dense,
        };
        let tokenizer = Tokenizer::for_model(&opts.model)?;
        let mut session =
            Session::open(&opts, tokenizer).with_context(|| format!("opening model {}", model.display()))?;
        session.model.set_prefill_chunk(self.engine.prefill_chunk(false)?)?;
        self.compute.apply(&mut session.model);
        Engine::new(session).with_context(|| format!("reading the chat template of {}", model.display()))
    }
}
