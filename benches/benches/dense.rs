//! The resident dense matrices against the machine's memory bandwidth, at Qwen3-30B-A3B attention
//! shapes (hidden 2048, 32 query heads and 4 KV heads of 128):
//!
//! - `dense_vs_memory`: matrix-vector products over a weight matrix larger than the last-level cache
//!   (eight `q_proj` tiles, 32,768 × 2048) in every dense layout the runtime keeps resident (`f32`,
//!   `bf16`, `i8` rows with row scales), on one thread and split across the rayon pool
//!   (`matvec_par`, as a decode step runs them), in bytes of weights per second; beside a plain read
//!   of the same number of bytes on one thread and on every thread of the pool (the machine's read
//!   bandwidth, the ceiling a memory-bound kernel can reach).
//! - `pool_overhead`: what one split across the rayon pool costs with no work in it (`rayon::join`
//!   of two empty closures, and a `par_chunks_mut` of 64 empty chunks, `matvec_par`'s pattern), and
//!   `k_proj` (512 × 2048 `f32`, cache-resident) through `matvec` and `matvec_par`: a decode step
//!   makes about seven such splits per layer.
//!
//! Run: `cargo bench -p picchio-bench --bench dense` (add a group name to filter).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use picchio_runtime::kernels::{Kernels, MatRef};
use rayon::prelude::*;

const HIDDEN: usize = 2048;
const Q_DIM: usize = 32 * 128;
const KV_DIM: usize = 4 * 128;

/// Deterministic values in [-1, 1) ([`picchio_core::rng::SplitMix64`]).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut g = picchio_core::rng::SplitMix64::new(seed);
    (0..n).map(|_| g.next_signed_f32()).collect()
}

/// `sum` of `v` with wrapping adds (the compiler vectorises it): a read of every byte once.
fn read_all(v: &[u64]) -> u64 {
    v.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

fn dense_vs_memory(c: &mut Criterion) {
    const TILES: usize = 8;
    let rows = TILES * Q_DIM;
    let one = values(Q_DIM * HIDDEN, 21);
    let f32w = one.repeat(TILES);
    drop(one);
    let bf16w: Vec<bf16> = f32w.iter().map(|&v| bf16::from_f32(v)).collect();
    let i8w: Vec<i8> = f32w.iter().map(|&v| (v * 127.0).round() as i8).collect();
    let scales = values(rows, 22);
    let x = values(HIDDEN, 23);
    let mut y = vec![0f32; rows];
    let k = Kernels::get();
    let threads = rayon::current_num_threads();
    let mut g = c.benchmark_group("dense_vs_memory");
    g.sample_size(20);

    let layouts: [(&str, MatRef<'_>, usize); 3] = [
        ("f32", MatRef::F32(&f32w), 4 * f32w.len()),
        ("bf16", MatRef::Bf16(&bf16w), 2 * bf16w.len()),
        ("i8_rows", MatRef::I8Rows { q: &i8w, scales: &scales }, i8w.len() + 4 * scales.len()),
    ];
    for (name, m, bytes) in layouts {
        g.throughput(Throughput::Bytes(bytes as u64));
        let src: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
        g.bench_function(BenchmarkId::new(format!("memory_read_{name}_bytes"), "1-thread"), |b| {
            b.iter(|| read_all(black_box(&src)))
        });
        g.bench_function(BenchmarkId::new(format!("memory_read_{name}_bytes"), format!("{threads}-threads")), |b| {
            b.iter(|| {
                black_box(&src).par_chunks(src.len().div_ceil(threads)).map(read_all).reduce(|| 0, u64::wrapping_add)
            })
        });
        drop(src);
        g.bench_function(BenchmarkId::new(format!("{name}_matvec"), format!("{}-1-thread", k.level())), |b| {
            b.iter(|| k.matvec(black_box(m), black_box(&x), black_box(&mut y)))
        });
        g.bench_function(BenchmarkId::new(format!("{name}_matvec"), format!("{}-par-{threads}", k.level())), |b| {
            b.iter(|| k.matvec_par(black_box(m), black_box(&x), black_box(&mut y)))
        });
    }
    g.finish();
}

fn pool_overhead(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool_overhead");
    g.bench_function("join_empty", |b| b.iter(|| rayon::join(|| black_box(1), || black_box(2))));
    let mut y = vec![0f32; 64];
    g.bench_function("par_chunks_64_empty", |b| {
        b.iter(|| black_box(&mut y).par_chunks_mut(1).for_each(|c| c[0] = black_box(0.0)))
    });
    let k = Kernels::get();
    let w = values(KV_DIM * HIDDEN, 31);
    let x = values(HIDDEN, 32);
    let mut y = vec![0f32; KV_DIM];
    g.throughput(Throughput::Bytes(4 * w.len() as u64));
    g.bench_function(BenchmarkId::new("k_proj_512x2048_f32", "matvec"), |b| {
        b.iter(|| k.matvec(MatRef::F32(black_box(&w)), black_box(&x), black_box(&mut y)))
    });
    g.bench_function(BenchmarkId::new("k_proj_512x2048_f32", "matvec_par"), |b| {
        b.iter(|| k.matvec_par(MatRef::F32(black_box(&w)), black_box(&x), black_box(&mut y)))
    });
    g.finish();
}

criterion_group!(benches, dense_vs_memory, pool_overhead);
criterion_main!(benches);
