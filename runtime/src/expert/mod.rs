//! Routed experts at run time: the payload layout and the safetensors loader ([`layout`]), the LRU
//! expert cache their payloads are read into ([`cache`]), and opening the expert store a run asks
//! for with `--store` ([`store`]), through the one engine factory ([`open`]).

pub mod cache;
pub mod io_worker;
pub mod layout;
pub mod open;
pub mod store;
pub mod usage;
