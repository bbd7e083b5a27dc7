//! Routed experts at run time: the payload layout and the safetensors loader ([`layout`]), the LRU
//! expert cache their payloads are read into ([`cache`]), and opening the expert store a run asks
//! for with `--store` ([`store`]).

pub mod cache;
pub mod layout;
pub mod store;
