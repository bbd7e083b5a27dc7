//! `picchio`: convert, pack, verify and run Mixture-of-Experts models whose routed experts stream from
//! storage. Library errors are typed; here they become `anyhow` chains printed as `Error: …`.

mod commands;

fn main() {
    restore_sigpipe();
    let cli = commands::parse();
    init_logging(cli.verbose, cli.quiet);
    if let Err(e) = commands::exec(cli) {
        eprintln!("Error: {}", chain(&e));
        // SIGINT/SIGTERM: everything was dropped (an nvme: controller shut down) on the way here.
        let interrupted = e.chain().any(|c| {
            matches!(c.downcast_ref::<picchio_runtime::Error>(), Some(picchio_runtime::Error::Interrupted { .. }))
        });
        std::process::exit(if interrupted { picchio_runtime::interrupt::exit_code() } else { 1 });
    }
}

/// Restores the default SIGPIPE action (terminate), which the Rust runtime replaces with "ignore":
/// `picchio verify IMG | head` then ends quietly when the reader goes away, like other Unix tools,
/// instead of panicking in `println!` with "failed printing to stdout".
#[cfg(unix)]
fn restore_sigpipe() {
    // SAFETY: called first thing in `main`, before any other thread exists; `signal` only changes the
    // process's disposition for SIGPIPE to the default, and no Rust code relies on SIGPIPE being
    // ignored (writes to a closed pipe now end the process instead of returning EPIPE).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn restore_sigpipe() {}

/// The error and its causes joined by ": " (as `{:#}`), skipping a cause whose text the message
/// already quotes: library errors name their cause in `Display` and also keep it as `source()`.
fn chain(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let s = cause.to_string();
        if !msg.contains(&s) {
            msg.push_str(": ");
            msg.push_str(&s);
        }
    }
    msg
}

/// Logs go to stderr; `RUST_LOG` overrides the level chosen by `-v` / `-q`.
fn init_logging(verbose: u8, quiet: bool) {
    let level = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "info",
        (false, 2) => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // Colour only on a terminal: a log file or a pipe gets plain text, not escape sequences.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(false)
        .init();
}
