//! The I/O worker of an overlapped decode step: one thread that owns the [`ExpertLoader`] for the
//! length of a forward pass and runs its (blocking) `load` calls, so the forward pass can submit
//! reads and keep computing while they are in flight (`ExpertCache::fetch_overlapped`).
//!
//! The forward pass sends *jobs* (one layer's experts, each with the cache slot to read into) and
//! receives [`IoMsg`]s: every delivered slot as [`IoMsg::Loaded`], in completion order, then one
//! [`IoMsg::JobEnd`] per job, in job order. A slot of the job that did not come back before its
//! `JobEnd` was kept by the loader (a contract violation the cache reports). Jobs run one after
//! another, in the order they were sent: a speculative prefetch sent after a layer's misses never
//! delays them, but the next layer's misses wait behind it (a wrong guess is read in full before
//! them).
//!
//! The thread is scoped ([`with_io_worker`]): it borrows the loader, and it ends, after the jobs
//! sent so far, when the forward pass returns. The worker only submits and reaps: every expert is
//! computed on the forward pass's thread, in whatever order the reads complete, and summed in
//! canonical order there (DESIGN.md, "Determinism").

use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Instant;

use picchio_core::{AlignedBuf, ExpertLoader, Loaded};

/// What the worker sends back.
#[derive(Debug)]
pub enum IoMsg {
    /// One slot back from the loader ([`ExpertLoader::load`]'s `ready`).
    Loaded(Loaded),
    /// Job `job` (its number from [`IoWorker::submit`]) is over: the loader's `load` returned.
    JobEnd {
        /// The job's number.
        job: u64,
    },
}

/// One layer's reads, sent to the worker.
struct Job {
    /// Number, from 0 per worker.
    id: u64,
    /// Decoder layer.
    layer: u32,
    /// `(expert id, slot)` pairs, as [`ExpertLoader::load`] takes them.
    requests: Vec<(u32, AlignedBuf)>,
}

/// The forward pass's end of the worker; see the module documentation.
pub struct IoWorker {
    jobs: Option<Sender<Job>>,
    done: Receiver<IoMsg>,
    /// Jobs sent whose [`IoMsg::JobEnd`] has not been received.
    open_jobs: usize,
    next_job: u64,
    /// Nanoseconds spent blocked in [`IoWorker::recv`] (exposed I/O wait).
    waited_ns: u64,
    describe: String,
}

impl IoWorker {
    /// Sends a job of `requests` (expert id, slot) of `layer` to the worker and returns its number.
    /// An empty job is not sent (and gets no `JobEnd`); it returns `None`.
    pub fn submit(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>) -> Option<u64> {
        if requests.is_empty() {
            return None;
        }
        let id = self.next_job;
        self.next_job += 1;
        let jobs = self.jobs.as_ref().expect("the worker's job channel is open while the forward pass runs");
        // The worker only stops when this end is dropped, so a failed send means it panicked: the
        // loader's panic is re-raised when the scope joins it. Until then, the job's slots are lost,
        // which the `JobEnd` that never comes would not tell: report the job as over instead.
        match jobs.send(Job { id, layer, requests }) {
            Ok(()) => self.open_jobs += 1,
            Err(_) => tracing::error!("the expert I/O worker has stopped (it panicked); job {id} is lost"),
        }
        Some(id)
    }

    /// The number the next [`IoWorker::submit`] will give its job.
    pub fn next_job(&self) -> u64 {
        self.next_job
    }

    /// Jobs sent and not yet over.
    pub fn open_jobs(&self) -> usize {
        self.open_jobs
    }

    /// The next message, blocking until there is one; `None` when no job is open (nothing can come)
    /// or the worker has stopped. The time blocked is added to [`IoWorker::waited_ns`].
    pub fn recv(&mut self) -> Option<IoMsg> {
        if self.open_jobs == 0 {
            return None;
        }
        let t = Instant::now();
        let msg = self.done.recv().ok();
        self.waited_ns += t.elapsed().as_nanos() as u64;
        match &msg {
            Some(IoMsg::JobEnd { .. }) => self.open_jobs -= 1,
            Some(IoMsg::Loaded(_)) => {}
            None => self.open_jobs = 0,
        }
        msg
    }

    /// Nanoseconds the forward pass has spent blocked in [`IoWorker::recv`].
    pub fn waited_ns(&self) -> u64 {
        self.waited_ns
    }

    /// The loader's description.
    pub fn describe(&self) -> &str {
        &self.describe
    }
}

/// Runs `f` with an [`IoWorker`] whose thread owns `loader` until `f` returns; the thread finishes
/// the jobs already sent (their messages are dropped unless `f` received them, so `f` must receive
/// every job's [`IoMsg::JobEnd`] before returning to get its slots back: `ExpertCache::settle`).
///
/// # Errors
/// The OS error when the thread cannot be started (e.g. `EAGAIN` at a process or pids limit); `f`
/// has not run then.
///
/// # Panics
/// Re-raises a panic of the loader on the worker thread.
pub fn with_io_worker<R>(loader: &mut dyn ExpertLoader, f: impl FnOnce(&mut IoWorker) -> R) -> std::io::Result<R> {
    let describe = loader.describe();
    std::thread::scope(|scope| {
        let (job_tx, job_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<IoMsg>();
        std::thread::Builder::new().name("picchio-io".into()).spawn_scoped(scope, move || {
            for job in job_rx {
                // A send fails only once the forward pass has dropped its end: nothing to do.
                loader.load(job.layer, job.requests, &mut |l| {
                    let _ = done_tx.send(IoMsg::Loaded(l));
                });
                let _ = done_tx.send(IoMsg::JobEnd { job: job.id });
            }
        })?;
        let mut worker =
            IoWorker { jobs: Some(job_tx), done: done_rx, open_jobs: 0, next_job: 0, waited_ns: 0, describe };
        let r = f(&mut worker);
        // Closing the job channel ends the worker's loop once it has finished the jobs sent.
        worker.jobs = None;
        Ok(r)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::ExpertKey;

    /// A mock loader: fills each slot's first byte with the expert id, in reverse request order.
    struct Mock;

    impl ExpertLoader for Mock {
        fn describe(&self) -> String {
            "mock".into()
        }
        fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
            for (expert, mut buf) in requests.into_iter().rev() {
                buf.as_mut_slice()[0] = expert as u8;
                ready(Loaded { key: ExpertKey { layer, expert }, buf, result: Ok(()) });
            }
        }
    }

    #[test]
    fn jobs_come_back_in_order_each_ended() {
        let mut loader = Mock;
        let got = with_io_worker(&mut loader, |w| {
            assert!(w.recv().is_none(), "nothing open: recv does not block");
            let bufs = |ids: &[u32]| ids.iter().map(|&e| (e, AlignedBuf::new(4096, 4096).unwrap())).collect();
            assert_eq!(w.submit(3, bufs(&[1, 2])), Some(0));
            assert_eq!(w.submit(4, Vec::new()), None);
            assert_eq!(w.submit(5, bufs(&[7])), Some(1));
            let mut got = Vec::new();
            while let Some(m) = w.recv() {
                got.push(match m {
                    IoMsg::Loaded(l) => format!("{}:{}:{}", l.key.layer, l.key.expert, l.buf.as_slice()[0]),
                    IoMsg::JobEnd { job } => format!("end {job}"),
                });
            }
            assert_eq!(w.open_jobs(), 0);
            assert_eq!(w.describe(), "mock");
            got
        })
        .unwrap();
        assert_eq!(got, ["3:2:2", "3:1:1", "end 0", "5:7:7", "end 1"]);
    }
}
