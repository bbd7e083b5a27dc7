//! `picchio convert`.

use std::path::PathBuf;

use anyhow::Context;

use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::quant::QuantKind;

/// Options of `picchio convert`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face checkpoint directory (config.json + safetensors, sharded or not). Never modified.
    #[arg(value_name = "HF_DIR")]
    pub src: PathBuf,
    /// Output directory (must not exist unless --force; written to a temporary sibling and renamed).
    #[arg(value_name = "OUT_DIR")]
    pub dst: PathBuf,
    /// Replace OUT_DIR if it already exists. The new directory is written beside it first; the old one
    /// is removed only after the new one is complete, so a failed conversion leaves it untouched.
    #[arg(long)]
    pub force: bool,
    /// Routed-expert quantization: q4 (default), q3, or none (f32, for oracle tests).
    #[arg(long, value_name = "KIND", default_value = "q4")]
    pub experts: QuantKind,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    // SIGINT/SIGTERM stop the conversion between tensors; the temporary directory is removed.
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    let report = convert(
        &a.src,
        &a.dst,
        &ConvertOptions { experts: a.experts, overwrite: a.force, progress: !a.no_progress, ..Default::default() },
    )?;
    // The summary is the command's result: stdout (logs, and progress, go to stderr).
    println!("{report}");
    Ok(())
}
