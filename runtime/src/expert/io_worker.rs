//! The I/O thread of overlapped decode steps: one long-lived thread ([`IoThread`], started once per
//! model, so once per [`crate::run::Session`]) that runs the (blocking) [`ExpertLoader::load`]
//! calls of a forward pass, so the pass can submit reads and keep computing while they are in
//! flight (`ExpertCache::fetch_overlapped`). A decode step starts no thread and creates no
//! channel: [`IoThread::lend`] lends the step's loader to the thread for the length of the pass and
//! takes it back before returning.
//!
//! The forward pass sends *jobs* (one layer's experts, each with the cache slot to read into)
//! through its [`IoWorker`] and receives [`IoMsg`]s: every delivered slot as [`IoMsg::Loaded`], in
//! completion order, then one [`IoMsg::JobEnd`] per job, in job order. A slot of the job that did
//! not come back before its `JobEnd` was kept by the loader (a contract violation the cache
//! reports). Jobs run one after another, in the order they were sent: a speculative prefetch sent
//! after a layer's misses never delays them, but the next layer's misses wait behind it (a wrong
//! guess is read in full before them).
//!
//! The thread only submits and reaps: every expert is computed on the forward pass's thread, in
//! whatever order the reads complete, and summed in canonical order there (DESIGN.md,
//! "Determinism"). A panic of the loader on the thread is caught there, ends the pass's jobs (the
//! forward pass sees the worker stop) and is raised again on the forward pass's thread when the
//! loan ends; the thread itself goes on serving later passes.
//!
//! The one `unsafe` of this module erases the lifetime of the lent `&mut dyn ExpertLoader` so the
//! long-lived thread can hold it: the loan ends (the thread has answered `Return`, or is gone)
//! before [`IoThread::lend`] returns or unwinds, which is what [`std::thread::scope`]
//! guarantees of its threads, here for a thread that outlives many loans.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Number, from 0 per loan.
    id: u64,
    /// Decoder layer.
    layer: u32,
    /// `(expert id, slot)` pairs, as [`ExpertLoader::load`] takes them.
    requests: Vec<(u32, AlignedBuf)>,
}

/// The lent loader, as the thread holds it between [`Cmd::Lend`] and [`Cmd::Return`].
struct Lent(*mut (dyn ExpertLoader + 'static));

// SAFETY: `ExpertLoader: Send`, so the `&mut dyn ExpertLoader` this pointer stands for may be used
// from another thread; the lender does not touch the loader while it is lent (`IoThread::lend`
// takes the only `&mut` for the length of the loan and hands `f` only the worker).
unsafe impl Send for Lent {}

/// What the forward pass's thread tells the I/O thread.
enum Cmd {
    /// Serve the next jobs with this loader; replies carry the loan's number.
    Lend(Lent, u64),
    /// Load one job with the lent loader.
    Job(Job),
    /// Answer the lent loader's [`ExpertLoader::describe`] (error messages only).
    Describe,
    /// Give the loader back: no job after this uses it. Answered on the `returned` channel with the
    /// loader's panic, if it panicked during the loan.
    Return,
}

/// What the I/O thread answers about a job, with the number of the loan it belongs to (a message
/// of an earlier loan that nobody received is skipped).
enum Reply {
    /// A message of a job.
    Msg(u64, IoMsg),
    /// The loader panicked in a job; the later jobs of the loan are dropped unread.
    Stopped(u64),
}

/// A loader panic, handed back when the loan ends.
type Panic = Box<dyn Any + Send>;

/// Threads [`IoThread::start`] has started in this process (the one place the decode path starts a
/// thread), for the test that checks a decode step starts none.
static THREADS_STARTED: AtomicU64 = AtomicU64::new(0);

/// How many I/O threads [`IoThread::start`] has started in this process so far.
pub fn threads_started() -> u64 {
    THREADS_STARTED.load(Ordering::Relaxed)
}

/// The long-lived I/O thread and its channels, created once ([`IoThread::start`]) and reused by
/// every loan ([`IoThread::lend`]). Dropping it ends the thread (after the jobs sent) and joins it.
pub struct IoThread {
    cmds: Sender<Cmd>,
    replies: Receiver<Reply>,
    described: Receiver<String>,
    returned: Receiver<Option<Panic>>,
    /// The number of the last loan.
    loan: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IoThread {
    /// Starts the thread (`picchio-io`).
    ///
    /// # Errors
    /// The OS error when the thread cannot be started (e.g. `EAGAIN` at a process or pids limit).
    pub fn start() -> std::io::Result<IoThread> {
        let (cmds, cmd_rx) = channel::<Cmd>();
        let (reply_tx, replies) = channel::<Reply>();
        let (describe_tx, described) = channel::<String>();
        let (return_tx, returned) = channel::<Option<Panic>>();
        let thread = std::thread::Builder::new()
            .name("picchio-io".into())
            .spawn(move || serve(cmd_rx, reply_tx, describe_tx, return_tx))?;
        THREADS_STARTED.fetch_add(1, Ordering::Relaxed);
        Ok(IoThread { cmds, replies, described, returned, loan: 0, thread: Some(thread) })
    }

    /// Runs `f` with an [`IoWorker`] whose jobs this thread loads with `loader`, lent to the thread
    /// until `f` returns; then waits for the thread to finish the jobs already sent and give the
    /// loader back (their messages are dropped unless `f` received them, so `f` must receive every
    /// job's [`IoMsg::JobEnd`] before returning to get its slots back: `ExpertCache::settle`).
    ///
    /// # Panics
    /// Raises a panic of the loader on the thread again here, after the loan has ended.
    pub fn lend<R>(&mut self, loader: &mut dyn ExpertLoader, f: impl FnOnce(&mut IoWorker<'_>) -> R) -> R {
        let ptr: *mut (dyn ExpertLoader + '_) = loader;
        // SAFETY: this only widens the trait object's lifetime bound; the pointer stays valid for
        // as long as the thread uses it: the thread dereferences it only between `Lend` and
        // `Return`, and `loan` below (dropped on return and on unwinding alike; `f` cannot reach
        // it) does not let this function end before the thread has answered `Return` or is gone.
        // Meanwhile `loader` is not used here (its `&mut` is held by this call).
        let ptr =
            unsafe { std::mem::transmute::<*mut (dyn ExpertLoader + '_), *mut (dyn ExpertLoader + 'static)>(ptr) };
        self.loan += 1;
        let stopped = self.cmds.send(Cmd::Lend(Lent(ptr), self.loan)).is_err();
        let mut loan = Loan { cmds: &self.cmds, returned: &self.returned, over: false };
        let mut worker = IoWorker {
            cmds: &self.cmds,
            replies: &mut self.replies,
            described: &mut self.described,
            loan: self.loan,
            open_jobs: 0,
            next_job: 0,
            waited_ns: 0,
            stopped,
        };
        let r = f(&mut worker);
        if let Some(panic) = loan.end() {
            resume_unwind(panic);
        }
        r
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        // Closing the command channel ends the thread's loop once it has finished what was sent.
        let (closed, _) = channel();
        drop(std::mem::replace(&mut self.cmds, closed));
        if let Some(t) = self.thread.take() {
            // The thread catches the loader's panics; a panic elsewhere is already reported.
            let _ = t.join();
        }
    }
}

/// The I/O thread's loop. A send fails only once the forward pass's end is gone (the `IoThread`
/// dropped, or a reply the worker no longer waits for): nothing to do then.
fn serve(cmds: Receiver<Cmd>, replies: Sender<Reply>, described: Sender<String>, returned: Sender<Option<Panic>>) {
    let mut lent: Option<(Lent, u64)> = None;
    // The lent loader's panic: the loan's later jobs are dropped (their slots freed) unread.
    let mut panic: Option<Panic> = None;
    for cmd in cmds {
        match cmd {
            Cmd::Lend(l, n) => (lent, panic) = (Some((l, n)), None),
            Cmd::Job(job) => {
                let Some((Lent(ptr), n)) = &lent else {
                    // No loan (cannot happen through `IoThread::lend`): the job's slots are dropped.
                    continue;
                };
                if panic.is_some() {
                    continue;
                }
                // SAFETY: between `Lend` and `Return` the lender blocks in `IoThread::lend` with the
                // loader's `&mut` and does not touch it; the pointer is valid (see there).
                let loader = unsafe { &mut **ptr };
                let ran = catch_unwind(AssertUnwindSafe(|| {
                    loader.load(job.layer, job.requests, &mut |l| {
                        let _ = replies.send(Reply::Msg(*n, IoMsg::Loaded(l)));
                    })
                }));
                match ran {
                    Ok(()) => {
                        let _ = replies.send(Reply::Msg(*n, IoMsg::JobEnd { job: job.id }));
                    }
                    Err(p) => {
                        panic = Some(p);
                        let _ = replies.send(Reply::Stopped(*n));
                    }
                }
            }
            Cmd::Describe => {
                let text = match &lent {
                    Some((Lent(ptr), _)) => {
                        // SAFETY: as for `Cmd::Job`: the loan is live.
                        let loader = unsafe { &**ptr };
                        catch_unwind(AssertUnwindSafe(|| loader.describe()))
                            .unwrap_or_else(|_| "the expert loader (its describe panicked)".into())
                    }
                    None => "no expert loader".into(),
                };
                let _ = described.send(text);
            }
            Cmd::Return => {
                lent = None;
                let _ = returned.send(panic.take());
            }
        }
    }
}

/// Ends a loan: sends `Return` and waits for the thread's answer (or its end). Runs at the end of
/// [`IoThread::lend`], or as the stack unwinds past it.
struct Loan<'t> {
    cmds: &'t Sender<Cmd>,
    returned: &'t Receiver<Option<Panic>>,
    over: bool,
}

impl Loan<'_> {
    /// Ends the loan and returns the loader's panic during it, if any.
    fn end(&mut self) -> Option<Panic> {
        if std::mem::replace(&mut self.over, true) {
            return None;
        }
        // A failed send or receive: the thread is gone, so it holds no pointer.
        self.cmds.send(Cmd::Return).ok()?;
        self.returned.recv().ok().flatten()
    }
}

impl Drop for Loan<'_> {
    fn drop(&mut self) {
        self.end();
    }
}

/// The forward pass's end of the I/O thread during one loan; see the module documentation.
pub struct IoWorker<'t> {
    cmds: &'t Sender<Cmd>,
    replies: &'t mut Receiver<Reply>,
    described: &'t mut Receiver<String>,
    /// The loan's number: replies of earlier loans are skipped.
    loan: u64,
    /// Jobs sent whose [`IoMsg::JobEnd`] has not been received.
    open_jobs: usize,
    next_job: u64,
    /// Nanoseconds spent blocked in [`IoWorker::recv`] (exposed I/O wait).
    waited_ns: u64,
    /// The thread stopped serving this loan (the loader panicked, or the thread is gone).
    stopped: bool,
}

impl IoWorker<'_> {
    /// Sends a job of `requests` (expert id, slot) of `layer` to the worker and returns its number.
    /// An empty job is not sent (and gets no `JobEnd`); it returns `None`.
    pub fn submit(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>) -> Option<u64> {
        if requests.is_empty() {
            return None;
        }
        let id = self.next_job;
        self.next_job += 1;
        // Once the loader has panicked (re-raised when the loan ends) the job's slots are lost,
        // which the `JobEnd` that never comes would not tell: report the job as over instead.
        if self.stopped || self.cmds.send(Cmd::Job(Job { id, layer, requests })).is_err() {
            self.stopped = true;
            tracing::error!("the expert I/O worker has stopped (its loader panicked); job {id} is lost");
        } else {
            self.open_jobs += 1;
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
        let t = Instant::now();
        let msg = loop {
            if self.open_jobs == 0 || self.stopped {
                break None;
            }
            match self.replies.recv() {
                Ok(Reply::Msg(n, msg)) if n == self.loan => {
                    if let IoMsg::JobEnd { .. } = msg {
                        self.open_jobs -= 1;
                    }
                    break Some(msg);
                }
                Ok(Reply::Stopped(n)) if n == self.loan => self.stopped = true,
                // A message of an earlier loan nobody received: its slot is dropped.
                Ok(_) => {}
                Err(_) => self.stopped = true,
            }
        };
        if self.stopped {
            self.open_jobs = 0;
        }
        self.waited_ns += t.elapsed().as_nanos() as u64;
        msg
    }

    /// Nanoseconds the forward pass has spent blocked in [`IoWorker::recv`].
    pub fn waited_ns(&self) -> u64 {
        self.waited_ns
    }

    /// The lent loader's description (asked of the I/O thread, which holds the loader: for error
    /// messages, not for every step).
    pub fn describe(&self) -> String {
        match self.cmds.send(Cmd::Describe) {
            Ok(()) => self.described.recv().unwrap_or_else(|_| "the expert loader (its I/O thread is gone)".into()),
            Err(_) => "the expert loader (its I/O thread is gone)".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::ExpertKey;

    /// A mock loader: fills each slot's first byte with the expert id, in reverse request order;
    /// panics on layer 99.
    struct Mock;

    impl ExpertLoader for Mock {
        fn describe(&self) -> String {
            "mock".into()
        }
        fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
            assert_ne!(layer, 99, "the mock loader panics on layer 99");
            for (expert, mut buf) in requests.into_iter().rev() {
                buf.as_mut_slice()[0] = expert as u8;
                ready(Loaded { key: ExpertKey { layer, expert }, buf, result: Ok(()) });
            }
        }
    }

    fn bufs(ids: &[u32]) -> Vec<(u32, AlignedBuf)> {
        ids.iter().map(|&e| (e, AlignedBuf::new(4096, 4096).unwrap())).collect()
    }

    #[test]
    fn jobs_come_back_in_order_each_ended_on_one_thread_across_loans() {
        let mut loader = Mock;
        let before = threads_started();
        let mut t = IoThread::start().unwrap();
        for _ in 0..3 {
            let got = t.lend(&mut loader, |w| {
                assert!(w.recv().is_none(), "nothing open: recv does not block");
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
            });
            assert_eq!(got, ["3:2:2", "3:1:1", "end 0", "5:7:7", "end 1"]);
        }
        // Other tests of this binary may start threads meanwhile: at least ours, and the loans none.
        assert!(threads_started() > before);
    }

    #[test]
    fn jobs_not_waited_for_finish_before_the_loan_ends() {
        let mut loader = Mock;
        let mut t = IoThread::start().unwrap();
        let sent = t.lend(&mut loader, |w| w.submit(1, bufs(&[1, 2, 3])));
        assert_eq!(sent, Some(0));
        // The next loan starts clean: no message of the last one is left over.
        let next = t.lend(&mut loader, |w| {
            w.submit(2, bufs(&[4]));
            let first = w.recv().map(|m| matches!(m, IoMsg::Loaded(l) if l.key.layer == 2));
            (w.next_job(), first)
        });
        assert_eq!(next, (1, Some(true)));
    }

    #[test]
    fn a_loader_panic_stops_the_loan_and_is_raised_after_it_the_thread_goes_on() {
        let mut loader = Mock;
        let mut t = IoThread::start().unwrap();
        let raised = std::panic::catch_unwind(AssertUnwindSafe(|| {
            t.lend(&mut loader, |w| {
                w.submit(99, bufs(&[1]));
                assert!(w.recv().is_none(), "the worker stopped");
                assert_eq!(w.submit(3, bufs(&[2])), Some(1), "a job after the panic is lost, not sent");
                assert_eq!(w.open_jobs(), 0);
            })
        }));
        let msg = raised.unwrap_err();
        let text = msg.downcast_ref::<String>().map(String::as_str).unwrap_or_default();
        assert!(text.contains("panics on layer 99"), "{text:?}");
        let ok = t.lend(&mut loader, |w| {
            w.submit(3, bufs(&[5]));
            matches!(w.recv(), Some(IoMsg::Loaded(l)) if l.buf.as_slice()[0] == 5)
        });
        assert!(ok, "the thread serves the next loan");
    }
}
