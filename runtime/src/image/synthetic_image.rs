//! `picchio synth`: `.picchioflat` images with a real model's expert geometry, filled with seeded
//! pseudo-random bytes, for storage experiments without model weights (`picchio bench`).
//!
//! The image is a valid v2 image in every respect the format checks — superblock, index, index
//! SHA-256, one payload hash per entry — written by [`FlatWriter`] (atomically into a file, or onto
//! a block device through the same inspection, refusals, `O_DIRECT` writer and read-back check as
//! `picchio pack --out raw:`). Its payloads are random bytes, not weights: `picchio run` cannot use
//! it (there are no dense weights either). What matters for I/O is the geometry: the number of
//! entries, the payload length (so the padded read length and the layout of the data region), and
//! the superblock's dimensions, which record the model the geometry is taken from.
//!
//! | `--arch` | superblock (hidden, n_layers, n_experts, topk, moe_inter) | payload bytes |
//! | --- | --- | --- |
//! | `qwen3-30b-a3b` | 2048, 48, 128, 8, 1536 | 2,654,208 |
//! | `gpt-oss-20b` | 2880, 24, 32, 4, 5760 | 13,996,800 |
//! | `gpt-oss-120b` | 2880, 36, 128, 4, 5760 | 13,996,800 |
//!
//! The payload length is our Q4 expert payload (docs/format.md) for the model's H and I: 27·H·I/16
//! bytes. For GPT-OSS (H = I = 2880, `config.json` of openai/gpt-oss-20b and -120b) that is what
//! `convert` writes (MXFP4 experts dequantized, then requantized to Q4; their gate_up/down biases
//! are resident tensors, not part of the payload).

use std::path::Path;

use picchio_core::format::{plan_image_len, ImageSink};
use picchio_core::loader::StoreDims;
use picchio_core::rng::SplitMix64;
use picchio_core::{FlatWriter, StoreUri, Superblock};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::image::write::{write_image, PayloadSource, Plan, ReportHead, WriteOptions, WriteReport, WriteTo};
use crate::progress;

/// A model's expert geometry as the superblock records it, plus the payload length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Superblock dimensions (n_layers is the model's, whatever `--layers` writes).
    pub dims: StoreDims,
    /// Bytes of one expert payload (`len` of every index entry). Held as u64 so that a geometry
    /// over the format's limit is reported ([`SynthOptions::plan`]), not wrapped into range.
    pub expert_bytes: u64,
}

impl Geometry {
    /// Qwen3-30B-A3B (`Qwen/Qwen3-30B-A3B` config.json: hidden_size 2048, num_hidden_layers 48,
    /// num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768), Q4 payload.
    pub fn qwen3_30b_a3b() -> Self {
        Geometry::q4(2048, 48, 128, 8, 768)
    }

    /// gpt-oss-20b (`openai/gpt-oss-20b` config.json: hidden_size 2880, num_hidden_layers 24,
    /// num_local_experts 32, num_experts_per_tok 4, intermediate_size 2880), Q4 payload.
    pub fn gpt_oss_20b() -> Self {
        Geometry::q4(2880, 24, 32, 4, 2880)
    }

    /// gpt-oss-120b (`openai/gpt-oss-120b` config.json: as gpt-oss-20b with 36 layers of 128
    /// experts), Q4 payload.
    pub fn gpt_oss_120b() -> Self {
        Geometry::q4(2880, 36, 128, 4, 2880)
    }

    /// A geometry whose payload is our Q4 layout for hidden size `hidden` and expert width
    /// `moe_intermediate` (27·H·I/16 bytes; both multiples of 64). `moe_inter` (2·I) saturates at
    /// u32::MAX; such a geometry's payload is far over the format's limit anyway.
    pub fn q4(hidden: u32, n_layers: u32, n_experts: u32, topk: u32, moe_intermediate: u32) -> Self {
        let expert_bytes = 27 * u64::from(hidden) * u64::from(moe_intermediate) / 16;
        Geometry {
            dims: StoreDims { hidden, n_layers, n_experts, topk, moe_inter: moe_intermediate.saturating_mul(2) },
            expert_bytes,
        }
    }

    /// The named geometry of `--arch` (`qwen3-30b-a3b`, `gpt-oss-20b`, `gpt-oss-120b`).
    ///
    /// # Errors
    /// [`Error::BadOption`] listing the names for anything else.
    pub fn named(arch: &str) -> Result<Self> {
        match arch {
            "qwen3-30b-a3b" => Ok(Geometry::qwen3_30b_a3b()),
            "gpt-oss-20b" => Ok(Geometry::gpt_oss_20b()),
            "gpt-oss-120b" => Ok(Geometry::gpt_oss_120b()),
            _ => Err(Error::BadOption {
                option: "--arch",
                value: arch.to_string(),
                expected: "expected qwen3-30b-a3b, gpt-oss-20b, gpt-oss-120b or custom".into(),
            }),
        }
    }

    /// Checks that the geometry makes a valid image: non-zero dimensions, `topk <= n_experts`, a
    /// non-empty payload.
    ///
    /// # Errors
    /// [`Error::BadOption`] naming the field.
    pub fn check(&self) -> Result<()> {
        let d = &self.dims;
        for (name, v) in [
            ("--hidden", u64::from(d.hidden)),
            ("--model-layers", u64::from(d.n_layers)),
            ("--experts", u64::from(d.n_experts)),
            ("--topk", u64::from(d.topk)),
            ("--moe-intermediate", u64::from(d.moe_inter)),
            ("--expert-bytes", self.expert_bytes),
        ] {
            if v == 0 {
                return Err(Error::BadOption {
                    option: name,
                    value: "0".into(),
                    expected: "must be at least 1".into(),
                });
            }
        }
        if d.topk > d.n_experts {
            return Err(Error::BadOption {
                option: "--topk",
                value: d.topk.to_string(),
                expected: format!("exceeds --experts {}", d.n_experts),
            });
        }
        Ok(())
    }
}

/// Options of [`synth`] and [`synth_to`].
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// The geometry.
    pub geometry: Geometry,
    /// Write only the first N layers' entries (a prefix store, as `pack --layers`); default all.
    pub layers: Option<u32>,
    /// Seed of the payload bytes: the same seed and geometry give the same image, byte for byte.
    pub seed: u64,
    /// Show a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

/// What [`synth`] wrote: the image writer's report with synth's summary (fields reachable
/// through `Deref`: `report.seed`).
pub type SynthReport = WriteReport<Synthesized>;

/// Synth's part of a [`SynthReport`].
#[derive(Clone, Debug)]
pub struct Synthesized {
    /// Bytes of each payload.
    pub expert_bytes: u64,
    /// The payload seed.
    pub seed: u64,
}

impl ReportHead for Synthesized {
    fn fmt_head(r: &WriteReport<Synthesized>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (dest, sb, bytes, elapsed) = (&r.dest, &r.superblock, r.bytes, r.elapsed);
        let layers = sb.image_layers();
        writeln!(f, "synthesized {dest}")?;
        writeln!(
            f,
            "  {} entries ({layers} of {} layers × {} experts) of {} bytes (seeded random, seed {})",
            sb.n_entries, sb.n_layers, sb.n_experts, r.expert_bytes, r.seed
        )?;
        write!(
            f,
            "  superblock: hidden {}, topk {}, moe_inter {}; {} bytes, {:.2?} ({:.0} MB/s)",
            sb.hidden,
            sb.topk,
            sb.moe_inter,
            bytes,
            elapsed,
            bytes as f64 / 1e6 / elapsed.as_secs_f64().max(1e-9)
        )
    }
}

impl SynthOptions {
    fn n_entries(&self) -> Result<u32> {
        self.geometry.check()?;
        let d = self.geometry.dims;
        let layers = self.layers.unwrap_or(d.n_layers);
        if layers == 0 || layers > d.n_layers {
            return Err(Error::BadOption {
                option: "--layers",
                value: layers.to_string(),
                expected: format!("the model has {} layers (use 1..={})", d.n_layers, d.n_layers),
            });
        }
        u32::try_from(u64::from(layers) * u64::from(d.n_experts))
            .map_err(|_| Error::TooManyEntries { layers: u64::from(layers), experts: u64::from(d.n_experts) })
    }

    /// The size in bytes of the image to be written to `dest` — superblock and index blocks, then
    /// one padded payload per entry — checked against the format's limits
    /// ([`picchio_core::format::plan_image_len`]) before anything is written.
    ///
    /// # Errors
    /// As [`Geometry::check`]; [`Error::BadOption`] for `layers` out of range,
    /// [`Error::TooManyEntries`] for more entries than a u32 holds; [`Error::Store`] ([`picchio_core::Error::FormatLimit`]) for a payload over
    /// [`picchio_core::format::MAX_PAYLOAD_LEN`], naming `dest`, the entry and the limit.
    pub fn plan(&self, dest: &Path) -> Result<u64> {
        let n = self.n_entries()?;
        Ok(plan_image_len(dest, self.geometry.dims, n, [self.geometry.expert_bytes])?)
    }
}

/// Fills `out` with the payload of entry `index` for `seed`: [`SplitMix64::stream`]`(seed, index)`
/// (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014), eight
/// little-endian bytes per step ([`SplitMix64::fill_bytes`]). Independent of thread count and of the
/// other entries.
pub fn fill_payload(seed: u64, index: u32, out: &mut [u8]) {
    SplitMix64::stream(seed, u64::from(index)).fill_bytes(out);
}

/// Bytes of payload buffers [`write_payloads`] keeps at most (beyond one payload).
const BATCH_BYTES: usize = 256 << 20;

/// Generates the payloads in parallel batches and pushes them in (layer, expert) order, polling
/// [`crate::interrupt`] before each push: on SIGINT/SIGTERM the error drops `w`, which removes its
/// temporary file.
fn write_payloads<S: ImageSink>(mut w: FlatWriter<S>, opts: &SynthOptions, n_entries: u32) -> Result<Superblock> {
    let bar = progress::bar(u64::from(n_entries), "synth", !opts.progress);
    let len = usize::try_from(opts.geometry.expert_bytes)
        .map_err(|_| Error::PayloadTooLarge { bytes: opts.geometry.expert_bytes })?;
    // Two payloads per thread, but never gigabytes of buffers for huge payloads.
    let batch = (rayon::current_num_threads().max(1) * 2).min((BATCH_BYTES / len.max(1)).max(1));
    let mut bufs: Vec<Vec<u8>> = (0..batch.min(n_entries as usize)).map(|_| vec![0u8; len]).collect();
    let mut next = 0u32;
    while next < n_entries {
        let n = (n_entries - next).min(batch as u32) as usize;
        bufs[..n].par_iter_mut().enumerate().for_each(|(i, b)| fill_payload(opts.seed, next + i as u32, b));
        for (i, b) in bufs[..n].iter().enumerate() {
            crate::interrupt::check(next as usize + i, n_entries as usize, "payloads")?;
            w.push(b)?;
            bar.inc(1);
        }
        next += n as u32;
    }
    let sb = w.finish()?;
    bar.finish_and_clear();
    Ok(sb)
}

/// Synth's payloads for the image writer: the options with their entry count checked.
struct Source<'a> {
    opts: &'a SynthOptions,
    n_entries: u32,
}

impl PayloadSource for Source<'_> {
    type Summary = Synthesized;

    fn command(&self) -> &'static str {
        "synth"
    }

    fn progress(&self) -> bool {
        self.opts.progress
    }

    fn dims(&self) -> StoreDims {
        self.opts.geometry.dims
    }

    fn n_entries(&self) -> u32 {
        self.n_entries
    }

    fn plan(&self, dest: &Path) -> Result<u64> {
        self.opts.plan(dest)
    }

    fn write<S: ImageSink>(&self, w: FlatWriter<S>) -> Result<(Superblock, Synthesized)> {
        let sb = write_payloads(w, self.opts, self.n_entries)?;
        Ok((sb, Synthesized { expert_bytes: self.opts.geometry.expert_bytes, seed: self.opts.seed }))
    }
}

/// Writes a synthetic image to the file `out`, atomically (temporary file + rename): [`synth_to`] a
/// `file:` target.
///
/// # Errors
/// [`Error::BadOption`] for a bad geometry or `layers`, [`Error::NotReplaced`] for an `out` that may not be replaced
/// ([`crate::image::write::check_replaceable`]: only a missing path, an empty file or an earlier
/// image), or a file system without room for the image ([`crate::image::write::check_free_space`]);
/// [`Error::Store`] for a geometry over the format's limits ([`SynthOptions::plan`]) or when writing
/// fails; [`Error::Interrupted`] after SIGINT/SIGTERM. Nothing is left at `out` (nor a temporary
/// file) after an error.
pub fn synth(out: &Path, opts: &SynthOptions) -> Result<SynthReport> {
    synth_to(WriteTo::Uri(&StoreUri::File(out.into())), opts, &WriteOptions::default(), &mut |_| {})
}

/// Writes a synthetic image to `to` through the image writer ([`crate::image::write::write_image`]:
/// a file, `raw:/dev/X[@BYTES]` or `nvme:BDF[/NSID]`, exactly as `picchio pack` writes a packed one:
/// inspect and `announce`, refuse unless `wopts.force`, write, read every hash back).
///
/// # Errors
/// As [`synth`] for the options; as [`crate::image::write::write_image`] for the target (a refusal,
/// a failed write; an interrupted NVMe write leaves the first block zeroed: no valid-looking image).
pub fn synth_to(
    to: WriteTo<'_>,
    opts: &SynthOptions,
    wopts: &WriteOptions,
    announce: &mut dyn FnMut(&Plan<'_>),
) -> Result<SynthReport> {
    let src = Source { opts, n_entries: opts.n_entries()? };
    write_image(to, &src, wopts, announce)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_geometries_have_the_real_payload_sizes() {
        let q = Geometry::qwen3_30b_a3b();
        assert_eq!((q.dims.n_layers, q.dims.n_experts, q.expert_bytes), (48, 128, 2_654_208));
        let g = Geometry::gpt_oss_20b();
        assert_eq!((g.dims.n_layers, g.dims.n_experts, g.expert_bytes), (24, 32, 13_996_800));
        let g = Geometry::gpt_oss_120b();
        assert_eq!((g.dims.n_layers, g.dims.n_experts, g.expert_bytes), (36, 128, 13_996_800));
        assert_eq!((g.dims.hidden, g.dims.topk, g.dims.moe_inter), (2880, 4, 5760));
        // Qwen3's payload is the one docs/format.md gives, 648 blocks exactly.
        assert_eq!(q.expert_bytes % 4096, 0);
        assert!(Geometry::named("llama").is_err());
    }

    #[test]
    fn oversize_geometry_is_refused_before_anything_is_written() {
        // `synth --arch custom --hidden 65536 --moe-intermediate 65536 --experts 100000
        // --model-layers 1000`: 7,247,757,312-byte payloads, 7×10^17 bytes in all.
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("cx.pf");
        let geometry = Geometry::q4(65536, 1000, 100_000, 8, 65536);
        assert_eq!(geometry.expert_bytes, 7_247_757_312, "not wrapped to a u32");
        let opts = SynthOptions { geometry, layers: None, seed: 0, progress: false };
        let e = synth(&out, &opts).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Store(picchio_core::Error::FormatLimit(l)) if l.what == "the payload" && l.value == 7_247_757_312
            ),
            "{e}"
        );
        let s = e.to_string();
        assert!(s.contains("cx.pf: entry 0 (layer 0, expert 0)") && s.contains("4294963200"), "{s}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written, no temporary file");
    }

    /// Unix only: elsewhere there is no free-space check and the write would start.
    #[cfg(unix)]
    #[test]
    fn an_image_larger_than_the_free_space_is_refused_naming_both() {
        // 3.6×10^9 payloads of 4.29 GB each (1.5×10^19 bytes, within the format's limits) fit no
        // file system: the check refuses before a byte is written.
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("big.pf");
        let mut geometry = Geometry::q4(64, 60_000, 60_000, 2, 64);
        geometry.expert_bytes = picchio_core::format::MAX_PAYLOAD_LEN;
        let opts = SynthOptions { geometry, layers: None, seed: 0, progress: false };
        let needed = opts.plan(&out).unwrap();
        let e = synth(&out, &opts).unwrap_err().to_string();
        assert!(e.contains(&format!("needs {needed} bytes")) && e.contains("available"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written, no temporary file");
    }

    #[test]
    fn payloads_are_seeded_and_distinct() {
        let mut a = vec![0u8; 4099];
        let mut b = vec![0u8; 4099];
        fill_payload(7, 3, &mut a);
        fill_payload(7, 3, &mut b);
        assert_eq!(a, b);
        fill_payload(7, 4, &mut b);
        assert_ne!(a[..64], b[..64]);
        fill_payload(8, 3, &mut b);
        assert_ne!(a[..64], b[..64]);
        // Roughly uniform bytes: every value appears.
        let mut seen = [false; 256];
        a.iter().for_each(|&x| seen[x as usize] = true);
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn writes_a_valid_prefix_image_and_refuses_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.picchioflat");
        let geometry = Geometry::q4(128, 4, 8, 2, 64);
        let opts = SynthOptions { geometry, layers: Some(2), seed: 1, progress: false };
        let r = synth(&out, &opts).unwrap();
        assert_eq!((r.superblock.n_entries, r.superblock.n_layers, r.bytes), (16, 4, opts.plan(&out).unwrap()));
        let v = crate::image::verify::verify(
            &out,
            None,
            &crate::image::verify::VerifyOptions { progress: false, ..Default::default() },
        )
        .unwrap();
        assert!(v.is_clean() && v.entries == 16, "{v}");
        // Same seed, same bytes; re-synthesizing over an image is allowed.
        let first = std::fs::read(&out).unwrap();
        synth(&out, &opts).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), first);
        let cfg = dir.path().join("config.json");
        std::fs::write(&cfg, b"{}").unwrap();
        let e = synth(&cfg, &opts).unwrap_err().to_string();
        assert!(e.contains("is not a .picchioflat image") && e.contains("synth will not replace it"), "{e}");
        let e = synth(&out, &SynthOptions { layers: Some(5), ..opts.clone() }).unwrap_err().to_string();
        assert!(e.contains("--layers 5"), "{e}");
    }
}
