//! [`WeightSource`]: where a model's resident tensors come from, by Hugging Face tensor name — a
//! converted directory's safetensors ([`TensorStore`]) or a GGUF file read in place
//! ([`crate::model::gguf::GgufWeights`], which maps the names onto llama.cpp's). Each
//! architecture's loader ([`super::DecoderLayer::load_layers`]) asks only this trait, so a new file
//! format is a new implementation, not a second loader.

use crate::error::Result;
use crate::model::matrix::Matrix;
use crate::model::safetensors::TensorStore;

/// The resident tensors of one model, fetched by their Hugging Face name
/// (`model.layers.N.self_attn.q_proj.weight`) and checked against the shape the config implies.
pub trait WeightSource {
    /// Whether the model holds tensor `name`.
    fn contains(&self, name: &str) -> bool;

    /// Tensor `name` as a `[rows, cols]` matrix in the form it is stored in ([`Matrix`]).
    ///
    /// # Errors
    /// [`crate::Error::MissingTensor`], [`crate::Error::TensorShape`] or
    /// [`crate::Error::TensorDtype`], naming the tensor and its file.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix>;

    /// Float tensor `name` of `shape` (outermost dimension first, as PyTorch writes it), widened to
    /// f32 in row-major order: norm weights, biases, attention sinks.
    ///
    /// # Errors
    /// As [`WeightSource::matrix`].
    fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;

    /// Drops every mapped page of the source from the resident set once the resident copies are
    /// made (the default does nothing).
    fn release_all(&self) {}
}

impl WeightSource for TensorStore {
    fn contains(&self, name: &str) -> bool {
        TensorStore::contains(self, name)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        Matrix::from_safetensors(self, name, rows, cols)
    }

    fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.get(name)?;
        t.expect_shape(shape)?;
        let v = t.to_f32()?;
        self.release(name);
        Ok(v)
    }

    fn release_all(&self) {
        TensorStore::release_all(self)
    }
}
