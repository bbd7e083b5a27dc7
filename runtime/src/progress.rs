//! The one progress-bar constructor of the runtime (`convert`, `pack`, `verify`).
//!
//! Bars draw on stderr (results go to stdout) and are hidden when stderr is not a terminal or when the
//! caller asks (`--json`, `--quiet`, tests), so logs and piped output never carry bar escapes.

use std::borrow::Cow;
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `len` steps labelled `message`, or a hidden bar (every call a no-op) when `hidden` is
/// set (`--json`, `--no-progress`, tests) or stderr is not a terminal.
pub fn bar(len: u64, message: impl Into<Cow<'static, str>>, hidden: bool) -> ProgressBar {
    if hidden || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{msg:>10} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta})")
        .expect("the template is valid");
    ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr()).with_style(style).with_message(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_on_request() {
        let b = bar(10, "convert", true);
        assert!(b.is_hidden());
        b.inc(3);
        b.finish_and_clear();
    }
}
