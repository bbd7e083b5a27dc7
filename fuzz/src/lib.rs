//! Helpers shared by the fuzz targets: an in-memory [`IoQueue`] (the image targets read through the
//! same `IoQueue` interface as every engine) and a per-process scratch directory (the safetensors and
//! config targets go through the real directory loaders).

use std::path::Path;
use std::sync::OnceLock;

use picchio_core::io::{ByteOffset, Completion, IoQueue, ReadReq};

/// A queue over bytes in memory: a read inside them completes with the bytes, one running past
/// the end completes with `UnexpectedEof` (as a block device or a file read with O_DIRECT does).
pub struct MemQueue<'a> {
    bytes: &'a [u8],
    done: Vec<Completion>,
}

impl<'a> MemQueue<'a> {
    /// A queue reading `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        MemQueue { bytes, done: Vec::new() }
    }
}

impl IoQueue for MemQueue<'_> {
    fn block_size(&self) -> u32 {
        4096
    }
    fn submit(&mut self, mut req: ReadReq) {
        let ByteOffset(at) = req.offset;
        let end = at.checked_add(u64::from(req.len));
        let result = match end {
            Some(end) if end <= self.bytes.len() as u64 && req.len as usize <= req.buf.len() => {
                req.buf.as_mut_slice()[..req.len as usize].copy_from_slice(&self.bytes[at as usize..end as usize]);
                Ok(req.len)
            }
            _ => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the end")),
        };
        self.done.push(Completion { tag: req.tag, buf: req.buf, result, latency_ns: 0 });
    }
    fn reap(&mut self, _min: usize, out: &mut Vec<Completion>) -> usize {
        let n = self.done.len();
        out.append(&mut self.done);
        n
    }
    fn in_flight(&self) -> usize {
        self.done.len()
    }
    fn describe(&self) -> String {
        "mem".into()
    }
}

/// A directory private to this process, removed when it exits normally (libFuzzer's `-runs` and
/// `-max_total_time` exits run the destructors of statics only partly: the directory lives in the
/// system temporary directory, named `picchio-fuzz-*`).
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::Builder::new().prefix("picchio-fuzz-").tempdir().expect("scratch dir")).path()
}

/// Writes `bytes` to `dir/name`, replacing the file.
pub fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).expect("write scratch file");
}
