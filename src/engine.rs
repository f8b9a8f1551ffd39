//! The high-level API: an [`Engine`] holds what every sequence of one model shares (config,
//! tokenizer, weights on the device, the kernel cache, compiled graphs) and is shared through
//! `Arc` (`Send + Sync`); a [`Session`] is one sequence on it (its KV caches, position and
//! sampler state). Many sessions run on one engine, each as if alone.
//!
//! ```no_run
//! use markbase::engine::{Engine, ModelOptions};
//! let engine = Engine::load("models/gemma3-270m-q4", ModelOptions::default())?;
//! let (mut a, mut b) = (engine.session()?, engine.session()?);
//! let la = a.logits(&[2, 818, 5279])?;
//! let lb = b.logits(&[2, 1437])?;
//! # Ok::<(), markbase::engine::Error>(())
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use markbase_graph::builder::{BuildOptions, Outputs, RECENT_TOKENS};
use markbase_graph::ir::{Graph, GraphKind};
use markbase_graph::passes::{compile, Compiled, PhasePolicy};
use markbase_graph::{FuseOptions, ModelConfig};

use crate::cpu::exec::StepInputs;
pub use crate::error::Error;
pub use crate::cpu::ops::SampleParams;
use crate::exec::{CpuExecutor, Executor, GraphKey, Profile, ProfileResult, StepOutput, StepStats};
use crate::gpu::runtime::{GpuExecutor, GpuShared};
use crate::loader::{Checkpoint, LoadOptions, ProgressFn};
use crate::tokenizer::Tokenizer;
use crate::audio::AudioEncoder;
use crate::vision::encode::ImagePrompt;
use crate::vision::{ImageEncoder, Modality, Placeholders, RgbImage, SoftTokens};
use crate::weights::Weights;
use markbase_graph::audio::AudioConfig;
use markbase_graph::vision::{TowerKind, VisionConfig};

/// Where the graph runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU reference executor (f32, slow, exact).
    Cpu,
    /// wgpu on the given backend (`None` = the platform's best, or `MARKBASE_BACKEND`).
    Gpu(Option<crate::gpu::device::Backend>),
}

/// Options of [`Engine::load`] (and [`Session::load`]).
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
    /// With `DeviceKind::Gpu(None)` and no backend named in the environment: when the only
    /// adapter is a software one (llvmpipe, lavapipe), run on the CPU reference executor
    /// instead (it is faster there). [`Engine::notice`] says so.
    pub cpu_if_software_gpu: bool,
    /// Called with the name of each loading stage as it starts ("reading weights", "uploading").
    pub stage: Option<Box<dyn Fn(&str) + Send + Sync>>,
    /// Lowers the byte size of one KV-cache buffer below the adapter's binding limit (GPU):
    /// longer caches are split across buffers ([`crate::gpu::kv`]). For tests of that path;
    /// never raises the limit (nor does `MARKBASE_MAX_KV_BINDING`, its environment form).
    pub max_kv_binding: Option<u64>,
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
            cpu_if_software_gpu: false,
            stage: None,
            max_kv_binding: None,
        }
    }
}

/// The device side an engine's sessions share.
enum Device {
    /// The weights as the CPU executor reads them (dequantized once, shared by the sessions).
    Cpu(crate::cpu::exec::CpuWeights),
    Gpu(GpuShared),
}

/// One model, ready to run: shared by its sessions.
pub struct Engine {
    pub config: ModelConfig,
    /// The checkpoint directory (for messages).
    dir: Option<PathBuf>,
    /// What loading decided on the caller's behalf (the CPU instead of a software GPU).
    notice: Option<String>,
    checkpoint: Option<Checkpoint>,
    weights: Arc<Weights>,
    tokenizer: Option<Tokenizer>,
    device: Device,
    /// Compiled graphs by key, built on first use.
    graphs: Mutex<HashMap<GraphKey, Arc<Compiled>>>,
    max_context: usize,
    chunk: usize,
    fuse: FuseOptions,
    /// The vision tower's config, where the checkpoint has one (a malformed one is reported
    /// when images are given, and does not keep text from running).
    vision: Result<Option<VisionConfig>, String>,
    /// The image encoder (the vision tower on the engine's device), opened on first use.
    encoder: Mutex<Option<ImageEncoder>>,
    /// The audio tower's config, as `vision`.
    audio: Result<Option<AudioConfig>, String>,
    /// The audio encoder (the audio tower on the engine's device), opened on first use.
    audio_encoder: Mutex<Option<AudioEncoder>>,
    /// The device the graphs run on, and NaN checks (for the encoders).
    device_kind: DeviceKind,
    check_nan: bool,
}

impl Engine {
    /// Opens a checkpoint directory, checks and loads the weights, and prepares the device.
    /// Everything cheap is checked first: the directory, the context against the model's
    /// positions, the device and whether the caches fit it, then the weights are read.
    pub fn load(dir: impl AsRef<Path>, opts: ModelOptions) -> Result<Arc<Engine>, Error> {
        let dir = dir.as_ref();
        check_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        check_context(ck.config(), opts.max_context, opts.prefill_chunk)?;
        let chunk = opts.prefill_chunk.min(opts.max_context);
        let probe = ck.build(BuildOptions::decode(opts.max_context, chunk))?;
        let mut need = crate::memory::Needs::of(&probe, &ck.build(prefill_options(opts.max_context, chunk))?).map_err(Error::Config)?;
        need.towers = ck.tower_needs();
        let (opened, notice) = open_device(&opts, &need)?;
        if let Some(f) = &opts.stage {
            f("reading weights");
        }
        let lo = LoadOptions { progress: opts.progress.as_deref() };
        let (weights, _report) = ck.load_weights_with(&probe, &lo)?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::load(dir, ck.config().bos_token_id, &ck.config().eos_token_ids)?)
        } else {
            None
        };
        let config = ck.config().clone();
        let vision = ck.vision_config().map_err(|e| e.to_string());
        let audio = ck.audio_config().map_err(|e| e.to_string());
        let parts = Parts { checkpoint: Some(ck), dir: Some(dir.to_path_buf()), notice, opened, vision, audio };
        Self::new(config, parts, Arc::new(weights), tokenizer, &opts)
    }

    /// An engine from a config and weights already in memory (synthetic models).
    pub fn from_parts(config: ModelConfig, weights: Arc<Weights>, tokenizer: Option<Tokenizer>, opts: &ModelOptions) -> Result<Arc<Engine>, Error> {
        Self::from_parts_with_vision(config, weights, tokenizer, None, opts)
    }

    /// [`Engine::from_parts`] of a decoder that takes images encoded elsewhere (benchmarks):
    /// `vision`, the tower's config, gives the image tokens' ids and Gemma 3's bidirectional
    /// image spans to prompts with soft tokens.
    pub fn from_parts_with_vision(
        config: ModelConfig,
        weights: Arc<Weights>,
        tokenizer: Option<Tokenizer>,
        vision: Option<VisionConfig>,
        opts: &ModelOptions,
    ) -> Result<Arc<Engine>, Error> {
        check_context(&config, opts.max_context, opts.prefill_chunk)?;
        let chunk = opts.prefill_chunk.min(opts.max_context);
        let r = WeightsResolver(&weights);
        let build = |o: &BuildOptions| markbase_graph::build(&config, &r, o).map_err(|e| Error::Config(e.to_string()));
        let need = crate::memory::Needs::of(&build(&BuildOptions::decode(opts.max_context, chunk))?, &build(&prefill_options(opts.max_context, chunk))?)
            .map_err(Error::Config)?;
        let (opened, notice) = open_device(opts, &need)?;
        Self::new(config, Parts { checkpoint: None, dir: None, notice, opened, vision: Ok(vision), audio: Ok(None) }, weights, tokenizer, opts)
    }

    fn new(config: ModelConfig, parts: Parts, weights: Arc<Weights>, tokenizer: Option<Tokenizer>, opts: &ModelOptions) -> Result<Arc<Engine>, Error> {
        let device_kind = match parts.opened {
            Opened::Cpu => DeviceKind::Cpu,
            Opened::Gpu(_) => opts.device,
        };
        let device = match parts.opened {
            Opened::Cpu => Device::Cpu(crate::cpu::exec::CpuWeights::new(weights.clone())),
            Opened::Gpu(gpu) => {
                if let Some(f) = &opts.stage {
                    f("uploading");
                }
                let mut shared = GpuShared::with_gpu(*gpu, &weights, opts.check_nan, None).map_err(Error::Device)?;
                shared.lower_kv_binding(opts.max_kv_binding);
                Device::Gpu(shared)
            }
        };
        Ok(Arc::new(Engine {
            config,
            dir: parts.dir,
            notice: parts.notice,
            checkpoint: parts.checkpoint,
            weights,
            tokenizer,
            device,
            graphs: Mutex::new(HashMap::new()),
            max_context: opts.max_context,
            chunk: opts.prefill_chunk.min(opts.max_context),
            fuse: opts.fuse.clone(),
            vision: parts.vision,
            encoder: Mutex::new(None),
            audio: parts.audio,
            audio_encoder: Mutex::new(None),
            device_kind,
            check_nan: opts.check_nan,
        }))
    }

    /// An executor on this engine's device and weights, with caches of its own.
    pub(crate) fn executor(&self) -> Box<dyn Executor> {
        match &self.device {
            Device::Cpu(w) => Box::new(CpuExecutor::with_weights(w.clone())),
            Device::Gpu(shared) => Box::new(GpuExecutor::for_session(shared)),
        }
    }

    /// Whether the graphs run on a GPU (else the CPU reference executor).
    pub fn on_gpu(&self) -> bool {
        matches!(self.device, Device::Gpu(_))
    }

    /// The graph `key` over the caches of a batch of `slots` sequences (see
    /// [`crate::batch::Batch`]): with `all_logits`, a decode step of `key.tokens` sequences (a
    /// token per row); else a prefill step of `key.tokens` tokens of one sequence (the last
    /// position's token). Not cached here: the batch keeps its graphs.
    pub fn batch_graph(&self, key: GraphKey, slots: usize) -> Result<Compiled, Error> {
        let decode = key.all_logits;
        let mut o = if decode { BuildOptions::decode(self.max_context, self.chunk) } else { BuildOptions::prefill(key.tokens, self.max_context) };
        o.tokens = key.tokens;
        o.chunk = self.chunk;
        o.batch = slots;
        o.outputs = if decode { Outputs::RowTokens } else { Outputs::LastLogits };
        o.sample = key.sample;
        o.fuse = self.fuse.clone();
        // a prompt's image steps take a soft row per token (unused rows are zeros)
        o.soft_rows = if key.images && !decode { key.tokens } else { 0 };
        let g: Graph = match &self.checkpoint {
            Some(ck) => ck.build(o)?,
            None => markbase_graph::build(&self.config, &WeightsResolver(&self.weights), &o).map_err(|e| Error::Config(e.to_string()))?,
        };
        let policy = if decode { PhasePolicy::Step } else { PhasePolicy::EmbedLayersHead };
        compile(g, policy).map_err(|e| Error::Config(e.to_string()))
    }

    /// A new sequence on this engine.
    pub fn session(self: &Arc<Self>) -> Result<Session, Error> {
        let exec = self.executor();
        Ok(Session {
            config: self.config.clone(),
            engine: self.clone(),
            exec,
            graphs: HashMap::new(),
            history: vec![],
            steps: 0,
            runs: 0,
            unread: Default::default(),
        })
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer, Error> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::Load(match &self.dir {
                Some(d) => format!("{}: no such file (generating text needs the checkpoint's tokenizer)", d.join("tokenizer.json").display()),
                None => "this model has no tokenizer".to_string(),
            })
        })
    }

    /// What loading decided on the caller's behalf, e.g. the CPU executor instead of a
    /// software GPU adapter ([`ModelOptions::cpu_if_software_gpu`]).
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    pub(crate) fn tokenizer_opt(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Longest sequence a session holds.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Longest prefill step.
    pub fn prefill_chunk(&self) -> usize {
        self.chunk
    }

    /// The vision tower's config (`None`: the checkpoint takes no images).
    pub fn vision_config(&self) -> Option<&VisionConfig> {
        self.vision.as_ref().ok().and_then(|v| v.as_ref())
    }

    /// The vision config, or the error of giving images to a model without a vision tower.
    pub fn vision_or_err(&self) -> Result<&VisionConfig, Error> {
        let v = self.vision.as_ref().map_err(|e| Error::Config(e.clone()))?;
        v.as_ref().ok_or_else(|| {
            let what = self.dir.as_ref().map_or("this model".to_string(), |d| d.display().to_string());
            Error::Input(format!("{what} has no vision tower (no vision_config in config.json): it takes no images"))
        })
    }

    /// The soft tokens of `img` from the checkpoint's vision tower, on the engine's device
    /// (the tower is loaded on first use).
    pub fn encode_image(&self, img: &RgbImage) -> Result<SoftTokens, Error> {
        self.encode_image_with_budget(img, None)
    }

    /// [`Engine::encode_image`] with Gemma 4's soft-token budget for this image (70, 140,
    /// 280, 560 or 1120; `None`: the checkpoint's); Gemma 3's SigLIP makes 256 whatever it is.
    pub fn encode_image_with_budget(&self, img: &RgbImage, budget: Option<usize>) -> Result<SoftTokens, Error> {
        self.with_image_encoder(|e| e.encode_with_budget(img, budget))
    }

    /// `f` on the image encoder, opened on first use.
    fn with_image_encoder<T>(&self, f: impl FnOnce(&mut ImageEncoder) -> Result<T, Error>) -> Result<T, Error> {
        self.vision_or_err()?;
        let dir = self.dir.as_ref().ok_or_else(|| Error::Input("this model was not loaded from a checkpoint: it takes no images".into()))?;
        let mut enc = self.encoder.lock().map_err(|_| Error::Device("the engine's image encoder is poisoned".into()))?;
        if enc.is_none() {
            *enc = Some(ImageEncoder::open(dir, self.device_kind, None, self.check_nan)?);
        }
        enc.as_mut().map(f).unwrap_or_else(|| Err(Error::Device("no image encoder".into())))
    }

    /// How many soft tokens [`Engine::encode_image_with_budget`] makes of `img`, without
    /// running the tower (it is loaded if it was not).
    pub fn image_soft_tokens(&self, img: &RgbImage, budget: Option<usize>) -> Result<usize, Error> {
        self.with_image_encoder(|e| e.soft_tokens(img, budget))
    }

    /// The checkpoint directory the engine was loaded from.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The audio tower's config (`None`: the checkpoint takes no audio).
    pub fn audio_config(&self) -> Option<&AudioConfig> {
        self.audio.as_ref().ok().and_then(|v| v.as_ref())
    }

    /// The audio config, or the error of giving clips to a model without an audio tower.
    pub fn audio_or_err(&self) -> Result<&AudioConfig, Error> {
        let v = self.audio.as_ref().map_err(|e| Error::Config(e.clone()))?;
        v.as_ref().ok_or_else(|| {
            let what = self.dir.as_ref().map_or("this model".to_string(), |d| d.display().to_string());
            Error::Input(format!("{what} has no audio tower markbase runs (no Gemma 4 audio_config in config.json): it takes no audio"))
        })
    }

    /// The soft tokens of a clip (mono samples at the feature extractor's rate, 16 kHz) from
    /// the checkpoint's audio tower, on the engine's device (the tower is loaded on first use).
    pub fn encode_audio(&self, samples: &[f32]) -> Result<SoftTokens, Error> {
        self.audio_or_err()?;
        let dir = self.dir.as_ref().ok_or_else(|| Error::Input("this model was not loaded from a checkpoint: it takes no audio".into()))?;
        let mut enc = self.audio_encoder.lock().map_err(|_| Error::Device("the engine's audio encoder is poisoned".into()))?;
        if enc.is_none() {
            *enc = Some(AudioEncoder::open(dir, self.device_kind, self.check_nan)?);
        }
        enc.as_mut().map(|e| e.encode(samples)).unwrap_or_else(|| Err(Error::Device("no audio encoder".into())))
    }

    /// The placeholder ids of the decoder's image and audio soft tokens.
    pub fn placeholders(&self) -> Placeholders {
        Placeholders { image: self.vision_config().map(|v| v.image_token), audio: self.audio_config().map(|a| a.audio_token) }
    }

    /// The steps `ids` are fed in (and whether each takes image rows), with their image
    /// prompt where `images` are given (Gemma 3: no step ends inside an image's run).
    pub fn plan(&self, ids: &[u32], images: &[SoftTokens]) -> Result<(Option<ImagePrompt>, Vec<(usize, bool)>), Error> {
        if images.is_empty() {
            return Ok((None, prefill_steps(ids.len(), self.chunk).into_iter().map(|n| (n, false)).collect()));
        }
        for kind in [Modality::Image, Modality::Audio] {
            if images.iter().any(|s| s.kind == kind) {
                match kind {
                    Modality::Image => self.vision_or_err().map(|_| ())?,
                    Modality::Audio => self.audio_or_err().map(|_| ())?,
                }
            }
        }
        let p = crate::vision::encode::soft_prompt(ids, &self.placeholders(), images)?;
        // bidirectional image spans (Gemma 3; Gemma 4 26B/31B on sliding layers) are fed whole
        let spans = match self.vision_config() {
            Some(vc) if vc.kind == TowerKind::Siglip || self.config.vision_spans_sliding => image_spans(ids, vc.image_token),
            _ => vec![],
        };
        let mut start = 0;
        let mut steps = vec![];
        for n in span_steps(ids.len(), self.chunk, &spans)? {
            steps.push((n, p.soft_index[start..start + n].iter().any(|&i| i > 0)));
            start += n;
        }
        Ok((Some(p), steps))
    }

    /// Compiled graphs so far (one per key; prompts are cut into a bounded set of step sizes).
    pub fn compiled_graphs(&self) -> usize {
        self.graphs.lock().map(|g| g.len()).unwrap_or(0)
    }

    /// The compiled graph for `key` (built on first use).
    pub fn graph(&self, key: GraphKey) -> Result<Arc<Compiled>, Error> {
        let mut graphs = self.graphs.lock().map_err(|_| Error::Device("the engine's graph cache is poisoned".into()))?;
        if let Some(c) = graphs.get(&key) {
            return Ok(c.clone());
        }
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
        // image steps take a soft row per token (unused rows are zeros)
        o.soft_rows = if key.images { key.tokens } else { 0 };
        let g: Graph = match &self.checkpoint {
            Some(ck) => ck.build(o)?,
            None => markbase_graph::build(&self.config, &WeightsResolver(&self.weights), &o).map_err(|e| Error::Config(e.to_string()))?,
        };
        // Decode: one submission per step (the next step is encoded while this one
        // runs); prefill: the layers are submitted before the head is encoded.
        let policy = if key.tokens == 1 { PhasePolicy::Step } else { PhasePolicy::EmbedLayersHead };
        let c = Arc::new(compile(g, policy).map_err(|e| Error::Config(e.to_string()))?);
        graphs.insert(key, c.clone());
        Ok(c)
    }
}

/// The step sizes a prompt of `n` tokens runs in: full chunks, then the rest as decreasing
/// powers of two, so that any prompt needs at most `log2(chunk) + 2` distinct graphs.
pub fn prefill_steps(n: usize, chunk: usize) -> Vec<usize> {
    let mut steps = vec![chunk; n / chunk];
    let mut rest = n % chunk;
    while rest > 0 {
        let p = 1 << (usize::BITS - 1 - rest.leading_zeros());
        steps.push(p);
        rest -= p;
    }
    steps
}

/// The step sizes of a prompt of `n` tokens whose `spans` (`[start, end)`, sorted, disjoint)
/// must each be fed within one step (Gemma 3's image spans, which attend to themselves): as
/// [`prefill_steps`], a step shortened to end where a span starts, or stretched to end where
/// one ends when it starts there. A span longer than `chunk` is an error.
pub fn span_steps(n: usize, chunk: usize, spans: &[(usize, usize)]) -> Result<Vec<usize>, Error> {
    let floor2 = |x: usize| 1usize << (usize::BITS - 1 - x.leading_zeros());
    let (mut steps, mut start) = (vec![], 0);
    while start < n {
        let rest = n - start;
        let mut s = if rest >= chunk { chunk } else { floor2(rest) };
        while let Some(&(a, b)) = spans.iter().find(|&&(a, b)| a < start + s && start + s < b) {
            if a > start {
                s = floor2(a - start);
            } else {
                if b - start > chunk {
                    return Err(Error::Input(format!(
                        "an image of {} soft tokens does not fit a prefill step of {chunk} tokens (its tokens attend to each other and are fed at once)",
                        b - a
                    )));
                }
                s = b - start;
                break;
            }
        }
        steps.push(s);
        start += s;
    }
    Ok(steps)
}

/// One sequence on an [`Engine`].
pub struct Session {
    pub config: ModelConfig,
    engine: Arc<Engine>,
    exec: Box<dyn Executor>,
    /// The engine's graphs this session has run.
    graphs: HashMap<GraphKey, Arc<Compiled>>,
    /// Tokens of the current sequence (their K/V are in the caches).
    history: Vec<u32>,
    /// Tokens sampled so far in this sequence (the sampler's counter).
    steps: u32,
    /// Graph executions, for tests and benchmarks.
    pub runs: usize,
    /// History slots of device-fed tokens not read back yet (pipelined decode).
    unread: std::collections::VecDeque<usize>,
}

impl Session {
    /// A session on an engine of its own (the one-sequence API).
    pub fn load(dir: impl AsRef<Path>, opts: ModelOptions) -> Result<Session, Error> {
        Engine::load(dir, opts)?.session()
    }

    /// A session on an engine of its own, from a config and weights in memory.
    pub fn from_parts(config: ModelConfig, weights: Arc<Weights>, tokenizer: Option<Tokenizer>, opts: &ModelOptions) -> Result<Session, Error> {
        Engine::from_parts(config, weights, tokenizer, opts)?.session()
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer, Error> {
        self.engine.tokenizer()
    }

    pub fn weights(&self) -> &Weights {
        self.engine.weights()
    }

    pub fn device(&self) -> String {
        self.exec.describe()
    }

    /// Longest sequence this session holds.
    pub fn max_context(&self) -> usize {
        self.engine.max_context
    }

    /// What loading decided on the caller's behalf (see [`Engine::notice`]).
    pub fn notice(&self) -> Option<&str> {
        self.engine.notice()
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
        if len - n > 1 && len > self.config.sliding_window.min(self.engine.max_context) {
            return false;
        }
        self.history.truncate(n);
        true
    }

    /// Compiles the graphs a generation after a `prompt_len`-token prompt runs (each is
    /// otherwise compiled on first use, inside the first step).
    pub fn prepare(&mut self, prompt_len: usize, s: &SampleParams) -> Result<(), Error> {
        let sample = !s.is_greedy();
        let mut lens = prefill_steps(prompt_len, self.engine.chunk);
        lens.push(1);
        lens.dedup();
        for tokens in lens {
            self.graph(GraphKey { tokens, all_logits: false, sample, images: false })?;
        }
        Ok(())
    }

    /// [`Session::prepare`] for a prompt of `ids` whose placeholder runs take `images` (its
    /// steps, with image rows where they hold image tokens).
    pub fn prepare_with_images(&mut self, ids: &[u32], images: &[SoftTokens], s: &SampleParams) -> Result<(), Error> {
        if images.is_empty() {
            return self.prepare(ids.len(), s);
        }
        let sample = !s.is_greedy();
        let (_, steps) = self.plan(ids, images)?;
        for (tokens, images) in steps.into_iter().chain([(1, false)]) {
            self.graph(GraphKey { tokens, all_logits: false, sample, images })?;
        }
        Ok(())
    }

    fn plan(&self, ids: &[u32], images: &[SoftTokens]) -> Result<(Option<ImagePrompt>, Vec<(usize, bool)>), Error> {
        self.engine.plan(ids, images)
    }

    /// Counters of the last GPU step (submits, dispatches, encode time).
    pub fn gpu_stats(&mut self) -> Option<StepStats> {
        self.exec.stats()
    }

    /// The kernel of each GPU dispatch of graph `key` (once a step has run it).
    pub fn gpu_kernels(&mut self, key: GraphKey) -> Option<Vec<(petgraph::graph::NodeIndex, String)>> {
        self.exec.kernels(key)
    }

    /// Sets timestamp profiling of the following GPU steps; false where the device has none.
    pub fn set_profile(&mut self, p: Profile) -> bool {
        self.exec.set_profile(p)
    }

    /// GPU times of the last profiled step.
    pub fn gpu_profile(&mut self) -> Option<ProfileResult> {
        self.exec.profile()
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

    /// Sets the sampler's counter: the next sampled token draws at step `step` (a prompt fed
    /// in several calls samples its first token at step 0, as one call would).
    pub fn set_sampler_step(&mut self, step: u32) {
        self.steps = step;
    }

    /// Whether decode steps can be pipelined (GPU, no repetition penalty needing the host's history).
    pub fn can_pipeline(&self, s: &SampleParams) -> bool {
        self.exec.pipelines() && s.repetition_penalty == 1.0
    }

    /// Submits a decode step without waiting for it. `token`: the input token, or
    /// `None` for the token the previous decode step produced (kept on the device).
    pub fn submit_decode(&mut self, token: Option<u32>, s: &SampleParams) -> Result<(), Error> {
        if self.history.len() + 1 > self.engine.max_context {
            return Err(Error::Input(format!("context full: max_context {}", self.engine.max_context)));
        }
        // greedy steps take the argmax (many workgroups) instead of the sampler (one)
        let key = GraphKey { tokens: 1, all_logits: false, sample: !s.is_greedy(), images: false };
        self.graph(key)?;
        let pos = [self.history.len() as u32];
        let tok = [token.unwrap_or(0)];
        let words = s.words(self.steps, 0);
        let step = StepInputs { tokens: &tok, positions: &pos, sampling: words, recent: &[], ..Default::default() };
        self.exec.submit(key, &self.graphs[&key], &step, token.is_none()).map_err(Error::Device)?;
        if token.is_none() {
            self.unread.push_back(self.history.len());
        }
        self.history.push(tok[0]);
        self.steps += 1;
        self.runs += 1;
        Ok(())
    }

    /// Waits for the oldest submitted decode step; returns its token.
    pub fn take_decode(&mut self) -> Result<u32, Error> {
        let t = self.exec.take().map_err(Error::Device)?;
        if let Some(i) = self.unread.pop_front() {
            self.history[i] = t;
        }
        Ok(t)
    }

    /// The compiled graph for `key` (the engine's, built on first use).
    pub fn graph(&mut self, key: GraphKey) -> Result<&Compiled, Error> {
        if !self.graphs.contains_key(&key) {
            let c = self.engine.graph(key)?;
            self.graphs.insert(key, c);
        }
        Ok(&self.graphs[&key])
    }

    /// Feeds `ids` after the current sequence, in steps of [`prefill_steps`]. Returns the
    /// output of the last step (its last position's token); with `all_logits`, the logits of
    /// every fed position are concatenated.
    pub fn forward(&mut self, ids: &[u32], all_logits: bool, sampling: Option<&SampleParams>) -> Result<StepOutput, Error> {
        self.forward_with_images(ids, &[], all_logits, sampling)
    }

    /// [`Session::forward`] of `ids` whose image and audio placeholder runs (the model's image
    /// and audio tokens, as the processor expands them) take the soft tokens of `images` (each
    /// run by its [`Modality`]), each kind in order. Gemma 3 (and Gemma 4 26B/31B on sliding
    /// layers): each image's run attends to itself bidirectionally, so that no prefill step
    /// ends inside one.
    pub fn forward_with_images(&mut self, ids: &[u32], images: &[SoftTokens], all_logits: bool, sampling: Option<&SampleParams>) -> Result<StepOutput, Error> {
        if ids.is_empty() {
            return Err(Error::Input("no tokens to process".into()));
        }
        if let Some(s) = sampling {
            s.validate().map_err(Error::Sampling)?;
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(Error::Input(format!("token id {bad} is outside the vocabulary ({vocab})")));
        }
        let max_context = self.engine.max_context;
        if self.history.len() + ids.len() > max_context {
            return Err(Error::Input(format!("context full: {} + {} tokens exceed max_context {max_context}", self.history.len(), ids.len())));
        }
        // with images: the placeholders filled, and where each step may end
        let (img, steps) = self.plan(ids, images)?;
        let mut all = vec![];
        let mut last = StepOutput::default();
        let mut start = 0;
        for (n, with_rows) in steps {
            let chunk = &ids[start..start + n];
            // this step's image rows, one per token (zeros for text), and attention bounds
            let rows = img.as_ref().filter(|_| with_rows).map(|p| step_rows(p, start, n, self.history.len()));
            start += n;
            let key = GraphKey { tokens: n, all_logits, sample: sampling.is_some_and(|s| !s.is_greedy()), images: rows.is_some() };
            self.graph(key)?;
            let p0 = self.history.len() as u32;
            let positions: Vec<u32> = (p0..p0 + n as u32).collect();
            let mut recent: Vec<u32> = self.history.iter().chain(chunk.iter()).rev().take(RECENT_TOKENS).cloned().collect();
            recent.reverse();
            let words = sampling.map(|s| s.words(self.steps, recent.len() as u32)).unwrap_or_default();
            let mut step = StepInputs { tokens: chunk, positions: &positions, sampling: words, recent: &recent, ..Default::default() };
            if let Some(r) = &rows {
                step = StepInputs { tokens: &r.tokens, soft_rows: &r.soft_rows, soft_index: &r.soft_index, attend_until: &r.attend_until, ..step };
            }
            last = self.exec.run(key, &self.graphs[&key], &step, all_logits).map_err(Error::Device)?;
            self.runs += 1;
            self.history.extend_from_slice(chunk);
            if all_logits {
                all.extend(last.logits.take().unwrap_or_default());
            }
        }
        // one sampler step per call: the token of the last position (the steps before it
        // sample nothing that is kept), whatever steps the prompt ran in
        self.steps += 1;
        if all_logits {
            last.logits = Some(all);
        }
        Ok(last)
    }

    /// Logits `[len][V]` of every position of `ids`, as a fresh sequence.
    pub fn logits(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>, Error> {
        self.reset();
        let out = self.forward(ids, true, None)?;
        let v = self.config.vocab_size;
        Ok(out.logits.unwrap_or_default().chunks(v).map(|c| c.to_vec()).collect())
    }
}

/// The `[start, end)` of each run of `image_token` in `ids`.
pub fn image_spans(ids: &[u32], image_token: u32) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = vec![];
    for (i, &t) in ids.iter().enumerate() {
        if t == image_token {
            match spans.last_mut() {
                Some(s) if s.1 == i => s.1 = i + 1,
                _ => spans.push((i, i + 1)),
            }
        }
    }
    spans
}

/// One prefill step's inputs of an image prompt.
pub(crate) struct StepRows {
    pub tokens: Vec<u32>,
    pub soft_rows: Vec<f32>,
    pub soft_index: Vec<u32>,
    pub attend_until: Vec<u32>,
}

/// Tokens `start..start + n` of `p` as a step from position `p0`: a soft row per token.
pub(crate) fn step_rows(p: &ImagePrompt, start: usize, n: usize, p0: usize) -> StepRows {
    let width = p.soft_rows.len() / p.soft_index.iter().filter(|&&i| i > 0).count().max(1);
    let mut soft_rows = vec![0f32; n * width];
    let mut soft_index = vec![0u32; n];
    for (i, &src) in p.soft_index[start..start + n].iter().enumerate() {
        if src > 0 {
            let r = src as usize - 1;
            soft_rows[i * width..(i + 1) * width].copy_from_slice(&p.soft_rows[r * width..(r + 1) * width]);
            soft_index[i] = i as u32 + 1;
        }
    }
    let attend_until = p.span_ends[start..start + n].iter().map(|&e| (p0 + e as usize - start) as u32).collect();
    StepRows { tokens: p.tokens[start..start + n].to_vec(), soft_rows, soft_index, attend_until }
}

/// The prefill graph whose buffers a load checks: one full chunk (at least 2 tokens) whose
/// last position's logits are kept, as generation and serving run it (a graph of every
/// position's logits, `logits`' and the tests', is checked against the adapter's limits when
/// its buffers are made: a chunk of 2,048 tokens over a vocabulary of 262,144 is 2 GiB of
/// logits alone).
fn prefill_options(max_context: usize, chunk: usize) -> BuildOptions {
    let mut o = BuildOptions::prefill(chunk.max(2), max_context.max(2));
    o.chunk = chunk.max(2);
    o.outputs = Outputs::LastLogits;
    o
}

/// A device opened for a model, before the weights are uploaded.
enum Opened {
    Cpu,
    Gpu(Box<crate::gpu::device::Gpu>),
}

/// What a load found beside the weights.
struct Parts {
    checkpoint: Option<Checkpoint>,
    dir: Option<PathBuf>,
    notice: Option<String>,
    opened: Opened,
    vision: Result<Option<VisionConfig>, String>,
    audio: Result<Option<AudioConfig>, String>,
}

/// A model directory, told apart from what it is often confused with (a GGUF or
/// safetensors file, a Hugging Face repository id, a mistyped path).
pub fn check_dir(dir: &Path) -> Result<(), Error> {
    const HOW: &str = "markbase reads MLX checkpoint directories (config.json, *.safetensors, tokenizer.json); \
                       make one with `mlx_lm.convert --hf-path <repo or dir> --mlx-path DIR` (add -q to quantize)";
    let d = dir.display();
    if dir.is_file() {
        return Err(Error::Load(format!("{d} is a file, not a model directory\n{HOW}")));
    }
    if !dir.exists() {
        let repo_like = !dir.is_absolute() && dir.components().count() == 2 && !dir.starts_with(".");
        let hint = if repo_like { " (a Hugging Face repository id is not downloaded: convert it first)" } else { "" };
        return Err(Error::Load(format!("{d}: no such directory{hint}\n{HOW}")));
    }
    if !dir.join("config.json").is_file() {
        return Err(Error::Load(format!("{d} has no config.json: not an MLX checkpoint\n{HOW}")));
    }
    Ok(())
}

/// The context and chunk lengths against each other and the model's positions.
fn check_context(config: &ModelConfig, max_context: usize, chunk: usize) -> Result<(), Error> {
    if max_context == 0 {
        return Err(Error::Input("the max context (--max-context) must be at least 1 token".into()));
    }
    if chunk == 0 {
        return Err(Error::Input("the prefill chunk must be at least 1 token".into()));
    }
    let limit = config.max_position_embeddings;
    if limit > 0 && max_context > limit {
        return Err(Error::Input(format!(
            "a max context (--max-context) of {max_context} tokens exceeds this model's {limit} positions (max_position_embeddings in config.json)"
        )));
    }
    Ok(())
}

/// Opens the device `opts` asks for and checks that the model's buffers fit it; on a
/// software adapter, where allowed, the CPU instead (with a notice).
fn open_device(opts: &ModelOptions, need: &crate::memory::Needs) -> Result<(Opened, Option<String>), Error> {
    use crate::gpu::device::{Backend, Gpu, GpuOptions};
    let dev = |e: String| Error::Device(e);
    match opts.device {
        DeviceKind::Cpu => {
            need.fit_host().map_err(dev)?;
            Ok((Opened::Cpu, None))
        }
        DeviceKind::Gpu(b) => {
            let env = if b.is_none() { Backend::from_env().map_err(|e| Error::Input(e.to_string()))? } else { None };
            let gpu = Gpu::with_options(&GpuOptions { backend: b, ..Default::default() }).map_err(|e| dev(e.to_string()))?;
            if opts.cpu_if_software_gpu && b.is_none() && env.is_none() && gpu.info.device_type == "cpu" {
                need.fit_host().map_err(dev)?;
                let note = format!(
                    "{} is a software GPU: running on the CPU reference executor, faster here (--backend {} forces it)",
                    gpu.info.name, gpu.info.backend
                );
                return Ok((Opened::Cpu, Some(note)));
            }
            let kv_binding = crate::gpu::kv::binding_limit(&gpu, opts.max_kv_binding);
            need.fit_gpu(&gpu.info.name, gpu.limits(), kv_binding, gpu.info.device_type == "cpu").map_err(dev)?;
            Ok((Opened::Gpu(Box::new(gpu)), None))
        }
    }
}

/// Weight formats read from weights already in memory.
pub(crate) struct WeightsResolver<'a>(pub(crate) &'a Weights);

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_are_shared_and_sessions_move() {
        fn shared<T: Send + Sync>() {}
        fn movable<T: Send>() {}
        shared::<Engine>();
        shared::<Arc<Engine>>();
        movable::<Session>();
    }

    #[test]
    fn prompts_run_in_few_step_sizes() {
        assert_eq!(prefill_steps(24, 32), [16, 8]);
        assert_eq!(prefill_steps(64, 32), [32, 32]);
        assert_eq!(prefill_steps(77, 32), [32, 32, 8, 4, 1]);
        assert_eq!(prefill_steps(1, 256), [1]);
        let mut sizes: Vec<usize> = (1..=1000).flat_map(|n| prefill_steps(n, 256)).collect();
        for n in 1..=1000 {
            assert_eq!(prefill_steps(n, 256).iter().sum::<usize>(), n);
        }
        sizes.sort_unstable();
        sizes.dedup();
        assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64, 128, 256]);
    }
}
