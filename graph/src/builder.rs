//! Model builders: a [`ModelConfig`] becomes an op graph for a prefill of T
//! tokens or for a decode step.

use petgraph::graph::NodeIndex;

use crate::config::{Family, LayerType, ModelConfig};
use crate::ir::{BuildError, Graph, GraphKind, InputKind, StateKind, WeightParam};
use crate::ops::{BinaryOp, HeadRange, KvAppend, NormScale, Op, TensorType, UnaryOp};
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
    /// Fuse ops for one-token steps: pre-norms into the matmuls that read them
    /// (`NormMatMul`). Post-norms and their residual adds are always one `RmsNormAdd`.
    pub fuse: bool,
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
            fuse: true,
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
            fuse: true,
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

struct B<'a> {
    g: Graph,
    cfg: &'a ModelConfig,
    res: &'a dyn WeightResolver,
    prefix: String,
    pos: NodeIndex,
    eps: f32,
    /// Pre-norms fused into their matmuls (one-token graphs).
    fuse_prenorm: bool,
}

/// The queries as the attention op sees them: a value, or its norm + RoPE left to the op.
enum Query {
    Node(NodeIndex),
    Fused { x: NodeIndex, heads: Option<HeadRange>, w: NodeIndex, norm: NormScale, rope: Op },
}

/// What a layer's attention reads its keys and values from: the caches after their write
/// ops, or the caches themselves, the attention appending the step's rows (`KvAppend`) with
/// the key's norm weight.
enum Kv {
    Written(NodeIndex, NodeIndex),
    Append { k: NodeIndex, v: NodeIndex, wk: NodeIndex, heads: KvAppend },
}

/// A pre-norm as the matmuls reading it see it: a value, or fused into each of them.
#[derive(Clone, Copy)]
enum Normed {
    Node(NodeIndex),
    Fused { x: NodeIndex, w: Option<NodeIndex>, scale: NormScale },
}

impl<'a> B<'a> {
    /// A builder over a new graph with its token and position inputs; returns the token input.
    fn new(cfg: &'a ModelConfig, res: &'a dyn WeightResolver, o: &BuildOptions) -> (Self, NodeIndex) {
        let mut g = Graph::new(o.tokens, o.kind);
        let tokens = g.input("tokens", InputKind::Tokens, TensorType::u32(&[o.tokens]));
        let pos = g.input("positions", InputKind::Positions, TensorType::u32(&[o.tokens]));
        let prefix = o.prefix.clone().unwrap_or_else(|| cfg.default_prefix().to_string());
        let fuse_prenorm = o.fuse && o.tokens == 1;
        (B { g, cfg, res, prefix, pos, eps: cfg.rms_norm_eps as f32, fuse_prenorm }, tokens)
    }

    fn w(&mut self, rel: &str, layer: Option<usize>, shape: &[usize], module: bool) -> NodeIndex {
        let name = format!("{}{}", self.prefix, rel);
        let format = self.res.format(&name, shape, module);
        let label = match layer {
            Some(_) => rel.splitn(3, '.').nth(2).unwrap_or(rel).to_string(),
            None => rel.to_string(),
        };
        let label = match layer {
            Some(l) => format!("l{l}.{label}"),
            None => label,
        };
        self.g.weight(&label, layer, WeightParam { name, shape: shape.to_vec(), format, module })
    }

    fn op(&mut self, name: &str, layer: Option<usize>, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, BuildError> {
        let name = match layer {
            Some(l) => format!("l{l}.{name}"),
            None => name.to_string(),
        };
        self.g.op(&name, layer, op, ins)
    }

    fn norm(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, w: Option<&str>, conv: NormScale) -> Result<NodeIndex, BuildError> {
        let d = self.g.node(x).ty.last();
        match w {
            Some(rel) if conv != NormScale::None => {
                let wn = self.w(rel, layer, &[d], false);
                self.op(name, layer, Op::RmsNorm { eps: self.eps, scale: conv }, &[x, wn])
            }
            _ => self.op(name, layer, Op::RmsNorm { eps: self.eps, scale: NormScale::None }, &[x]),
        }
    }

    fn linear(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, rel: &str, out: usize) -> Result<NodeIndex, BuildError> {
        let inn = self.g.node(x).ty.last();
        let w = self.w(rel, layer, &[out, inn], true);
        self.op(name, layer, Op::MatMul, &[x, w])
    }

    /// A norm read only by matmuls ([`B::linear_n`]): a node, or fused into each of them.
    fn prenorm(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, w: Option<&str>, conv: NormScale) -> Result<Normed, BuildError> {
        if !self.fuse_prenorm {
            return Ok(Normed::Node(self.norm(name, layer, x, w, conv)?));
        }
        let d = self.g.node(x).ty.last();
        Ok(match w {
            Some(rel) if conv != NormScale::None => Normed::Fused { x, w: Some(self.w(rel, layer, &[d], false)), scale: conv },
            _ => Normed::Fused { x, w: None, scale: NormScale::None },
        })
    }

    fn linear_n(&mut self, name: &str, layer: Option<usize>, x: Normed, rel: &str, out: usize) -> Result<NodeIndex, BuildError> {
        match x {
            Normed::Node(n) => self.linear(name, layer, n, rel, out),
            Normed::Fused { x, w, scale } => {
                let inn = self.g.node(x).ty.last();
                let wm = self.w(rel, layer, &[out, inn], true);
                let ins: Vec<NodeIndex> = std::iter::once(x).chain(w).chain([wm]).collect();
                self.op(name, layer, Op::NormMatMul { eps: self.eps, scale }, &ins)
            }
        }
    }

    /// Attention projections of layer `i` (`(name, heads)`: `q_proj`, `k_proj`, `v_proj`) as
    /// `[T, heads, D]` values, each with the heads it takes from them. A fused pre-norm (one
    /// token) and several projections: one `NormMatMul` over their weights, read by head
    /// range; otherwise a matmul each.
    fn projections(&mut self, i: usize, xn: Normed, d: usize, projs: &[(&str, usize)]) -> Result<Vec<(NodeIndex, Option<HeadRange>)>, BuildError> {
        let l = Some(i);
        let t = self.g.tokens;
        if let (Normed::Fused { x, w, scale }, true) = (xn, projs.len() > 1) {
            let h = self.g.node(x).ty.last();
            let ws: Vec<NodeIndex> = projs.iter().map(|(n, heads)| self.w(&format!("layers.{i}.self_attn.{n}"), l, &[heads * d, h], true)).collect();
            let ins: Vec<NodeIndex> = std::iter::once(x).chain(w).chain(ws).collect();
            let tag: String = projs.iter().map(|(n, _)| &n[..1]).collect();
            let cat = self.op(&format!("{tag}_proj"), l, Op::NormMatMul { eps: self.eps, scale }, &ins)?;
            let total = projs.iter().map(|p| p.1).sum();
            let cat = self.reshape(&format!("{tag}_heads"), l, cat, &[t, total, d])?;
            let mut start = 0;
            return Ok(projs
                .iter()
                .map(|&(_, count)| {
                    start += count;
                    (cat, Some(HeadRange { start: start - count, count }))
                })
                .collect());
        }
        let mut out = vec![];
        for &(n, heads) in projs {
            let v = self.linear_n(n, l, xn, &format!("layers.{i}.self_attn.{n}"), heads * d)?;
            out.push((self.reshape(&format!("{}_heads", &n[..1]), l, v, &[t, heads, d])?, None));
        }
        Ok(out)
    }

    /// `rope(norm(x))` per head (of `heads` of x when given).
    #[allow(clippy::too_many_arguments)]
    fn norm_rope(
        &mut self,
        name: &str,
        layer: Option<usize>,
        (x, heads): (NodeIndex, Option<HeadRange>),
        w: &str,
        conv: NormScale,
        rope: &Op,
    ) -> Result<NodeIndex, BuildError> {
        let Op::Rope { theta, factor, rotary_pairs } = *rope else {
            return Err(BuildError::Config(format!("{name}: not a rope op: {rope:?}")));
        };
        let d = self.g.node(x).ty.last();
        let wn = self.w(w, layer, &[d], false);
        let op = Op::NormRope { eps: self.eps, scale: conv, theta, factor, rotary_pairs, heads };
        self.op(name, layer, op, &[x, self.pos, wn])
    }

    /// The queries of layer `i`: `rope(norm(x))` (weight `w`), a node, or for one-token graphs
    /// left to the attention op to compute.
    fn query(&mut self, i: usize, (x, heads): (NodeIndex, Option<HeadRange>), w: &str, conv: NormScale, rope: &Op) -> Result<Query, BuildError> {
        if !self.fuse_prenorm {
            return Ok(Query::Node(self.norm_rope("q_norm_rope", Some(i), (x, heads), w, conv, rope)?));
        }
        let d = self.g.node(x).ty.last();
        let w = self.w(w, Some(i), &[d], false);
        Ok(Query::Fused { x, heads, w, norm: conv, rope: rope.clone() })
    }

    /// `res + norm(x)`.
    fn norm_add(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, res: NodeIndex, w: &str, conv: NormScale) -> Result<NodeIndex, BuildError> {
        self.norm_add_scaled(name, layer, x, res, w, conv, None)
    }

    /// `(res + norm(x)) * s` with a scalar weight `s` (`res + norm(x)` without).
    #[allow(clippy::too_many_arguments)]
    fn norm_add_scaled(
        &mut self,
        name: &str,
        layer: Option<usize>,
        x: NodeIndex,
        res: NodeIndex,
        w: &str,
        conv: NormScale,
        s: Option<NodeIndex>,
    ) -> Result<NodeIndex, BuildError> {
        let d = self.g.node(x).ty.last();
        let wn = self.w(w, layer, &[d], false);
        let ins: Vec<NodeIndex> = [x, res, wn].into_iter().chain(s).collect();
        self.op(name, layer, Op::RmsNormAdd { eps: self.eps, scale: conv, scaled: s.is_some() }, &ins)
    }

    fn reshape(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, shape: &[usize]) -> Result<NodeIndex, BuildError> {
        self.op(name, layer, Op::Reshape { shape: shape.to_vec() }, &[x])
    }

    fn add(&mut self, name: &str, layer: Option<usize>, a: NodeIndex, b: NodeIndex) -> Result<NodeIndex, BuildError> {
        self.op(name, layer, Op::Binary { f: BinaryOp::Add }, &[a, b])
    }

    /// Attention of layer `i` over its (or its KV source's) caches, the output
    /// projection and its norm, added to the residual `x`.
    fn attention_block(&mut self, i: usize, x: NodeIndex, q: Query, kv: Kv, conv: NormScale) -> Result<NodeIndex, BuildError> {
        let (l, cfg) = (Some(i), self.cfg);
        let window = if cfg.layer_types[i] == LayerType::Sliding { Some(cfg.sliding_window) } else { None };
        let scale = cfg.attn_scale as f32;
        let a = match (q, kv) {
            (Query::Node(q), Kv::Written(kc, vc)) => self.op("attention", l, Op::Attention { scale, window }, &[q, self.pos, kc, vc])?,
            (Query::Fused { x, heads, w, norm, rope }, kv) => {
                let Op::Rope { theta, factor, rotary_pairs } = rope else {
                    return Err(BuildError::Config(format!("layer {i}: not a rope op: {rope:?}")));
                };
                let (append, ins) = match kv {
                    Kv::Written(kc, vc) => (None, vec![x, self.pos, kc, vc, w]),
                    Kv::Append { k, v, wk, heads } => (Some(heads), vec![x, self.pos, k, v, w, wk]),
                };
                let op = Op::NormRopeAttention { scale, window, eps: self.eps, norm, theta, factor, rotary_pairs, heads, append };
                let name = if append.is_some() { "kv_append_attention" } else { "q_norm_rope_attention" };
                self.op(name, l, op, &ins)?
            }
            (Query::Node(_), Kv::Append { .. }) => return Err(BuildError::Config(format!("layer {i}: appending attention without its query"))),
        };
        let qs = self.g.node(a).ty.shape.clone();
        let a = self.reshape("attn_flat", l, a, &[qs[0], qs[1] * qs[2]])?;
        let a = self.linear("o_proj", l, a, &format!("layers.{i}.self_attn.o_proj"), cfg.hidden_size)?;
        self.norm_add("attn_residual", l, a, x, &format!("layers.{i}.post_attention_layernorm.weight"), conv)
    }

    /// The dense GeGLU MLP of layer `i`: `down(gelu(gate(m)) * up(m))`.
    fn mlp(&mut self, i: usize, m: Normed, inter: usize) -> Result<NodeIndex, BuildError> {
        let l = Some(i);
        if let Normed::Fused { x, w, scale } = m {
            // gate, up and the activation in one pass when both weights are stored alike
            let h = self.g.node(x).ty.last();
            let wg = self.w(&format!("layers.{i}.mlp.gate_proj"), l, &[inter, h], true);
            let wu = self.w(&format!("layers.{i}.mlp.up_proj"), l, &[inter, h], true);
            let fmt = |b: &Self, n: NodeIndex| b.g.node(n).weight().map(|p| p.format);
            if fmt(self, wg) == fmt(self, wu) {
                let ins: Vec<NodeIndex> = std::iter::once(x).chain(w).chain([wg, wu]).collect();
                let gu = self.op("gate_up_geglu", l, Op::NormGeGlu { eps: self.eps, scale }, &ins)?;
                return self.linear("down_proj", l, gu, &format!("layers.{i}.mlp.down_proj"), self.cfg.hidden_size);
            }
            let gt = self.op("gate_proj", l, Op::NormMatMul { eps: self.eps, scale }, &std::iter::once(x).chain(w).chain([wg]).collect::<Vec<_>>())?;
            let up = self.op("up_proj", l, Op::NormMatMul { eps: self.eps, scale }, &std::iter::once(x).chain(w).chain([wu]).collect::<Vec<_>>())?;
            let gu = self.op("geglu", l, Op::GeGlu, &[gt, up])?;
            return self.linear("down_proj", l, gu, &format!("layers.{i}.mlp.down_proj"), self.cfg.hidden_size);
        }
        let gt = self.linear_n("gate_proj", l, m, &format!("layers.{i}.mlp.gate_proj"), inter)?;
        let up = self.linear_n("up_proj", l, m, &format!("layers.{i}.mlp.up_proj"), inter)?;
        let gu = self.op("geglu", l, Op::GeGlu, &[gt, up])?;
        self.linear("down_proj", l, gu, &format!("layers.{i}.mlp.down_proj"), self.cfg.hidden_size)
    }
}

/// Builds the graph of `cfg` with weights resolved by `res`.
pub fn build(cfg: &ModelConfig, res: &dyn WeightResolver, o: &BuildOptions) -> Result<Graph, BuildError> {
    if o.tokens == 0 {
        return Err(BuildError::Config("a graph needs at least one token".into()));
    }
    if o.tokens > o.chunk || o.chunk > o.max_context {
        return Err(BuildError::Config(format!(
            "tokens {} must be <= chunk {} <= max_context {}",
            o.tokens, o.chunk, o.max_context
        )));
    }
    match cfg.family {
        Family::Gemma3 => build_gemma3(cfg, res, o),
        Family::Gemma4 => build_gemma4(cfg, res, o),
        Family::Gemma3n => Err(BuildError::Config(format!(
            "model_type {}: graph builder not implemented yet for this family",
            cfg.model_type
        ))),
    }
}

/// Builds from `config.json` alone.
pub fn build_from_config(cfg: &ModelConfig, o: &BuildOptions) -> Result<Graph, BuildError> {
    build(cfg, &ConfigResolver(cfg), o)
}

fn build_gemma3(cfg: &ModelConfig, res: &dyn WeightResolver, o: &BuildOptions) -> Result<Graph, BuildError> {
    let (h, nq, d) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim);
    let (mut b, tokens) = B::new(cfg, res, o);
    let conv = NormScale::OnePlusW;

    let emb = b.w("embed_tokens", None, &[cfg.vocab_size, h], true);
    // Gemma 3 scales the embedding by bf16(sqrt(H)) whatever the weights' dtype.
    let scale = round_bf16((h as f32).sqrt());
    let mut x = b.op("embed", None, Op::Embed { scale, clamp: None }, &[tokens, emb])?;

    for i in 0..cfg.num_layers {
        let l = Some(i);
        let p = |s: &str| format!("layers.{i}.{s}");
        let nkv = cfg.layer_kv_heads(i);
        let lt = cfg.layer_types[i];
        let xn = b.prenorm("input_norm", l, x, Some(&p("input_layernorm.weight")), conv)?;
        let pr = b.projections(i, xn, d, &[("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)])?;
        let (q, k, v) = (pr[0], pr[1], pr[2]);
        let rope = cfg.layer_rope(i).clone();
        let rop = Op::Rope { theta: rope.theta as f32, factor: rope.factor as f32, rotary_pairs: d / 2 };
        let q = b.query(i, q, &p("self_attn.q_norm.weight"), conv, &rop)?;
        let k_norm = p("self_attn.k_norm.weight");
        let kv = match kv_append(&mut b, i, &q, k, v, &k_norm, cache_slots(cfg, lt, o)) {
            Some(kv) => kv,
            None => {
                let (kc, vc) = kv_write(&mut b, i, k, &k_norm, conv, &rop, v, false, cache_slots(cfg, lt, o))?;
                Kv::Written(kc, vc)
            }
        };
        x = b.attention_block(i, x, q, kv, conv)?;
        let m = b.prenorm("pre_ff_norm", l, x, Some(&p("pre_feedforward_layernorm.weight")), conv)?;
        let inter = cfg.layer_intermediate(i);
        let dn = b.mlp(i, m, inter)?;
        x = b.norm_add("ff_residual", l, dn, x, &p("post_feedforward_layernorm.weight"), conv)?;
    }
    head(b, x, emb, conv, o)
}

/// The K and V caches of layer `i`: `[slots, nkv, d]` each.
fn kv_states(b: &mut B, i: usize, nkv: usize, d: usize, slots: usize) -> (NodeIndex, NodeIndex) {
    let l = Some(i);
    let cache_ty = TensorType::f32(&[slots, nkv, d]);
    let ks = b.g.state(&format!("l{i}.k_cache"), l, StateKind::KvCache { layer: i, value: false }, cache_ty.clone());
    let vs = b.g.state(&format!("l{i}.v_cache"), l, StateKind::KvCache { layer: i, value: true }, cache_ty);
    (ks, vs)
}

/// Layer `i`'s caches for an attention that appends the step's key and value itself: one-token
/// graphs whose query, key and value are heads of one fused projection and whose query and key
/// norms have weights stored alike (`None` otherwise: the caches are written by ops in front).
fn kv_append(
    b: &mut B,
    i: usize,
    q: &Query,
    (k, k_heads): (NodeIndex, Option<HeadRange>),
    (v, v_heads): (NodeIndex, Option<HeadRange>),
    k_norm: &str,
    slots: usize,
) -> Option<Kv> {
    let Query::Fused { x, w, norm, .. } = q else { return None };
    let (Some(kh), Some(vh)) = (k_heads, v_heads) else { return None };
    if b.g.tokens != 1 || *x != k || *x != v || *norm == NormScale::None || kh.count != vh.count {
        return None;
    }
    let d = b.g.node(k).ty.last();
    let k_format = b.res.format(&format!("{}{k_norm}", b.prefix), &[d], false);
    if b.g.node(*w).weight().map(|p| p.format) != Some(k_format) {
        return None;
    }
    let wk = b.w(k_norm, Some(i), &[d], false);
    let (ks, vs) = kv_states(b, i, kh.count, d, slots);
    Some(Kv::Append { k: ks, v: vs, wk, heads: KvAppend { k: kh, v: vh } })
}

/// The attention inputs of layer `i` written into its caches: K after its norm (weight `k_norm`)
/// and RoPE, V as it is or after a weightless norm (`v_norm`, Gemma 4), each from the heads of
/// its value when given; returns the cache values. One-token graphs norm, rotate and write K in
/// one op, and norm and write V in one op.
#[allow(clippy::too_many_arguments)]
fn kv_write(
    b: &mut B,
    i: usize,
    (k, k_heads): (NodeIndex, Option<HeadRange>),
    k_norm: &str,
    conv: NormScale,
    rope: &Op,
    (v, v_heads): (NodeIndex, Option<HeadRange>),
    v_norm: bool,
    slots: usize,
) -> Result<(NodeIndex, NodeIndex), BuildError> {
    let l = Some(i);
    let vt = b.g.node(v).ty.shape.clone();
    let (nkv, d) = (v_heads.map_or(vt[1], |r| r.count), vt[2]);
    let (ks, vs) = kv_states(b, i, nkv, d, slots);
    let kc = if b.fuse_prenorm {
        let Op::Rope { theta, factor, rotary_pairs } = *rope else {
            return Err(BuildError::Config(format!("layer {i}: not a rope op: {rope:?}")));
        };
        let wn = b.w(k_norm, l, &[d], false);
        let op = Op::KvWriteNormRope { eps: b.eps, scale: conv, theta, factor, rotary_pairs, heads: k_heads };
        b.op("k_norm_rope_write", l, op, &[k, b.pos, wn, ks])?
    } else {
        let k = b.norm_rope("k_norm_rope", l, (k, k_heads), k_norm, conv, rope)?;
        b.op("k_write", l, Op::KvWrite { heads: None }, &[k, b.pos, ks])?
    };
    // V's weightless norm: a norm-rope without pairs (theta unused)
    let vc = match (v_norm, b.fuse_prenorm) {
        (false, _) => b.op("v_write", l, Op::KvWrite { heads: v_heads }, &[v, b.pos, vs])?,
        (true, true) => {
            let op = Op::KvWriteNormRope { eps: b.eps, scale: NormScale::None, theta: 1.0, factor: 1.0, rotary_pairs: 0, heads: v_heads };
            b.op("v_norm_write", l, op, &[v, b.pos, vs])?
        }
        (true, false) => {
            let vn = match v_heads {
                Some(_) => {
                    let op = Op::NormRope { eps: b.eps, scale: NormScale::None, theta: 1.0, factor: 1.0, rotary_pairs: 0, heads: v_heads };
                    b.op("v_norm", l, op, &[v, b.pos])?
                }
                None => b.norm("v_norm", l, v, None, NormScale::None)?,
            };
            b.op("v_write", l, Op::KvWrite { heads: None }, &[vn, b.pos, vs])?
        }
    };
    Ok((kc, vc))
}

/// Final norm, tied (or untied) head, softcap and argmax.
fn head(mut b: B, x: NodeIndex, emb: NodeIndex, conv: NormScale, o: &BuildOptions) -> Result<Graph, BuildError> {
    let t = o.tokens;
    let h = b.cfg.hidden_size;
    let x = if o.outputs == Outputs::LastLogits && t > 1 {
        b.op("last_row", None, Op::Slice { axis: 0, start: t - 1, len: 1 }, &[x])?
    } else {
        x
    };
    let xn = b.prenorm("final_norm", None, x, Some("norm.weight"), conv)?;
    // Untied only when the checkpoint has its own head (mlx-lm ties iff it is absent).
    let lm_head = format!("{}lm_head", b.prefix.strip_suffix("model.").unwrap_or(""));
    let head_w = if b.res.exists(&lm_head) {
        let format = b.res.format(&lm_head, &[b.cfg.vocab_size, h], true);
        let wp = WeightParam { name: lm_head, shape: vec![b.cfg.vocab_size, h], format, module: true };
        b.g.weight("lm_head", None, wp)
    } else {
        emb
    };
    let mut logits = match xn {
        Normed::Node(xn) => b.op("logits", None, Op::MatMul, &[xn, head_w])?,
        Normed::Fused { x, w, scale } => {
            let ins: Vec<NodeIndex> = std::iter::once(x).chain(w).chain([head_w]).collect();
            b.op("logits", None, Op::NormMatMul { eps: b.eps, scale }, &ins)?
        }
    };
    if let Some(cap) = b.cfg.final_logit_softcap {
        logits = b.op("softcap", None, Op::Unary { f: UnaryOp::Softcap { cap: cap as f32 } }, &[logits])?;
    }
    let tok = if o.sample {
        let params = b.g.input("sampling_params", InputKind::SamplingParams, TensorType::u32(&[crate::ops::SAMPLE_PARAMS]));
        let recent = b.g.input("recent_tokens", InputKind::RecentTokens, TensorType::u32(&[RECENT_TOKENS]));
        b.op("sample", None, Op::Sample, &[logits, params, recent])?
    } else {
        b.op("argmax", None, Op::Argmax, &[logits])?
    };
    b.g.set_output("logits", logits);
    b.g.set_output("token", tok);
    Ok(b.g)
}

fn build_gemma4(cfg: &ModelConfig, res: &dyn WeightResolver, o: &BuildOptions) -> Result<Graph, BuildError> {
    let t = o.tokens;
    let (h, nq) = (cfg.hidden_size, cfg.num_heads);
    let nl = cfg.num_layers;
    let pd = cfg.hidden_size_per_layer_input;
    let (mut b, tokens) = B::new(cfg, res, o);
    let conv = NormScale::W;
    let k_const = |x: f32| if o.bf16_constants { round_bf16(x) } else { x };

    let emb = b.w("embed_tokens", None, &[cfg.vocab_size, h], true);
    let mut x = b.op("embed", None, Op::Embed { scale: k_const((h as f32).sqrt()), clamp: None }, &[tokens, emb])?;

    // Per-layer inputs: [T, L, Pd], one slice per layer.
    let pli = if pd > 0 {
        let tab = b.w("embed_tokens_per_layer", None, &[cfg.vocab_size_per_layer_input, nl * pd], true);
        let tok = b.op("ple_embed", None, Op::Embed { scale: k_const((pd as f32).sqrt()), clamp: None }, &[tokens, tab])?;
        let proj = b.linear("ple_proj", None, x, "per_layer_model_projection", nl * pd)?;
        let proj = b.op("ple_proj_scale", None, Op::Unary { f: UnaryOp::Scale { factor: k_const((h as f32).powf(-0.5)) } }, &[proj])?;
        let proj = b.reshape("ple_proj_slots", None, proj, &[t, nl, pd])?;
        let proj = b.norm("ple_proj_norm", None, proj, Some("per_layer_projection_norm.weight"), conv)?;
        let tok = b.reshape("ple_embed_slots", None, tok, &[t, nl, pd])?;
        let sum = b.add("ple_sum", None, proj, tok)?;
        let sum = b.op("ple_inputs", None, Op::Unary { f: UnaryOp::Scale { factor: k_const(0.5f32.sqrt()) } }, &[sum])?;
        Some(sum)
    } else {
        None
    };

    // One-token graphs take every layer's slot up front: copies that depend on nothing a layer
    // computes, run back to back before the layers instead of one on each layer's path.
    let mut early_slots = vec![];
    if let (Some(pli), 1) = (pli, t) {
        for i in 0..nl {
            let slot = b.op(&format!("ple_slot{i}"), None, Op::Slice { axis: 1, start: i, len: 1 }, &[pli])?;
            early_slots.push(b.reshape(&format!("ple_slot{i}_flat"), None, slot, &[t, pd])?);
        }
    }

    let first_shared = cfg.first_shared_layer();
    let mut caches: Vec<Option<(NodeIndex, NodeIndex)>> = vec![None; nl];
    for i in 0..nl {
        let l = Some(i);
        let p = |s: &str| format!("layers.{i}.{s}");
        let lt = cfg.layer_types[i];
        let full = lt == LayerType::Full;
        let d = cfg.layer_head_dim(i);
        let nkv = cfg.layer_kv_heads(i);
        let xn = b.prenorm("input_norm", l, x, Some(&p("input_layernorm.weight")), conv)?;
        // q; k and v unless the layer reads another's cache; v is k's projection on full
        // layers with attention_k_eq_v
        let own_kv = i < first_shared;
        let k_eq_v = full && cfg.attention_k_eq_v;
        let mut projs = vec![("q_proj", nq)];
        if own_kv {
            projs.push(("k_proj", nkv));
            if !k_eq_v {
                projs.push(("v_proj", nkv));
            }
        }
        let pr = b.projections(i, xn, d, &projs)?;
        let rope = cfg.layer_rope(i).clone();
        let pairs = if rope.partial < 1.0 { ((d as f64 * rope.partial) as usize) / 2 } else { d / 2 };
        let rop = Op::Rope { theta: rope.theta as f32, factor: rope.factor as f32, rotary_pairs: pairs };
        let q = b.query(i, pr[0], &p("self_attn.q_norm.weight"), conv, &rop)?;
        let (kc, vc) = if own_kv {
            let v = if k_eq_v { pr[1] } else { pr[2] };
            let kv = kv_write(&mut b, i, pr[1], &p("self_attn.k_norm.weight"), conv, &rop, v, true, cache_slots(cfg, lt, o))?;
            caches[i] = Some(kv);
            kv
        } else {
            let src = cfg.kv_source(i);
            caches[src].ok_or_else(|| BuildError::Config(format!("layer {i}: KV source layer {src} has no cache")))?
        };
        x = b.attention_block(i, x, q, Kv::Written(kc, vc), conv)?;

        let inter = cfg.layer_intermediate(i);
        let m = b.prenorm("pre_ff_norm", l, x, Some(&p("pre_feedforward_layernorm.weight")), conv)?;
        let mut u = b.mlp(i, m, inter)?;
        if cfg.enable_moe_block {
            let e = cfg.num_experts.ok_or_else(|| BuildError::Config("MoE without num_experts".into()))?;
            let k = cfg.top_k_experts.ok_or_else(|| BuildError::Config("MoE without top_k_experts".into()))?;
            let im = cfg.moe_intermediate_size.ok_or_else(|| BuildError::Config("MoE without moe_intermediate_size".into()))?;
            let h1 = b.norm("post_ff_norm_1", l, u, Some(&p("post_feedforward_layernorm_1.weight")), conv)?;
            // Router: rms(h) * router.scale * H^-0.5, projected, top-k, softmax over the k.
            let z = b.norm("router_norm", l, x, Some(&p("router.scale")), conv)?;
            let z = b.op("router_in", l, Op::Unary { f: UnaryOp::Scale { factor: k_const((h as f32).powf(-0.5)) } }, &[z])?;
            let logits = b.linear("router", l, z, &p("router.proj"), e)?;
            let ids = b.op("top_k", l, Op::TopK { k }, &[logits])?;
            let pes = b.w(&p("router.per_expert_scale"), l, &[e], false);
            let wgt = b.op("route_weights", l, Op::TopKSoftmax, &[logits, ids, pes])?;
            let x2 = b.norm("pre_ff_norm_2", l, x, Some(&p("pre_feedforward_layernorm_2.weight")), conv)?;
            let wg = b.w(&p("experts.switch_glu.gate_proj"), l, &[e, im, h], true);
            let wu = b.w(&p("experts.switch_glu.up_proj"), l, &[e, im, h], true);
            let wd = b.w(&p("experts.switch_glu.down_proj"), l, &[e, h, im], true);
            // Several tokens: the pairs are grouped by expert once, and each expert's
            // weights are multiplied with all its rows at once. One token: a gathered GEMV.
            let groups = if t > 1 { Some(b.op("expert_groups", l, Op::MoeGroup { experts: e }, &[ids])?) } else { None };
            let expert_mm = |b: &mut B, name: &str, x: NodeIndex, w: NodeIndex| match groups {
                Some(gr) => b.op(name, l, Op::GroupedMatMul, &[x, ids, w, gr]),
                None => b.op(name, l, Op::GatherMatMul, &[x, ids, w]),
            };
            let eg = expert_mm(&mut b, "expert_gate", x2, wg)?;
            let eu = expert_mm(&mut b, "expert_up", x2, wu)?;
            let egu = b.op("expert_geglu", l, Op::GeGlu, &[eg, eu])?;
            let ed = expert_mm(&mut b, "expert_down", egu, wd)?;
            let h2 = b.op("expert_sum", l, Op::WeightedSum, &[ed, wgt])?;
            // h1 + norm(h2): the experts' post-norm and the sum in one pass
            u = b.norm_add("ff_sum", l, h2, h1, &p("post_feedforward_layernorm_2.weight"), conv)?;
        }
        // the layer scalar multiplies the layer's last residual sum, in that op
        let ls = b.w(&p("layer_scalar"), l, &[1], false);
        let ff_scale = if pli.is_some() { None } else { Some(ls) };
        x = b.norm_add_scaled("ff_residual", l, u, x, &p("post_feedforward_layernorm.weight"), conv, ff_scale)?;

        if let Some(pli) = pli {
            let gate = b.linear("ple_gate", l, x, &p("per_layer_input_gate"), pd)?;
            let slot = match early_slots.get(i) {
                Some(&s) => s,
                None => {
                    let slot = b.op("ple_slot", l, Op::Slice { axis: 1, start: i, len: 1 }, &[pli])?;
                    b.reshape("ple_slot_flat", l, slot, &[t, pd])?
                }
            };
            // gelu(gate) * slot, one pass
            let gated = b.op("ple_gelu_mul", l, Op::GeGlu, &[gate, slot])?;
            let pr = b.linear("ple_projection", l, gated, &p("per_layer_projection"), h)?;
            x = b.norm_add_scaled("ple_residual", l, pr, x, &p("post_per_layer_input_norm.weight"), conv, Some(ls))?;
        }
    }
    head(b, x, emb, conv, o)
}
