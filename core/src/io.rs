//! [`IoQueue`]: the block-read interface every engine implements (psync, io_uring, user-space NVMe).

use crate::buf::AlignedBuf;

/// A byte offset from the start of a device or file (never an LBA: engines convert).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteOffset(pub u64);

/// Caller-chosen identifier carried from a [`ReadReq`] to its [`Completion`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag(pub u64);

/// One read: `len` bytes at `offset` into the start of `buf`.
///
/// `offset`, `len` and the buffer address must be multiples of [`IoQueue::block_size`], and
/// `len <= buf.len()`. The buffer moves into the engine and comes back in the [`Completion`].
#[derive(Debug)]
pub struct ReadReq {
    /// Where to read, in bytes from the start of the target.
    pub offset: ByteOffset,
    /// Bytes to read.
    pub len: u32,
    /// Destination; returned in the completion.
    pub buf: AlignedBuf,
    /// Identifier returned in the completion.
    pub tag: Tag,
}

/// The outcome of one [`ReadReq`].
#[derive(Debug)]
pub struct Completion {
    /// The request's tag.
    pub tag: Tag,
    /// The request's buffer, now holding the bytes read.
    pub buf: AlignedBuf,
    /// Bytes read (a short count is reported as-is; the caller decides), or the I/O error.
    pub result: std::io::Result<u32>,
    /// Wall time from submission to completion, in nanoseconds.
    pub latency_ns: u64,
}

/// A queue of block-aligned reads on one target, completed in any order.
///
/// Consumer operations only: opening, probing and sizing stay on each engine's own type.
/// A request the engine cannot perform (misaligned, out of range) completes with an error rather
/// than failing `submit`, so every submitted buffer comes back exactly once.
pub trait IoQueue: Send {
    /// Required alignment in bytes of offsets, lengths and buffer addresses.
    fn block_size(&self) -> u32;

    /// Submits one read. Never blocks for I/O; may block briefly to hand the request over.
    fn submit(&mut self, req: ReadReq);

    /// Waits until at least `min` completions are available (or nothing is in flight), appends all
    /// available ones to `out`, and returns how many were appended.
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize;

    /// Reads submitted and not yet reaped.
    fn in_flight(&self) -> usize;

    /// A short description for logs and `--json` stats, e.g. `psync(direct, 2 threads)`.
    fn describe(&self) -> String;

    /// Memory for `count` long-lived buffers of `len` bytes each (an expert cache's slots) that reads
    /// on this queue reach **without a copy**, when the engine has such memory: the user-space NVMe
    /// driver reserves `count × len` bytes of its hugepage DMA pool and lends slots from it. Called
    /// once, before the buffers are needed.
    ///
    /// `None` (the default, and the answer of every kernel engine): allocate the buffers on the heap
    /// with [`AlignedBuf::new`], which O_DIRECT, io_uring and IOCP read into directly anyway.
    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        let _ = (count, len);
        None
    }

    /// Bytes this queue has copied between its own buffers and request buffers so far (a bounce
    /// buffer: the NVMe driver reading into memory the device cannot reach). 0 for engines that read
    /// straight into the request's buffer (the default).
    fn bounce_bytes(&self) -> u64 {
        0
    }
}

/// Hands out buffers from memory an engine reads into without a copy (see
/// [`IoQueue::slot_allocator`]); each buffer returns to it when dropped.
pub trait SlotAllocator: Send {
    /// A zeroed buffer of at least `len` bytes, aligned to at least 4096 bytes.
    ///
    /// # Errors
    /// [`crate::Error::Alloc`] when the reserved memory is used up or `len` exceeds the slot size
    /// the allocator was made for (the caller then allocates on the heap).
    fn alloc(&mut self, len: usize) -> crate::Result<AlignedBuf>;

    /// What the memory is, for logs, e.g. `nvme DMA pool: 48 slots of 2654208 B in 61 × 2 MiB hugepages`.
    fn describe(&self) -> String;
}

impl<Q: IoQueue + ?Sized> IoQueue for Box<Q> {
    fn block_size(&self) -> u32 {
        (**self).block_size()
    }
    fn submit(&mut self, req: ReadReq) {
        (**self).submit(req)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        (**self).reap(min, out)
    }
    fn in_flight(&self) -> usize {
        (**self).in_flight()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        (**self).slot_allocator(count, len)
    }
    fn bounce_bytes(&self) -> u64 {
        (**self).bounce_bytes()
    }
}

/// An [`IoQueue`] that performs each read inside `submit` through `read`, so every read has
/// completed when `submit` returns and `reap` only hands the completions out: an image in memory
/// (fuzzing, tests, with [`read_from_memory`]), or no read at all (the floor `picchio bench
/// overhead` measures). The completions come out in submission order with `latency_ns` 0.
pub struct InstantQueue<F> {
    read: F,
    block_size: u32,
    describe: &'static str,
    done: Vec<Completion>,
}

impl<F: FnMut(&mut ReadReq) -> std::io::Result<u32> + Send> InstantQueue<F> {
    /// A queue of `block_size`-byte blocks, described as `describe`, whose reads `read` performs:
    /// it fills the request's buffer and returns the bytes read, or the error the read completes with.
    pub fn new(block_size: u32, describe: &'static str, read: F) -> Self {
        InstantQueue { read, block_size, describe, done: Vec::new() }
    }
}

impl<F> std::fmt::Debug for InstantQueue<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstantQueue")
            .field("block_size", &self.block_size)
            .field("describe", &self.describe)
            .field("done", &self.done.len())
            .finish()
    }
}

impl<F: FnMut(&mut ReadReq) -> std::io::Result<u32> + Send> IoQueue for InstantQueue<F> {
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn submit(&mut self, mut req: ReadReq) {
        let result = (self.read)(&mut req);
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
        self.describe.into()
    }
}

/// Performs `req` on a target holding `bytes` (an [`InstantQueue`]'s `read` over memory): copies
/// the bytes into the request's buffer when the read lies inside them.
///
/// # Errors
/// `UnexpectedEof` when the read runs past the end of `bytes` (as a block device or a file read
/// with O_DIRECT does) or past the end of the request's buffer.
pub fn read_from_memory(bytes: &[u8], req: &mut ReadReq) -> std::io::Result<u32> {
    let ByteOffset(at) = req.offset;
    match at.checked_add(u64::from(req.len)) {
        Some(end) if end <= bytes.len() as u64 && req.len as usize <= req.buf.len() => {
            req.buf.as_mut_slice()[..req.len as usize].copy_from_slice(&bytes[at as usize..end as usize]);
            Ok(req.len)
        }
        _ => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the end")),
    }
}

/// Reads `len` bytes at `offset` synchronously through `queue` (used at open for the superblock and
/// index). Must be called with nothing else in flight.
///
/// # Errors
/// The I/O error, or `UnexpectedEof` on a short read.
pub fn read_blocking<Q: IoQueue + ?Sized>(queue: &mut Q, offset: u64, len: u32) -> std::io::Result<AlignedBuf> {
    let bs = queue.block_size() as usize;
    let buf = AlignedBuf::new(len as usize, bs.max(512))
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, crate::error::chain(&e).to_string()))?;
    queue.submit(ReadReq { offset: ByteOffset(offset), len, buf, tag: Tag(u64::MAX) });
    let mut out = Vec::with_capacity(1);
    while out.is_empty() {
        queue.reap(1, &mut out);
    }
    let c = out.pop().expect("one completion");
    match c.result {
        Ok(n) if n == len => Ok(c.buf),
        Ok(n) => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("short read: {n} of {len} bytes"))),
        Err(e) => Err(e),
    }
}
