//! `picchio`: convert, pack, verify and run Mixture-of-Experts models whose routed experts stream from
//! storage. Library errors are typed; here they become `anyhow` chains printed as `Error: …`.

mod commands;
mod hint;

fn main() {
    // `picchio verify IMG | head` ends quietly when the reader goes away, like other Unix tools.
    picchio_runtime::sys::restore_default_sigpipe();
    let cli = commands::parse();
    init_logging(cli.verbose, cli.quiet);
    if let Err(e) = commands::exec(cli) {
        eprintln!("Error: {e:#}");
        if let Some(h) = hint::hint(&e) {
            eprintln!("hint: {h}");
        }
        if let Some(h) = hint::limit(&e, &std::fs::read_to_string("/proc/self/limits").unwrap_or_default()) {
            eprintln!("hint: {h}");
        }
        // SIGINT/SIGTERM: everything was dropped (an nvme: controller shut down) on the way here.
        let interrupted =
            e.chain().any(|c| matches!(hint::as_runtime(c), Some(picchio_runtime::Error::Interrupted { .. })));
        std::process::exit(if interrupted { picchio_runtime::interrupt::exit_code() } else { 1 });
    }
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
