//! The compute options the model-running commands share (`run`, `demo`, `chat`, `serve`, `bench decode`;
//! `plan` takes `--dense` alone).

use picchio_runtime::model::DenseFormat;

/// How the resident weights are kept and computed with.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ComputeArgs {
    /// Keep the resident attention (and dense-MLP) projections as stored (`stored`: exact), or
    /// convert them at load to `bf16` (half the RAM traffic of f32) or `int8` rows with one scale per
    /// row (a quarter), for when the dense part's RAM traffic dominates a token (every expert
    /// cached), at a drift from the reference measured in docs/kernels.md. The router, embeddings and lm_head stay
    /// as stored.
    #[arg(long, value_name = "FORMAT", default_value = "stored")]
    pub dense: DenseFormat,
    /// Compute the Q4 expert products in integer arithmetic: each input quantized to int8 per group
    /// of 64, then u8 x i8 dot products (AVX2 vpmaddubsw; Picchio (C)'s IDOT=1). Fewer instructions
    /// per weight than the exact f32 kernels, at a drift from the reference measured in
    /// docs/kernels.md. Also on with PICCHIO_IDOT=1; PICCHIO_KERNELS=scalar runs its portable twin
    /// (same bits).
    #[arg(long)]
    pub idot: bool,
}

impl ComputeArgs {
    /// Applies the per-model options to an opened model (`--idot`; `--dense` is applied at load).
    pub fn apply(&self, model: &mut picchio_runtime::model::Model) {
        if self.idot {
            model.set_kernels(model.kernels().with_idot(true));
        }
    }
}
