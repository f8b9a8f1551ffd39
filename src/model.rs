//! The library API: load a checkpoint, get logits, generate text.
//!
//! ```no_run
//! use markbase::model::{Model, ModelOptions, GenerateParams};
//! let mut m = Model::load("models/gemma3-270m-q4", ModelOptions::default())?;
//! // Logits of every position of a token sequence.
//! let logits = m.logits(&[2, 818, 5279])?;
//! assert_eq!(logits.len(), 3);
//! // Streaming generation.
//! let prompt = m.tokenizer()?.encode("The capital of France is", true)?;
//! for piece in m.generate(&prompt, GenerateParams { max_tokens: 16, ..Default::default() })? {
//!     print!("{}", piece?.text);
//! }
//! # Ok::<(), String>(())
//! ```

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use markbase_graph::builder::{BuildOptions, Outputs, RECENT_TOKENS};
use markbase_graph::ir::{Graph, GraphKind};
use markbase_graph::passes::{compile, Compiled, PhasePolicy};
use markbase_graph::{FuseOptions, ModelConfig};

use crate::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
pub use crate::cpu::ops::SampleParams;
use crate::loader::{Checkpoint, LoadOptions, ProgressFn};
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

/// Where the graph runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU reference executor (f32, slow, exact).
    Cpu,
    /// wgpu on the given backend (`None` = the platform's best, or `MARKBASE_BACKEND`).
    Gpu(Option<crate::gpu::device::Backend>),
}

/// Options of [`Model::load`].
pub struct ModelOptions {
    pub device: DeviceKind,
    /// Longest sequence (KV cache of full-attention layers).
    pub max_context: usize,
    /// Longest prefill chunk; longer prompts are processed in chunks.
    pub prefill_chunk: usize,
    /// Progress of weight loading `(bytes, total)`.
    pub progress: Option<Box<ProgressFn>>,
    /// Debug: one submission per node, each output checked for NaN/Inf (GPU).
    pub check_nan: bool,
    /// The fusion rules compiled graphs run (all by default; none: the graphs as built).
    pub fuse: FuseOptions,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            device: DeviceKind::Gpu(None),
            max_context: 4096,
            prefill_chunk: 256,
            progress: None,
            check_nan: false,
            fuse: FuseOptions::all(),
        }
    }
}

/// What one step returns.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Logits `[rows, V]` flattened, when asked for.
    pub logits: Option<Vec<f32>>,
    /// The sampled (or argmax) token of the last position.
    pub token: u32,
}

/// Key of a compiled graph: tokens per step, outputs, device sampling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub tokens: usize,
    pub all_logits: bool,
    pub sample: bool,
}

/// Runs compiled graphs on one device, keeping the KV caches between steps.
pub trait Executor {
    /// Runs graph `key` (compiled as `c`) for one step; `want_logits` asks for the
    /// logits to be read back.
    fn run(&mut self, key: GraphKey, c: &Compiled, step: &StepInputs, want_logits: bool) -> Result<StepOutput, String>;
    /// Forgets the sequence (the caches need not be zeroed: positions mask them).
    fn reset(&mut self);
    /// Short description of the device.
    fn describe(&self) -> String;
    /// Whether [`Executor::submit`]/[`Executor::take`] pipeline steps.
    fn pipelines(&self) -> bool {
        false
    }
    /// Submits a step without waiting; `feed_device`: its token is the previous
    /// step's output, copied on the device. Only where [`Executor::pipelines`].
    fn submit(&mut self, _key: GraphKey, _c: &Compiled, _step: &StepInputs, _feed_device: bool) -> Result<(), String> {
        Err("this executor does not pipeline steps".into())
    }
    /// Waits for the oldest submitted step and returns its token.
    fn take(&mut self) -> Result<u32, String> {
        Err("this executor does not pipeline steps".into())
    }
    /// The GPU executor behind this one, if any (counters, profiling).
    fn as_gpu(&mut self) -> Option<&mut crate::gpu::runtime::GpuExecutor> {
        None
    }
}

/// The CPU reference executor behind [`Executor`].
pub struct CpuExecutor {
    weights: CpuWeights,
    state: CpuState,
}

impl CpuExecutor {
    pub fn new(weights: Arc<Weights>) -> Self {
        CpuExecutor { weights: CpuWeights::new(weights), state: CpuState::default() }
    }
}

impl Executor for CpuExecutor {
    fn run(&mut self, _key: GraphKey, c: &Compiled, step: &StepInputs, want_logits: bool) -> Result<StepOutput, String> {
        let out = exec::run(c, &mut self.weights, &mut self.state, step)?;
        let token = out.get("token").map(|v| v.u()[0]).ok_or("graph has no token output")?;
        let logits = if want_logits { out.get("logits").map(|v| v.f().to_vec()) } else { None };
        Ok(StepOutput { logits, token })
    }
    fn reset(&mut self) {
        self.state.clear();
    }
    fn describe(&self) -> String {
        "cpu (reference, f32)".into()
    }
}

/// Parameters of [`Model::generate`].
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SampleParams,
    /// Stop at the checkpoint's stop tokens (EOS, `<end_of_turn>`).
    pub stop_at_eos: bool,
    /// Decode tokens to text while streaming (needs a tokenizer).
    pub text: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams { max_tokens: 128, sampling: SampleParams::default(), stop_at_eos: true, text: true }
    }
}

/// One generated token.
#[derive(Clone, Debug)]
pub struct Piece {
    pub token: u32,
    /// The text this token adds (empty while a character is incomplete).
    pub text: String,
}

/// A loaded model.
pub struct Model {
    pub config: ModelConfig,
    checkpoint: Option<Checkpoint>,
    weights: Arc<Weights>,
    tokenizer: Option<Tokenizer>,
    graphs: HashMap<GraphKey, Compiled>,
    exec: Box<dyn Executor>,
    max_context: usize,
    chunk: usize,
    fuse: FuseOptions,
    /// Tokens of the current sequence (their K/V are in the caches).
    history: Vec<u32>,
    /// Steps run so far in this sequence (the sampler's counter).
    steps: u32,
    /// Graph executions, for tests and benchmarks.
    pub runs: usize,
    /// History slots of device-fed tokens not read back yet (pipelined decode).
    unread: std::collections::VecDeque<usize>,
}

impl Model {
    /// Opens a checkpoint directory, checks and loads the weights, and prepares the device.
    pub fn load(dir: impl AsRef<Path>, opts: ModelOptions) -> Result<Model, String> {
        let dir = dir.as_ref();
        let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
        let probe = ck.build(BuildOptions::decode(opts.max_context, opts.prefill_chunk.min(opts.max_context))).map_err(|e| e.to_string())?;
        let lo = LoadOptions { progress: opts.progress.as_deref() };
        let (weights, _report) = ck.load_weights_with(&probe, &lo).map_err(|e| e.to_string())?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::load(dir, ck.config().bos_token_id, &ck.config().eos_token_ids)?)
        } else {
            None
        };
        let config = ck.config().clone();
        let mut m = Self::from_parts(config, Arc::new(weights), tokenizer, &opts)?;
        m.checkpoint = Some(ck);
        Ok(m)
    }

    /// A model from a config and weights already in memory (synthetic models).
    pub fn from_parts(config: ModelConfig, weights: Arc<Weights>, tokenizer: Option<Tokenizer>, opts: &ModelOptions) -> Result<Model, String> {
        if opts.prefill_chunk == 0 || opts.max_context == 0 {
            return Err("max_context and prefill_chunk must be > 0".into());
        }
        let exec: Box<dyn Executor> = match opts.device {
            DeviceKind::Cpu => Box::new(CpuExecutor::new(weights.clone())),
            DeviceKind::Gpu(b) => Box::new(crate::gpu::runtime::GpuExecutor::new(b, weights.clone(), opts.check_nan)?),
        };
        Ok(Model {
            config,
            checkpoint: None,
            weights,
            tokenizer,
            graphs: HashMap::new(),
            exec,
            max_context: opts.max_context,
            chunk: opts.prefill_chunk.min(opts.max_context),
            fuse: opts.fuse.clone(),
            history: vec![],
            steps: 0,
            runs: 0,
            unread: Default::default(),
        })
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer, String> {
        self.tokenizer.as_ref().ok_or_else(|| "this checkpoint has no tokenizer.json".to_string())
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    pub fn device(&self) -> String {
        self.exec.describe()
    }

    /// Counters of the last GPU step (submits, dispatches, encode time).
    pub fn gpu_stats(&mut self) -> Option<crate::gpu::runtime::StepStats> {
        self.exec.as_gpu().map(|g| g.last)
    }

    /// The kernel of each GPU dispatch of graph `key` (once a step has run it).
    pub fn gpu_kernels(&mut self, key: GraphKey) -> Option<Vec<(petgraph::graph::NodeIndex, String)>> {
        self.exec.as_gpu().and_then(|g| g.dispatch_kernels(key))
    }

    /// Sets timestamp profiling of the following GPU steps.
    pub fn set_profile(&mut self, p: crate::gpu::runtime::Profile) {
        if let Some(g) = self.exec.as_gpu() {
            g.profile = p;
        }
    }

    /// GPU times of the last profiled step.
    pub fn gpu_profile(&mut self) -> Option<crate::gpu::runtime::ProfileResult> {
        self.exec.as_gpu().map(|g| g.profiled.clone())
    }

    /// Tokens in the current sequence.
    pub fn position(&self) -> usize {
        self.history.len()
    }

    /// Starts a new sequence.
    pub fn reset(&mut self) {
        self.history.clear();
        self.unread.clear();
        self.steps = 0;
        self.exec.reset();
    }

    /// Whether decode steps can be pipelined (GPU, no repetition penalty needing the host's history).
    pub fn can_pipeline(&self, s: &SampleParams) -> bool {
        self.exec.pipelines() && s.repetition_penalty == 1.0
    }

    /// Submits a decode step without waiting for it. `token`: the input token, or
    /// `None` for the token the previous decode step produced (kept on the device).
    pub fn submit_decode(&mut self, token: Option<u32>, s: &SampleParams) -> Result<(), String> {
        if self.history.len() + 1 > self.max_context {
            return Err(format!("context full: max_context {}", self.max_context));
        }
        // greedy steps take the argmax (many workgroups) instead of the sampler (one)
        let key = GraphKey { tokens: 1, all_logits: false, sample: !s.is_greedy() };
        self.graph(key)?;
        let pos = [self.history.len() as u32];
        let tok = [token.unwrap_or(0)];
        let words = s.words(self.steps, 0);
        let step = StepInputs { tokens: &tok, positions: &pos, sampling: words, recent: &[] };
        self.exec.submit(key, &self.graphs[&key], &step, token.is_none())?;
        if token.is_none() {
            self.unread.push_back(self.history.len());
        }
        self.history.push(tok[0]);
        self.steps += 1;
        self.runs += 1;
        Ok(())
    }

    /// Waits for the oldest submitted decode step; returns its token.
    pub fn take_decode(&mut self) -> Result<u32, String> {
        let t = self.exec.take()?;
        if let Some(i) = self.unread.pop_front() {
            self.history[i] = t;
        }
        Ok(t)
    }

    /// The compiled graph for `key` (built on first use).
    pub fn graph(&mut self, key: GraphKey) -> Result<&Compiled, String> {
        if !self.graphs.contains_key(&key) {
            let mut o = if key.tokens == 1 && !key.all_logits {
                BuildOptions::decode(self.max_context, self.chunk)
            } else {
                let mut o = BuildOptions::prefill(key.tokens, self.max_context);
                o.chunk = self.chunk;
                o
            };
            o.outputs = if key.all_logits { Outputs::AllLogits } else { Outputs::LastLogits };
            o.sample = key.sample;
            o.kind = if key.tokens == 1 { GraphKind::Decode } else { GraphKind::Prefill };
            o.fuse = self.fuse.clone();
            let g: Graph = match &self.checkpoint {
                Some(ck) => ck.build(o).map_err(|e| e.to_string())?,
                None => markbase_graph::build(&self.config, &WeightsResolver(&self.weights), &o).map_err(|e| e.to_string())?,
            };
            // Decode: one submission per step (the next step is encoded while this one
            // runs); prefill: the layers are submitted before the head is encoded.
            let policy = if key.tokens == 1 { PhasePolicy::Step } else { PhasePolicy::EmbedLayersHead };
            let c = compile(g, policy).map_err(|e| e.to_string())?;
            self.graphs.insert(key, c);
        }
        Ok(&self.graphs[&key])
    }

    /// Feeds `ids` after the current sequence, in chunks. Returns the output of
    /// the last chunk (its last position's token); with `all_logits`, the logits
    /// of every fed position are concatenated.
    pub fn forward(&mut self, ids: &[u32], all_logits: bool, sampling: Option<&SampleParams>) -> Result<StepOutput, String> {
        if ids.is_empty() {
            return Err("no tokens to process".into());
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(format!("token id {bad} is outside the vocabulary ({vocab})"));
        }
        if self.history.len() + ids.len() > self.max_context {
            return Err(format!(
                "context full: {} + {} tokens exceed max_context {}",
                self.history.len(),
                ids.len(),
                self.max_context
            ));
        }
        let mut all = vec![];
        let mut last = StepOutput::default();
        for chunk in ids.chunks(self.chunk) {
            let key = GraphKey { tokens: chunk.len(), all_logits, sample: sampling.is_some_and(|s| !s.is_greedy()) };
            self.graph(key)?;
            let start = self.history.len() as u32;
            let positions: Vec<u32> = (start..start + chunk.len() as u32).collect();
            let mut recent: Vec<u32> = self.history.iter().chain(chunk.iter()).rev().take(RECENT_TOKENS).cloned().collect();
            recent.reverse();
            let words = sampling.map(|s| s.words(self.steps, recent.len() as u32)).unwrap_or_default();
            let step = StepInputs { tokens: chunk, positions: &positions, sampling: words, recent: &recent };
            let c = &self.graphs[&key];
            last = self.exec.run(key, c, &step, all_logits)?;
            self.runs += 1;
            self.steps += 1;
            self.history.extend_from_slice(chunk);
            if all_logits {
                all.extend(last.logits.take().unwrap_or_default());
            }
        }
        if all_logits {
            last.logits = Some(all);
        }
        Ok(last)
    }

    /// Logits `[len][V]` of every position of `ids`, as a fresh sequence.
    pub fn logits(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>, String> {
        self.reset();
        let out = self.forward(ids, true, None)?;
        let v = self.config.vocab_size;
        Ok(out.logits.unwrap_or_default().chunks(v).map(|c| c.to_vec()).collect())
    }

    /// Streams up to `max_tokens` tokens after `prompt` (a fresh sequence).
    pub fn generate(&mut self, prompt: &[u32], params: GenerateParams) -> Result<Generation<'_>, String> {
        self.reset();
        if prompt.is_empty() {
            return Err("empty prompt".into());
        }
        Ok(Generation { model: self, prompt: prompt.to_vec(), params, produced: vec![], next: None, done: false, in_flight: 0 })
    }
}

/// Weight formats read from weights already in memory.
struct WeightsResolver<'a>(&'a Weights);

impl markbase_graph::builder::WeightResolver for WeightsResolver<'_> {
    fn format(&self, name: &str, _shape: &[usize], _module: bool) -> markbase_graph::WeightFormat {
        self.0
            .get(name)
            .map(|w| w.param.format)
            .unwrap_or(markbase_graph::WeightFormat::Float { dtype: markbase_graph::FloatType::Bf16 })
    }
    fn exists(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
}

/// The generation iterator of [`Model::generate`].
pub struct Generation<'a> {
    model: &'a mut Model,
    prompt: Vec<u32>,
    params: GenerateParams,
    produced: Vec<u32>,
    next: Option<u32>,
    done: bool,
    /// Pipelined decode steps submitted and not read yet.
    in_flight: usize,
}

impl Generation<'_> {
    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.produced
    }

    fn step(&mut self) -> Result<Option<Piece>, String> {
        if self.done || self.produced.len() >= self.params.max_tokens {
            return Ok(None);
        }
        let s = self.params.sampling;
        let pipelined = self.model.can_pipeline(&s);
        let more_after = |n: usize| n + 1 < self.params.max_tokens;
        let tok = if !self.prompt.is_empty() {
            let prompt = std::mem::take(&mut self.prompt);
            let t = self.model.forward(&prompt, false, Some(&s))?.token;
            if pipelined && more_after(self.produced.len()) && self.model.position() < self.model.max_context {
                self.model.submit_decode(Some(t), &s)?;
                self.in_flight += 1;
            }
            t
        } else if pipelined {
            if self.in_flight == 0 {
                return Ok(None);
            }
            // Keep the GPU busy: the next step is queued before this one is read.
            if more_after(self.produced.len()) && self.model.position() < self.model.max_context {
                self.model.submit_decode(None, &s)?;
                self.in_flight += 1;
            }
            self.in_flight -= 1;
            self.model.take_decode()?
        } else {
            match self.next.take() {
                Some(t) => t,
                None => return Ok(None),
            }
        };
        if self.params.stop_at_eos {
            if let Some(tk) = &self.model.tokenizer {
                if tk.stop_ids.contains(&tok) {
                    self.done = true;
                    return Ok(None);
                }
            } else if self.model.config.eos_token_ids.contains(&tok) {
                self.done = true;
                return Ok(None);
            }
        }
        let text = match (&self.model.tokenizer, self.params.text) {
            (Some(tk), true) => tk.decode_incremental(&self.produced, tok)?,
            _ => String::new(),
        };
        self.produced.push(tok);
        if !pipelined && self.produced.len() < self.params.max_tokens {
            if self.model.position() >= self.model.max_context {
                self.done = true;
            } else {
                self.next = Some(self.model.forward(&[tok], false, Some(&s))?.token);
            }
        }
        Ok(Some(Piece { token: tok, text }))
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Piece, String>;
    fn next(&mut self) -> Option<Self::Item> {
        match self.step() {
            Ok(Some(p)) => Some(Ok(p)),
            Ok(None) => None,
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}
