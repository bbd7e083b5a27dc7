//! `picchio pack`.

use std::path::PathBuf;

use anyhow::Context;
use picchio_core::StoreUri;
use picchio_runtime::expert::open::write_target;
use picchio_runtime::expert::store::DEFAULT_IMAGE;
use picchio_runtime::image::pack::{pack, pack_to, PackOptions};
use picchio_runtime::image::write::{WriteOptions, WriteTo};

/// Options of `picchio pack`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Converted model directory (from `picchio convert`, or one written by Picchio (C)), or a
    /// GGUF file: its expert bundle (format version 3: each expert's gate|up|down bytes as the GGUF
    /// stores them, with the GGUF's fingerprint) goes by default to X.gguf.picchioflat beside
    /// X.gguf, where `run --store auto` looks for it; re-packing replaces a stale bundle.
    #[arg(value_name = "MODEL_DIR|X.gguf")]
    pub model: PathBuf,
    /// Where to write the image [default: MODEL_DIR/experts.picchioflat]. A path (or file:PATH; a
    /// name containing ':' must be written file:PATH or ./PATH) is written atomically (temporary
    /// file + rename) after checking that its file system has room. raw:/dev/X or raw:/dev/X@BYTES writes a block
    /// device from byte BYTES on (a whole number of logical blocks; default 0): the device is
    /// inspected first and refused if it is mounted, in use, or carries a partition table or
    /// file-system signature; what will be overwritten is printed, and the image is read back and
    /// checked after writing. nvme:BDF[/NSID] writes namespace NSID (default 1) of the NVMe
    /// controller BDF from LBA 0 with NVM Write commands through the user-space driver: the
    /// controller must already be bound to vfio-pci (`picchio nvme bind BDF`, which refuses
    /// controllers with mounted namespaces), the namespace's first blocks are inspected and refused
    /// like raw:, and the image is flushed and read back through the driver.
    /// nvme-tcp://HOST:PORT/NQN[/NSID] writes a remote namespace the same way through the NVMe/TCP
    /// initiator (docs/nvme-tcp.md).
    #[arg(long, value_name = "PATH|raw:/dev/X[@BYTES]|nvme:BDF[/NSID]|nvme-tcp://HOST:PORT/NQN[/NSID]")]
    pub out: Option<String>,
    /// With --out raw: or nvme:, write the target although it carries a partition table or a
    /// file-system signature, or (raw:) is found mounted or in use; everything on it is lost. The
    /// kernel still refuses a device that a mounted file system, swap area or device-mapper holds,
    /// and the device backing / is never written. With a file --out, replace the image
    /// although another picchio process (run, verify, bench) is reading it: that reader keeps
    /// serving the old image from its open file (also for the default --out, MODEL_DIR's own
    /// image); a raw: device being read is written anyway.
    #[arg(long)]
    pub force: bool,
    /// Pack only the first N layers (a prefix store; later layers are served from safetensors).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Reader threads for reading a raw: image back after writing it.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub io_threads: usize,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Leave the superblock's reserved bytes zero instead of recording MODEL_DIR there (by default
    /// the image names the directory it was packed from, with a hash of its config.json, so
    /// `picchio --store URI` finds the model: docs/format.md, "Model record"). Without the record the
    /// image is byte for byte what Picchio (C)'s packer writes, and names no local path.
    #[arg(long)]
    pub no_model_record: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    if picchio_runtime::model::gguf::is_gguf(&a.model) {
        return exec_gguf(&a);
    }
    let record = match a.no_model_record {
        true => picchio_runtime::image::record::RecordModel::Nothing,
        false => picchio_runtime::image::record::RecordModel::Packed,
    };
    let opts = PackOptions { layers: a.layers, progress: !a.no_progress, record };
    // SIGINT/SIGTERM stop the write between payloads: a file's temporary file is removed, a device
    // is left without a valid superblock.
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    let out = match a.out.as_deref().map(write_target).transpose()? {
        None => a.model.join(DEFAULT_IMAGE),
        Some(StoreUri::File(path)) => path,
        Some(StoreUri::Raw { device, offset }) => return pack_raw(&a, &device, offset, opts),
        Some(StoreUri::Nvme { bdf, nsid }) => return pack_nvme(&a, &bdf, nsid, opts),
        Some(uri @ StoreUri::NvmeTcp { .. }) => return pack_device(&a, &uri, opts),
        Some(other) => unreachable!("write_target refuses {other}"),
    };
    let report = if a.force {
        // A file image another picchio process is reading is replaced anyway (it keeps its old bytes).
        let wopts = WriteOptions { force: true, ..WriteOptions::default() };
        pack_to(&a.model, WriteTo::Uri(&StoreUri::File(out)), &opts, &wopts, &mut |_| {})?
    } else {
        pack(&a.model, &out, &opts)?
    };
    // The summary is the command's result: stdout (logs, and progress, go to stderr).
    println!("{report}");
    Ok(())
}

fn pack_raw(a: &Args, device: &std::path::Path, offset: u64, pack: PackOptions) -> anyhow::Result<()> {
    pack_device(a, &StoreUri::Raw { device: device.into(), offset }, pack)
}

fn pack_nvme(a: &Args, bdf: &str, nsid: u32, pack: PackOptions) -> anyhow::Result<()> {
    pack_device(a, &StoreUri::Nvme { bdf: bdf.into(), nsid }, pack)
}

/// `--out raw:`, `nvme:` or `nvme-tcp:` through the image writer, which prints its plan before writing.
fn pack_device(a: &Args, uri: &StoreUri, pack: PackOptions) -> anyhow::Result<()> {
    let wopts = WriteOptions { force: a.force, io_threads: a.io_threads, ..WriteOptions::default() };
    let report = pack_to(&a.model, WriteTo::Uri(uri), &pack, &wopts, &mut |plan| eprintln!("{plan}"))?;
    println!("{report}");
    Ok(())
}

/// `picchio pack X.gguf`: the GGUF's expert bundle (`--no-model-record` does not apply: a bundle
/// records its GGUF).
fn exec_gguf(a: &Args) -> anyhow::Result<()> {
    use picchio_runtime::image::bundle::pack_gguf_to;
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    let uri = match a.out.as_deref().map(write_target).transpose()? {
        None => StoreUri::File(picchio_runtime::expert::store::default_image(&a.model, true)),
        Some(uri) => uri,
    };
    let wopts = WriteOptions { force: a.force, io_threads: a.io_threads, ..WriteOptions::default() };
    let report =
        pack_gguf_to(&a.model, WriteTo::Uri(&uri), a.layers, !a.no_progress, &wopts, &mut |plan| eprintln!("{plan}"))?;
    println!("{report}");
    Ok(())
}
