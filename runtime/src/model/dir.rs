//! A model directory (or a GGUF file) opened once per command: its path and its `config.json` (a
//! GGUF's metadata), read and checked once ([`ModelDir::open`]) and handed down to everything that needs the configuration — the
//! memory plan ([`crate::plan::plan`]), the model ([`crate::model::Model::load`]), the session
//! ([`crate::run::SessionOptions::model`]), `--usage-out` ([`crate::expert::usage::UsageOut::create`])
//! — as llama2.c reads its checkpoint header once in `build_transformer` and passes the `Config`
//! down. So a missing key's transformers default is said once per command, because the file is
//! parsed once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::gguf::{is_gguf, GgufWeights};

/// The name of the configuration file in a model directory.
pub const CONFIG_FILE: &str = "config.json";

/// A converted (or Hugging Face, for `convert`) model directory, or a GGUF file, with its
/// configuration parsed.
#[derive(Clone, Debug)]
pub struct ModelDir {
    path: PathBuf,
    config: Config,
    config_sha256: [u8; 32],
    gguf: Option<Arc<GgufWeights>>,
}

impl PartialEq for ModelDir {
    /// The same path, configuration and configuration hash (a GGUF's fingerprint).
    fn eq(&self, other: &Self) -> bool {
        (&self.path, &self.config, &self.config_sha256) == (&other.path, &other.config, &other.config_sha256)
    }
}

impl ModelDir {
    /// Reads `<path>/config.json` once: checked as [`Config::parse`] does, and hashed (the SHA-256
    /// `picchio pack` records in the image, [`crate::image::record`]).
    ///
    /// A GGUF file ([`is_gguf`]: a file starting with the magic `GGUF`) is opened in place
    /// instead ([`GgufWeights::open`]): its configuration comes from its metadata
    /// ([`GgufWeights::config`]) and the hash is its fingerprint.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file if it is unreadable; the errors of [`Config::parse`]; for a
    /// GGUF, those of [`GgufWeights::open`] and [`GgufWeights::config`].
    pub fn open(path: &Path) -> Result<ModelDir> {
        if is_gguf(path) {
            let g = GgufWeights::open(path)?;
            let config = g.config()?;
            let config_sha256 = *g.fingerprint();
            return Ok(ModelDir { path: path.to_path_buf(), config, config_sha256, gguf: Some(Arc::new(g)) });
        }
        let file = path.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&file).map_err(Error::io(&file, "read config"))?;
        let config = Config::parse(&text, &file)?;
        let config_sha256 = Sha256::digest(text.as_bytes()).into();
        Ok(ModelDir { path: path.to_path_buf(), config, config_sha256, gguf: None })
    }

    /// The GGUF this model is read from in place, or `None` for a directory.
    pub fn gguf(&self) -> Option<&Arc<GgufWeights>> {
        self.gguf.as_ref()
    }

    /// The directory, as given to [`ModelDir::open`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The configuration read at [`ModelDir::open`].
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// `<path>/config.json` (the GGUF itself for a GGUF model), for messages that name the file.
    pub fn config_path(&self) -> PathBuf {
        match self.gguf {
            Some(_) => self.path.clone(),
            None => self.path.join(CONFIG_FILE),
        }
    }

    /// SHA-256 of the `config.json` bytes that were parsed.
    pub fn config_sha256(&self) -> &[u8; 32] {
        &self.config_sha256
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;

    #[test]
    fn open_reads_the_config_and_hashes_the_bytes_it_parsed() {
        let dir = fixture("picchio_c/qwen3_moe");
        let m = ModelDir::open(&dir).unwrap();
        assert_eq!(m.path(), dir);
        assert_eq!(m.config(), &Config::from_dir(&dir).unwrap());
        assert_eq!(m.config_path(), dir.join("config.json"));
        let bytes = std::fs::read(dir.join("config.json")).unwrap();
        assert_eq!(m.config_sha256(), &<[u8; 32]>::from(Sha256::digest(&bytes)));
    }

    #[test]
    fn open_names_a_missing_or_bad_config() {
        let tmp = tempfile::tempdir().unwrap();
        let e = ModelDir::open(tmp.path()).unwrap_err().to_string();
        assert!(e.contains(&tmp.path().join("config.json").display().to_string()), "{e}");
        std::fs::write(tmp.path().join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
        let e = ModelDir::open(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("unsupported model_type \"llama\"") && e.contains("config.json"), "{e}");
    }
}
