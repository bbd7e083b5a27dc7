//! `picchio verify`.

use std::path::PathBuf;

use anyhow::bail;
use picchio_core::StoreUri;
use picchio_runtime::image::verify::{verify, VerifyOptions, VerifyReport};

/// Options of `picchio verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The .picchioflat image: a path, file:PATH, raw:/dev/X or raw:/dev/X@BYTES for an image on
    /// a block device starting at byte BYTES (default 0), or nvme:BDF[/NSID] for an image at LBA 0 of
    /// an NVMe namespace read through the user-space driver (controller bound to vfio-pci with
    /// `picchio nvme bind`), or nvme-tcp://HOST:PORT/NQN[/NSID] for one on a remote namespace read
    /// through the NVMe/TCP initiator, or nvme-sim:PATH for an image file read by the user-space
    /// driver through its controller model. The image is only read.
    #[arg(value_name = "STORE")]
    pub store: String,
    /// Also compare every payload byte for byte with this converted model's safetensors experts.
    #[arg(long, value_name = "MODEL_DIR")]
    pub model: Option<PathBuf>,
    /// Read through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Reader threads.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = super::int_in::<usize>(1, Some(256)))]
    pub io_threads: usize,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    let opts = VerifyOptions { io_threads: a.io_threads, direct: !a.buffered, progress: !a.no_progress };
    // A block device given as a path is verified as `raw:PATH` (the one resolution run and bench use).
    let uri = picchio_runtime::expert::open::resolve_device(a.store.parse()?);
    let (name, report) = match &uri {
        StoreUri::File(path) => (path.display().to_string(), verify(path, a.model.as_deref(), &opts)?),
        StoreUri::Raw { device, offset } => (a.store.clone(), verify_raw(device, *offset, &a, &opts)?),
        StoreUri::Nvme { bdf, nsid } => (a.store.clone(), verify_nvme(bdf, *nsid, &a, &opts)?),
        StoreUri::Auto | StoreUri::Safetensors => bail!(
            "{}: names no image to verify: give the image as a path, file:PATH, raw:/dev/X[@BYTES], nvme:BDF[/NSID], \
             nvme-tcp://HOST:PORT/NQN[/NSID] or nvme-sim:PATH",
            a.store
        ),
        // nvme-tcp://, nvme-sim: (the driver on its controller model): through the store's own engine.
        other => (other.to_string(), picchio_runtime::image::verify::verify_store(other, a.model.as_deref(), &opts)?),
    };
    println!("{report}");
    if !report.is_clean() {
        bail!(
            "{name}: verification failed: {} image-level problem(s), {} expert(s) failed",
            report.store_problems.len(),
            report.failures.len()
        );
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn verify_raw(device: &std::path::Path, offset: u64, a: &Args, opts: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    Ok(picchio_runtime::image::verify::verify_raw(device, offset, a.model.as_deref(), opts)?)
}

#[cfg(not(target_os = "linux"))]
fn verify_raw(device: &std::path::Path, _: u64, _: &Args, _: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    bail!("raw:{}: block devices are supported on Linux only", device.display())
}

#[cfg(target_os = "linux")]
fn verify_nvme(bdf: &str, nsid: u32, a: &Args, opts: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    Ok(picchio_runtime::image::verify::verify_nvme(bdf, nsid, a.model.as_deref(), opts)?)
}

#[cfg(not(target_os = "linux"))]
fn verify_nvme(bdf: &str, _: u32, _: &Args, _: &VerifyOptions) -> anyhow::Result<VerifyReport> {
    bail!("nvme:{bdf}: the user-space NVMe driver needs Linux VFIO")
}
