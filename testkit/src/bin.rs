//! Running a binary as a user does, with the command, its status and its output echoed to the test
//! log (shown when the test fails), and a bounded wait so a hang fails the test instead of the run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// How long [`Bin::run`] waits for the child before killing it: bounds a hang; generous, because a
/// loaded 2-core machine can be many times slower than an idle one.
pub const HANG_LIMIT: Duration = Duration::from_secs(600);

/// A binary under test, e.g. `Bin::new("picchio", env!("CARGO_BIN_EXE_picchio"))`.
#[derive(Clone, Debug)]
pub struct Bin {
    name: String,
    exe: PathBuf,
}

impl Bin {
    /// The binary at `exe`, shown as `name` in the log.
    pub fn new(name: &str, exe: impl AsRef<Path>) -> Bin {
        Bin { name: name.into(), exe: exe.as_ref().into() }
    }

    /// A [`Command`] for the binary (for tests that need more control: environment, stdin, spawn).
    pub fn command(&self) -> Command {
        Command::new(&self.exe)
    }

    /// Runs `NAME ARGS` with stdin closed and stdout and stderr captured, echoing the command, its
    /// status and its output; see [`run_with`](Self::run_with).
    pub fn run(&self, args: &[&str]) -> Output {
        self.run_with(args, Stdio::piped())
    }

    /// Runs `NAME ARGS` with `stdout` (e.g. a closed pipe), failing the test if it runs longer than
    /// [`HANG_LIMIT`] (the child is killed).
    ///
    /// # Panics
    /// When the binary cannot be started, or it hangs.
    pub fn run_with(&self, args: &[&str], stdout: impl Into<Stdio>) -> Output {
        let child = self
            .command()
            .args(args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run {} ({}): {e}", self.name, self.exe.display()));
        let out = wait_bounded(child, HANG_LIMIT)
            .unwrap_or_else(|| panic!("{} {} hung (killed after {HANG_LIMIT:?})", self.name, args.join(" ")));
        eprintln!(
            "$ {} {}\n[{}]\n{}{}",
            self.name,
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Runs `NAME ARGS`, asserts it succeeded, and returns its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(o.status.success(), "{} {} failed", self.name, args.join(" "));
        stdout(&o)
    }
}

/// Waits for `child` for at most `limit`, reading its piped output meanwhile; `None` (after killing
/// it) when it ran longer.
pub fn wait_bounded(child: std::process::Child, limit: Duration) -> Option<Output> {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => Some(out.expect("wait for child")),
        Err(_) => {
            // The waiting thread owns the child; kill it by pid with the `kill` tool (no libc here).
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            let _ = rx.recv_timeout(Duration::from_secs(30));
            None
        }
    }
}

/// The stdout of `o` as text (lossy).
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The stderr of `o` as text (lossy).
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
