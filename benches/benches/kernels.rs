//! Matrix-vector kernels at real Qwen3-30B-A3B expert shapes: the fused gate_up projection
//! (`[2 * 768, 2048]` = rows 1536, cols 2048) and down (`[2048, 768]`), for every weight layout
//! (Q4, Q3, f32, bf16) at every kernel level this CPU supports, single-threaded, plus the best level
//! split across the rayon pool (`matvec_par`).
//!
//! Throughput is reported in weight bytes read per second (packed bytes + scales), the number that
//! matters once experts stream from storage. Run: `cargo bench -p picchio-bench --bench kernels`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use picchio_runtime::kernels::{Kernels, Level, MatRef};
use picchio_runtime::quant::{quantize_q3, quantize_q4};

/// Deterministic values in [-1, 1) ([`picchio_core::rng::SplitMix64`]).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut g = picchio_core::rng::SplitMix64::new(seed);
    (0..n).map(|_| g.next_signed_f32()).collect()
}

/// One weight matrix in every layout.
struct Layouts {
    f32: Vec<f32>,
    bf16: Vec<bf16>,
    q4: (Vec<u8>, Vec<f32>),
    q3: (Vec<u8>, Vec<f32>),
}

impl Layouts {
    fn new(rows: usize, cols: usize) -> Layouts {
        let w = values(rows * cols, 0x5eed ^ (rows * cols) as u64);
        Layouts {
            bf16: w.iter().map(|&v| bf16::from_f32(v)).collect(),
            q4: quantize_q4(&w, rows, cols),
            q3: quantize_q3(&w, rows, cols),
            f32: w,
        }
    }

    /// `(name, matrix, bytes read per matvec)`.
    fn all(&self) -> [(&'static str, MatRef<'_>, usize); 4] {
        [
            ("q4", MatRef::Q4 { packed: &self.q4.0, scales: &self.q4.1 }, self.q4.0.len() + 4 * self.q4.1.len()),
            ("q3", MatRef::Q3 { packed: &self.q3.0, scales: &self.q3.1 }, self.q3.0.len() + 4 * self.q3.1.len()),
            ("f32", MatRef::F32(&self.f32), 4 * self.f32.len()),
            ("bf16", MatRef::Bf16(&self.bf16), 2 * self.bf16.len()),
        ]
    }
}

fn matvec(c: &mut Criterion) {
    let levels: Vec<Kernels> = Level::ALL.into_iter().filter_map(Kernels::new).collect();
    for level in Level::ALL.into_iter().filter(|l| !l.is_supported()) {
        eprintln!("kernels bench: level {level} not supported by this CPU, skipped");
    }
    let best = Kernels::best();
    for (name, rows, cols) in [("gate_up_1536x2048", 1536usize, 2048usize), ("down_2048x768", 2048, 768)] {
        let m = Layouts::new(rows, cols);
        let x = values(cols, 7);
        let mut y = vec![0f32; rows];
        let mut group = c.benchmark_group(format!("matvec/{name}"));
        for (fmt, w, bytes) in m.all() {
            group.throughput(Throughput::Bytes(bytes as u64));
            for k in &levels {
                group.bench_function(BenchmarkId::new(fmt, k.level()), |b| {
                    b.iter(|| k.matvec(black_box(w), black_box(&x), black_box(&mut y)))
                });
            }
            let id = format!("{}-par", best.level());
            group.bench_function(BenchmarkId::new(fmt, id), |b| {
                b.iter(|| best.matvec_par(black_box(w), black_box(&x), black_box(&mut y)))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, matvec);
criterion_main!(benches);
