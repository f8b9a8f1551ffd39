//! Building a graph: a [`ModelConfig`] becomes an op graph for a prefill of T tokens or for
//! a decode step, through its family's builder ([`crate::models`]) and the fusion pass.

use crate::config::{Family, LayerType, ModelConfig};
use crate::fuse::{fuse, FuseOptions};
use crate::ir::{BuildError, Graph, GraphKind};
use crate::models;
use crate::quant::{FloatType, WeightFormat};

/// Decides how each weight is stored. The default follows `config.json`; the
/// loader supplies one that reads the checkpoint's actual tensors.
pub trait WeightResolver {
    /// `name`: full checkpoint name (module path or plain tensor name);
    /// `shape`: float shape; `module`: a Linear/Embedding-like module that MLX may quantize.
    fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat;
    /// Whether an optional tensor or module (e.g. an untied `lm_head`) is present.
    fn exists(&self, _name: &str) -> bool {
        false
    }
}

/// Resolution from `config.json` alone (used when no weights are at hand).
pub struct ConfigResolver<'a>(pub &'a ModelConfig);

impl WeightResolver for ConfigResolver<'_> {
    fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat {
        let float = WeightFormat::Float { dtype: FloatType::Bf16 };
        if !module {
            return float;
        }
        let q = &self.0.quant;
        let inn = *shape.last().unwrap_or(&0);
        // MLX quantizes a module iff its input dim divides by the *global* group size
        // (overrides apply to modules that pass that test).
        let global_fits = q.global.map(|g| inn % g.group_size == 0).unwrap_or(true);
        match q.for_module(name) {
            Some(spec) if global_fits && spec.fits(inn) => WeightFormat::Quantized { spec, global_scale: false },
            _ => float,
        }
    }
}

/// What the graph returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outputs {
    /// Logits of every position `[T, V]` and the argmax of the last.
    AllLogits,
    /// Logits of the last position `[1, V]` and its argmax.
    LastLogits,
    /// Logits of every row `[T, V]` and a token per row (argmax, or sampled with each row's
    /// parameters): a decode step of T sequences of a batch ([`BuildOptions::batch`]).
    RowTokens,
}

/// Graph-shape options.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    pub kind: GraphKind,
    /// Tokens per step (1 for decode).
    pub tokens: usize,
    /// Longest sequence the KV cache holds (full-attention layers).
    pub max_context: usize,
    /// Longest prefill chunk; sliding layers keep `window + chunk` slots so that a
    /// chunk never overwrites keys its own queries still need.
    pub chunk: usize,
    pub outputs: Outputs,
    /// Tensor prefix; `None` = the model type's default.
    pub prefix: Option<String>,
    /// Sample the next token on the device (`Op::Sample`) instead of taking the argmax.
    pub sample: bool,
    /// Round Gemma 3n/4 constants (embedding scale) to bf16, as mlx-lm does on bf16
    /// checkpoints; off = exact, as in f32 runs. Gemma 3 always uses bf16(sqrt(H)).
    pub bf16_constants: bool,
    /// The fusion rules run on the built graph (see [`crate::fuse`]).
    pub fuse: FuseOptions,
    /// Soft-token rows (images) the prompt's embeddings take (inputs `soft_rows` `[N, D]` and
    /// `soft_index` `[T]`, see [`crate::ops::Op::Scatter`]); 0: none. Gemma 3 graphs with them
    /// also take the attention bounds `attn_positions` (image spans attend bidirectionally).
    pub soft_rows: usize,
    /// Sequence slots of a batch (0: none, the graph runs one sequence). With N slots the KV
    /// caches hold N sequences (`[N, S, kv_heads, head_dim]`), the graph takes the slot of each
    /// row (input `slot_ids`), and its cache writes and attention are the batched ops: a
    /// prefill step of one sequence (every row the same slot) or a decode step of T sequences
    /// (one row each, [`Outputs::RowTokens`]).
    pub batch: usize,
}

impl BuildOptions {
    pub fn prefill(tokens: usize, max_context: usize) -> Self {
        BuildOptions {
            kind: GraphKind::Prefill,
            tokens,
            max_context,
            chunk: tokens.max(1),
            outputs: Outputs::AllLogits,
            prefix: None,
            sample: false,
            bf16_constants: false,
            fuse: FuseOptions::all(),
            soft_rows: 0,
            batch: 0,
        }
    }
    pub fn decode(max_context: usize, chunk: usize) -> Self {
        BuildOptions {
            kind: GraphKind::Decode,
            tokens: 1,
            max_context,
            chunk,
            outputs: Outputs::LastLogits,
            prefix: None,
            sample: false,
            bf16_constants: false,
            fuse: FuseOptions::all(),
            soft_rows: 0,
            batch: 0,
        }
    }
}

/// Rounds an f32 to the nearest bf16 (ties to even), as f32.
pub fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let lsb = (b >> 16) & 1;
    let r = b.wrapping_add(0x7fff + lsb) & 0xffff_0000;
    f32::from_bits(r)
}

/// Length of the recent-token window of the repetition penalty (mlx-lm's default context is 20).
pub const RECENT_TOKENS: usize = 64;

/// KV-cache slots of a layer type.
pub fn cache_slots(cfg: &ModelConfig, t: LayerType, o: &BuildOptions) -> usize {
    match t {
        LayerType::Full => o.max_context,
        LayerType::Sliding => (cfg.sliding_window + o.chunk).min(o.max_context),
    }
}

/// Builds the graph of `cfg` with weights resolved by `res`.
pub fn build(cfg: &ModelConfig, res: &dyn WeightResolver, o: &BuildOptions) -> Result<Graph, BuildError> {
    if o.tokens == 0 {
        return Err(BuildError::Config("a graph needs at least one token".into()));
    }
    // (a batch's decode step has a row per sequence, each one token: any number of rows)
    let rows = o.batch > 0 && o.kind == GraphKind::Decode;
    if (o.tokens > o.chunk && !rows) || o.chunk > o.max_context {
        return Err(BuildError::Config(format!(
            "tokens {} must be <= chunk {} <= max_context {}",
            o.tokens, o.chunk, o.max_context
        )));
    }
    if rows && o.soft_rows > 0 {
        return Err(BuildError::Config("a batch's decode step takes no image rows (a prompt's prefill steps do)".into()));
    }
    if (o.outputs == Outputs::RowTokens) != (o.batch > 0 && o.kind == GraphKind::Decode) {
        return Err(BuildError::Config("a token per row is the output of a batch's decode step, and only of it".into()));
    }
    if o.soft_rows > 0 && !matches!(cfg.family, Family::Gemma4 | Family::Gemma3) {
        return Err(BuildError::Config(format!("model_type {}: image rows in the prompt are supported for Gemma 3 and Gemma 4 only", cfg.model_type)));
    }
    let g = match cfg.family {
        Family::Gemma3 => models::gemma3::build(cfg, res, o),
        Family::Gemma4 => models::gemma4::build(cfg, res, o),
        Family::Gemma3n => Err(BuildError::Config(format!(
            "model_type {}: the Gemma 3n text decoder is not supported yet (its audio tower is: `encode --audio`)",
            cfg.model_type
        ))),
    }?;
    fuse(g, &o.fuse)
}

/// Builds from `config.json` alone.
pub fn build_from_config(cfg: &ModelConfig, o: &BuildOptions) -> Result<Graph, BuildError> {
    build(cfg, &ConfigResolver(cfg), o)
}
