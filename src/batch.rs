//! A batch of sequences on one [`Engine`]: one executor holds the KV caches of `slots`
//! sequences (`[slots, S, kv_heads, head_dim]` per layer; sliding layers keep a ring per
//! sequence), prompts are fed slot by slot in prefill steps, and one decode step advances any
//! number of the sequences at once: a graph of one row per sequence, each row with its own
//! token, position, slot and sampling parameters, so every matmul multiplies the weights with
//! all the rows at once.
//!
//! Each row's arithmetic is that of the same row alone: the batched ops compute every row
//! from its own inputs, and the matmuls of a step's graph compute each row as they would at
//! any other row count of the graphs a batch runs (the CPU reference computes every row the
//! same way; on a GPU, the decode graphs have 1 to 64 rows, and their dense matmuls all take
//! the several-token GEMV with one workgroup size, or with `--batch-f16` the f16 GEMM with a
//! fixed number of parts of K per weight, whose sums of a row do not depend on the other rows:
//! see `Kernels::matmul_rowwise`). Rows past the sequences of a step are idle: they
//! read slot `u32::MAX`, write nothing and attend to nothing.
//!
//! ```no_run
//! use markbase::batch::{Batch, Row};
//! use markbase::engine::{Engine, ModelOptions, SampleParams};
//! let engine = Engine::load("models/gemma3-270m-q4", ModelOptions::default())?;
//! let mut b = Batch::new(&engine, 4)?;
//! let greedy = SampleParams::default();
//! let a = b.prefill(0, &[2, 818, 5279], false, Some((&greedy, 0)))?.token;
//! let c = b.prefill(1, &[2, 1437], false, Some((&greedy, 0)))?.token;
//! let rows = [Row { slot: 0, token: a, sampling: &greedy, step: 1 }, Row { slot: 1, token: c, sampling: &greedy, step: 1 }];
//! let next = b.decode(&rows, false)?.tokens; // a token per row
//! # Ok::<(), markbase::engine::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use markbase_graph::builder::RECENT_TOKENS;
use markbase_graph::passes::Compiled;

use crate::cpu::exec::StepInputs;
use crate::engine::{prefill_steps, step_rows, Engine, Error, SampleParams, StepRows};
use crate::exec::{Executor, GraphKey, StepOutput};
use crate::gpu::runtime::{Profile, ProfileResult};
use crate::vision::encode::ImagePrompt;

/// Most sequences of a batch on a GPU: the decode graphs' rows stay within one 64-row tile of
/// the expert-grouped GEMM (MoE), whose arithmetic per row is then the same at every row count.
pub const MAX_GPU_SLOTS: usize = 64;
/// Fewest rows of a decode graph on a GPU: a batch's decode graphs take the several-token
/// GEMV's path at every row count (one row too: groups of one token, not the one-token GEMV
/// and its fusions, whose reduction order differs), and the MoE the expert-grouped GEMM.
pub const MIN_GPU_ROWS: usize = 1;

/// The slot of an idle row.
pub const IDLE: u32 = u32::MAX;

/// One sequence's row of a decode step.
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    pub slot: usize,
    /// The token fed (the one sampled by the previous step).
    pub token: u32,
    pub sampling: &'a SampleParams,
    /// The sampler's counter for this row (tokens the sequence has sampled so far).
    pub step: u32,
}

/// The sequences of a batch and the executor of their caches.
pub struct Batch {
    engine: Arc<Engine>,
    exec: Box<dyn Executor>,
    graphs: HashMap<GraphKey, Arc<Compiled>>,
    /// Tokens in each slot's cache.
    history: Vec<Vec<u32>>,
    /// Fewest rows of a decode graph.
    min_rows: usize,
}

impl Batch {
    /// A batch of `slots` sequences on `engine` (its caches are allocated by the first step).
    pub fn new(engine: &Arc<Engine>, slots: usize) -> Result<Batch, Error> {
        if slots == 0 {
            return Err(Error::Input("a batch needs at least one sequence slot".into()));
        }
        let gpu = engine.on_gpu();
        if gpu && slots > MAX_GPU_SLOTS {
            return Err(Error::Input(format!("at most {MAX_GPU_SLOTS} sequences run in parallel on a GPU, not {slots}")));
        }
        let min_rows = if gpu { MIN_GPU_ROWS } else { 1 };
        Ok(Batch { engine: engine.clone(), exec: engine.executor(), graphs: HashMap::new(), history: vec![vec![]; slots], min_rows })
    }

    pub fn slots(&self) -> usize {
        self.history.len()
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Tokens whose keys and values slot `slot` holds.
    pub fn tokens(&self, slot: usize) -> &[u32] {
        self.history.get(slot).map_or(&[], |h| h.as_slice())
    }

    pub fn position(&self, slot: usize) -> usize {
        self.tokens(slot).len()
    }

    /// Forgets slot `slot`'s sequence.
    pub fn reset(&mut self, slot: usize) {
        if let Some(h) = self.history.get_mut(slot) {
            h.clear();
        }
    }

    /// Keeps only the first `n` tokens of slot `slot`, so that another continuation can be fed
    /// after them; false (nothing changed) where a sliding-window ring has already overwritten
    /// positions they need (as [`crate::engine::Session::truncate`]).
    pub fn truncate(&mut self, slot: usize, n: usize) -> bool {
        let window = self.engine.config.sliding_window.min(self.engine.max_context());
        let Some(h) = self.history.get_mut(slot) else { return false };
        let len = h.len();
        if n >= len {
            return n == len;
        }
        if len - n > 1 && len > window {
            return false;
        }
        h.truncate(n);
        true
    }

    /// The rows of the decode graph for `n` sequences: a power of two, at least the batch's
    /// fewest.
    pub fn rows_for(&self, n: usize) -> usize {
        n.max(self.min_rows).next_power_of_two()
    }

    /// The graph of a decode step of `n` sequences, `sample`: with the sampler.
    fn decode_key(&self, n: usize, sample: bool) -> GraphKey {
        GraphKey { tokens: self.rows_for(n), all_logits: true, sample, images: false }
    }

    /// The compiled graph of a decode step of `n` greedy sequences (benchmarks, profiles).
    pub fn decode_graph(&mut self, n: usize) -> Result<Arc<Compiled>, Error> {
        self.graph(self.decode_key(n, false))
    }

    /// The matmul kernels of the decode step of `n` greedy sequences (GPU, once a step has run
    /// it): the GEMV's or the f16 GEMM's (`--batch-f16`), by name, each once.
    pub fn decode_matmuls(&mut self, n: usize) -> Option<Vec<String>> {
        let mut names: Vec<String> = self.exec.kernels(self.decode_key(n, false))?.into_iter().map(|(_, k)| k).filter(|k| k.starts_with("gemv") || k.starts_with("gemm")).collect();
        names.sort();
        names.dedup();
        Some(names)
    }

    /// Sets timestamp profiling of the following steps (GPU); false where there is none.
    pub fn set_profile(&mut self, p: Profile) -> bool {
        self.exec.set_profile(p)
    }

    /// Times of the last profiled step (GPU).
    pub fn profile(&self) -> Option<ProfileResult> {
        self.exec.profile()
    }

    fn graph(&mut self, key: GraphKey) -> Result<Arc<Compiled>, Error> {
        if let Some(c) = self.graphs.get(&key) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.engine.batch_graph(key, self.history.len())?);
        self.graphs.insert(key, c.clone());
        Ok(c)
    }

    fn check_slot(&self, slot: usize) -> Result<(), Error> {
        if slot >= self.history.len() {
            return Err(Error::Input(format!("sequence slot {slot} out of range ({} slots)", self.history.len())));
        }
        Ok(())
    }

    /// Feeds `ids` after slot `slot`'s sequence, in the steps a session feeds them in
    /// ([`prefill_steps`]). With `sampling` (parameters and sampler step), the last position's
    /// token is sampled; with `logits`, its logits are returned.
    pub fn prefill(&mut self, slot: usize, ids: &[u32], logits: bool, sampling: Option<(&SampleParams, u32)>) -> Result<StepOutput, Error> {
        self.check_prefill(slot, ids, sampling)?;
        let mut last = StepOutput::default();
        let mut start = 0;
        for n in prefill_steps(ids.len(), self.engine.prefill_chunk()) {
            start += n;
            last = self.prefill_step(slot, &ids[start - n..start], None, logits && start == ids.len(), sampling)?;
        }
        Ok(last)
    }

    /// [`Batch::prefill`] of a prompt holding image and audio placeholder runs: of `ids` (the
    /// prompt whose soft tokens `p` holds, see [`Engine::plan`]), the tokens from `start` in
    /// `steps` (sizes, and whether each takes soft rows: a piece of the plan's steps), each
    /// placeholder taking its soft row (Gemma 3: each image's run attending to itself).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_soft(
        &mut self,
        slot: usize,
        ids: &[u32],
        p: &ImagePrompt,
        start: usize,
        steps: &[(usize, bool)],
        logits: bool,
        sampling: Option<(&SampleParams, u32)>,
    ) -> Result<StepOutput, Error> {
        let end = start + steps.iter().map(|s| s.0).sum::<usize>();
        if ids.len() != p.tokens.len() || end > ids.len() {
            return Err(Error::Input(format!("steps to token {end} of a prompt of {} tokens ({} soft-token positions)", ids.len(), p.tokens.len())));
        }
        self.check_prefill(slot, &ids[start..end], sampling)?;
        let mut last = StepOutput::default();
        let mut at = start;
        for &(n, with_rows) in steps {
            let rows = with_rows.then(|| step_rows(p, at, n, self.history[slot].len()));
            at += n;
            last = self.prefill_step(slot, &ids[at - n..at], rows.as_ref(), logits && at == end, sampling)?;
        }
        Ok(last)
    }

    fn check_prefill(&self, slot: usize, ids: &[u32], sampling: Option<(&SampleParams, u32)>) -> Result<(), Error> {
        self.check_slot(slot)?;
        if ids.is_empty() {
            return Err(Error::Input("no tokens to process".into()));
        }
        if let Some((s, _)) = sampling {
            s.validate().map_err(Error::Sampling)?;
        }
        let vocab = self.engine.config.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(Error::Input(format!("token id {bad} is outside the vocabulary ({vocab})")));
        }
        let max_context = self.engine.max_context();
        let have = self.history[slot].len();
        if have + ids.len() > max_context {
            return Err(Error::Input(format!("context full: {have} + {} tokens exceed max_context {max_context}", ids.len())));
        }
        Ok(())
    }

    /// One prefill step of `chunk` into slot `slot` (with `rows`: its soft rows).
    fn prefill_step(&mut self, slot: usize, chunk: &[u32], rows: Option<&StepRows>, logits: bool, sampling: Option<(&SampleParams, u32)>) -> Result<StepOutput, Error> {
        let n = chunk.len();
        let sample = sampling.is_some_and(|(s, _)| needs_sampler(s));
        let key = GraphKey { tokens: n, all_logits: false, sample, images: rows.is_some() };
        let c = self.graph(key)?;
        let h = &self.history[slot];
        let p0 = h.len() as u32;
        let positions: Vec<u32> = (p0..p0 + n as u32).collect();
        let recent = recent_of(h, chunk);
        let words = sampling.map(|(s, step)| s.words(step, recent.len() as u32)).unwrap_or_default();
        let slot_ids = vec![slot as u32; n];
        let mut step = StepInputs { tokens: chunk, positions: &positions, sampling: words, recent: &recent, slot_ids: &slot_ids, ..Default::default() };
        if let Some(r) = rows {
            step = StepInputs { tokens: &r.tokens, soft_rows: &r.soft_rows, soft_index: &r.soft_index, attend_until: &r.attend_until, ..step };
        }
        let out = self.exec.run(key, &c, &step, logits).map_err(Error::Device)?;
        self.history[slot].extend_from_slice(chunk);
        Ok(out)
    }

    /// One decode step of the sequences of `rows` (distinct slots): each row's token is fed
    /// at its slot's next position. Returns a token per row, in order (`tokens`), and with
    /// `logits`, the logits of every row of the graph (`[rows_for(rows.len()), V]`, the
    /// given rows first).
    pub fn decode(&mut self, rows: &[Row], logits: bool) -> Result<StepOutput, Error> {
        if rows.is_empty() {
            return Err(Error::Input("a decode step needs at least one sequence".into()));
        }
        let vocab = self.engine.config.vocab_size as u32;
        let max_context = self.engine.max_context();
        let mut seen = vec![false; self.history.len()];
        for r in rows {
            self.check_slot(r.slot)?;
            if std::mem::replace(&mut seen[r.slot], true) {
                return Err(Error::Input(format!("sequence slot {} twice in one decode step", r.slot)));
            }
            r.sampling.validate().map_err(Error::Sampling)?;
            if r.token >= vocab {
                return Err(Error::Input(format!("token id {} is outside the vocabulary ({vocab})", r.token)));
            }
            if self.history[r.slot].len() + 1 > max_context {
                return Err(Error::Input(format!("context full: max_context {max_context}")));
            }
        }
        let sample = rows.iter().any(|r| needs_sampler(r.sampling));
        let key = self.decode_key(rows.len(), sample);
        let b = key.tokens;
        let c = self.graph(key)?;
        let mut tokens = vec![0u32; b];
        let mut positions = vec![0u32; b];
        let mut slot_ids = vec![IDLE; b];
        let mut words = vec![0u32; b * 8];
        let mut recent = vec![0u32; b * RECENT_TOKENS];
        for (i, r) in rows.iter().enumerate() {
            let h = &self.history[r.slot];
            tokens[i] = r.token;
            positions[i] = h.len() as u32;
            slot_ids[i] = r.slot as u32;
            let rc = recent_of(h, &[r.token]);
            recent[i * RECENT_TOKENS..i * RECENT_TOKENS + rc.len()].copy_from_slice(&rc);
            words[i * 8..i * 8 + 8].copy_from_slice(&r.sampling.words(r.step, rc.len() as u32));
        }
        let step = StepInputs {
            tokens: &tokens,
            positions: &positions,
            slot_ids: &slot_ids,
            row_sampling: if sample { &words } else { &[] },
            row_recent: if sample { &recent } else { &[] },
            ..Default::default()
        };
        let mut out = self.exec.run(key, &c, &step, logits).map_err(Error::Device)?;
        if out.tokens.len() != b {
            return Err(Error::Device(format!("a decode step of {b} rows returned {} tokens", out.tokens.len())));
        }
        out.tokens.truncate(rows.len());
        for r in rows {
            self.history[r.slot].push(r.token);
        }
        Ok(out)
    }
}

/// Whether a sequence's tokens go through the sampler (else the argmax is its token).
fn needs_sampler(s: &SampleParams) -> bool {
    !s.is_greedy()
}

/// The recent ids of a step (the repetition penalty's window): the last of `history` and
/// `fed` together.
fn recent_of(history: &[u32], fed: &[u32]) -> Vec<u32> {
    let mut r: Vec<u32> = history.iter().chain(fed).rev().take(RECENT_TOKENS).cloned().collect();
    r.reverse();
    r
}
