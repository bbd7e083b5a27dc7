//! One module per subcommand: an `Args` struct and an `exec` that calls one library function.

use clap::{Parser, Subcommand};

mod bench;
mod chat;
mod compute_args;
mod convert;
mod demo;
mod model_args;
mod nvme;
mod pack;
mod plan;
mod run;
mod serve;
mod synth;
mod transcode;
mod verify;

/// Run Mixture-of-Experts models larger than RAM: routed experts stream from storage.
#[derive(Parser, Debug)]
#[command(name = "picchio", version, about = ABOUT, long_about = None, propagate_version = true)]
pub struct Cli {
    /// More log output on stderr (-v info, -vv debug, -vvv trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Log only errors (results still print).
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Convert a Hugging Face Qwen3-MoE or GPT-OSS checkpoint into a Picchio model directory
    /// (quantized experts).
    Convert(convert::Args),
    /// Pack a converted model's routed experts into a .picchioflat image.
    Pack(pack::Args),
    /// Re-quantize a converted model's routed experts (q4 -> q3) into a new directory, without the
    /// original checkpoint.
    Transcode(transcode::Args),
    /// Check a .picchioflat image: superblock, index hash, every payload hash, and optionally the bytes
    /// against the model's safetensors experts.
    Verify(verify::Args),
    /// Generate text with experts streamed from a store.
    Run(run::Args),
    /// Print the memory plan of a model: the dense part, the KV cache and the expert cache within a
    /// budget (--mem), without running it.
    Plan(plan::Args),
    /// Talk to the model in the terminal (the bare `picchio --model DIR [--store URI]` is this):
    /// streamed answers, the conversation's KV cache reused between turns.
    Chat(chat::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /// /v1/models; /health, /metrics).
    Serve(serve::Args),
    /// The embedded default: convert, pack and run the vendored real-tokenizer model (no download).
    Demo(demo::Args),
    /// List NVMe controllers, hand one to vfio-pci for the user-space driver and back, identify it.
    Nvme(nvme::Args),
    /// Experiments with a JSON report (docs/experiments.md): env, qd-sweep, layout, tiers, overhead,
    /// trace, cache, decode; plot redraws a report's charts.
    Bench(bench::Args),
    /// Write a .picchioflat image with a real model's expert geometry and seeded random payloads.
    Synth(synth::Args),
}

/// The `--help` headline: what the binary is and what its subcommands do (the crate's description is
/// the library's, not the tool's).
const ABOUT: &str = "picchio runs Mixture-of-Experts models larger than RAM, streaming routed experts from \
                     storage: convert and pack a checkpoint, verify the image, run or demo it; nvme, bench and \
                     synth for devices and experiments";

/// The command line: [`Cli`] with negative numbers accepted as values of every option and positional
/// argument of every subcommand (so `--temperature -1` reaches the option's range check instead of
/// reading as an unknown flag `-1`), and a negative value of an unsigned option reported as a range
/// error naming the option. Exits 2 (usage) on a parse error, 0 for `--help`/`--version`.
pub fn parse() -> Cli {
    use clap::FromArgMatches;
    let matches = command()
        .try_get_matches_from(bare_chat(std::env::args_os(), model_in_env()))
        .unwrap_or_else(|e| negative_unsigned(e).exit());
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// The value parser of an integer option that takes `lo..=hi` (`hi` `None`: no upper bound but the
/// type's): any integer outside, negative or past the type, is refused as "V is not in LO..=HI" (or
/// "V is less than LO"), which clap prints after the option's name. clap's own ranged parsers say
/// "must be an integer >= 0" for `-1` of an unsigned type, and "number too large to fit in target
/// type" past it, neither of which gives the range.
pub(crate) fn int_in<T>(
    lo: i128,
    hi: Option<i128>,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: TryFrom<i128> + Clone + Send + Sync + 'static,
{
    move |s: &str| {
        let range = match hi {
            Some(hi) => format!("in {lo}..={hi}"),
            None => format!("at least {lo}"),
        };
        let v: i128 = s.trim().parse().map_err(|_| format!("{s:?} is not an integer {range}"))?;
        let outside = || match hi {
            Some(hi) => format!("{v} is not in {lo}..={hi}"),
            None => format!("{v} is less than {lo}"),
        };
        if v < lo || hi.is_some_and(|hi| v > hi) {
            return Err(outside());
        }
        T::try_from(v).map_err(|_| format!("{v} is too large"))
    }
}

/// The value parser of a 32-bit float option (the sampling options): a number past `f32`'s range
/// (`--temperature 1e300`) is refused as typed, where `f32`'s own parsing turns it into `inf` and
/// the option's range check then reports `inf`. Each option's own range is checked after parsing.
pub(crate) fn f32_in_range(s: &str) -> Result<f32, String> {
    let x: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number"))?;
    if x.is_finite() && x.abs() > f64::from(f32::MAX) {
        return Err(format!("{s} is beyond the largest magnitude accepted, {:e}", f32::MAX));
    }
    Ok(x as f32)
}

/// Whether `$PICCHIO_MODEL` names a model (set and not empty).
fn model_in_env() -> bool {
    std::env::var_os("PICCHIO_MODEL").is_some_and(|m| !m.is_empty())
}

/// The bare form `picchio [-v] --model DIR [--store URI] ...` (or `picchio --store URI` with
/// `$PICCHIO_MODEL`) is `picchio chat ...`: `chat` is inserted before the first argument when that
/// is `--model` or `--store`; with `$PICCHIO_MODEL` set (`model_env`), also when there is none
/// (`picchio`) or it is another option (`picchio -n 200`), but not `--help` or `--version`.
fn bare_chat(args: impl Iterator<Item = std::ffi::OsString>, model_env: bool) -> Vec<std::ffi::OsString> {
    let mut args: Vec<_> = args.collect();
    let first = args.iter().skip(1).position(|a| {
        let a = a.to_string_lossy();
        !(a == "-q" || a == "--quiet" || a == "--verbose" || (a.starts_with("-v") && a[1..].chars().all(|c| c == 'v')))
    });
    match first.map(|i| i + 1) {
        Some(i) => {
            let a = args[i].to_string_lossy();
            let store_or_model = ["--model", "--store"].iter().any(|f| a == *f || a.starts_with(&format!("{f}=")));
            let help = ["-h", "--help", "-V", "--version"].contains(&a.as_ref());
            if store_or_model || (model_env && a.starts_with('-') && !help) {
                args.insert(i, "chat".into());
            }
        }
        None if model_env && !args.is_empty() => args.push("chat".into()),
        None => {}
    }
    args
}

/// [`Cli`]'s command with [`allow_negative_numbers`] applied to every subcommand.
fn command() -> clap::Command {
    use clap::CommandFactory;
    allow_negative_numbers(Cli::command())
}

/// `cmd` and all its subcommands with every argument that takes a value accepting a negative number.
fn allow_negative_numbers(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| if a.get_action().takes_values() { a.allow_negative_numbers(true) } else { a })
        .mut_subcommands(allow_negative_numbers)
}

/// A value-validation error for a negative number given to an unsigned integer option (whose parser
/// says only "invalid digit found in string"), rewritten as a range error naming the option.
fn negative_unsigned(e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::ValueValidation {
        return e;
    }
    let (Some(ContextValue::String(arg)), Some(ContextValue::String(value))) =
        (e.get(ContextKind::InvalidArg), e.get(ContextKind::InvalidValue))
    else {
        return e;
    };
    let negative = value.strip_prefix('-').is_some_and(|v| v.parse::<f64>().is_ok());
    if !negative || !e.to_string().contains("invalid digit") {
        return e;
    }
    let msg = format!("invalid value '{value}' for '{arg}': must be an integer >= 0\n");
    clap::Error::raw(ErrorKind::ValueValidation, msg).with_cmd(&command())
}

/// Runs the chosen subcommand.
pub fn exec(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Convert(a) => convert::exec(a),
        Command::Pack(a) => pack::exec(a),
        Command::Transcode(a) => transcode::exec(a),
        Command::Verify(a) => verify::exec(a),
        Command::Run(a) => run::exec(a),
        Command::Plan(a) => plan::exec(a),
        Command::Chat(a) => chat::exec(a),
        Command::Serve(a) => serve::exec(a),
        Command::Demo(a) => demo::exec(a),
        Command::Nvme(a) => nvme::exec(a),
        Command::Bench(a) => bench::exec(a),
        Command::Synth(a) => synth::exec(a),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bare_model_or_store_is_chat() {
        let with = |args: &[&str], env: bool| {
            super::bare_chat(args.iter().map(|a| std::ffi::OsString::from(*a)), env)
                .into_iter()
                .map(|a| a.into_string().unwrap())
                .collect::<Vec<_>>()
        };
        let v = |args: &[&str]| with(args, false);
        // With $PICCHIO_MODEL: bare options (or none) are chat's; help, version and subcommands not.
        assert_eq!(with(&["picchio"], true), ["picchio", "chat"]);
        assert_eq!(with(&["picchio", "-v", "-n", "2"], true), ["picchio", "-v", "chat", "-n", "2"]);
        assert_eq!(with(&["picchio", "--help"], true), ["picchio", "--help"]);
        assert_eq!(with(&["picchio", "-V"], true), ["picchio", "-V"]);
        assert_eq!(with(&["picchio", "run", "-n", "2"], true), ["picchio", "run", "-n", "2"]);
        assert_eq!(with(&["picchio", "-n", "2"], false), ["picchio", "-n", "2"]);
        assert_eq!(
            v(&["picchio", "--model", "m", "--store", "s"]),
            ["picchio", "chat", "--model", "m", "--store", "s"]
        );
        assert_eq!(v(&["picchio", "-vv", "--store=raw:/dev/x"]), ["picchio", "-vv", "chat", "--store=raw:/dev/x"]);
        assert_eq!(v(&["picchio", "run", "--model", "m"]), ["picchio", "run", "--model", "m"]);
        assert_eq!(v(&["picchio"]), ["picchio"]);
    }

    #[test]
    fn cli_is_consistent() {
        super::command().debug_assert();
    }

    /// Every argument that takes a value, of every subcommand, accepts a negative number as a value.
    #[test]
    fn every_valued_argument_accepts_negative_numbers() {
        fn walk(cmd: &clap::Command, path: &str, seen: &mut usize) {
            let mut cmd = cmd.clone();
            cmd.build();
            for a in cmd.get_arguments().filter(|a| a.get_action().takes_values()) {
                assert!(a.is_allow_negative_numbers_set(), "{path} {}", a.get_id());
                *seen += 1;
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), seen);
            }
        }
        let mut seen = 0;
        walk(&super::command(), "picchio", &mut seen);
        assert!(seen > 50, "only {seen} valued arguments");
    }
}
