//! Writes the seed corpus of the `nvme_tcp` fuzz target (`fuzz/corpus/nvme_tcp/`): each of
//! [`replay::seed_sessions`] is recorded against the in-process model target through a recording
//! proxy (`picchio_nvme::tcp::replay::record`), checked to succeed at every step, and written as
//! one file in the target's session format (each under 64 KiB).
//!
//! `cargo run -p picchio-nvme --example nvme_tcp_seeds -- fuzz/corpus/nvme_tcp`
//!
//! The recordings are the same on every run except the discovery log entry's TRSVCID, the model's
//! port number as text.

#[cfg(target_os = "linux")]
use std::error::Error;
#[cfg(target_os = "linux")]
use std::path::PathBuf;

#[cfg(target_os = "linux")]
use picchio_nvme::tcp::replay;

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("nvme_tcp_seeds: the NVMe/TCP initiator is Linux-only");
    std::process::exit(2);
}

#[cfg(target_os = "linux")]
fn main() -> Result<(), Box<dyn Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: nvme_tcp_seeds DIR (fuzz/corpus/nvme_tcp)")?);
    std::fs::create_dir_all(&dir)?;
    for (name, opts, cfg) in replay::seed_sessions() {
        let (bytes, out) = replay::record(opts, cfg)?;
        if let Some(e) = out.error() {
            return Err(format!("{name}: the recorded session failed: {}", e.message).into());
        }
        if bytes.len() >= 64 << 10 {
            return Err(format!("{name}: {} bytes, the corpus keeps files under 64 KiB", bytes.len()).into());
        }
        std::fs::write(dir.join(name), &bytes)?;
        println!("{name}: {} bytes, {} steps", bytes.len(), out.steps.len());
    }
    Ok(())
}
