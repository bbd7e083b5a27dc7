//! `picchio verify`.

use std::path::PathBuf;

use anyhow::bail;
use picchio_runtime::verify::{verify, VerifyOptions};

/// Options of `picchio verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The .picchioflat image (a path or file:PATH).
    #[arg(value_name = "STORE")]
    pub store: String,
    /// Also compare every payload byte for byte with this converted model's safetensors experts.
    #[arg(long, value_name = "MODEL_DIR")]
    pub model: Option<PathBuf>,
    /// Read through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Reader threads.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub io_threads: usize,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    let path = PathBuf::from(a.store.strip_prefix("file:").unwrap_or(&a.store));
    let opts = VerifyOptions { io_threads: a.io_threads, direct: !a.buffered, progress: !a.no_progress };
    let report = verify(&path, a.model.as_deref(), &opts)?;
    println!("{report}");
    if !report.is_clean() {
        bail!("{}: {} expert(s) failed verification", path.display(), report.failures.len());
    }
    Ok(())
}
