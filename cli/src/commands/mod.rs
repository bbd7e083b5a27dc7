//! One module per subcommand: an `Args` struct and an `exec` that calls one library function.

use clap::{Parser, Subcommand};

mod bench;
mod bench_io;
mod bench_model;
mod convert;
mod demo;
mod nvme;
mod pack;
mod run;
mod synth;
mod verify;

/// Run Mixture-of-Experts models larger than RAM: routed experts stream from storage.
#[derive(Parser, Debug)]
#[command(name = "picchio", version, about, long_about = None, propagate_version = true)]
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
    /// Convert a Hugging Face Qwen3-MoE checkpoint into a Picchio model directory (quantized experts).
    Convert(convert::Args),
    /// Pack a converted model's routed experts into a .picchioflat image.
    Pack(pack::Args),
    /// Check a .picchioflat image: superblock, index hash, every payload hash, and optionally the bytes
    /// against the model's safetensors experts.
    Verify(verify::Args),
    /// Generate text with experts streamed from a store.
    Run(run::Args),
    /// The embedded default: convert, pack and run the vendored real-tokenizer model (no download).
    Demo(demo::Args),
    /// List NVMe controllers, hand one to vfio-pci for the user-space driver and back, identify it.
    Nvme(nvme::Args),
    /// Experiments with a JSON report (docs/experiments.md): env, qd-sweep, layout, tiers, overhead,
    /// trace, cache; plot redraws a report's charts.
    Bench(bench::Args),
    /// Write a .picchioflat image with a real model's expert geometry and seeded random payloads.
    Synth(synth::Args),
}

/// Runs the chosen subcommand.
pub fn exec(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Convert(a) => convert::exec(a),
        Command::Pack(a) => pack::exec(a),
        Command::Verify(a) => verify::exec(a),
        Command::Run(a) => run::exec(a),
        Command::Demo(a) => demo::exec(a),
        Command::Nvme(a) => nvme::exec(a),
        Command::Bench(a) => bench::exec(a),
        Command::Synth(a) => synth::exec(a),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
