//! The next step after a failed command, in this binary's flags: maps the libraries' typed errors
//! to the flag that changes the outcome, printed as a `hint:` line after the error (hyperfine's
//! `src/error.rs` puts the advice beside the error the same way). An error whose own message already
//! names the flag (`--force` of `Error::Exists` and of a mounted controller) gets no hint repeating it.

use picchio_runtime::quant::QuantError;

/// The hint for the first error in `e`'s chain that has one.
pub(crate) fn hint(e: &anyhow::Error) -> Option<&'static str> {
    e.chain().find_map(|c| {
        if let Some(r) = c.downcast_ref::<picchio_runtime::Error>() {
            runtime(r)
        } else if let Some(b) = c.downcast_ref::<picchio_bench::error::Error>() {
            bench(b)
        } else if let Some(b) = c.downcast_ref::<picchio_blockdev::Error>() {
            blockdev(b)
        } else {
            c.downcast_ref::<QuantError>().and_then(quant)
        }
    })
}

/// The runtime error `c` is, or that a bench error passes through (transparent variants are not in
/// the `source()` chain themselves).
pub(crate) fn as_runtime<'a>(c: &'a (dyn std::error::Error + 'static)) -> Option<&'a picchio_runtime::Error> {
    c.downcast_ref::<picchio_runtime::Error>()
        .or_else(|| c.downcast_ref::<picchio_bench::error::Error>().and_then(picchio_bench::error::Error::runtime))
}

fn bench(e: &picchio_bench::error::Error) -> Option<&'static str> {
    use picchio_bench::error::Error as E;
    match e {
        // Transparent variants: their inner error is not in the `source()` chain.
        E::Runtime(r) => runtime(r),
        E::Engine(b) => blockdev(b),
        _ => None,
    }
}

fn runtime(e: &picchio_runtime::Error) -> Option<&'static str> {
    use picchio_runtime::Error as E;
    match e {
        E::BadOption { option: "--ecap", .. } => Some("pass --ecap 1 or more (or leave it out for the default)"),
        E::ContextOverflow { .. } => Some("use a shorter prompt or a smaller -n"),
        E::VocabBelowTokenizer { .. } => {
            Some("give a --vocab of at least the tokenizer's ids, or --no-tokenizer (prompts are then token ids)")
        }
        // Transparent variants: their inner error is not in the `source()` chain.
        E::Engine(b) => blockdev(b),
        E::Quant(q) => quant(q),
        _ => None,
    }
}

fn blockdev(e: &picchio_blockdev::Error) -> Option<&'static str> {
    use picchio_blockdev::Error as E;
    match e {
        E::DirectUnsupported { .. } => Some("pass --buffered to read through the page cache"),
        E::UringUnavailable { .. } => Some("use --io psync"),
        // The library names its options; these are the flags that set them.
        E::OptionOutOfRange { option: "PsyncOptions::threads", .. } => Some("pass --io-threads in the range above"),
        E::OptionOutOfRange { option: "UringOptions::qd" | "IocpOptions::qd", .. } => {
            Some("pass --qd in the range above")
        }
        E::IopollNeedsDirect => Some("drop --buffered (direct reads are the default) or drop --iopoll"),
        E::UringOption { option: "sqpoll", .. } => Some("drop --sqpoll (or run as root)"),
        E::UringOption { option: "iopoll", .. } => Some("drop --iopoll"),
        E::UringOption { option: "sqpoll and iopoll", .. } => Some("drop --sqpoll or --iopoll"),
        E::UringOption { option: "register_files", .. } => Some("pass --register-files false"),
        E::Refused { hint, .. } if !hint.contains("never") => Some("pass --force to write it anyway"),
        _ => None,
    }
}

fn quant(e: &QuantError) -> Option<&'static str> {
    match e {
        QuantError::ColsNotMultipleOfGroup { .. } => Some("pass --quant none for this model"),
        _ => None,
    }
}

/// The process limit an OS error in `e`'s chain ran into, named with its value from `limits` (the
/// text of `/proc/self/limits`; empty where there is none): `EMFILE` is `RLIMIT_NOFILE`, `ENFILE`
/// the system's file table. `None` for any other error.
pub(crate) fn limit(e: &anyhow::Error, limits: &str) -> Option<String> {
    let os = e.chain().find_map(|c| {
        c.downcast_ref::<std::io::Error>()
            .and_then(|io| io.raw_os_error())
            .filter(|&n| n == libc::EMFILE || n == libc::ENFILE)
    })?;
    if os == libc::ENFILE {
        return Some(
            "the system's table of open files is full (ENFILE): see /proc/sys/fs/file-nr and fs.file-max".into(),
        );
    }
    // `Max open files            1024                 4096                 files`
    let (soft, hard) = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .map(|rest| {
            let mut w = rest.split_whitespace();
            (w.next().unwrap_or("?").to_string(), w.next().unwrap_or("?").to_string())
        })
        .unwrap_or_else(|| ("?".into(), "?".into()));
    Some(format!(
        "picchio may have at most {soft} files open at once (RLIMIT_NOFILE, `ulimit -n`; hard limit {hard}) and \
         needed more: raise it, e.g. `ulimit -n 4096`"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_open_files_names_the_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            6                    6                    files\n";
        let emfile =
            anyhow::Error::new(std::io::Error::from_raw_os_error(libc::EMFILE)).context("/m/config.json: read");
        let h = limit(&emfile, limits).unwrap();
        assert!(
            h.starts_with("picchio may have at most 6 files open at once (RLIMIT_NOFILE") && h.contains("hard limit 6"),
            "{h}"
        );
        let enfile = anyhow::Error::new(std::io::Error::from_raw_os_error(libc::ENFILE));
        assert!(limit(&enfile, limits).unwrap().contains("ENFILE"));
        assert_eq!(limit(&anyhow::Error::new(std::io::Error::from_raw_os_error(libc::EIO)), limits), None);
    }

    fn hint_of(e: impl std::error::Error + Send + Sync + 'static) -> Option<&'static str> {
        hint(&anyhow::Error::new(e).context("picchio run"))
    }

    #[test]
    fn typed_errors_get_the_flag_that_changes_them() {
        let e = picchio_runtime::Error::BadOption { option: "--ecap", value: "0".into(), expected: "≥ 1".into() };
        assert!(hint_of(e).unwrap().contains("--ecap"));
        // The message names --force itself: no hint repeats it.
        let e =
            picchio_runtime::Error::Exists { path: "/o".into(), what: "destination", replace_with: Some("--force") };
        assert!(e.to_string().contains("pass --force to replace it"), "{e}");
        assert_eq!(hint_of(e), None);
        let direct = picchio_blockdev::Error::DirectUnsupported { path: "/f".into(), reason: "r".into(), cause: None };
        assert!(hint_of(picchio_runtime::Error::Engine(direct)).unwrap().contains("--buffered"));
        let q = QuantError::ColsNotMultipleOfGroup { kind: picchio_runtime::quant::QuantKind::Q4, rows: 1, cols: 3 };
        assert!(hint_of(picchio_runtime::Error::Quant(q)).unwrap().contains("--quant none"));
        let a = picchio_runtime::nvme_admin::AdminError::Mounted {
            bdf: "0000:01:00.0".into(),
            uses: "nvme0n1p1 on /mnt".into(),
        };
        let e = picchio_runtime::Error::admin("nvme:0000:01:00.0/1")(a);
        assert!(picchio_core::error::chain(&e).to_string().contains("pass --force to detach it anyway"));
        assert_eq!(hint_of(e), None);
        assert_eq!(hint_of(picchio_runtime::Error::EmptyPrompt), None);
        let e = picchio_runtime::Error::VocabBelowTokenizer { path: "/t/tokenizer.json".into(), ids: 300, vocab: 8 };
        let h = hint_of(e).unwrap();
        assert!(h.contains("--vocab") && h.contains("--no-tokenizer"), "{h}");
    }

    /// blockdev names its options (`UringOptions::qd`, `iopoll`); the hint names the flag that sets it.
    #[test]
    fn engine_options_get_the_flag_that_sets_them() {
        use picchio_blockdev::Error as B;
        let range = |option| B::OptionOutOfRange { option, value: 0, min: 1, max: 256 };
        assert!(hint_of(range("PsyncOptions::threads")).unwrap().contains("--io-threads"));
        assert!(hint_of(picchio_runtime::Error::Engine(range("UringOptions::qd"))).unwrap().contains("--qd"));
        assert!(hint_of(B::IopollNeedsDirect).unwrap().contains("--buffered"));
        let refused = |option| B::UringOption { path: "/f".into(), option, reason: "r".into(), cause: None };
        assert!(hint_of(refused("sqpoll")).unwrap().contains("--sqpoll"));
        assert!(hint_of(refused("iopoll")).unwrap().contains("--iopoll"));
        assert!(hint_of(refused("register_files")).unwrap().contains("--register-files false"));
    }

    /// A bench error passes library errors through transparently: their hints (and the exit status
    /// of an interrupt) are found through it.
    #[test]
    fn bench_errors_show_the_hints_of_what_they_wrap() {
        use picchio_bench::error::Error as Bench;
        let e = Bench::from(picchio_runtime::Error::BadOption {
            option: "--ecap",
            value: "0".into(),
            expected: "≥ 1".into(),
        });
        assert!(hint_of(e).unwrap().contains("--ecap"));
        let direct = picchio_blockdev::Error::DirectUnsupported { path: "/f".into(), reason: "r".into(), cause: None };
        assert!(hint_of(Bench::from(direct)).unwrap().contains("--buffered"));
        assert_eq!(hint_of(Bench::EmptyPrompt { experiment: "cache" }), None);
        let stop = picchio_runtime::Error::Interrupted { signal: "SIGINT".into(), done: 1, wanted: 2, unit: "tokens" };
        let e = anyhow::Error::new(Bench::from(stop)).context("picchio bench decode");
        assert!(e.chain().any(|c| matches!(as_runtime(c), Some(picchio_runtime::Error::Interrupted { .. }))));
    }
}
