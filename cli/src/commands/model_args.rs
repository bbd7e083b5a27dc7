//! The model and store options of the long-running front ends (`chat`, `serve`): one model, one
//! KV cache sized for `--ctx` positions, opened once.

use std::path::PathBuf;

use anyhow::Context;
use picchio_core::StoreUri;
use picchio_runtime::chat::engine::Engine;
use picchio_runtime::expert::store::IoOptions;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::run::{Session, SessionOptions};

/// Options naming the model and how its experts are read.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Converted model directory (from `picchio convert`) [default: $PICCHIO_MODEL].
    #[arg(long, value_name = "DIR", env = "PICCHIO_MODEL")]
    pub model: PathBuf,
    /// Where routed experts come from (as `picchio run --store`): `auto`, `safetensors`,
    /// `file:PATH`, `raw:/dev/X[@BYTES]`, `nvme:BDF[/NSID]`.
    #[arg(long, value_name = "URI", default_value = "auto")]
    pub store: StoreUri,
    /// Read flat stores through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Reader threads of the psync engine.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub io_threads: u16,
    #[command(flatten)]
    pub engine: super::run::EngineArgs,
    #[command(flatten)]
    pub compute: super::compute_args::ComputeArgs,
    /// Expert-cache capacity in experts [default: all experts that fit in half the available memory].
    #[arg(long, value_name = "N")]
    pub ecap: Option<usize>,
    /// Context: positions of the KV cache (prompt + answer of a request, the whole conversation of a
    /// chat) [default: 4096, or the model's max_position_embeddings when smaller].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub ctx: Option<u64>,
}

impl ModelArgs {
    /// Opens the session and its chat engine.
    ///
    /// # Errors
    /// Model, store and template errors, with the model directory named.
    pub fn open(&self) -> anyhow::Result<Engine> {
        let cfg = picchio_runtime::Config::from_dir(&self.model)?;
        let ctx = match self.ctx {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => 4096.min(cfg.max_position_embeddings),
        };
        let opts = SessionOptions {
            model_dir: self.model.clone(),
            store: self.store.clone(),
            io: self.engine.apply(IoOptions {
                direct: !self.buffered,
                threads: usize::from(self.io_threads),
                ..IoOptions::default()
            }),
            ecap: self.ecap,
            max_seq: ctx,
            dense: self.compute.dense,
        };
        let tokenizer = Tokenizer::from_dir(&self.model)?;
        let mut session =
            Session::open(&opts, tokenizer).with_context(|| format!("opening model {}", self.model.display()))?;
        self.compute.apply(&mut session.model);
        Engine::new(session).with_context(|| format!("reading the chat template of {}", self.model.display()))
    }
}
