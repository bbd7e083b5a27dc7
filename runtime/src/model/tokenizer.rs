//! Text ↔ token ids through Hugging Face's `tokenizers` crate, from a model directory's
//! `tokenizer.json` or from a GGUF's metadata ([`super::gguf_tokenizer`]).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A loaded `tokenizer.json`, or one rebuilt from a GGUF.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `<dir>/tokenizer.json`, or returns `Ok(None)` when the directory has none (then prompts
    /// must be given as ids).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the file exists but cannot be parsed.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer { path: path.clone(), message: e.to_string() })?;
        Ok(Some(Tokenizer { inner, path }))
    }

    /// The tokenizer of an opened model: a GGUF's own, from its `tokenizer.ggml.*` metadata
    /// ([`Tokenizer::from_gguf`]; `Ok(None)` when it has no `tokenizer.ggml.model` key at all), else
    /// the directory's `tokenizer.json` ([`Tokenizer::from_dir`]).
    ///
    /// # Errors
    /// As [`Tokenizer::from_gguf`] and [`Tokenizer::from_dir`].
    pub fn for_model(model: &crate::model::dir::ModelDir) -> Result<Option<Self>> {
        match model.gguf() {
            Some(g) if g.gguf().meta().get("tokenizer.ggml.model").is_none() => Ok(None),
            Some(g) => Ok(Some(Tokenizer::from_gguf(g.gguf().meta())?.tokenizer)),
            None => Tokenizer::from_dir(model.path()),
        }
    }

    /// Wraps a tokenizer built in memory (from a GGUF's metadata: [`Tokenizer::from_gguf`]); `path`
    /// is the file it came from, named in errors.
    pub(crate) fn from_parts(inner: tokenizers::Tokenizer, path: &Path) -> Self {
        Tokenizer { inner, path: path.to_owned() }
    }

    /// Encodes `text` without adding special tokens (as transformers' `add_special_tokens=False`).
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), message: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, keeping special tokens (`skip_special_tokens=False`).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] (e.g. an id beyond the vocabulary).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer { path: self.path.clone(), message: e.to_string() })
    }

    /// Decodes ids to text without the special tokens (`skip_special_tokens=True`): what a chat shows.
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer { path: self.path.clone(), message: e.to_string() })
    }

    /// The id of the token spelled `token` (a vocabulary entry or an added token such as `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The spelling of token `id`, if the vocabulary has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is an added token marked `special` (`<|im_end|>`, `<|return|>`), which decoding
    /// for display skips.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }

    /// The tokenizer.json (or GGUF) this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_the_fixture_prompt_like_transformers() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_text");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let ids = |k: &str| r[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let t = Tokenizer::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.encode(r["prompt_text"].as_str().unwrap()).unwrap(), ids("prompt_ids"));
        assert_eq!(t.decode(&ids("greedy_ids")).unwrap(), r["greedy_text"].as_str().unwrap());
        assert!(Tokenizer::from_dir(&dir.join("../qwen3_moe")).unwrap().is_none());
    }
}
