//! `picchio transcode`.

use std::path::PathBuf;

use anyhow::Context;

use picchio_runtime::image::transcode::{default_destination, transcode, TranscodeOptions};
use picchio_runtime::quant::QuantKind;

/// Options of `picchio transcode`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Converted model directory (Qwen3-MoE, GPT-OSS or Picchio (C)) whose experts are re-quantized.
    /// Never modified.
    #[arg(value_name = "MODEL_DIR")]
    pub src: PathBuf,
    /// Expert quantization to write: q3 (from q4 or none) or q4 (from none). q4 -> q4 is refused
    /// (nothing to do) and q3 -> q4 too (Q3 dropped information Q4 cannot get back).
    #[arg(long, value_name = "KIND")]
    pub to: QuantKind,
    /// Output directory (default: MODEL_DIR-KIND beside MODEL_DIR, e.g. model-q3). Must not exist
    /// unless --force; written to a temporary sibling and renamed into place.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Replace the output directory if it exists. The old one is removed only after the new one is
    /// complete, so a failed transcode leaves it untouched.
    #[arg(long)]
    pub force: bool,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    // SIGINT/SIGTERM stop between tensors; the temporary directory is removed.
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    let dst = a.out.unwrap_or_else(|| default_destination(&a.src, a.to));
    let opts = TranscodeOptions { to: a.to, overwrite: a.force, progress: !a.no_progress, ..Default::default() };
    let report = transcode(&a.src, &dst, &opts)?;
    println!("{report}");
    Ok(())
}
