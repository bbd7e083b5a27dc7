//! [`NullQueue`]: an [`IoQueue`] that completes every read at once without reading anything.
//!
//! It is **not a storage engine** and never serves a store: it exists so `picchio bench overhead`
//! can show what the `IoQueue` contract itself costs per read — a call through `Box<dyn IoQueue>`,
//! moving the request (with its buffer) in and the completion (with the buffer) out, and the
//! bookkeeping of `in_flight` — below which no engine can go.

use picchio_core::{Completion, IoQueue, ReadReq};

/// Completes each submitted read immediately with `Ok(len)`, leaving the buffer untouched.
#[derive(Debug, Default)]
pub struct NullQueue {
    done: Vec<Completion>,
}

impl NullQueue {
    /// An empty queue.
    pub fn new() -> Self {
        NullQueue::default()
    }
}

impl IoQueue for NullQueue {
    fn block_size(&self) -> u32 {
        512
    }

    fn submit(&mut self, req: ReadReq) {
        self.done.push(Completion { tag: req.tag, buf: req.buf, result: Ok(req.len), latency_ns: 0 });
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
        "null (completes instantly, reads nothing)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::{AlignedBuf, ByteOffset, Tag};

    #[test]
    fn every_buffer_comes_back_once_with_its_tag() {
        let mut q = NullQueue::new();
        for i in 0..3 {
            let buf = AlignedBuf::new(4096, 4096).unwrap();
            q.submit(ReadReq { offset: ByteOffset(i * 4096), len: 4096, buf, tag: Tag(i) });
        }
        assert_eq!(q.in_flight(), 3);
        let mut out = Vec::new();
        assert_eq!(q.reap(1, &mut out), 3);
        assert_eq!(q.in_flight(), 0);
        assert_eq!(out.iter().map(|c| c.tag.0).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(out.iter().all(|c| matches!(c.result, Ok(4096)) && c.buf.len() == 4096));
    }
}
