//! [`ModelWeights`]: the resident weights every architecture has around its decoder layers
//! (embeddings, final norm, output projection), and [`DecoderLayer`], how one architecture reads
//! its layers' weights.

use super::matrix::{vector, DenseFormat, Matrix};
use crate::error::Result;
use crate::model::config::Config;
use crate::model::source::WeightSource;

/// The decoder-layer weights of one architecture ([`super::qwen3_moe::LayerWeights`],
/// [`super::gpt_oss::LayerWeights`]): how they are read from a converted directory.
pub trait DecoderLayer: Sized {
    /// Reads the resident tensors of every decoder layer of `cfg`'s model from `store` (by Hugging
    /// Face name), checking each shape, with the projections kept in `dense`.
    ///
    /// # Errors
    /// [`crate::Error::MissingTensor`], [`crate::Error::TensorShape`], [`crate::Error::TensorDtype`],
    /// naming tensor and file.
    fn load_layers(store: &dyn WeightSource, cfg: &Config, dense: DenseFormat) -> Result<Vec<Self>>;

    /// Whether the model has no `lm_head.weight` of its own and reuses `embed_tokens`
    /// (`tie_word_embeddings`, by default).
    fn tied(store: &dyn WeightSource, cfg: &Config) -> bool {
        let _ = store;
        cfg.tie_word_embeddings
    }
}

/// The resident weights of a model (everything but the routed experts' matrices), fetched by
/// Hugging Face tensor name: the layers `L` of its architecture between the embeddings and the
/// output projection.
#[derive(Clone, Debug)]
pub struct ModelWeights<L> {
    /// `model.embed_tokens.weight` `[V, H]`.
    pub embed_tokens: Matrix,
    /// `model.layers.N.*`, one per decoder layer.
    pub layers: Vec<L>,
    /// `model.norm.weight` `[H]`.
    pub norm: Vec<f32>,
    /// `lm_head.weight` `[V, H]`; `None` when tied ([`DecoderLayer::tied`]: embed_tokens is used).
    pub lm_head: Option<Matrix>,
}

impl<L: DecoderLayer> ModelWeights<L> {
    /// Reads every resident tensor of `cfg`'s model from `store`, checking each shape.
    ///
    /// # Errors
    /// [`crate::Error::MissingTensor`], [`crate::Error::TensorShape`], [`crate::Error::TensorDtype`],
    /// naming tensor and file.
    pub fn load(store: &dyn WeightSource, cfg: &Config) -> Result<Self> {
        Self::load_as(store, cfg, DenseFormat::Stored)
    }

    /// [`ModelWeights::load`] with the layers' projections kept in `dense` ([`DenseFormat`]; which
    /// ones is the architecture's choice, see its [`DecoderLayer::load_layers`]).
    ///
    /// # Errors
    /// As [`ModelWeights::load`].
    pub fn load_as(store: &dyn WeightSource, cfg: &Config, dense: DenseFormat) -> Result<Self> {
        let layers = L::load_layers(store, cfg, dense)?;
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let lm_head = match L::tied(store, cfg) {
            true => None,
            false => Some(Matrix::load(store, "lm_head.weight", v, h)?),
        };
        Ok(ModelWeights {
            embed_tokens: Matrix::load(store, "model.embed_tokens.weight", v, h)?,
            layers,
            norm: vector(store, "model.norm.weight", h)?,
            lm_head,
        })
    }
}

impl<L> ModelWeights<L> {
    /// The output projection `[V, H]`: lm_head, or embed_tokens when tied.
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }
}
