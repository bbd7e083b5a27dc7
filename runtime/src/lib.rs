//! Picchio runtime: converts Hugging Face Qwen3-MoE checkpoints, packs their routed experts into a
//! `.picchioflat` image, and runs the model with the experts streamed through an LRU expert cache.
#![deny(missing_docs)]

pub mod bench;
pub mod cache;
pub mod config;
pub mod convert;
pub mod error;
pub mod expert;
pub mod interrupt;
pub mod kernels;
pub mod model;
pub mod moe;
pub mod nvme_admin;
pub mod pack;
pub mod progress;
pub mod quant;
pub mod rope;
pub mod run;
pub mod safetensors;
pub mod sampler;
pub mod store;
pub mod synth;
pub mod synthetic;
pub mod tokenizer;
pub mod verify;

pub use config::Config;
pub use error::{Error, Result};
