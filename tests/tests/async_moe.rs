//! Async MoE does not change a bit: with experts delivered in a seeded random completion order (by
//! [`MockShuffledCompletions`], a test double wrapping a real loader), the hidden states of every
//! layer and the logits of every position are bit-identical to an in-order run, with async MoE on
//! (compute each expert in completion order) and off (compute a batch in request order after it is
//! loaded), for expert-cache capacities 1, 3 and all, with the decode step's reads on this thread,
//! on an I/O worker thread (overlapped with the hits' compute, the default) and with speculative
//! prefetch of the next layer's experts, over the safetensors loader and over a real `FlatStore`
//! read by io_uring (psync where io_uring is unavailable, said visibly).

use picchio_core::{AlignedBuf, ExpertLoader, Loaded};
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::expert::store::open_flat_file;
use picchio_runtime::model::sampler::argmax;
use picchio_runtime::model::{DecodeSchedule, Model, Trace};
use picchio_tests::*;

/// Test double: serves each `load` through the wrapped real loader in random sub-batches, and hands
/// every sub-batch's experts to `ready` in a seeded random order, so completion order differs from
/// request order and compute interleaves with loading as it does with a deep queue.
struct MockShuffledCompletions<L> {
    inner: L,
    rng: Rng,
    /// Deliveries that came in another order than requested (to show the mock did reorder).
    reordered: usize,
}

impl<L: ExpertLoader> MockShuffledCompletions<L> {
    fn new(inner: L, seed: u64) -> Self {
        MockShuffledCompletions { inner, rng: Rng(picchio_core::rng::SplitMix64::new(seed)), reordered: 0 }
    }
}

impl<L: ExpertLoader> ExpertLoader for MockShuffledCompletions<L> {
    fn describe(&self) -> String {
        format!("mock shuffled completions over {}", self.inner.describe())
    }

    fn load(&mut self, layer: u32, mut requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        while !requests.is_empty() {
            let n = 1 + self.rng.below(requests.len() as u64) as usize;
            let rest = requests.split_off(n);
            let asked: Vec<u32> = requests.iter().map(|r| r.0).collect();
            let mut got = Vec::with_capacity(n);
            self.inner.load(layer, std::mem::replace(&mut requests, rest), &mut |l| got.push(l));
            // Fisher-Yates with the seeded generator; a shuffle that came out as the identity is
            // turned into one that is not (completion order is to differ from request order).
            for i in (1..got.len()).rev() {
                got.swap(i, self.rng.below(i as u64 + 1) as usize);
            }
            if got.len() > 1 && got.iter().map(|l| l.key.expert).eq(asked.iter().copied()) {
                got.swap(0, 1);
            }
            if got.iter().map(|l| l.key.expert).ne(asked.iter().copied()) {
                self.reordered += 1;
            }
            got.into_iter().for_each(&mut *ready);
        }
    }
}

/// [`SplitMix64`](picchio_core::rng::SplitMix64), as a uniform index generator.
struct Rng(picchio_core::rng::SplitMix64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
}

/// Everything a run produced, as bits: per position, every hidden-state row, then the logits.
#[derive(PartialEq)]
struct Bits(Vec<Vec<u32>>);

impl std::fmt::Debug for Bits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} positions", self.0.len())
    }
}

const N: usize = 12;

fn c_prompt() -> Vec<u32> {
    ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids")
}

/// Runs `tokens` (teacher-forced) through the model with `loader`; returns the bits of every
/// position and the greedy choice after each.
fn run(
    model: &mut Model,
    ecap: usize,
    async_moe: bool,
    loader: &mut dyn ExpertLoader,
    tokens: &[u32],
) -> (Bits, Vec<u32>) {
    run_with(model, ecap, async_moe, DecodeSchedule::default(), loader, tokens)
}

/// [`run`] with the decode step's reads scheduled as `dio` says (its `async_moe` is the cache's: `async_moe`).
fn run_with(
    model: &mut Model,
    ecap: usize,
    async_moe: bool,
    dio: DecodeSchedule,
    loader: &mut dyn ExpertLoader,
    tokens: &[u32],
) -> (Bits, Vec<u32>) {
    model.set_decode_schedule(dio);
    let mut cache = model.new_cache(ecap).unwrap();
    cache.set_async_moe(async_moe);
    let mut trace = Trace::new(model.config());
    let mut bits = Vec::new();
    let mut greedy = Vec::new();
    for (pos, &t) in tokens.iter().enumerate() {
        let logits = model.forward_traced(t, pos, &mut cache, loader, Some(&mut trace)).unwrap();
        greedy.push(argmax(logits));
        let mut row: Vec<u32> = logits.iter().map(|v| v.to_bits()).collect();
        row.extend(trace.hidden.iter().flatten().map(|v| v.to_bits()));
        bits.push(row);
    }
    let p = cache.prefetch_stats();
    assert_eq!(p.issued, p.used + p.wasted, "every prefetched expert judged: {p:?}");
    assert!(dio.prefetch || p.issued == 0, "no prefetch without --prefetch: {p:?}");
    model.set_decode_schedule(DecodeSchedule::default());
    (Bits(bits), greedy)
}

#[test]
fn shuffled_completions_give_bit_identical_hidden_states_and_logits() {
    let dir = fixture("picchio_c/qwen3_moe");
    let prompt = c_prompt();
    let mut model = Model::load(&picchio_runtime::ModelDir::open(&dir).unwrap(), prompt.len() + N).unwrap();
    let total = model.config().moe_layers().len() * model.config().num_experts;

    // Reference: in order (the safetensors loader delivers in request order), async on, every
    // expert fits; its greedy continuation is Picchio (C)'s.
    let mut tokens = prompt.clone();
    {
        let mut cache = model.new_cache(total).unwrap();
        let mut st = model.in_place_loader();
        for pos in 0..prompt.len() + N - 1 {
            let logits = model.forward(tokens[pos], pos, &mut cache, &mut st).unwrap();
            if pos + 1 >= prompt.len() {
                tokens.push(argmax(logits));
            }
        }
    }
    assert_eq!(tokens[prompt.len()..], PICCHIO_C_TOKENS[..N]);
    let mut in_order = model.in_place_loader();
    let (want, _) = run(&mut model, total, true, &mut in_order, &tokens);

    // On Linux the flat store is served by io_uring, which must work here (a failure names why).
    let uring = cfg!(target_os = "linux");
    if uring {
        if let Err(e) = uring_probe() {
            panic!("io_uring unavailable here (kernel, sysctl or seccomp): {e:?}");
        }
    }
    let io = EngineOptions {
        engine: if uring { IoEngine::Uring } else { IoEngine::Psync },
        qd: 4,
        ..EngineOptions::default()
    };
    let image = dir.join("experts.picchioflat");
    let mut runs = 0;
    let dios = [
        DecodeSchedule { async_moe: true, overlap: false, prefetch: false },
        DecodeSchedule { async_moe: true, overlap: true, prefetch: false },
        DecodeSchedule { async_moe: true, overlap: true, prefetch: true },
    ];
    for ecap in [1, 3, total] {
        for async_moe in [true, false] {
            for (seed, dio) in [1, 2, 3].into_iter().flat_map(|s| dios.map(|d| (s, d))) {
                let what = format!("ecap {ecap}, async {async_moe}, seed {seed}, {dio:?}");
                let mut st = MockShuffledCompletions::new(model.in_place_loader(), seed);
                let (got, _) = run_with(&mut model, ecap, async_moe, dio, &mut st, &tokens);
                assert!(got == want, "safetensors, {what}: differs from the in-order run");
                // (ecap 1 loads one expert at a time: nothing to reorder.)
                assert!(ecap == 1 || st.reordered > 0, "{what}: the mock never reordered");

                let flat = open_flat_file(&image, model.config(), model.layout(), io, false).unwrap();
                let engine = flat.describe();
                assert!(!uring || engine.contains("uring(direct, qd 4, fixed file)"), "{engine}");
                let mut flat = MockShuffledCompletions::new(flat, seed ^ 0xA5);
                let (got, greedy) = run_with(&mut model, ecap, async_moe, dio, &mut flat, &tokens);
                assert!(got == want, "{engine}, {what}: differs from the in-order run");
                assert_eq!(greedy[prompt.len() - 1..prompt.len() - 1 + N], PICCHIO_C_TOKENS[..N]);
                runs += 2;
            }
        }
    }
    eprintln!("{runs} shuffled runs bit-identical to the in-order run");
}

#[test]
fn async_toggle_through_sessions_keeps_the_tokens_and_is_reported() {
    let dir = fixture("picchio_c/qwen3_moe");
    for async_moe in [true, false] {
        let opts = picchio_runtime::run::SessionOptions {
            model: picchio_runtime::ModelDir::open(&dir).unwrap(),
            store: picchio_core::StoreUri::File(dir.join("experts.picchioflat")),
            engine: EngineOptions::default(),
            schedule: DecodeSchedule { async_moe, ..DecodeSchedule::default() },
            verify: false,
            ecap: Some(3),
            max_seq: c_prompt().len() + 16,
            dense: Default::default(),
        };
        let (g, s) = greedy_with(&opts, &c_prompt(), 16).unwrap();
        assert_eq!(g.tokens, PICCHIO_C_TOKENS, "async {async_moe}");
        assert_eq!((g.stats.async_moe, s.cache.async_moe()), (async_moe, async_moe));
    }
}

#[cfg(target_os = "linux")]
fn uring_probe() -> Result<(), String> {
    picchio_blockdev::UringQueue::probe().map_err(|e| e.to_string())
}

#[cfg(not(target_os = "linux"))]
fn uring_probe() -> Result<(), String> {
    Err("io_uring is Linux-only".into())
}
