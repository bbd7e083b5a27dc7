//! Picchio runtime: converts Hugging Face Qwen3-MoE checkpoints, packs their routed experts into a
//! `.picchioflat` image, and runs the model with the experts streamed through an LRU expert cache.
#![deny(missing_docs)]

pub mod kernels;
pub mod quant;
