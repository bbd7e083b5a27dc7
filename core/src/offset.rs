//! [`OffsetQueue`]: an image that starts at byte `base` of its target (`raw:/dev/X@BYTES`, an
//! NVMe namespace at an offset) seen from its first byte, over any engine. Engine-independent, so
//! it lives here beside [`IoQueue`].

use crate::io::{ByteOffset, Completion, IoQueue, ReadReq};

/// Any [`IoQueue`] seen from an image's first byte at `base` on its target: a read at image offset
/// `o` goes to `base + o`. Completions are passed through untouched (they carry no offset).
#[derive(Debug)]
pub struct OffsetQueue<Q> {
    inner: Q,
    base: ByteOffset,
}

impl<Q: IoQueue> OffsetQueue<Q> {
    /// Wraps `inner`; `base` should be a multiple of `inner.block_size()` (else every read completes
    /// with the engine's misalignment error).
    pub fn new(inner: Q, base: ByteOffset) -> Self {
        OffsetQueue { inner, base }
    }

    /// The offset added to every read.
    pub fn base(&self) -> ByteOffset {
        self.base
    }

    /// The wrapped queue.
    pub fn inner(&self) -> &Q {
        &self.inner
    }

    /// Unwraps the queue.
    pub fn into_inner(self) -> Q {
        self.inner
    }
}

impl<Q: IoQueue> IoQueue for OffsetQueue<Q> {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn submit(&mut self, mut req: ReadReq) {
        // An overflowing offset becomes one the engine refuses as past the end.
        req.offset = ByteOffset(self.base.0.saturating_add(req.offset.0));
        self.inner.submit(req)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        self.inner.reap(min, out)
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{read_blocking, Tag};

    /// A queue over bytes in memory that records the offsets it was asked for.
    #[derive(Debug)]
    struct Mem {
        bytes: Vec<u8>,
        done: Vec<Completion>,
        asked: Vec<u64>,
    }

    impl IoQueue for Mem {
        fn block_size(&self) -> u32 {
            512
        }
        fn submit(&mut self, mut req: ReadReq) {
            let at = req.offset.0;
            self.asked.push(at);
            let end = at.saturating_add(u64::from(req.len));
            let result = if end <= self.bytes.len() as u64 {
                req.buf.as_mut_slice()[..req.len as usize].copy_from_slice(&self.bytes[at as usize..end as usize]);
                Ok(req.len)
            } else {
                Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the end"))
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

    #[test]
    fn reads_land_at_base_plus_offset_and_overflow_saturates() {
        let bytes: Vec<u8> = (0..16384u32).map(|i| (i % 253) as u8).collect();
        let mem = Mem { bytes: bytes.clone(), done: Vec::new(), asked: Vec::new() };
        let mut q = OffsetQueue::new(mem, ByteOffset(4096));
        assert_eq!((q.base(), q.block_size(), q.describe()), (ByteOffset(4096), 512, "mem".to_string()));
        let b = read_blocking(&mut q, 4096, 4096).unwrap();
        assert!(b.as_slice()[..4096] == bytes[8192..12288]);
        assert!(read_blocking(&mut q, 12288, 512).is_err(), "past the end of the target");
        let buf = crate::AlignedBuf::new(512, 512).unwrap();
        q.submit(ReadReq { offset: ByteOffset(u64::MAX), len: 512, buf, tag: Tag(9) });
        let mut out = Vec::new();
        assert_eq!((q.reap(1, &mut out), q.in_flight()), (1, 0));
        assert!(out[0].result.is_err() && out[0].tag == Tag(9));
        assert_eq!(q.inner().asked, [8192, 16384, u64::MAX], "base added, saturating");
        assert_eq!(q.into_inner().bytes.len(), 16384);
    }
}
