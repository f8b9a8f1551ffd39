//! Model builders, one file per family, on the shared blocks of this module. Builders emit
//! primitive ops only (norms, matmuls, RoPE, cache writes, attention, elementwise); fusing
//! them is the job of the [`crate::fuse`] pass.

pub mod gemma3;
pub mod gemma4;

use petgraph::graph::NodeIndex;

use crate::builder::{cache_slots, BuildOptions, Outputs, WeightResolver, RECENT_TOKENS};
use crate::config::{LayerType, ModelConfig};
use crate::ir::{BuildError, Graph, InputKind, StateKind, WeightParam};
use crate::ops::{BinaryOp, NormScale, Op, TensorType, UnaryOp};

/// A graph under construction: the config, the weight resolver, the tensor prefix and the
/// positions input every RoPE and cache write reads.
pub(crate) struct B<'a> {
    pub g: Graph,
    pub cfg: &'a ModelConfig,
    res: &'a dyn WeightResolver,
    prefix: String,
    pub pos: NodeIndex,
    /// What the attention ops read as positions: `pos`, or the attention bounds of a prompt
    /// with image spans ([`B::soft_rows`]).
    pub attn_pos: NodeIndex,
    /// Which layers' attention reads `attn_pos` (the others read `pos`).
    spans: Spans,
    /// The sequence slot of each row (graphs over a batch's caches, [`BuildOptions::batch`]).
    pub slot: Option<NodeIndex>,
    /// Sequences of the batch's caches (0: one sequence).
    pub batch: usize,
    pub eps: f32,
}

/// Where the tokens of an image's placeholder run see each other (bidirectionally).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spans {
    /// Nowhere: causal everywhere (Gemma 4 E2B/E4B).
    Off,
    /// On every layer (Gemma 3).
    AllLayers,
    /// On sliding layers only (Gemma 4 26B/31B); full-attention layers stay causal.
    SlidingLayers,
}

impl<'a> B<'a> {
    /// A builder over a new graph with its token and position inputs; returns the token input.
    pub fn new(cfg: &'a ModelConfig, res: &'a dyn WeightResolver, o: &BuildOptions) -> (Self, NodeIndex) {
        let mut g = Graph::new(o.tokens, o.kind);
        let tokens = g.input("tokens", InputKind::Tokens, TensorType::u32(&[o.tokens]));
        let pos = g.input("positions", InputKind::Positions, TensorType::u32(&[o.tokens]));
        let slot = (o.batch > 0).then(|| g.input("slot_ids", InputKind::SlotIds, TensorType::u32(&[o.tokens])));
        let prefix = o.prefix.clone().unwrap_or_else(|| cfg.default_prefix().to_string());
        (B { g, cfg, res, prefix, pos, attn_pos: pos, spans: Spans::Off, slot, batch: o.batch, eps: cfg.rms_norm_eps as f32 }, tokens)
    }

    /// Image soft-token rows merged into the embeddings `x` (inputs `soft_rows` `[N, D]` and
    /// `soft_index` `[T]`, the rows as they are); where `spans` says, the attention ops read the
    /// attention bounds input, so that the tokens of an image span see each other.
    pub fn soft_rows(&mut self, x: NodeIndex, o: &BuildOptions, spans: Spans) -> Result<NodeIndex, BuildError> {
        if o.soft_rows == 0 {
            return Ok(x);
        }
        let (t, h) = (o.tokens, self.cfg.hidden_size);
        let rows = self.g.input("soft_rows", InputKind::SoftRows, TensorType::f32(&[o.soft_rows, h]));
        let idx = self.g.input("soft_index", InputKind::SoftIndex, TensorType::u32(&[t]));
        if spans != Spans::Off {
            self.attn_pos = self.g.input("attn_positions", InputKind::AttnPositions, TensorType::u32(&[2, t]));
            self.spans = spans;
        }
        self.op("merge_soft_rows", None, Op::Scatter, &[x, rows, idx])
    }

    /// The weight `rel` (relative to the prefix) of layer `layer`.
    pub fn w(&mut self, rel: &str, layer: Option<usize>, shape: &[usize], module: bool) -> NodeIndex {
        let name = format!("{}{}", self.prefix, rel);
        let format = self.res.format(&name, shape, module);
        let label = match layer {
            Some(l) => format!("l{l}.{}", rel.splitn(3, '.').nth(2).unwrap_or(rel)),
            None => rel.to_string(),
        };
        self.g.weight(&label, layer, WeightParam { name, shape: shape.to_vec(), format, module })
    }

    pub fn op(&mut self, name: &str, layer: Option<usize>, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, BuildError> {
        let name = match layer {
            Some(l) => format!("l{l}.{name}"),
            None => name.to_string(),
        };
        self.g.op(&name, layer, op, ins)
    }

    /// `rms_norm(x)` with weight `w` (relative name) in convention `conv`; weightless without.
    pub fn norm(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, w: Option<&str>, conv: NormScale) -> Result<NodeIndex, BuildError> {
        let d = self.g.node(x).ty.last();
        match w {
            Some(rel) if conv != NormScale::None => {
                let wn = self.w(rel, layer, &[d], false);
                self.op(name, layer, Op::RmsNorm { eps: self.eps, scale: conv }, &[x, wn])
            }
            _ => self.op(name, layer, Op::RmsNorm { eps: self.eps, scale: NormScale::None }, &[x]),
        }
    }

    /// `x @ w^T` with the module `rel` of `out` rows.
    pub fn linear(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, rel: &str, out: usize) -> Result<NodeIndex, BuildError> {
        let inn = self.g.node(x).ty.last();
        let w = self.w(rel, layer, &[out, inn], true);
        self.op(name, layer, Op::MatMul, &[x, w])
    }

    pub fn reshape(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, shape: &[usize]) -> Result<NodeIndex, BuildError> {
        self.op(name, layer, Op::Reshape { shape: shape.to_vec() }, &[x])
    }

    pub fn add(&mut self, name: &str, layer: Option<usize>, a: NodeIndex, b: NodeIndex) -> Result<NodeIndex, BuildError> {
        self.op(name, layer, Op::Binary { f: BinaryOp::Add }, &[a, b])
    }

    /// `gelu(a) * b` (a GeGLU's activation and product).
    pub fn gelu_mul(&mut self, name: &str, layer: Option<usize>, a: NodeIndex, b: NodeIndex) -> Result<NodeIndex, BuildError> {
        let g = self.op(&format!("{name}_gelu"), layer, Op::Unary { f: UnaryOp::Gelu }, &[a])?;
        self.op(name, layer, Op::Binary { f: BinaryOp::Mul }, &[g, b])
    }

    pub fn scale(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, factor: f32) -> Result<NodeIndex, BuildError> {
        self.op(name, layer, Op::Unary { f: UnaryOp::Scale { factor } }, &[x])
    }

    /// `res + rms_norm(x)` (a post-norm and its residual add), the sum named `name`.
    pub fn norm_add(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, res: NodeIndex, w: &str, conv: NormScale) -> Result<NodeIndex, BuildError> {
        let n = self.norm(&format!("{name}_norm"), layer, x, Some(w), conv)?;
        self.add(name, layer, res, n)
    }

    /// `(res + rms_norm(x)) * s` with the scalar weight `s`.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_add_scaled(
        &mut self,
        name: &str,
        layer: Option<usize>,
        x: NodeIndex,
        res: NodeIndex,
        w: &str,
        conv: NormScale,
        s: NodeIndex,
    ) -> Result<NodeIndex, BuildError> {
        let sum = self.norm_add(name, layer, x, res, w, conv)?;
        self.op(&format!("{name}_scaled"), layer, Op::Binary { f: BinaryOp::Mul }, &[sum, s])
    }

    /// The attention projections of layer `i` (`(name, heads)`) of the normed input `xn`,
    /// each as a `[T, heads, d]` value.
    pub fn projections(&mut self, i: usize, xn: NodeIndex, d: usize, projs: &[(&str, usize)]) -> Result<Vec<NodeIndex>, BuildError> {
        let t = self.g.tokens;
        let mut out = vec![];
        for &(n, heads) in projs {
            let v = self.linear(n, Some(i), xn, &format!("layers.{i}.self_attn.{n}"), heads * d)?;
            out.push(self.reshape(&format!("{}_heads", &n[..1]), Some(i), v, &[t, heads, d])?);
        }
        Ok(out)
    }

    /// `rope(rms_norm(x))` per head, the norm's weight `w`.
    pub fn norm_rope(&mut self, name: &str, layer: Option<usize>, x: NodeIndex, w: &str, conv: NormScale, rope: &Op) -> Result<NodeIndex, BuildError> {
        let n = self.norm(&format!("{name}_norm"), layer, x, Some(w), conv)?;
        self.op(&format!("{name}_rope"), layer, rope.clone(), &[n, self.pos])
    }

    /// The K and V caches of layer `i`: `[slots, nkv, d]` each (`[batch, slots, nkv, d]` over a
    /// batch of sequences).
    pub fn kv_states(&mut self, i: usize, nkv: usize, d: usize, slots: usize) -> (NodeIndex, NodeIndex) {
        let l = Some(i);
        let cache_ty = if self.batch > 0 { TensorType::f32(&[self.batch, slots, nkv, d]) } else { TensorType::f32(&[slots, nkv, d]) };
        let ks = self.g.state(&format!("l{i}.k_cache"), l, StateKind::KvCache { layer: i, value: false }, cache_ty.clone());
        let vs = self.g.state(&format!("l{i}.v_cache"), l, StateKind::KvCache { layer: i, value: true }, cache_ty);
        (ks, vs)
    }

    /// Layer `i`'s keys (normed with weight `k_norm` and rotated) and values (as they are, or
    /// after a weightless norm with `v_norm`) written into its caches; returns the caches
    /// after the writes.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &mut self,
        i: usize,
        k: NodeIndex,
        k_norm: &str,
        conv: NormScale,
        rope: &Op,
        v: NodeIndex,
        v_norm: bool,
        slots: usize,
    ) -> Result<(NodeIndex, NodeIndex), BuildError> {
        let l = Some(i);
        let vt = self.g.node(v).ty.shape.clone();
        let (ks, vs) = self.kv_states(i, vt[1], vt[2], slots);
        let k = self.norm_rope("k", l, k, k_norm, conv, rope)?;
        let v = if v_norm { self.norm("v_norm", l, v, None, NormScale::None)? } else { v };
        if let Some(slot) = self.slot {
            let kc = self.op("k_write", l, Op::KvWriteBatched, &[k, self.pos, slot, ks])?;
            let vc = self.op("v_write", l, Op::KvWriteBatched, &[v, self.pos, slot, vs])?;
            return Ok((kc, vc));
        }
        let kc = self.op("k_write", l, Op::KvWrite { heads: None }, &[k, self.pos, ks])?;
        let vc = self.op("v_write", l, Op::KvWrite { heads: None }, &[v, self.pos, vs])?;
        Ok((kc, vc))
    }

    /// Attention of layer `i` (queries `q`, caches `kc`/`vc`), the output projection and its
    /// post-norm, added to the residual `x`.
    pub fn attention_block(&mut self, i: usize, x: NodeIndex, q: NodeIndex, (kc, vc): (NodeIndex, NodeIndex), conv: NormScale) -> Result<NodeIndex, BuildError> {
        let (l, cfg) = (Some(i), self.cfg);
        let window = if cfg.layer_types[i] == LayerType::Sliding { Some(cfg.sliding_window) } else { None };
        let scale = cfg.attn_scale as f32;
        // the attention bounds where image spans attend to themselves on this layer
        let pos = if self.spans == Spans::SlidingLayers && window.is_none() { self.pos } else { self.attn_pos };
        let a = match self.slot {
            Some(slot) => self.op("attention", l, Op::AttentionBatched { scale, window }, &[q, pos, slot, kc, vc])?,
            None => self.op("attention", l, Op::Attention { scale, window }, &[q, pos, kc, vc])?,
        };
        let qs = self.g.node(a).ty.shape.clone();
        let a = self.reshape("attn_flat", l, a, &[qs[0], qs[1] * qs[2]])?;
        let a = self.linear("o_proj", l, a, &format!("layers.{i}.self_attn.o_proj"), cfg.hidden_size)?;
        self.norm_add("attn_residual", l, a, x, &format!("layers.{i}.post_attention_layernorm.weight"), conv)
    }

    /// The dense GeGLU MLP of layer `i`: `down(gelu(gate(m)) * up(m))`.
    pub fn mlp(&mut self, i: usize, m: NodeIndex, inter: usize) -> Result<NodeIndex, BuildError> {
        let l = Some(i);
        let gt = self.linear("gate_proj", l, m, &format!("layers.{i}.mlp.gate_proj"), inter)?;
        let up = self.linear("up_proj", l, m, &format!("layers.{i}.mlp.up_proj"), inter)?;
        let gu = self.gelu_mul("geglu", l, gt, up)?;
        self.linear("down_proj", l, gu, &format!("layers.{i}.mlp.down_proj"), self.cfg.hidden_size)
    }

    /// Layer `i`'s cache slots.
    pub fn slots(&self, i: usize, o: &BuildOptions) -> usize {
        cache_slots(self.cfg, self.cfg.layer_types[i], o)
    }

    /// Final norm, tied (or untied) head, softcap and argmax or sampling; the graph.
    pub fn head(mut self, x: NodeIndex, emb: NodeIndex, conv: NormScale, o: &BuildOptions) -> Result<Graph, BuildError> {
        let t = o.tokens;
        let h = self.cfg.hidden_size;
        let x = if o.outputs == Outputs::LastLogits && t > 1 {
            self.op("last_row", None, Op::Slice { axis: 0, start: t - 1, len: 1 }, &[x])?
        } else {
            x
        };
        let xn = self.norm("final_norm", None, x, Some("norm.weight"), conv)?;
        // Untied only when the checkpoint has its own head (mlx-lm ties iff it is absent).
        let lm_head = format!("{}lm_head", self.prefix.strip_suffix("model.").unwrap_or(""));
        let head_w = if self.res.exists(&lm_head) {
            let format = self.res.format(&lm_head, &[self.cfg.vocab_size, h], true);
            let wp = WeightParam { name: lm_head, shape: vec![self.cfg.vocab_size, h], format, module: true };
            self.g.weight("lm_head", None, wp)
        } else {
            emb
        };
        let mut logits = self.op("logits", None, Op::MatMul, &[xn, head_w])?;
        if let Some(cap) = self.cfg.final_logit_softcap {
            logits = self.op("softcap", None, Op::Unary { f: UnaryOp::Softcap { cap: cap as f32 } }, &[logits])?;
        }
        let tok = if o.outputs == Outputs::RowTokens && o.sample {
            let params = self.g.input("row_sampling", InputKind::RowSampling, TensorType::u32(&[t, crate::ops::SAMPLE_PARAMS]));
            let recent = self.g.input("row_recent", InputKind::RowRecent, TensorType::u32(&[t, RECENT_TOKENS]));
            self.op("sample", None, Op::SampleRows, &[logits, params, recent])?
        } else if o.outputs == Outputs::RowTokens {
            self.op("argmax", None, Op::ArgmaxRows, &[logits])?
        } else if o.sample {
            let params = self.g.input("sampling_params", InputKind::SamplingParams, TensorType::u32(&[crate::ops::SAMPLE_PARAMS]));
            let recent = self.g.input("recent_tokens", InputKind::RecentTokens, TensorType::u32(&[RECENT_TOKENS]));
            self.op("sample", None, Op::Sample, &[logits, params, recent])?
        } else {
            self.op("argmax", None, Op::Argmax, &[logits])?
        };
        self.g.set_output("logits", logits);
        self.g.set_output("token", tok);
        Ok(self.g)
    }
}

/// The RoPE of layer `i`, rotating `pairs` pairs.
pub(crate) fn rope_op(cfg: &ModelConfig, i: usize, pairs: usize) -> Op {
    let r = cfg.layer_rope(i);
    Op::Rope { theta: r.theta as f32, factor: r.factor as f32, rotary_pairs: pairs }
}
