//! Picchio runtime: converts Hugging Face Qwen3-MoE checkpoints, packs their routed experts into a
//! `.picchioflat` image, and runs the model with the experts streamed through an LRU expert cache.
//!
//! - [`model`]: the model (config, tensors, tokenizer, forward pass, MoE routing, sampling);
//! - [`kernels`]: the matrix kernels of the forward pass;
//! - [`expert`]: routed experts at run time (payload layout, expert cache, opening a `--store`);
//! - [`image`]: writing and checking `.picchioflat` images (convert, pack, verify, synth);
//! - [`plan`]: the memory plan, and the memory figures it is made of (peak RSS, available memory,
//!   cgroup limit);
//! - [`run`]: a session (model + store) and generation;
//! - [`chat`]: chat templates, end-of-turn ids, reasoning, generation reusing the KV cache;
//! - [`nvme_admin`]: host management of NVMe controllers (binding to `vfio-pci` and back);
//! - [`sys`]: the runtime's `unsafe` OS calls (mmap, signal disposition), one function each.
#![deny(missing_docs)]

pub mod chat;
pub mod error;
pub mod expert;
pub mod image;
pub mod interrupt;
pub mod kernels;
pub mod model;
pub mod nvme_admin;
pub mod output;
pub mod plan;
pub mod progress;
pub mod quant;
pub mod run;
pub mod sys;

pub use error::{Error, Result};

/// The vendored test fixture `name` (a directory or file under the checkout's `tests/fixtures/`),
/// for the unit tests of every module.
#[cfg(test)]
pub(crate) fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}
pub use model::config::Config;
pub use model::dir::ModelDir;
