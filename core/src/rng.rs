//! One seeded pseudo-random generator for the whole workspace: SplitMix64.
//!
//! Source: G. L. Steele Jr., D. Lea, C. H. Flood, "Fast splittable pseudorandom number generators",
//! OOPSLA 2014, in the form of S. Vigna's public-domain `splitmix64.c`
//! (<https://prng.di.unimi.it/splitmix64.c>): the state advances by the golden-ratio increment
//! `0x9E3779B97F4A7C15` and each output is the state passed through a 64-bit finaliser (MurmurHash3's
//! `fmix64` variant "Mix13"). Not cryptographic; every output is a pure function of the seed, so
//! synthetic images, test data and the bench's offsets are reproducible across machines and thread
//! counts.
//!
//! Streams: callers that need many independent streams from one seed (one per image entry, tensor or
//! bench thread) derive each stream's state from `(seed, stream)` with [`SplitMix64::stream`] or their
//! own mixing, then draw from it; the stream derivations in use are documented where they are used,
//! because changing one changes the bytes of synthetic images for a given `--seed`.

/// The golden-ratio increment of the state, `2⁶⁴ / φ`.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The odd multiplier [`SplitMix64::stream`] spreads stream numbers with (from Vigna's tables of
/// good multipliers for 64-bit linear congruential / multiplicative hashing).
pub const STREAM_MULTIPLIER: u64 = 0xD1B5_4A32_D192_ED03;

/// SplitMix64 (Steele, Lea & Flood 2014; Vigna's `splitmix64.c`): 64 bits of state, period 2⁶⁴.
///
/// ```
/// use picchio_core::rng::SplitMix64;
/// let mut g = SplitMix64::new(1234567);
/// assert_eq!(g.next_u64(), 6457827717110365317); // splitmix64.c's first output for seed 1234567
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose state is `seed` (as `splitmix64.c`'s `x = seed`): the first output is the
    /// finaliser of `seed + GOLDEN_GAMMA`. Every `u64` is a valid seed, 0 included.
    pub const fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The generator for stream `stream` of `seed`: state `seed ^ (stream + 1) · STREAM_MULTIPLIER`
    /// (wrapping). Streams of one seed are independent for practical purposes; used for the payload
    /// of synthetic image entry `stream` and for bench thread `stream`.
    pub const fn stream(seed: u64, stream: u64) -> Self {
        SplitMix64::new(seed ^ stream.wrapping_add(1).wrapping_mul(STREAM_MULTIPLIER))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 24 random bits (the top 24 of [`next_u64`](Self::next_u64)), so
    /// every value is exactly representable.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[-1, 1)` with 24 random bits: `2 · next_f32() − 1`.
    pub fn next_signed_f32(&mut self) -> f32 {
        self.next_f32() * 2.0 - 1.0
    }

    /// Uniform in `0..n` by Lemire's multiply-shift (the high 64 bits of `next_u64() · n`); the bias
    /// is below `n / 2⁶⁴`. `below(0)` is 0 (and still advances the generator).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Fills `out` with the outputs as little-endian bytes, eight per step; a last partial chunk
    /// takes the first bytes of one more output.
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let last = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&last[..rest.len()]);
        }
    }

    /// `n` bytes from [`fill_bytes`](Self::fill_bytes).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.fill_bytes(&mut v);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test vector: the first five outputs of Vigna's `splitmix64.c`, compiled with gcc, for
    /// `x = 1234567`.
    #[test]
    fn matches_the_reference_vector() {
        let mut g = SplitMix64::new(1234567);
        let want =
            [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821];
        for w in want {
            assert_eq!(g.next_u64(), w);
        }
    }

    #[test]
    fn streams_floats_ranges_and_bytes() {
        assert_eq!(SplitMix64::stream(7, 3), SplitMix64::new(7 ^ 4u64.wrapping_mul(STREAM_MULTIPLIER)));
        let mut g = SplitMix64::new(42);
        for _ in 0..10_000 {
            let f = g.next_f32();
            assert!((0.0..1.0).contains(&f), "{f}");
            let s = g.next_signed_f32();
            assert!((-1.0..1.0).contains(&s), "{s}");
            assert!(g.below(10) < 10);
        }
        let (mut a, mut b) = (SplitMix64::new(5), SplitMix64::new(5));
        let bytes = a.bytes(19);
        let mut want = Vec::new();
        for _ in 0..3 {
            want.extend_from_slice(&b.next_u64().to_le_bytes());
        }
        assert_eq!(bytes, want[..19]);
        // A whole number of words draws no extra output.
        let (mut a, mut b) = (SplitMix64::new(5), SplitMix64::new(5));
        a.bytes(16);
        b.next_u64();
        b.next_u64();
        assert_eq!(a, b);
        assert_eq!(SplitMix64::new(1).below(0), 0);
    }
}
