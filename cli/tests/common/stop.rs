//! Children that stop themselves at a `picchio_core::stop_point` (`PICCHIO_STOP_AFTER_BYTES`,
//! `PICCHIO_STOP_AFTER_LOADS`): the test acts at exactly that point — kills the process, changes the
//! world under it, starts a second writer — instead of polling for progress and racing the process
//! to the end. Nothing here depends on the machine's speed or load: a count names the point.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use picchio_testkit::bin::wait_bounded;

/// Bounds each wait for a child (a hang fails the test; not a timing assertion).
pub const LIMIT: Duration = Duration::from_secs(300);

/// Starts `cmd` with stdin closed, stdout piped and stderr to the file `log`, and waits until it
/// stops itself (`waitpid(WUNTRACED)`). `cmd` carries the stop point's variable.
///
/// # Errors
/// The process exited (or was killed) before its stop point: its status and `log`'s text, for the
/// test's failure message. It has been reaped.
///
/// # Panics
/// When it neither stops nor exits within [`LIMIT`] (it is killed).
pub fn spawn_stopped(cmd: &mut Command, log: &Path) -> Result<Child, String> {
    let child = cmd
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(log).expect("create the child's stderr log"))
        .spawn()
        .expect("start picchio");
    let pid = child.id() as libc::pid_t;
    let t0 = std::time::Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED | libc::WNOHANG) };
        assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if r == pid {
            break;
        }
        if t0.elapsed() > LIMIT {
            // SAFETY: signals our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{cmd:?} neither stopped nor exited in {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if libc::WIFSTOPPED(status) {
        return Ok(child);
    }
    // Reaped by waitpid: `child` is not waited for again (dropping a `Child` does not wait).
    drop(child);
    let how = if libc::WIFEXITED(status) {
        format!("exit code {}", libc::WEXITSTATUS(status))
    } else {
        format!("signal {}", libc::WTERMSIG(status))
    };
    Err(format!("{cmd:?} ended ({how}) before its stop point; its stderr:\n{}", read(log)))
}

/// `log`'s text (lossy; empty when missing).
pub fn read(log: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned()
}

/// Kills a stopped child with `SIGKILL` and reaps it; asserts the signal ended it.
pub fn kill9(child: Child) -> Output {
    // SAFETY: signals our own child, stopped and not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) }, 0);
    let o = wait_bounded(child, LIMIT).expect("the killed process exits");
    assert_eq!(o.status.code(), None, "killed by the signal, not finished");
    o
}

/// Lets a stopped child go on (`SIGCONT`) and waits for it to end.
pub fn resume(child: Child) -> Output {
    // SAFETY: signals our own child, stopped and not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGCONT) }, 0);
    wait_bounded(child, LIMIT).expect("the resumed process ends")
}

/// Starts `picchio ARGS` (a writer) with `PICCHIO_STOP_AFTER_BYTES=at` and returns it stopped once
/// it has written `at` bytes of its output ([`spawn_stopped`]; stderr in `log`).
///
/// # Errors
/// [`spawn_stopped`]'s: the writer ended before writing `at` bytes.
pub fn writer_stopped_at(args: &[String], at: u64, log: &Path) -> Result<Child, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picchio"));
    cmd.args(args).env(picchio_core::stop_point::BYTES_ENV, at.to_string());
    spawn_stopped(&mut cmd, log)
}

/// A writer killed with `SIGKILL` part way through its write.
pub struct Killed {
    /// Its process id (names its temporary output, see [`tmp_of`]).
    pub pid: u32,
    /// What it had written to stderr when it was killed (e.g. the leftovers it removed).
    pub stderr: String,
}

/// Runs `picchio ARGS` until it has written `at` bytes of its output ([`writer_stopped_at`]), then
/// kills it with `SIGKILL` ([`kill9`]) — `kill -9` at a byte count, not at a time.
///
/// # Errors
/// The writer ended before writing `at` bytes (its status and stderr).
pub fn kill_writer_at(args: &[String], at: u64, log: &Path) -> Result<Killed, String> {
    let child = writer_stopped_at(args, at, log)?;
    let pid = child.id();
    let stderr = read(log);
    kill9(child);
    Ok(Killed { pid, stderr })
}

/// The temporary file `<out>.tmp-<pid>` beside `out` that process `pid` writes an image file in
/// before renaming it to `out`: what a writer killed mid-write leaves behind.
pub fn tmp_of(out: &Path, pid: u32) -> PathBuf {
    let mut n = out.file_name().expect("an output file name").to_os_string();
    n.push(format!(".tmp-{pid}"));
    out.with_file_name(n)
}

/// Asserts that `leftover`, a dead writer's temporary output of `bytes` bytes, is gone, and that the
/// writer whose stderr is `stderr` removed it and said so: its path, its size and that its writer is
/// no longer running.
pub fn assert_leftover_removed(stderr: &str, leftover: &Path, bytes: u64) {
    assert!(!leftover.exists(), "{} left behind", leftover.display());
    assert!(
        stderr.contains(&format!("removed {} ({bytes} bytes", leftover.display()))
            && stderr.contains("no longer running"),
        "the leftover {} ({bytes} bytes) was not named as removed:\n{stderr}",
        leftover.display()
    );
}
