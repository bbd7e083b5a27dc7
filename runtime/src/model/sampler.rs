//! Choosing the next token from logits: greedy at temperature 0, else temperature, top-k, nucleus
//! (top-p) and min-p sampling from a seeded generator, so a run is reproducible from its `--seed`;
//! with the repetition penalty of transformers' `RepetitionPenaltyLogitsProcessor` (Picchio (C)'s
//! `REP`) and OpenAI's presence/frequency penalties applied to the logits first. Greedy without
//! penalties is `argmax` of the model's logits, bit for bit what `run` always chose.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerOptions {
    /// Softmax temperature; 0 means greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables top-p.
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
    /// Keep only the `top_k` most probable tokens; 0 disables top-k.
    pub top_k: usize,
    /// Keep only tokens whose probability is at least `min_p` × the most probable one's; 0 disables.
    pub min_p: f32,
    /// transformers' repetition penalty over every id of the sequence so far (prompt and generated):
    /// a positive logit is divided by it, a negative one multiplied; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every id generated so far.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from an id's logit once per time it was generated.
    pub frequency_penalty: f32,
}

impl Default for SamplerOptions {
    fn default() -> Self {
        SamplerOptions {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplerOptions {
    /// Whether any penalty changes the logits.
    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Checks the ranges: temperature finite and >= 0, top_p in (0, 1], min_p in [0, 1],
    /// repetition_penalty finite and > 0, presence/frequency penalties finite.
    ///
    /// # Errors
    /// A message naming the setting and its range.
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be a finite number >= 0 (0 is greedy), got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty must be a finite number > 0 (1 is none), got {}",
                self.repetition_penalty
            ));
        }
        if !(self.presence_penalty.is_finite() && self.frequency_penalty.is_finite()) {
            return Err("presence_penalty and frequency_penalty must be finite numbers".into());
        }
        Ok(())
    }
}

/// A token chooser (holds the random generator and a scratch buffer).
pub struct Sampler {
    opts: SamplerOptions,
    rng: StdRng,
    probs: Vec<(f32, u32)>,
    penalized: Vec<f32>,
    counts: std::collections::HashMap<u32, u32>,
}

/// Index of the largest logit (the first one on ties, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler with `opts`.
    pub fn new(opts: SamplerOptions) -> Self {
        Sampler {
            opts,
            rng: StdRng::seed_from_u64(opts.seed),
            probs: Vec::new(),
            penalized: Vec::new(),
            counts: Default::default(),
        }
    }

    /// Picks the next token id from `logits` after applying the penalties: the repetition penalty
    /// to every id of `sequence` (the prompt and what was generated), the presence and frequency
    /// penalties to the ids of `generated`. Without penalties this is [`Sampler::sample`].
    pub fn sample_after(&mut self, logits: &[f32], sequence: &[u32], generated: &[u32]) -> u32 {
        if !self.opts.penalizes() {
            return self.sample(logits);
        }
        let mut l = std::mem::take(&mut self.penalized);
        l.clear();
        l.extend_from_slice(logits);
        let rp = self.opts.repetition_penalty;
        if rp != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in sequence {
                if let Some(v) = l.get_mut(t as usize).filter(|_| seen.insert(t)) {
                    *v = if *v > 0.0 { *v / rp } else { *v * rp };
                }
            }
        }
        if self.opts.presence_penalty != 0.0 || self.opts.frequency_penalty != 0.0 {
            self.counts.clear();
            for &t in generated {
                *self.counts.entry(t).or_default() += 1;
            }
            for (&t, &n) in &self.counts {
                if let Some(v) = l.get_mut(t as usize) {
                    *v -= self.opts.presence_penalty + self.opts.frequency_penalty * n as f32;
                }
            }
        }
        let next = self.sample(&l);
        self.penalized = l;
        next
    }

    /// Picks the next token id from `logits` (one per vocabulary id).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.opts.temperature <= 0.0 {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.probs.clear();
        let mut sum = 0.0f64;
        for (i, &l) in logits.iter().enumerate() {
            let p = ((l - max) / self.opts.temperature).exp();
            sum += f64::from(p);
            self.probs.push((p, i as u32));
        }
        // Descending probability, ties by id: the nucleus is a deterministic prefix.
        self.probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let cut = f64::from(self.opts.top_p.clamp(f32::MIN_POSITIVE, 1.0)) * sum;
        let mut kept = 0.0f64;
        let mut n = 0;
        let top_k = if self.opts.top_k == 0 { usize::MAX } else { self.opts.top_k };
        // min-p: the threshold relative to the most probable token (probs[0], unnormalized).
        let floor = self.probs[0].0 * self.opts.min_p;
        for &(p, _) in &self.probs {
            if n == top_k || (n > 0 && p < floor) {
                break;
            }
            kept += f64::from(p);
            n += 1;
            if kept >= cut {
                break;
            }
        }
        let r = self.rng.gen::<f64>() * kept;
        let mut acc = 0.0f64;
        for &(p, id) in &self.probs[..n] {
            acc += f64::from(p);
            if r < acc {
                return id;
            }
        }
        self.probs[n - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_max_and_sampling_is_seeded() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplerOptions { temperature: 0.8, top_p: 0.9, seed, ..Default::default() });
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // top_p tiny keeps only the argmax.
        let mut s = Sampler::new(SamplerOptions { temperature: 1.0, top_p: 1e-9, seed: 1, ..Default::default() });
        assert!((0..10).all(|_| s.sample(&logits) == argmax(&logits)));
    }

    /// The ids a sampler draws from `logits` over `n` draws.
    fn drawn(opts: SamplerOptions, logits: &[f32], n: usize) -> std::collections::BTreeSet<u32> {
        let mut s = Sampler::new(opts);
        (0..n).map(|_| s.sample(logits)).collect()
    }

    #[test]
    fn top_k_and_min_p_cut_the_candidates() {
        // Probabilities at temperature 1 ∝ e^l: ids 0..4 with logits 4, 3, 2, 1, 0.
        let logits = [4.0f32, 3.0, 2.0, 1.0, 0.0];
        let t1 = SamplerOptions { temperature: 1.0, seed: 3, ..Default::default() };
        assert_eq!(drawn(t1, &logits, 2000), (0..5).collect());
        assert_eq!(drawn(SamplerOptions { top_k: 2, ..t1 }, &logits, 2000), [0, 1].into());
        assert_eq!(drawn(SamplerOptions { top_k: 1, ..t1 }, &logits, 200), [0].into());
        // min_p 0.2: e^-1 = 0.37 and e^-2 = 0.135 of the top: ids 0 and 1 stay.
        assert_eq!(drawn(SamplerOptions { min_p: 0.2, ..t1 }, &logits, 2000), [0, 1].into());
        assert_eq!(drawn(SamplerOptions { min_p: 0.1, ..t1 }, &logits, 2000), [0, 1, 2].into());
    }

    #[test]
    fn penalties_follow_transformers_and_openai() {
        let logits = [2.0f32, 1.9, -1.0, 0.5];
        let g = SamplerOptions::default();
        let mut s = Sampler::new(g);
        // No penalty: the argmax of the logits themselves.
        assert_eq!(s.sample_after(&logits, &[0, 0, 3], &[0]), 0);
        // Repetition 1.1: 2.0 / 1.1 = 1.818 < 1.9, so id 1 wins; once per id however often it occurs.
        let mut s = Sampler::new(SamplerOptions { repetition_penalty: 1.1, ..g });
        assert_eq!(s.sample_after(&logits, &[0, 0, 0], &[]), 1);
        // 1.05: 2.0 / 1.05 = 1.905 > 1.9 stays.
        let mut s = Sampler::new(SamplerOptions { repetition_penalty: 1.05, ..g });
        assert_eq!(s.sample_after(&logits, &[0], &[]), 0);
        // A negative logit is multiplied: -1.0 * 3 = -3 falls below -2.5.
        let mut s = Sampler::new(SamplerOptions { repetition_penalty: 3.0, ..g });
        assert_eq!(s.sample_after(&[-1.0, -2.5], &[0], &[]), 1);
        assert_eq!(s.sample_after(&[-1.0, -2.5, -2.9], &[0, 1], &[]), 2);
        // Frequency 0.06 per occurrence: two occurrences of id 0 cost 0.12 -> 1.88 < 1.9.
        let mut s = Sampler::new(SamplerOptions { frequency_penalty: 0.06, ..g });
        assert_eq!(s.sample_after(&logits, &[], &[0]), 0);
        assert_eq!(s.sample_after(&logits, &[], &[0, 0]), 1);
        // Presence once, whatever the count.
        let mut s = Sampler::new(SamplerOptions { presence_penalty: 0.2, ..g });
        assert_eq!(s.sample_after(&logits, &[], &[0, 0, 0, 1]), 0);
        assert_eq!(s.sample_after(&logits, &[], &[0]), 1);
    }

    #[test]
    fn options_are_range_checked() {
        let ok = SamplerOptions::default();
        assert!(ok.check().is_ok());
        for (bad, what) in [
            (SamplerOptions { temperature: -1.0, ..ok }, "temperature"),
            (SamplerOptions { top_p: 0.0, ..ok }, "top_p"),
            (SamplerOptions { min_p: 1.5, ..ok }, "min_p"),
            (SamplerOptions { repetition_penalty: 0.0, ..ok }, "repetition_penalty"),
            (SamplerOptions { presence_penalty: f32::NAN, ..ok }, "presence_penalty"),
        ] {
            assert!(bad.check().unwrap_err().contains(what), "{what}");
        }
    }
}
