//! Model architectures. Each is declared like llama2.c `run.c`: `Config`, resident `Weights`, a
//! `RunState` allocated once, and a `forward` that streams routed experts through an
//! [`ExpertCache`](crate::expert::cache::ExpertCache) from an [`ExpertLoader`](picchio_core::ExpertLoader).

pub mod config;
pub mod moe;
pub mod qwen3_moe;
pub mod rope;
pub mod safetensors;
pub mod sampler;
pub mod tokenizer;

pub use qwen3_moe::{LayerWeights, Matrix, Mlp, Model, RunState, Trace, Weights};
