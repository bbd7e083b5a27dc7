//! Micro-benchmarks of the pieces an expert miss goes through, at Qwen3-30B-A3B shapes (hidden 2048,
//! expert width 768, Q4 expert payload 2,654,208 B):
//!
//! - `weights_vs_memory`: Q4 and Q3 matvec over a weight matrix larger than the last-level cache (48
//!   experts' gate_up rows, 73,728 × 2048), in bytes of weights per second, beside the machine's own
//!   memory bandwidth measured the same way (a sum over the same number of bytes, and a memcpy), so
//!   "GB/s of weights" can be read as a fraction of what the memory delivers.
//! - `expert_forward`: one routed expert on one token (gate_up matvec + SwiGLU + down matvec), Q4 and
//!   Q3, as the runtime runs it (`moe::expert_forward`: matvecs split across the rayon pool);
//!   throughput in payload bytes.
//! - `store_open`: `FlatStore::open` of a 48 × 128-entry image (superblock read and checks, index
//!   read, SHA-256 of the 147 KiB index, every entry checked).
//! - `cached_read`: one expert-sized (2,654,208 B) and one 4 KiB read of a page-cache-hot file through
//!   the psync pool and io_uring, at QD 1 (the kernel's copy included; psync's figure also includes
//!   handing each read to a pool thread and back).
//!
//! - `ggml_matvec`: one GGUF weight matrix used as stored (`MatRef::Ggml`: the input quantized to
//!   Q8_0/Q8_K, then ggml's dot product per row) of each ggml type at a real size (Qwen3-30B-A3B's
//!   expert gate `[768, 2048]` and down `[2048, 768]` for the K-quants, gpt-oss's `[2880, 2880]` for
//!   the 32-element types), at every kernel level, one thread; throughput in weight bytes.
//!
//! Run: `cargo bench -p picchio-bench --bench micro` (add a group name to filter).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use picchio_core::format::gguf::GgmlType;
use picchio_core::io::read_blocking;
use picchio_core::loader::StoreDims;
use picchio_core::{AlignedBuf, FlatStore, FlatStoreOptions, FlatWriter};
use picchio_runtime::expert::layout::ExpertLayout;
use picchio_runtime::image::convert::expert_payload;
use picchio_runtime::kernels::{Kernels, Level, MatRef};
use picchio_runtime::model::moe::{expert_forward, ExpertScratch};
use picchio_runtime::quant::{quantize_q3, quantize_q4, QuantKind};

const HIDDEN: usize = 2048;
const INTER: usize = 768;

/// Deterministic values in [-1, 1) ([`picchio_core::rng::SplitMix64`]).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut g = picchio_core::rng::SplitMix64::new(seed);
    (0..n).map(|_| g.next_signed_f32()).collect()
}

fn weights_vs_memory(c: &mut Criterion) {
    // 48 experts' gate_up rows (73,728 × 2048): 75 MB of Q4 codes + scales, 57 MB of Q3, both well
    // beyond this machine's 32 MiB L3. One expert's matrix is quantized and tiled (the bytes a
    // kernel reads cost the same whatever the values).
    const TILES: usize = 48;
    let (one, cols) = (2 * INTER, HIDDEN);
    let rows = TILES * one;
    let w = values(one * cols, 11);
    let tile = |(p, s): (Vec<u8>, Vec<f32>)| (p.repeat(TILES), s.repeat(TILES));
    let q4 = tile(quantize_q4(&w, one, cols));
    let q3 = tile(quantize_q3(&w, one, cols));
    drop(w);
    let x = values(cols, 3);
    let mut y = vec![0f32; rows];
    let k = Kernels::best();
    let mut g = c.benchmark_group("weights_vs_memory");
    g.sample_size(20);

    let q4_bytes = q4.0.len() + 4 * q4.1.len();
    g.throughput(Throughput::Bytes(q4_bytes as u64));
    // The memory baseline over the same byte count: a sum that reads every byte once (u64 lanes the
    // compiler vectorises), and a copy (read + write: criterion counts the bytes copied).
    let src: Vec<u64> = (0..q4_bytes / 8).map(|i| i as u64).collect();
    let mut dst = vec![0u64; src.len()];
    g.bench_function("memory_sum", |b| b.iter(|| black_box(&src).iter().fold(0u64, |a, &v| a.wrapping_add(v))));
    g.bench_function("memory_copy", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
    let m = MatRef::Q4 { packed: &q4.0, scales: &q4.1 };
    g.bench_function(BenchmarkId::new("q4_matvec", k.level()), |b| {
        b.iter(|| k.matvec(black_box(m), black_box(&x), black_box(&mut y)))
    });
    g.bench_function(BenchmarkId::new("q4_matvec", format!("{}-par", k.level())), |b| {
        b.iter(|| k.matvec_par(black_box(m), black_box(&x), black_box(&mut y)))
    });
    let q3_bytes = q3.0.len() + 4 * q3.1.len();
    g.throughput(Throughput::Bytes(q3_bytes as u64));
    let m = MatRef::Q3 { packed: &q3.0, scales: &q3.1 };
    g.bench_function(BenchmarkId::new("q3_matvec", k.level()), |b| {
        b.iter(|| k.matvec(black_box(m), black_box(&x), black_box(&mut y)))
    });
    g.bench_function(BenchmarkId::new("q3_matvec", format!("{}-par", k.level())), |b| {
        b.iter(|| k.matvec_par(black_box(m), black_box(&x), black_box(&mut y)))
    });
    g.finish();
}

/// An expert payload for `quant`, made by `picchio convert`'s own [`expert_payload`].
fn expert_payload_buf(layout: &ExpertLayout) -> AlignedBuf {
    let (h, i) = (layout.hidden, layout.inter);
    let (gate, up, down) = (values(i * h, 5), values(i * h, 7), values(h * i, 6));
    let payload = expert_payload(layout, &gate, &up, &down).expect("benchmarked for Q4 and Q3");
    let mut buf = AlignedBuf::new(layout.len(), 4096).expect("payload buffer");
    buf.as_mut_slice()[..payload.len()].copy_from_slice(&payload);
    buf
}

fn expert(c: &mut Criterion) {
    let mut g = c.benchmark_group("expert_forward");
    let x = values(HIDDEN, 9);
    let mut out = vec![0f32; HIDDEN];
    let mut scratch = ExpertScratch::new(INTER);
    for quant in [QuantKind::Q4, QuantKind::Q3] {
        let layout = ExpertLayout::new(quant, HIDDEN, INTER).expect("Qwen3-30B-A3B expert layout");
        let payload = expert_payload_buf(&layout);
        g.throughput(Throughput::Bytes(layout.len() as u64));
        // `expert_forward` runs its matvecs on the rayon pool, as the runtime does.
        g.bench_function(BenchmarkId::new(quant.to_string(), "2048x768"), |b| {
            b.iter(|| {
                expert_forward(
                    Kernels::get(),
                    &layout,
                    0,
                    payload.as_slice(),
                    black_box(&x),
                    0.5,
                    &mut scratch,
                    &mut out,
                )
                .expect("expert forward")
            })
        });
    }
    g.finish();
}

/// A Qwen3-30B-A3B-shaped image (48 layers × 128 experts) with one-block payloads: opening it costs
/// what opening the real 16 GB image costs (superblock + index), without writing 16 GB.
fn write_image(path: &std::path::Path) -> u64 {
    let dims = StoreDims { hidden: 2048, n_layers: 48, n_experts: 128, topk: 8, moe_inter: 2 * 768 };
    let n = dims.n_layers * dims.n_experts;
    let mut w = FlatWriter::create(path, dims, n).expect("create image");
    let mut payload = vec![0u8; 4096];
    for i in 0..n {
        payload[..4].copy_from_slice(&i.to_le_bytes());
        w.push(&payload).expect("push payload");
    }
    w.finish().expect("finish image");
    std::fs::metadata(path).expect("stat image").len()
}

fn store_open(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q30b.picchioflat");
    let len = write_image(&path);
    let mut g = c.benchmark_group("store_open");
    g.bench_function("flatstore_48x128_buffered", |b| {
        b.iter(|| {
            let q =
                picchio_blockdev::PsyncQueue::open(&path, picchio_blockdev::PsyncOptions { threads: 1, direct: false })
                    .expect("open");
            let opts = FlatStoreOptions { image_len: len, ..Default::default() };
            black_box(FlatStore::open(q, "bench", opts).expect("store open"))
        })
    });
    g.finish();
}

fn cached_read(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hot.bin");
    let expert = 2_654_208u32;
    // 64 MiB, just written: its pages are in the page cache, so this measures the software path
    // and the kernel's copy, not a device.
    std::fs::write(&path, vec![0x5au8; 64 << 20]).expect("write the file");
    let mut g = c.benchmark_group("cached_read");
    for (name, len) in [("expert_2654208B", expert), ("4KiB", 4096)] {
        g.throughput(Throughput::Bytes(u64::from(len)));
        let mut psync =
            picchio_blockdev::PsyncQueue::open(&path, picchio_blockdev::PsyncOptions { threads: 1, direct: false })
                .expect("psync");
        let mut off = 0u64;
        let span = (64u64 << 20) - u64::from(len);
        g.bench_function(BenchmarkId::new("psync", name), |b| {
            b.iter(|| {
                off = (off + 1_048_576 + 4096) % span / 4096 * 4096;
                black_box(read_blocking(&mut psync, off, len).expect("read"))
            })
        });
        #[cfg(target_os = "linux")]
        {
            let opts = picchio_blockdev::UringOptions {
                qd: 1,
                direct: false,
                sqpoll: false,
                iopoll: false,
                register_files: true,
            };
            match picchio_blockdev::UringQueue::open(&path, opts) {
                Ok(mut uring) => {
                    g.bench_function(BenchmarkId::new("uring", name), |b| {
                        b.iter(|| {
                            off = (off + 1_048_576 + 4096) % span / 4096 * 4096;
                            black_box(read_blocking(&mut uring, off, len).expect("read"))
                        })
                    });
                }
                Err(e) => eprintln!("cached_read: io_uring unavailable here ({e}); uring skipped"),
            }
        }
    }
    g.finish();
}

/// `rows × cols` weights of ggml type `ty` (random codes, every f16 scale field a small normal f16,
/// MXFP4 exponents near 1): the bytes cost the same whatever the values.
fn ggml_weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let mut g = picchio_core::rng::SplitMix64::new(ty as u64 + 17);
    let bb = ty.block_bytes() as usize;
    let mut w: Vec<u8> = (0..rows * cols / ty.block_elems() as usize * bb).map(|_| g.next_u64() as u8).collect();
    let f16_fields = picchio_runtime::kernels::ggml::f16_scale_fields(ty);
    for b in w.chunks_exact_mut(bb) {
        for &at in f16_fields {
            let v = half::f16::from_f32(g.next_signed_f32() * 0.01);
            b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
        if ty == GgmlType::MXFP4 {
            b[0] = 120 + b[0] % 10;
        }
    }
    w
}

fn ggml_matvec(c: &mut Criterion) {
    use GgmlType::*;
    let cases: [(GgmlType, usize, usize); 15] = [
        (Q4_K, INTER, HIDDEN),
        (Q4_K, HIDDEN, INTER),
        (Q6_K, INTER, HIDDEN),
        (Q6_K, HIDDEN, INTER),
        (Q8_0, 2880, 2880),
        (MXFP4, 2880, 2880),
        (Q5_K, INTER, HIDDEN),
        (Q5_K, HIDDEN, INTER),
        (Q3_K, INTER, HIDDEN),
        (Q2_K, INTER, HIDDEN),
        (Q4_0, 2880, 2880),
        (Q4_1, 2880, 2880),
        (Q5_0, 2880, 2880),
        (Q5_1, 2880, 2880),
        (Q8_0, HIDDEN, INTER),
    ];
    let mut g = c.benchmark_group("ggml_matvec");
    g.sample_size(10)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    for (ty, rows, cols) in cases {
        let w = ggml_weights(ty, rows, cols);
        let x = values(cols, 5);
        let mut y = vec![0f32; rows];
        g.throughput(Throughput::Bytes(w.len() as u64));
        for level in Level::ALL {
            let Some(k) = Kernels::new(level) else {
                eprintln!("ggml_matvec: {level} not supported here, skipped");
                continue;
            };
            let m = MatRef::Ggml { ty, data: &w };
            g.bench_function(BenchmarkId::new(format!("{ty}_{rows}x{cols}"), level), |b| {
                b.iter(|| k.matvec(black_box(m), black_box(&x), black_box(&mut y)))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, weights_vs_memory, expert, store_open, cached_read, ggml_matvec);
criterion_main!(benches);
