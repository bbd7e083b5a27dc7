//! [`null_queue`]: an [`IoQueue`](picchio_core::IoQueue) that completes every read at once without reading anything.
//!
//! It is **not a storage engine** and never serves a store: it exists so `picchio bench overhead`
//! can show what the `IoQueue` contract itself costs per read — a call through `Box<dyn IoQueue>`,
//! moving the request (with its buffer) in and the completion (with the buffer) out, and the
//! bookkeeping of `in_flight` — below which no engine can go.

use picchio_core::{InstantQueue, ReadReq};

/// A queue that completes each submitted read immediately with `Ok(len)`, leaving the buffer
/// untouched.
pub fn null_queue() -> InstantQueue<impl FnMut(&mut ReadReq) -> std::io::Result<u32> + Send> {
    InstantQueue::new(512, "null (completes instantly, reads nothing)", |req: &mut ReadReq| Ok(req.len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::{AlignedBuf, ByteOffset, IoQueue, Tag};

    #[test]
    fn every_buffer_comes_back_once_with_its_tag() {
        let mut q = null_queue();
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
