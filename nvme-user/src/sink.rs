//! [`NvmeSink`]: the image writer beside the reader ([`NvmeQueue`]): a
//! [`picchio_core::format::ImageSink`] that writes a `.picchioflat` image onto an NVMe namespace
//! from LBA 0 with NVM Write commands, and makes it durable with NVM Flush.
//!
//! Deciding whether the namespace may be overwritten (its first blocks' signatures) is not this
//! module's concern: the caller inspects the namespace before it opens the sink.

use std::io;
use std::path::{Path, PathBuf};

use picchio_core::format::ImageSink;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, Tag, BLOCK_SIZE};

use crate::ctrlr::Namespace;
use crate::engine::NvmeQueue;
use crate::request::{Requests, WriteReq};

/// A queue that can also write its namespace: the VFIO driver's [`NvmeQueue`] and the NVMe/TCP
/// initiator's [`crate::tcp::NvmeTcpQueue`]. What [`NvmeSink`] and the image writer need.
///
/// A namespace is written only through [`NvmWriteQueue::submit_write`] with a [`WriteReq`]:
/// [`IoQueue::submit`] takes a [`picchio_core::ReadReq`] and issues NVM Read commands only.
pub trait NvmWriteQueue: IoQueue {
    /// The namespace (NSID, LBA size, blocks).
    fn namespace(&self) -> Namespace;
    /// Submits an NVM Write of `req.len` bytes from `req.buf` to byte `req.offset`; it completes
    /// through [`IoQueue::reap`] like a read.
    fn submit_write(&mut self, req: WriteReq);
    /// Waits for every command in flight, then issues an NVM Flush and waits for it.
    ///
    /// # Errors
    /// The Flush's failure.
    fn flush(&mut self) -> io::Result<()>;
    /// NVMe commands and Flushes issued so far, for reports.
    fn command_counts(&self) -> (u64, u64);
    /// How messages describe the path to the namespace (e.g. `user-space driver, vfio-pci`).
    fn transport(&self) -> &'static str;
}

/// What an NVM Flush needs of a queue beyond [`IoQueue`]: its requests, which keep the Flush's
/// outcome and take held completions back, and how it queues the Flush command. The VFIO driver's
/// [`NvmeQueue`] and the NVMe/TCP initiator's [`crate::tcp::NvmeTcpQueue`] implement it;
/// [`flush_after_in_flight`] is the one flush procedure over both.
pub(crate) trait FlushSteps: IoQueue {
    /// The transport's part of each request.
    type Transport;
    /// The queue's requests: a Flush's outcome is recorded there, and held completions go back there
    /// ahead of any other, so that the next [`IoQueue::reap`] returns them.
    fn requests(&mut self) -> &mut Requests<Self::Transport>;
    /// Queues an NVM Flush (opcode 00h, NVM command set §3.2.2) of the namespace, with `buf` (4 KiB,
    /// no data moves) as its request buffer. Its outcome is recorded in [`FlushSteps::requests`]
    /// when the command completes, or at once when it cannot be issued.
    fn enqueue_flush(&mut self, buf: AlignedBuf);
}

/// Waits until every command submitted to `q` so far has completed, then issues an NVM Flush and
/// waits for it: data of the completed writes is then in non-volatile media (NVM command set
/// §3.2.2). The completions reaped while waiting stay queued for the caller's next
/// [`IoQueue::reap`], on every path.
///
/// # Errors
/// `OutOfMemory` when the Flush's 4 KiB request buffer cannot be allocated; otherwise the Flush's
/// own outcome (its error status, a timeout, the controller's or connection's failure). The failure
/// of a write still in flight is reported by that write's completion, not here.
pub(crate) fn flush_after_in_flight<Q: FlushSteps>(q: &mut Q) -> io::Result<()> {
    let mut held = Vec::new();
    // `reap` moves every ready completion into `held`, so afterwards `in_flight` counts only the
    // commands still at the device.
    while q.in_flight() > 0 {
        q.reap(1, &mut held);
    }
    let buf = match AlignedBuf::new(4096, 4096) {
        Ok(b) => b,
        Err(e) => {
            q.requests().hold_back(held);
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, picchio_core::error::chain(&e).to_string()));
        }
    };
    q.requests().clear_flush();
    q.enqueue_flush(buf);
    let outcome = loop {
        if let Some(outcome) = q.requests().take_flush() {
            break outcome.map(|_| ());
        }
        // Nothing else is in flight: this returns once the Flush has completed (or the queue gave
        // up on it), keeping any completion that arrives meanwhile.
        q.reap(1, &mut held);
    };
    q.requests().hold_back(held);
    outcome
}

impl NvmWriteQueue for NvmeQueue {
    fn namespace(&self) -> Namespace {
        NvmeQueue::namespace(self)
    }
    fn submit_write(&mut self, req: WriteReq) {
        NvmeQueue::submit_write(self, req)
    }
    fn flush(&mut self) -> io::Result<()> {
        NvmeQueue::flush(self)
    }
    fn command_counts(&self) -> (u64, u64) {
        let s = self.stats();
        (s.commands, s.flushes)
    }
    fn transport(&self) -> &'static str {
        "user-space driver, vfio-pci"
    }
}

impl NvmWriteQueue for crate::tcp::NvmeTcpQueue {
    fn namespace(&self) -> Namespace {
        crate::tcp::NvmeTcpQueue::namespace(self)
    }
    fn submit_write(&mut self, req: WriteReq) {
        crate::tcp::NvmeTcpQueue::submit_write(self, req)
    }
    fn flush(&mut self) -> io::Result<()> {
        crate::tcp::NvmeTcpQueue::flush(self)
    }
    fn command_counts(&self) -> (u64, u64) {
        let s = self.stats();
        (s.commands, s.flushes)
    }
    fn transport(&self) -> &'static str {
        "user-space NVMe/TCP initiator"
    }
}

/// Bytes per gathered write run.
const RUN: usize = 4 << 20;
/// Runs in flight at once.
const DEPTH: usize = 4;

/// Writes an image onto the namespace an [`NvmWriteQueue`] ([`NvmeQueue`], [`crate::tcp::NvmeTcpQueue`]) drives, from byte 0 (LBA 0).
///
/// Contiguous writes are gathered into 4 MiB runs (in [`BLOCK_SIZE`]-aligned buffers), each written
/// with [`NvmWriteQueue::submit_write`], up to 4 runs in flight; [`ImageSink::barrier`] submits the
/// current run, waits for every run and issues a Flush. A run must be a whole number of the
/// namespace's LBAs when it is submitted (the writer pads the image to [`BLOCK_SIZE`], which every
/// supported LBA size divides). Dropping the sink waits for the runs still in flight, so the queue
/// is free for other commands afterwards.
pub struct NvmeSink<'q, Q: NvmWriteQueue = NvmeQueue> {
    queue: &'q mut Q,
    dest: PathBuf,
    limit: u64,
    lba: usize,
    run: Option<AlignedBuf>,
    run_start: u64,
    run_len: usize,
    spare: Vec<AlignedBuf>,
    in_flight: usize,
    done: Vec<Completion>,
    failed: Option<io::Error>,
}

impl<'q, Q: NvmWriteQueue> NvmeSink<'q, Q> {
    /// A sink for an image of `limit` bytes at LBA 0 of `queue`'s namespace, named `name` (e.g.
    /// `nvme:0000:01:00.0/1`) in messages. Zeroes the first image block ([`BLOCK_SIZE`] bytes) and
    /// flushes before returning, so the old superblock (ours or a file system's) is gone before
    /// any other byte changes and an interrupted write leaves no valid-looking image.
    ///
    /// # Errors
    /// The failed Write or Flush of the first block (its [`io::ErrorKind`] from the engine).
    pub fn open(queue: &'q mut Q, name: &str, limit: u64) -> io::Result<NvmeSink<'q, Q>> {
        let lba = queue.block_size() as usize;
        let mut sink = NvmeSink {
            queue,
            dest: PathBuf::from(name),
            limit,
            lba,
            run: None,
            run_start: 0,
            run_len: 0,
            spare: Vec::new(),
            in_flight: 0,
            done: Vec::new(),
            failed: None,
        };
        sink.write_at(0, &vec![0u8; BLOCK_SIZE as usize])?;
        sink.barrier()?;
        Ok(sink)
    }

    fn buffer(&mut self) -> io::Result<AlignedBuf> {
        match self.spare.pop() {
            Some(b) => Ok(b),
            None => AlignedBuf::new(RUN, BLOCK_SIZE as usize)
                .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, picchio_core::error::chain(&e).to_string())),
        }
    }

    /// Reaps completions until at most `max_in_flight` runs are outstanding.
    fn drain_to(&mut self, max_in_flight: usize) -> io::Result<()> {
        while self.in_flight > max_in_flight {
            self.done.clear();
            self.queue.reap(1, &mut self.done);
            for c in self.done.drain(..) {
                self.in_flight -= 1;
                if let Err(e) = c.result {
                    let at = c.tag.0;
                    self.failed.get_or_insert(io::Error::new(
                        e.kind(),
                        format!("write at byte {at:#x}: {}", picchio_core::error::chain(&e)),
                    ));
                }
                self.spare.push(c.buf);
            }
        }
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Submits the gathered run.
    fn submit(&mut self) -> io::Result<()> {
        let Some(buf) = self.run.take() else { return Ok(()) };
        let len = self.run_len;
        self.run_len = 0;
        if !len.is_multiple_of(self.lba) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "write of {len} bytes at byte {:#x} is not a whole number of {}-byte LBAs",
                    self.run_start, self.lba
                ),
            ));
        }
        self.drain_to(DEPTH - 1)?;
        let at = self.run_start;
        self.queue.submit_write(WriteReq { offset: ByteOffset(at), len: len as u32, buf, tag: Tag(at) });
        self.in_flight += 1;
        self.run_start += len as u64;
        Ok(())
    }
}

impl<Q: NvmWriteQueue> ImageSink for NvmeSink<'_, Q> {
    fn dest(&self) -> &Path {
        &self.dest
    }

    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let end = offset.saturating_add(bytes.len() as u64);
        if end > self.limit {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("write of {} bytes at byte {offset:#x} past the image's {} bytes", bytes.len(), self.limit),
            ));
        }
        if self.run.is_some() && offset != self.run_start + self.run_len as u64 {
            self.submit()?;
        }
        let mut rest = bytes;
        let mut at = offset;
        while !rest.is_empty() {
            if self.run.is_none() {
                self.run = Some(self.buffer()?);
                self.run_start = at;
            }
            let take = rest.len().min(RUN - self.run_len);
            let run = self.run.as_mut().expect("set above");
            run.as_mut_slice()[self.run_len..self.run_len + take].copy_from_slice(&rest[..take]);
            self.run_len += take;
            rest = &rest[take..];
            at += take as u64;
            if self.run_len == RUN {
                self.submit()?;
            }
        }
        Ok(())
    }

    fn end_run(&mut self) -> io::Result<()> {
        self.submit()?;
        self.drain_to(0)
    }

    fn barrier(&mut self) -> io::Result<()> {
        self.end_run()?;
        self.queue.flush()
    }

    fn commit(&mut self, _len: u64) -> picchio_core::Result<()> {
        self.barrier().map_err(|cause| picchio_core::Error::Write {
            path: self.dest.clone(),
            what: "final writes and flush",
            cause,
        })
    }
}

impl<Q: NvmWriteQueue> Drop for NvmeSink<'_, Q> {
    fn drop(&mut self) {
        // Buffers in flight must come back before the queue is used for anything else.
        let _ = self.drain_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{fault::Fault, SimConfig};
    use crate::spec::Status;
    use crate::NvmeQueueOptions;
    use picchio_core::io::read_blocking;

    /// A writable sim namespace of `len` bytes filled with 0xEE, and its queue.
    fn sim_queue(dir: &Path, len: usize, lba: u32) -> (NvmeQueue, crate::sim::Sim) {
        let path = dir.join("ns1");
        std::fs::write(&path, vec![0xEEu8; len]).unwrap();
        let mut cfg = SimConfig::single(&path, lba);
        cfg.namespaces[0].writable = true;
        NvmeQueue::open_sim(cfg, &NvmeQueueOptions::default()).unwrap()
    }

    fn read(q: &mut NvmeQueue, off: u64, len: usize) -> Vec<u8> {
        read_blocking(q, off, len as u32).unwrap().as_slice()[..len].to_vec()
    }

    #[test]
    fn open_zeroes_the_first_block_then_writes_gather_into_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (mut q, _sim) = sim_queue(dir.path(), 16 << 20, 512);
        let limit = 12 << 20;
        let before = q.stats();
        let mut sink = NvmeSink::open(&mut q, "nvme:sim/1", limit).unwrap();
        assert_eq!(sink.dest(), Path::new("nvme:sim/1"));
        // Two contiguous pieces, a gap, then a piece longer than one run.
        sink.write_at(4096, &[1u8; 4096]).unwrap();
        sink.write_at(8192, &[2u8; 8192]).unwrap();
        let big: Vec<u8> = (0..(RUN + 8192)).map(|i| (i % 251) as u8).collect();
        sink.write_at(1 << 20, &big).unwrap();
        sink.barrier().unwrap();
        sink.write_at(0, &[9u8; 4096]).unwrap();
        sink.commit(limit).unwrap();
        drop(sink);
        let after = q.stats();
        // First block zeroed + flushed, then runs; flushes: open, barrier, commit.
        assert_eq!(after.flushes - before.flushes, 3);
        assert_eq!(read(&mut q, 0, 4096), vec![9u8; 4096]);
        assert_eq!(read(&mut q, 4096, 4096), vec![1u8; 4096]);
        assert_eq!(read(&mut q, 8192, 8192), vec![2u8; 8192]);
        assert_eq!(read(&mut q, 16384, 4096), vec![0xEE; 4096], "the gap is untouched");
        assert_eq!(read(&mut q, 1 << 20, big.len()), big);
    }

    #[test]
    fn an_interrupted_write_leaves_the_first_block_zeroed() {
        let dir = tempfile::tempdir().unwrap();
        let (mut q, _sim) = sim_queue(dir.path(), 1 << 20, 4096);
        let sink = NvmeSink::open(&mut q, "nvme:sim/1", 1 << 20).unwrap();
        drop(sink);
        assert_eq!(read(&mut q, 0, BLOCK_SIZE as usize), vec![0u8; BLOCK_SIZE as usize]);
        assert_eq!(read(&mut q, u64::from(BLOCK_SIZE), 4096), vec![0xEE; 4096]);
    }

    #[test]
    fn writes_past_the_limit_and_partial_lbas_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut q, _sim) = sim_queue(dir.path(), 1 << 20, 4096);
        let mut sink = NvmeSink::open(&mut q, "nvme:sim/1", 64 << 10).unwrap();
        let e = sink.write_at(60 << 10, &[0u8; 8192]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(e.to_string(), "write of 8192 bytes at byte 0xf000 past the image's 65536 bytes");
        sink.write_at(8192, &[1u8; 100]).unwrap();
        let e = sink.barrier().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(e.to_string(), "write of 100 bytes at byte 0x2000 is not a whole number of 4096-byte LBAs");
    }

    #[test]
    fn a_failed_write_names_its_byte_offset_and_commit_names_the_step() {
        let dir = tempfile::tempdir().unwrap();
        let (mut q, sim) = sim_queue(dir.path(), 1 << 20, 512);
        let mut sink = NvmeSink::open(&mut q, "nvme:sim/1", 1 << 20).unwrap();
        sim.inject(Fault::io_status(sim.io_count() + 1, Status::INVALID_FIELD));
        sink.write_at(0x10000, &[3u8; 4096]).unwrap();
        let e = sink.commit(1 << 20).unwrap_err();
        let picchio_core::Error::Write { path, what, cause } = &e else { panic!("{e:?}") };
        assert_eq!((path.as_path(), *what), (Path::new("nvme:sim/1"), "final writes and flush"));
        assert!(cause.to_string().starts_with("write at byte 0x10000: "), "{cause}");
    }
}
