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
use std::path::{Path, PathBuf};
use std::sync::Arc;

use markbase_graph::builder::{BuildOptions, Outputs, RECENT_TOKENS};
use markbase_graph::ir::{Graph, GraphKind};
use markbase_graph::passes::{compile, Compiled, PhasePolicy};
use markbase_graph::ModelConfig;

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
    /// With `DeviceKind::Gpu(None)` and no backend named in the environment: when the only
    /// adapter is a software one (llvmpipe, lavapipe), run on the CPU reference executor
    /// instead (it is faster there). [`Model::notice`] says so.
    pub cpu_if_software_gpu: bool,
    /// Called with the name of each loading stage as it starts ("reading weights", "uploading").
    pub stage: Option<Box<dyn Fn(&str) + Send + Sync>>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            device: DeviceKind::Gpu(None),
            max_context: 4096,
            prefill_chunk: 256,
            progress: None,
            check_nan: false,
            cpu_if_software_gpu: false,
            stage: None,
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

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` tokens were generated.
    MaxTokens,
    /// A stop token (EOS, `<end_of_turn>`) was sampled.
    Stop,
    /// The sequence filled the context (`max_context` tokens).
    ContextFull,
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
    /// The checkpoint directory (for messages).
    dir: Option<PathBuf>,
    /// What the loader decided on the user's behalf (the CPU instead of a software GPU).
    notice: Option<String>,
    checkpoint: Option<Checkpoint>,
    weights: Arc<Weights>,
    tokenizer: Option<Tokenizer>,
    graphs: HashMap<GraphKey, Compiled>,
    exec: Box<dyn Executor>,
    max_context: usize,
    chunk: usize,
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
    /// Everything cheap is checked first: the directory, the context against the model's
    /// positions, the device and whether the caches fit it, then the weights are read.
    pub fn load(dir: impl AsRef<Path>, opts: ModelOptions) -> Result<Model, String> {
        let dir = dir.as_ref();
        check_dir(dir)?;
        let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
        check_context(ck.config(), opts.max_context, opts.prefill_chunk)?;
        let chunk = opts.prefill_chunk.min(opts.max_context);
        let probe = ck.build(BuildOptions::decode(opts.max_context, chunk)).map_err(|e| e.to_string())?;
        let mut prefill = BuildOptions::prefill(chunk.max(2), opts.max_context.max(2));
        prefill.chunk = chunk.max(2);
        let need = crate::memory::Needs::of(&probe, &ck.build(prefill).map_err(|e| e.to_string())?)?;
        let (opened, notice) = open_device(&opts, &need)?;
        if let Some(f) = &opts.stage {
            f("reading weights");
        }
        let lo = LoadOptions { progress: opts.progress.as_deref() };
        let (weights, _report) = ck.load_weights_with(&probe, &lo).map_err(|e| e.to_string())?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::load(dir, ck.config().bos_token_id, &ck.config().eos_token_ids)?)
        } else {
            None
        };
        let config = ck.config().clone();
        let mut m = Self::assemble(config, Arc::new(weights), tokenizer, &opts, opened)?;
        m.checkpoint = Some(ck);
        m.dir = Some(dir.to_path_buf());
        m.notice = notice;
        Ok(m)
    }

    /// A model from a config and weights already in memory (synthetic models).
    pub fn from_parts(config: ModelConfig, weights: Arc<Weights>, tokenizer: Option<Tokenizer>, opts: &ModelOptions) -> Result<Model, String> {
        check_context(&config, opts.max_context, opts.prefill_chunk)?;
        let chunk = opts.prefill_chunk.min(opts.max_context);
        let r = WeightsResolver(&weights);
        let decode = markbase_graph::build(&config, &r, &BuildOptions::decode(opts.max_context, chunk)).map_err(|e| e.to_string())?;
        let mut prefill = BuildOptions::prefill(chunk.max(2), opts.max_context.max(2));
        prefill.chunk = chunk.max(2);
        let prefill = markbase_graph::build(&config, &r, &prefill).map_err(|e| e.to_string())?;
        let need = crate::memory::Needs::of(&decode, &prefill)?;
        let (opened, notice) = open_device(opts, &need)?;
        let mut m = Self::assemble(config, weights, tokenizer, opts, opened)?;
        m.notice = notice;
        Ok(m)
    }

    fn assemble(config: ModelConfig, weights: Arc<Weights>, tokenizer: Option<Tokenizer>, opts: &ModelOptions, opened: Opened) -> Result<Model, String> {
        let exec: Box<dyn Executor> = match opened {
            Opened::Cpu => Box::new(CpuExecutor::new(weights.clone())),
            Opened::Gpu(gpu) => {
                if let Some(f) = &opts.stage {
                    f("uploading");
                }
                Box::new(crate::gpu::runtime::GpuExecutor::with_gpu(*gpu, &weights, opts.check_nan, None)?)
            }
        };
        Ok(Model {
            config,
            dir: None,
            notice: None,
            checkpoint: None,
            weights,
            tokenizer,
            graphs: HashMap::new(),
            exec,
            max_context: opts.max_context,
            chunk: opts.prefill_chunk.min(opts.max_context),
            history: vec![],
            steps: 0,
            runs: 0,
            unread: Default::default(),
        })
    }

    /// What loading decided on the caller's behalf, e.g. the CPU executor instead of a
    /// software GPU adapter ([`ModelOptions::cpu_if_software_gpu`]).
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    /// Longest sequence the caches hold.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Tokens of the current sequence (those whose keys and values are cached).
    pub fn tokens(&self) -> &[u32] {
        &self.history
    }

    /// Keeps only the first `n` tokens of the current sequence, so that a different
    /// continuation can be fed after them. False (and nothing changed) where a
    /// sliding-window cache has already overwritten positions the kept tokens need:
    /// dropping more than one token is safe only while the sequence is shorter than
    /// the window.
    pub fn truncate(&mut self, n: usize) -> bool {
        let len = self.history.len();
        if n >= len || !self.unread.is_empty() {
            return n == len;
        }
        if len - n > 1 && len > self.config.sliding_window.min(self.max_context) {
            return false;
        }
        self.history.truncate(n);
        true
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer, String> {
        self.tokenizer.as_ref().ok_or_else(|| match &self.dir {
            Some(d) => format!("{}: no such file (generating text needs the checkpoint's tokenizer)", d.join("tokenizer.json").display()),
            None => "this model has no tokenizer".to_string(),
        })
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

    /// Compiles the graphs a generation after a `prompt_len`-token prompt runs (each is
    /// otherwise compiled on first use, inside the first step).
    pub fn prepare(&mut self, prompt_len: usize, s: &SampleParams) -> Result<(), String> {
        let sample = !s.is_greedy();
        let mut lens = vec![1];
        if prompt_len >= self.chunk {
            lens.push(self.chunk);
        }
        if prompt_len % self.chunk != 0 {
            lens.push(prompt_len % self.chunk);
        }
        for tokens in lens {
            self.graph(GraphKey { tokens, all_logits: false, sample })?;
        }
        Ok(())
    }

    /// Feeds `ids` after the current sequence, in chunks. Returns the output of
    /// the last chunk (its last position's token); with `all_logits`, the logits
    /// of every fed position are concatenated.
    pub fn forward(&mut self, ids: &[u32], all_logits: bool, sampling: Option<&SampleParams>) -> Result<StepOutput, String> {
        if ids.is_empty() {
            return Err("no tokens to process".into());
        }
        if let Some(s) = sampling {
            s.validate()?;
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
        params.sampling.validate()?;
        self.reset();
        self.generate_after(prompt, params)
    }

    /// Streams up to `max_tokens` tokens after the current sequence extended by `ids`:
    /// the cached keys and values of the sequence so far are kept (a chat's next turn).
    pub fn generate_after(&mut self, ids: &[u32], params: GenerateParams) -> Result<Generation<'_>, String> {
        params.sampling.validate()?;
        if ids.is_empty() {
            return Err("empty prompt".into());
        }
        if self.history.len() + ids.len() > self.max_context {
            return Err(if self.history.is_empty() {
                format!("the prompt has {} tokens, more than the context of {} tokens: raise the max context (--max-context) or shorten the prompt", ids.len(), self.max_context)
            } else {
                format!("context full: {} + {} tokens exceed the context of {} tokens", self.history.len(), ids.len(), self.max_context)
            });
        }
        Ok(Generation { model: self, prompt: ids.to_vec(), params, produced: vec![], pending: None, done: false, stop: None, in_flight: 0 })
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
    /// Unpipelined: the last token, fed when the next one is asked for.
    pending: Option<u32>,
    done: bool,
    stop: Option<StopReason>,
    /// Pipelined decode steps submitted and not read yet.
    in_flight: usize,
}

impl Generation<'_> {
    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.produced
    }

    /// Why the generation ended (`None` while it runs, or after an error).
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    fn finish(&mut self, why: StopReason) -> Result<Option<Piece>, String> {
        self.done = true;
        self.stop = Some(why);
        Ok(None)
    }

    fn step(&mut self) -> Result<Option<Piece>, String> {
        if self.done {
            return Ok(None);
        }
        if self.produced.len() >= self.params.max_tokens {
            return self.finish(StopReason::MaxTokens);
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
                // a step is always queued while tokens remain, unless the context is full
                return self.finish(StopReason::ContextFull);
            }
            // Keep the GPU busy: the next step is queued before this one is read.
            if more_after(self.produced.len()) && self.model.position() < self.model.max_context {
                self.model.submit_decode(None, &s)?;
                self.in_flight += 1;
            }
            self.in_flight -= 1;
            self.model.take_decode()?
        } else {
            let Some(t) = self.pending.take() else {
                return self.finish(StopReason::ContextFull);
            };
            if self.model.position() >= self.model.max_context {
                return self.finish(StopReason::ContextFull);
            }
            // the step runs when its token is asked for, so that timing a piece times its step
            self.model.forward(&[t], false, Some(&s))?.token
        };
        let stops = match &self.model.tokenizer {
            Some(tk) => tk.stop_ids.contains(&tok),
            None => self.model.config.eos_token_ids.contains(&tok),
        };
        if self.params.stop_at_eos && stops {
            return self.finish(StopReason::Stop);
        }
        let text = match (&self.model.tokenizer, self.params.text) {
            (Some(tk), true) => tk.decode_incremental(&self.produced, tok)?,
            _ => String::new(),
        };
        self.produced.push(tok);
        if !pipelined {
            self.pending = Some(tok);
        }
        Ok(Some(Piece { token: tok, text }))
    }
}

impl Drop for Generation<'_> {
    /// Reads the decode steps still queued, so that the sequence stays consistent
    /// (a following [`Model::generate_after`] continues it).
    fn drop(&mut self) {
        while self.in_flight > 0 {
            self.in_flight -= 1;
            if self.model.take_decode().is_err() {
                break;
            }
        }
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

/// A device opened for a model, before the weights are uploaded.
enum Opened {
    Cpu,
    Gpu(Box<crate::gpu::device::Gpu>),
}

/// A model directory, told apart from what it is often confused with (a GGUF or
/// safetensors file, a Hugging Face repository id, a mistyped path).
pub fn check_dir(dir: &Path) -> Result<(), String> {
    const HOW: &str = "markbase reads MLX checkpoint directories (config.json, *.safetensors, tokenizer.json); \
                       make one with `mlx_lm.convert --hf-path <repo or dir> --mlx-path DIR` (add -q to quantize)";
    let d = dir.display();
    if dir.is_file() {
        return Err(format!("{d} is a file, not a model directory\n{HOW}"));
    }
    if !dir.exists() {
        let repo_like = !dir.is_absolute() && dir.components().count() == 2 && !dir.starts_with(".");
        let hint = if repo_like { " (a Hugging Face repository id is not downloaded: convert it first)" } else { "" };
        return Err(format!("{d}: no such directory{hint}\n{HOW}"));
    }
    if !dir.join("config.json").is_file() {
        return Err(format!("{d} has no config.json: not an MLX checkpoint\n{HOW}"));
    }
    Ok(())
}

/// The context and chunk lengths against each other and the model's positions.
fn check_context(config: &ModelConfig, max_context: usize, chunk: usize) -> Result<(), String> {
    if max_context == 0 {
        return Err("the max context (--max-context) must be at least 1 token".into());
    }
    if chunk == 0 {
        return Err("the prefill chunk must be at least 1 token".into());
    }
    let limit = config.max_position_embeddings;
    if limit > 0 && max_context > limit {
        return Err(format!(
            "a max context (--max-context) of {max_context} tokens exceeds this model's {limit} positions (max_position_embeddings in config.json)"
        ));
    }
    Ok(())
}

/// Opens the device `opts` asks for and checks that the model's buffers fit it; on a
/// software adapter, where allowed, the CPU instead (with a notice).
fn open_device(opts: &ModelOptions, need: &crate::memory::Needs) -> Result<(Opened, Option<String>), String> {
    use crate::gpu::device::{Backend, Gpu, GpuOptions};
    match opts.device {
        DeviceKind::Cpu => {
            need.fit_host()?;
            Ok((Opened::Cpu, None))
        }
        DeviceKind::Gpu(b) => {
            let env = if b.is_none() { Backend::from_env().map_err(|e| e.to_string())? } else { None };
            let gpu = Gpu::with_options(&GpuOptions { backend: b, ..Default::default() }).map_err(|e| e.to_string())?;
            if opts.cpu_if_software_gpu && b.is_none() && env.is_none() && gpu.info.device_type == "cpu" {
                need.fit_host()?;
                let note = format!(
                    "{} is a software GPU: running on the CPU reference executor, faster here (--backend {} forces it)",
                    gpu.info.name, gpu.info.backend
                );
                return Ok((Opened::Cpu, Some(note)));
            }
            need.fit_gpu(&gpu.info.name, gpu.limits())?;
            Ok((Opened::Gpu(Box::new(gpu)), None))
        }
    }
}
