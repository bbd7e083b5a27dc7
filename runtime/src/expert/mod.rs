//! Routed experts at run time: the payload layout ([`layout`]) and the safetensors loader that
//! reads it from a converted directory ([`safetensors`]) or a GGUF ([`gguf`]), the LRU expert cache their payloads are
//! read into ([`cache`]) and the long-lived I/O thread of overlapped decode steps ([`io_worker`]),
//! and opening the store a run asks for with `--store`: the engine and its reader's lock
//! ([`open`]), then the loader assembled on it ([`store`], which uses `open`, never the reverse).

pub mod cache;
pub mod gguf;
pub mod io_worker;
pub mod layout;
pub mod open;
pub mod safetensors;
pub mod store;
pub mod usage;
