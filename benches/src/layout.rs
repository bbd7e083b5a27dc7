//! `picchio bench layout`: one expert as N scattered per-tensor reads (how GGUF and safetensors
//! files store experts) versus one contiguous read of the same bytes (how `.picchioflat` stores
//! them), at each thread count × queue depth × engine.
//!
//! # Where the scattered reads land
//! A checkpoint stores each expert matrix of a layer as one tensor of shape `[E, …]` (GGUF's
//! `ffn_{gate,up,down}_exps`, the fused expert tensors of transformers 5 and of GPT-OSS's
//! safetensors), tensors one after another. Expert `e`'s slice of tensor `k` is at
//! `base_k + e·size_k` with `base_k = layer_start + Σ_{j<k} E·size_j`: the N pieces of one expert
//! are about `E·size` apart, never adjacent. With the store's own geometry (H = `hidden`,
//! I = `moe_inter / 2`, E = `n_experts`, Q4 as our format stores it) the pieces are:
//!
//! * **3 pieces** (`gate`, `up`, `down`, as GGUF): each `9·H·I/16` bytes (4-bit weights `H·I/2` +
//!   f32 scales per 64 `H·I/16`), together exactly one `.picchioflat` payload.
//! * **9 pieces** (`weight`, `scales`, `biases` of each matrix, as MLX/GPT-OSS-style checkpoints
//!   keep them): `H·I/2`, `H·I/16`, and a bf16 bias of `2·I` (gate, up) or `2·H` (down) bytes.
//!
//! Every piece is rounded up to 4096 bytes (an O_DIRECT read covers whole blocks, so a real
//! unaligned tensor costs at least this much), and the contiguous read is the sum of the rounded
//! pieces: both variants read the same bytes per expert. The virtual layers are laid over the
//! store's data region (whose bytes are the image's payloads; only their placement matters), as many
//! whole layers as fit. A unit is one expert: its latency runs from its first read's submission to
//! its last completion.

use serde::{Deserialize, Serialize};

use super::measure::{self, Engine, PointResult, PointSpec, Skipped, Stop, StoreLayout, UnitSource};
use crate::error::{Error, Result};
use picchio_core::StoreUri;

/// Options of [`run`] (recorded in the report's `flags`).
#[derive(Clone, Debug, Serialize)]
pub struct LayoutOptions {
    /// Engines (`None`: the defaults for the store).
    pub engines: Option<Vec<Engine>>,
    /// Pieces per expert to compare with one contiguous read: 3 and/or 9.
    pub pieces: Vec<u32>,
    /// Queue depths (reads in flight per thread).
    pub qds: Vec<u32>,
    /// Submitting-thread counts.
    pub threads: Vec<u32>,
    /// Per point: stop after this duration or byte count.
    pub stop: Stop,
    /// Seed of the experts drawn.
    pub seed: u64,
    /// Do not drop the page cache before buffered points.
    pub warm: bool,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        LayoutOptions {
            engines: None,
            pieces: vec![3, 9],
            qds: vec![1, 4, 16, 64],
            threads: (1..=std::thread::available_parallelism().map_or(1, usize::from) as u32).collect(),
            stop: Stop::Duration(2.0),
            seed: 0,
            warm: false,
        }
    }
}

/// The per-tensor split of one expert.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// Pieces per expert.
    pub pieces: u32,
    /// Tensor names, in file order.
    pub names: Vec<String>,
    /// Bytes of each piece as the model has it.
    pub piece_bytes: Vec<u64>,
    /// Bytes of each piece as read (rounded up to 4096).
    pub read_bytes: Vec<u32>,
    /// Bytes read per expert (sum of `read_bytes`; also the contiguous read).
    pub expert_bytes: u64,
    /// Distance in bytes from each piece of an expert to the next piece of the same expert, for
    /// expert 0 (`E·read_bytes[k]`).
    pub piece_gaps: Vec<u64>,
}

impl Split {
    /// The split of an expert of hidden size `h` and width `i` into `pieces` (3 or 9) for a layer of
    /// `e` experts.
    ///
    /// # Errors
    /// [`Error::BadOption`] for another piece count.
    pub fn new(pieces: u32, h: u64, i: u64, e: u64) -> Result<Self> {
        let (w, s) = (h * i / 2, h * i / 16);
        let (names, bytes): (Vec<&str>, Vec<u64>) = match pieces {
            3 => (vec!["gate", "up", "down"], vec![w + s, w + s, w + s]),
            9 => (
                vec![
                    "gate.weight",
                    "gate.scales",
                    "gate.biases",
                    "up.weight",
                    "up.scales",
                    "up.biases",
                    "down.weight",
                    "down.scales",
                    "down.biases",
                ],
                vec![w, s, 2 * i, w, s, 2 * i, w, s, 2 * h],
            ),
            n => {
                return Err(Error::BadOption {
                    experiment: None,
                    option: "--pieces",
                    value: n.to_string(),
                    expected: "expected 3 (gate/up/down) or 9 (weight/scales/biases each)".into(),
                })
            }
        };
        let read_bytes: Vec<u32> = bytes.iter().map(|&b| (b.div_ceil(4096) * 4096) as u32).collect();
        let expert_bytes = read_bytes.iter().map(|&b| u64::from(b)).sum();
        let piece_gaps = read_bytes[..read_bytes.len() - 1].iter().map(|&b| e * u64::from(b)).collect();
        Ok(Split {
            pieces,
            names: names.into_iter().map(String::from).collect(),
            piece_bytes: bytes,
            read_bytes,
            expert_bytes,
            piece_gaps,
        })
    }

    /// Image offsets of expert `e`'s pieces in a layer starting at `layer_start` with `n_experts`.
    pub fn scattered(&self, layer_start: u64, n_experts: u64, e: u64) -> impl Iterator<Item = (u64, u32)> + '_ {
        let mut base = layer_start;
        self.read_bytes.iter().map(move |&b| {
            let off = base + e * u64::from(b);
            base += n_experts * u64::from(b);
            (off, b)
        })
    }
}

/// One measured point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayoutPoint {
    /// Our measurement (`units` are experts; `unit_latency_us` is per expert).
    #[serde(flatten)]
    pub ours: PointResult,
    /// Pieces of the split this point belongs to.
    pub pieces: u32,
    /// `scattered` (N reads per expert) or `contiguous` (one read of the same bytes).
    pub variant: String,
    /// Reads per expert.
    pub reads_per_expert: u32,
}

/// The same engine × threads × QD, both variants.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Pieces of the scattered variant.
    pub pieces: u32,
    /// Engine.
    pub engine: String,
    /// Threads.
    pub threads: u32,
    /// Queue depth.
    pub qd: u32,
    /// Experts per second, contiguous.
    pub contiguous_experts_per_s: f64,
    /// Experts per second, scattered.
    pub scattered_experts_per_s: f64,
    /// contiguous / scattered.
    pub contiguous_over_scattered: f64,
    /// Median expert latency, contiguous, µs.
    pub contiguous_p50_us: f64,
    /// Median expert latency, scattered, µs.
    pub scattered_p50_us: f64,
}

/// `results` of a layout report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayoutResults {
    /// The store.
    pub store: String,
    /// H from the superblock.
    pub hidden: u32,
    /// I = moe_inter / 2.
    pub moe_intermediate: u32,
    /// Experts per virtual layer (the store's n_experts, or fewer when one layer does not fit).
    pub experts_per_layer: u32,
    /// The splits compared, with the virtual layers that fit the data region.
    pub splits: Vec<SplitUse>,
    /// Every point.
    pub points: Vec<LayoutPoint>,
    /// Contiguous vs scattered at each engine × threads × QD.
    pub comparisons: Vec<Comparison>,
    /// What was not run.
    pub skipped: Vec<Skipped>,
}

/// A split and how many virtual layers of it fit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitUse {
    /// The split.
    #[serde(flatten)]
    pub split: Split,
    /// Virtual layers laid over the data region.
    pub layers: u32,
}

/// Runs the comparison; `progress` is called after each point.
///
/// # Errors
/// Opening the store or an engine, a failed read, a store whose data region holds no expert of the
/// split.
pub fn run(store: &StoreUri, opts: &LayoutOptions, progress: &mut dyn FnMut(&LayoutPoint)) -> Result<LayoutResults> {
    if opts.qds.is_empty()
        || opts.threads.is_empty()
        || opts.pieces.is_empty()
        || opts.qds.contains(&0)
        || opts.threads.contains(&0)
    {
        return Err(Error::NoValues {
            options: "--qd, --threads and --pieces",
            need: "need at least one value; QD and threads at least 1",
        });
    }
    let mut skipped = Vec::new();
    let engines = super::qd_sweep::engines(store, &opts.engines, &mut skipped);
    let first = *engines.first().ok_or_else(|| Error::NoEngine { store: store.to_string() })?;
    let layout = StoreLayout::read(store, first)?;
    let sb = &layout.superblock;
    let (h, i) = (u64::from(sb.hidden), u64::from(sb.moe_inter / 2));
    let start = sb.data_offset;
    let end = layout.entries.iter().map(|&(o, l)| o + u64::from(l)).max().expect("non-empty");
    let region = end - start;
    let mut splits = Vec::new();
    let mut experts_per_layer = sb.n_experts;
    for &n in &opts.pieces {
        let s = Split::new(n, h, i, u64::from(sb.n_experts))?;
        experts_per_layer = experts_per_layer.min((region / s.expert_bytes).min(u64::from(sb.n_experts)) as u32);
        splits.push(s);
    }
    if experts_per_layer == 0 {
        return Err(Error::SplitTooLarge {
            store: store.to_string(),
            region,
            expert_bytes: splits.iter().map(|s| s.expert_bytes).max().unwrap_or(0),
        });
    }
    let e = u64::from(experts_per_layer);
    // Recompute the gaps for the experts per layer actually used.
    let splits: Vec<SplitUse> = splits
        .into_iter()
        .map(|s| {
            let s = Split::new(s.pieces, h, i, e).expect("checked above");
            let layers = (region / (e * s.expert_bytes)).max(1) as u32;
            SplitUse { split: s, layers }
        })
        .collect();
    let mut points = Vec::new();
    let mut comparisons = Vec::new();
    for su in &splits {
        let split = std::sync::Arc::new(su.split.clone());
        let layers = u64::from(su.layers);
        let max_piece = *split.read_bytes.iter().max().expect("pieces");
        for &engine in &engines {
            for &threads in &opts.threads {
                for &qd in &opts.qds {
                    let mut pair = Vec::new();
                    for contiguous in [true, false] {
                        let spec = PointSpec { engine, threads, qd, stop: opts.stop, seed: opts.seed, warm: opts.warm };
                        let sp = split.clone();
                        let source = move |_t: u32| -> UnitSource {
                            let sp = sp.clone();
                            Box::new(move |rng, out| {
                                let l = rng.below(layers);
                                let x = rng.below(e);
                                let layer_start = start + l * e * sp.expert_bytes;
                                if contiguous {
                                    out.push((layer_start + x * sp.expert_bytes, sp.expert_bytes as u32));
                                } else {
                                    out.extend(sp.scattered(layer_start, e, x));
                                }
                            })
                        };
                        let max_read = if contiguous { split.expert_bytes as u32 } else { max_piece };
                        let ours = measure::run_point(store, &spec, max_read, &source)?;
                        let p = LayoutPoint {
                            ours,
                            pieces: split.pieces,
                            variant: if contiguous { "contiguous" } else { "scattered" }.into(),
                            reads_per_expert: if contiguous { 1 } else { split.pieces },
                        };
                        progress(&p);
                        pair.push(p.ours.clone());
                        points.push(p);
                    }
                    let (c, s) = (&pair[0], &pair[1]);
                    comparisons.push(Comparison {
                        pieces: split.pieces,
                        engine: engine.name().into(),
                        threads,
                        qd,
                        contiguous_experts_per_s: c.units_per_s,
                        scattered_experts_per_s: s.units_per_s,
                        contiguous_over_scattered: if s.units_per_s > 0.0 {
                            c.units_per_s / s.units_per_s
                        } else {
                            0.0
                        },
                        contiguous_p50_us: c.unit_latency_us.p50,
                        scattered_p50_us: s.unit_latency_us.p50,
                    });
                }
            }
        }
    }
    Ok(LayoutResults {
        store: store.to_string(),
        hidden: sb.hidden,
        moe_intermediate: sb.moe_inter / 2,
        experts_per_layer,
        splits,
        points,
        comparisons,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_split_matches_the_payload_and_places_pieces_e_strides_apart() {
        let s = Split::new(3, 2048, 768, 128).unwrap();
        assert_eq!(s.read_bytes, vec![884_736; 3]);
        assert_eq!(s.expert_bytes, 2_654_208, "three pieces are one .picchioflat payload");
        let offs: Vec<u64> = s.scattered(0, 128, 5).map(|p| p.0).collect();
        assert_eq!(offs, vec![5 * 884_736, 128 * 884_736 + 5 * 884_736, 256 * 884_736 + 5 * 884_736]);
        let s9 = Split::new(9, 2048, 768, 128).unwrap();
        assert_eq!(s9.piece_bytes, vec![786_432, 98_304, 1536, 786_432, 98_304, 1536, 786_432, 98_304, 4096]);
        assert_eq!(s9.read_bytes[2], 4096);
        assert_eq!(s9.expert_bytes, 2_654_208 + 3 * 4096);
        // Every piece of every expert is inside its layer and no two overlap.
        let mut all: Vec<(u64, u32)> = (0..128).flat_map(|e| s9.scattered(0, 128, e).collect::<Vec<_>>()).collect();
        all.sort();
        assert!(all.windows(2).all(|w| w[0].0 + u64::from(w[0].1) <= w[1].0));
        assert_eq!(all.last().map(|p| p.0 + u64::from(p.1)), Some(128 * s9.expert_bytes));
        assert!(Split::new(4, 64, 64, 2).is_err());
    }
}
