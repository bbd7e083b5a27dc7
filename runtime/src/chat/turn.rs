//! Generation that reuses the KV cache: [`Session::complete`] compares the new prompt with the
//! token ids the session's KV cache holds ([`Session::kv_ids`]), keeps the longest common prefix,
//! and prefills only the rest (overwriting the positions where the two diverge). A conversation
//! re-rendered each turn, or an agent resending its long system prompt, recomputes only what is new.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::model::sampler::{Sampler, SamplerOptions};
use crate::run::{RunStats, Session};

/// Settings of one completion.
#[derive(Clone, Debug, Default)]
pub struct TurnOptions {
    /// Tokens to generate at most (the stop token included).
    pub max_new: usize,
    /// Sampling and penalties.
    pub sampler: SamplerOptions,
    /// Stop at the session's end-of-turn ids ([`Session::stop_ids`]).
    pub stop_at_eos: bool,
    /// **A mock, for tests only:** the ids to take instead of sampling, one per step (sampling
    /// resumes after them). Everything after the choice of id (the forward pass, the end-of-turn
    /// check, detokenizing, the front ends) runs for real. It exists because the random-weight
    /// fixture models never write, say, a tool call on their own; `None` in every real run.
    pub mock_sampled: Option<Vec<u32>>,
}

/// Why a completion ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-turn id was generated (OpenAI's `stop`).
    Stop,
    /// `max_new` tokens were generated (OpenAI's `length`).
    Length,
    /// The token callback asked to stop (a client went away, Ctrl-C, a stop string).
    Cancelled,
}

/// The result of [`Session::complete`].
#[derive(Clone, Debug)]
pub struct Turn {
    /// Generated ids, without the end-of-turn id.
    pub tokens: Vec<u32>,
    /// The end-of-turn id that ended the turn, when one did.
    pub stop_id: Option<u32>,
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens whose KV came from the previous requests (not recomputed).
    pub cached_tokens: usize,
    /// Wall time from the call to the first generated token, milliseconds (prefill of the new part
    /// plus one sampling).
    pub first_token_ms: f64,
    /// Figures (`prompt_tokens` is the whole prompt; `prefill_ms` covers only the new part).
    pub stats: RunStats,
}

impl Turn {
    /// Generated tokens as OpenAI counts them: the end-of-turn id included.
    pub fn completion_tokens(&self) -> usize {
        self.tokens.len() + usize::from(self.stop_id.is_some())
    }
}

/// Length of the longest common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Session {
    /// Generates after `prompt`, reusing the KV of the longest common prefix with [`Session::kv_ids`]
    /// (at most `prompt.len() - 1` tokens, so the last prompt token is run and gives the logits) and
    /// prefilling the rest. `on_token` sees each generated id (not the end-of-turn id) as soon as it
    /// is chosen; [`ControlFlow::Break`] ends the turn there ([`Finish::Cancelled`], the id kept).
    /// Afterwards the KV cache holds the prompt and every generated id but the last (which was never
    /// run), and [`Session::kv_ids`] says so.
    ///
    /// # Errors
    /// [`crate::Error::EmptyPrompt`], [`crate::Error::OutOfVocabulary`],
    /// [`crate::Error::ContextOverflow`] when prompt + `max_new` exceed the KV cache (nothing is run);
    /// [`crate::Error::Interrupted`] after SIGINT/SIGTERM during the prefill; forward-pass errors (the
    /// KV record is then cut to what is valid).
    pub fn complete(
        &mut self,
        prompt: &[u32],
        opts: &TurnOptions,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Turn> {
        self.complete_until(prompt, opts, on_token, &mut || false)
    }

    /// [`Session::complete`] that also asks `stop` before every prefill chunk and every decode
    /// step, so a caller can end the turn while the prompt is still being prefilled (a server's
    /// client that went away, Ctrl-C in a chat), not only at its first token. Stopped during the
    /// prefill, the turn is [`Finish::Cancelled`] with no tokens, and [`Session::kv_ids`] keeps
    /// the prompt's chunks that ran (a retry of the same prompt reuses them).
    ///
    /// # Errors
    /// As [`Session::complete`].
    pub fn complete_until(
        &mut self,
        prompt: &[u32],
        opts: &TurnOptions,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
        stop: &mut dyn FnMut() -> bool,
    ) -> Result<Turn> {
        crate::run::check_prompt(&self.model, prompt, opts.max_new)?;
        let vocab = self.model.config().vocab_size;
        let start = (self.cache.hits(), self.cache.misses(), self.io_stats.snapshot());
        let (pf0, wait0) = (self.cache.prefetch_stats(), self.cache.io_wait_ns());
        let t0 = Instant::now();
        let cached = common_prefix(&self.kv, prompt).min(prompt.len() - 1);
        let done = self.prefill_until(&prompt[cached..], cached, stop)?;
        let prefill = t0.elapsed();
        let io_prefill = self.io_stats.snapshot();
        if cached + done < prompt.len() {
            tracing::debug!("stopped during the prefill, after {done} of {} new prompt tokens", prompt.len() - cached);
            let mut stats = self.stats_since(start, io_prefill, prompt.len(), 0, prefill, Duration::ZERO, 0);
            stats.prompt_tokens = prompt.len();
            let finish = Finish::Cancelled;
            return Ok(Turn {
                tokens: Vec::new(),
                stop_id: None,
                finish,
                cached_tokens: cached,
                first_token_ms: 0.0,
                stats,
            });
        }
        let since = crate::run::SinceStart {
            prefetch: pf0,
            io_wait_ns: wait0,
            decode_timers: self.model.timers(),
            decode_io_wait_ns: self.cache.io_wait_ns(),
        };

        let mut sampler = Sampler::new(opts.sampler);
        let mut sequence = prompt.to_vec();
        let mut tokens = Vec::new();
        let (mut stop_id, mut finish) = (None, Finish::Length);
        let mut first_token_ms = 0.0;
        let t1 = Instant::now();
        let mut decode_steps = 0;
        while tokens.len() < opts.max_new {
            let next = match opts.mock_sampled.as_ref().and_then(|ids| ids.get(tokens.len())) {
                Some(&id) if (id as usize) < vocab => id,
                _ => sampler.sample_after(self.model.logits(), &sequence, &sequence[prompt.len()..]),
            };
            if tokens.is_empty() && stop_id.is_none() {
                first_token_ms = t0.elapsed().as_secs_f64() * 1e3;
            }
            if opts.stop_at_eos && self.stop_ids.contains(&next) {
                stop_id = Some(next);
                finish = Finish::Stop;
                break;
            }
            tokens.push(next);
            sequence.push(next);
            if on_token(next).is_break() {
                finish = Finish::Cancelled;
                break;
            }
            if tokens.len() == opts.max_new {
                break;
            }
            if stop() {
                finish = Finish::Cancelled;
                break;
            }
            let pos = self.kv.len();
            if let Err(e) = self.model.forward(next, pos, &mut self.cache, &mut *self.loader) {
                self.kv.truncate(pos);
                return Err(e);
            }
            self.kv.push(next);
            decode_steps += 1;
        }
        let generated = tokens.len() + usize::from(stop_id.is_some());
        let mut stats =
            self.stats_since(start, io_prefill, prompt.len(), generated, prefill, t1.elapsed(), decode_steps);
        stats.prompt_tokens = prompt.len();
        self.add_decode_figures(&mut stats, since);
        Ok(Turn { tokens, stop_id, finish, cached_tokens: cached, first_token_ms, stats })
    }
}

#[cfg(test)]
mod tests {
    use super::common_prefix;

    #[test]
    fn common_prefix_counts_equal_leading_ids() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2]), 2);
    }
}
