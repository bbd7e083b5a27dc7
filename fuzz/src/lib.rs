//! Helpers shared by the fuzz targets: an in-memory [`IoQueue`](picchio_core::IoQueue) (the image
//! targets read through the same `IoQueue` interface as every engine) and a per-process scratch
//! directory (the safetensors and config targets go through the real directory loaders).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use picchio_core::io::{read_from_memory, InstantQueue, ReadReq};

/// A queue over `bytes` (block size 4096): a read inside them completes with the bytes, one running
/// past the end completes with `UnexpectedEof` (as a block device or a file read with O_DIRECT does).
pub fn mem_queue(bytes: &[u8]) -> InstantQueue<impl FnMut(&mut ReadReq) -> std::io::Result<u32> + Send + '_> {
    InstantQueue::new(4096, "mem", move |req: &mut ReadReq| read_from_memory(bytes, req))
}

/// A directory private to this process, removed when it exits normally (libFuzzer's `-runs` and
/// `-max_total_time` exits run the destructors of statics only partly: the directory lives in the
/// system temporary directory, named `picchio-fuzz-*`).
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::Builder::new().prefix("picchio-fuzz-").tempdir().expect("scratch dir")).path()
}

/// The scratch subdirectory `sub` (created when missing) holding `bytes` as its file `name` (a
/// model directory of one file, for the loaders that read a directory).
pub fn scratch_with(sub: &str, name: &str, bytes: &[u8]) -> PathBuf {
    let dir = scratch_dir().join(sub);
    std::fs::create_dir_all(&dir).expect("scratch");
    put(&dir, name, bytes);
    dir
}

/// Writes `bytes` to `dir/name`, replacing the file.
pub fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).expect("write scratch file");
}
