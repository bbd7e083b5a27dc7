//! `picchio pack`.

use std::path::PathBuf;

use picchio_runtime::pack::{pack, PackOptions};
use picchio_runtime::store::DEFAULT_IMAGE;

/// Options of `picchio pack`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Converted model directory (from `picchio convert`, or one written by Picchio (C)).
    #[arg(value_name = "MODEL_DIR")]
    pub model: PathBuf,
    /// Image path [default: MODEL_DIR/experts.picchioflat]. Written atomically (temporary file + rename).
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
    /// Pack only the first N layers (a prefix store; later layers are served from safetensors).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    let out = a.out.clone().unwrap_or_else(|| a.model.join(DEFAULT_IMAGE));
    let report = pack(&a.model, &out, &PackOptions { layers: a.layers, progress: !a.no_progress })?;
    eprintln!("{report}");
    Ok(())
}
