//! Every op of the IR, defined once: its inputs, attributes and output-shape rule.
//!
//! Lowerings live elsewhere (the CPU reference executor and the WGSL kernels);
//! both read the attributes defined here and nothing else.

use serde::Serialize;

/// Element type of a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    U32,
}

impl DType {
    pub fn bytes(self) -> usize {
        4
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::U32 => "u32",
        }
    }
}

/// Shape and dtype of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct TensorType {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorType {
    pub fn f32(shape: &[usize]) -> Self {
        TensorType { shape: shape.to_vec(), dtype: DType::F32 }
    }
    pub fn u32(shape: &[usize]) -> Self {
        TensorType { shape: shape.to_vec(), dtype: DType::U32 }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.bytes()
    }
    pub fn last(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    /// Product of all dims but the last.
    pub fn rows(&self) -> usize {
        if self.shape.is_empty() {
            1
        } else {
            self.shape[..self.shape.len() - 1].iter().product()
        }
    }
    pub fn describe(&self) -> String {
        format!("{}{:?}", self.dtype.name(), self.shape)
    }
}

/// Scale convention of an RMSNorm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NormScale {
    /// `rms(x) * (1 + w)` (Gemma 3).
    OnePlusW,
    /// `rms(x) * w` (Gemma 3n / 4).
    W,
    /// `rms(x)` (no weight).
    None,
}

/// Elementwise binary operation with broadcasting of the second operand over
/// leading dims (its shape must equal a suffix of the first's, or be `[1]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BinaryOp {
    Add,
    Mul,
}

/// Elementwise unary operation.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "fn", rename_all = "snake_case")]
pub enum UnaryOp {
    /// `x * factor`.
    Scale { factor: f32 },
    /// GELU, tanh approximation.
    Gelu,
    /// `cap * tanh(x / cap)`.
    Softcap { cap: f32 },
    /// `max(x, 0)`.
    Relu,
    /// `x * sigmoid(x)`.
    Silu,
}

/// The ops. Inputs are listed per variant as `[name: type]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// `[ids: u32[T], table: weight[V, D]] -> f32[T, D]`: row lookup times `scale`.
    /// Ids `>= clamp` (when set) read row 0 (Gemma 3n's per-layer table).
    Embed { scale: f32, clamp: Option<u32> },
    /// `[x: f32[.., K], w: weight[N, K]] -> f32[.., N]`: `x @ w^T`.
    MatMul,
    /// `[x: f32[T, S, K], ids: u32[T, S], w: weight[E, N, K]] -> f32[T, S, N]`:
    /// row `(t, s)` multiplied by expert `ids[t, s]`. `S` = experts per token;
    /// `x` may also be `f32[T, K]` (broadcast over S).
    GatherMatMul,
    /// `[ids: u32[T, S]] -> u32[E + 1 + T*S]`: the (token, expert) pairs `p = t*S + s`
    /// grouped by expert. Words `0..=E` are offsets: expert `e`'s pairs are entries
    /// `offsets[e]..offsets[e + 1]` of the list that follows (`offsets[E]` = pairs with
    /// an expert `< E`, i.e. T*S for valid ids). Words `E + 1..` list the pair indices
    /// by expert, increasing inside each expert (a stable sort of the pairs by expert).
    MoeGroup { experts: usize },
    /// `[x, ids, w: weight[E, N, K], groups: u32[E + 1 + T*S]] -> f32[T, S, N]`: the
    /// result of [`Op::GatherMatMul`] on `[x, ids, w]`, computed expert by expert over
    /// the pairs of `groups` (the [`Op::MoeGroup`] of `ids`): each expert's weights are
    /// read once for all its pairs (prefill).
    GroupedMatMul,
    /// `[x: f32[.., D], w?: f32-weight[D]] -> f32[.., D]`.
    RmsNorm { eps: f32, scale: NormScale },
    /// `[x: f32[.., D], res: f32[.., D], w?: f32-weight[D], s?: f32-weight[1]] -> f32[.., D]`:
    /// `res + rms_norm(x)` (a post-norm and its residual add, one pass); `scaled`: that sum
    /// times the scalar `s` (Gemma 4's layer scalar).
    RmsNormAdd { eps: f32, scale: NormScale, scaled: bool },
    /// `[x: f32[.., K], nw?: f32-weight[K], w1: weight[N1, K], w2.., ..] -> f32[.., N1 + N2 + ..]`:
    /// `rms_norm(x) @ [w1; w2; ..]^T` (a pre-norm read by matmuls only; the norm's weight is
    /// the second input unless `scale` is `None`). Several weights: their outputs side by
    /// side in one value (the q, k and v projections of one token in one pass).
    NormMatMul { eps: f32, scale: NormScale },
    /// `[x: f32[.., K], nw?: f32-weight[K], wg: weight[I, K], wu: weight[I, K]] -> f32[.., I]`:
    /// `gelu(m @ wg^T) * (m @ wu^T)` with `m = rms_norm(x)` (a GeGLU MLP's gate, up and
    /// activation in one pass; the norm's weight is the second input unless `scale` is `None`).
    NormGeGlu { eps: f32, scale: NormScale },
    /// `[x: f32[T, heads, D], pos: u32[T]] -> f32[T, heads, D]`: half-split RoPE on pairs
    /// `(i, i + D/2)` for `i < rotary_pairs`; `inv_freq_i = theta^(-2i/D) / factor`.
    Rope { theta: f32, factor: f32, rotary_pairs: usize },
    /// `[x: f32[T, heads, D], pos: u32[T], w?: f32-weight[D]] -> f32[T, heads, D]`:
    /// `rope(rms_norm(x))` per head (the q/k norms and their RoPE, one pass). With `heads`:
    /// only those heads of x (which then holds more), the output has `heads.count`.
    NormRope { eps: f32, scale: NormScale, theta: f32, factor: f32, rotary_pairs: usize, heads: Option<HeadRange> },
    /// `[x: f32[T, heads, D], pos: u32[T], cache: state[S, heads, D]] -> state`:
    /// writes row `t` at slot `pos[t] % S`. The output is the cache itself. With `heads`:
    /// only those heads of x (which then holds more).
    KvWrite { heads: Option<HeadRange> },
    /// `[x: f32[T, nkv, D], pos: u32[T], slot: u32[T], cache: state[N, S, nkv, D]] -> state`:
    /// the cache of N sequence slots (a batch of sequences, each its own ring of S positions);
    /// row `t` is written at position slot `pos[t] % S` of sequence slot `slot[t]`. Rows whose
    /// `slot[t] >= N` (idle rows of a batch) write nothing. The output is the cache itself.
    KvWriteBatched,
    /// `[q: f32[T, nq, D], pos: u32[T] | u32[2, T], slot: u32[T], k: state[N, S, nkv, D], v:
    /// state[N, S, nkv, D]] -> f32[T, nq, D]`: [`Op::Attention`] of each row over its own
    /// sequence slot: query `t` attends to the positions `j <= pos[t]` (and `j > pos[t] -
    /// window`) of slot `slot[t]`, read from position slot `j % S`; with attention bounds
    /// `[2, T]` (a prompt's image spans), to `j <= max(pos[t], pos[T + t])`. GQA as
    /// [`Op::Attention`]. Rows whose `slot[t] >= N` get zeros. Each row's arithmetic depends
    /// on its own inputs only.
    AttentionBatched { scale: f32, window: Option<usize> },
    /// `[x: f32[T, H, D], pos: u32[T], w?: f32-weight[D], cache: state[S, heads, D]] -> state`:
    /// [`Op::NormRope`] of x written straight into a cache as [`Op::KvWrite`] writes (k's norm,
    /// RoPE and cache write in one pass).
    KvWriteNormRope { eps: f32, scale: NormScale, theta: f32, factor: f32, rotary_pairs: usize, heads: Option<HeadRange> },
    /// `[q: f32[T, nq, D], pos: u32[T], k: state[S, nkv, D], v: state[S, nkv, D]] -> f32[T, nq, D]`:
    /// query `t` attends to absolute positions `j <= pos[t]` (and `j > pos[t] - window`),
    /// read from slot `j % S`. GQA: head `h` uses kv head `h / (nq / nkv)`. With `pos`
    /// `u32[2, T]` (positions, then last positions: [`crate::ir::InputKind::AttnPositions`]),
    /// query `t` attends to `j <= pos[1][t]` instead (an image span's tokens see the whole
    /// span), the window still counted from `pos[0][t]`; the span's keys must be in the caches.
    Attention { scale: f32, window: Option<usize> },
    /// `[x: f32[T, H, D], pos: u32[T], k: state, v: state, w?: f32-weight[D], wk?: f32-weight[D]]
    /// -> f32[T, nq, D]`: [`Op::Attention`] of the queries `rope(rms_norm(x))` ([`Op::NormRope`]
    /// with the norm convention `norm`; heads `heads` of x when given), the query's norm and
    /// RoPE done by the attention pass itself. With `append` (one token): the step's own key
    /// and value are heads of x too, the key normed (weight `wk`) and rotated as the query is;
    /// the pass writes both to the caches k and v (states it alone uses) and attends to them.
    NormRopeAttention {
        scale: f32,
        window: Option<usize>,
        eps: f32,
        norm: NormScale,
        theta: f32,
        factor: f32,
        rotary_pairs: usize,
        heads: Option<HeadRange>,
        append: Option<KvAppend>,
    },
    /// `[a, b] -> a`.
    Binary { f: BinaryOp },
    /// `[x] -> x`.
    Unary { f: UnaryOp },
    /// `[gate: f32[.., I], up: f32[.., I]] -> f32[.., I]`: `gelu(gate) * up`.
    GeGlu,
    /// `[logits: f32[T, E]] -> u32[T, k]`: indices of the k largest (ties: lower index first).
    TopK { k: usize },
    /// `[logits: f32[T, E], ids: u32[T, k], scale?: f32-weight[E]] -> f32[T, k]`:
    /// softmax over the selected logits, times `scale[ids]` when given.
    TopKSoftmax,
    /// `[x: f32[T, S, D], w: f32[T, S]] -> f32[T, D]`: weighted sum over S.
    WeightedSum,
    /// `[x] -> x'`: same data, another shape (a view: no copy, no buffer).
    Reshape { shape: Vec<usize> },
    /// `[x: f32[.., N, ..]] -> f32[.., len, ..]`: `len` entries from `start` along `axis`.
    Slice { axis: usize, start: usize, len: usize },
    /// `[logits: f32[T, V]] -> u32[1]`: argmax of the last row.
    Argmax,
    /// `[logits: f32[T, V], params: u32[8], recent: u32[R]] -> u32[1]`: samples a token
    /// from the last row. `params` (host-written each step, f32 as bits):
    /// `[temperature, top_k, top_p, min_p, repetition_penalty, seed, step, n_recent]`;
    /// the first `n_recent` ids of `recent` get the repetition penalty. Temperature 0 = greedy.
    Sample,
    /// `[logits: f32[T, V]] -> u32[T]`: the argmax of every row (each row a sequence of a
    /// batch; ties as [`Op::Argmax`]).
    ArgmaxRows,
    /// `[logits: f32[T, V], params: u32[T, 8], recent: u32[T, R]] -> u32[T]`: [`Op::Sample`]
    /// of every row with its own parameter words and recent ids (each row a sequence of a batch).
    SampleRows,
    /// `[x: f32[..], lo: f32-weight[], hi: f32-weight[]] -> x`: `min(max(x, lo), hi)` with
    /// scalar bounds (the input and output clips of Gemma 4's clipped linears).
    Clamp,
    /// `[x: f32[T, H, D], px: u32[T], py: u32[T]] -> f32[T, H, D]`: 2-D RoPE (D a multiple of
    /// 4): channels `0..D/2` rotate with `px`, `D/2..D` with `py`; inside each half the
    /// rotate-half pairs `(i, i + D/4)` turn by `pos / theta^(4i/D)`.
    Rope2d { theta: f32 },
    /// `[q: f32[T, H, D], k: f32[S, Hk, D], v: f32[S, Hk, D], valid?: u32[S]] -> f32[T, H, D]`:
    /// `softmax(q kᵀ · scale) v` over every key (bidirectional, no cache); keys whose `valid`
    /// word is 0 are masked out (a query with no valid key gets zeros). Head `h` reads kv
    /// head `h / (H / Hk)`.
    FullAttention { scale: f32 },
    /// `[x: f32[rows * cols, D]] -> f32[(rows / k) * (cols / k), D]`: the mean of each k×k
    /// block of the row-major grid of rows, blocks in row-major order.
    AvgPool { rows: usize, cols: usize, k: usize },
    /// `[x: f32[.., D], w: f32-weight[D], b?: f32-weight[D]] -> x`:
    /// `(x - mean) / sqrt(var + eps) * w (+ b)` over the last dim.
    LayerNorm { eps: f32 },
    /// `[x: f32[T, D], rows: f32[N, D], src: u32[T]] -> f32[T, D]`: row `t` of x replaced by
    /// `rows[src[t] - 1]` where `src[t] > 0` (soft-token rows into a prompt's embeddings).
    Scatter,
    /// `[x: f32[H, W, C], w: f32-weight[O, kh, kw, C]] -> f32[Ho, Wo, O]`: a dense 2-D
    /// convolution (MLX layout, no bias), `pad` zeros left and right, `time_pad` zeros above
    /// and below, `Ho = (H + time_pad[0] + time_pad[1] − kh) / stride + 1`,
    /// `Wo = (W + 2·pad − kw) / stride + 1` (the audio subsampling convs: 3x3, stride 2, pad 1;
    /// time pad 1, 1 for Gemma 4, 0, 2 for Gemma 3n).
    Conv2d { stride: usize, pad: usize, time_pad: [usize; 2] },
    /// `[x: f32[T, F, C], w: f32-weight[C]] -> x`: Gemma 3n's cumulative group norm, row `t`
    /// normalised by the statistics of rows `0..=t`: `μ_t = Σ_{τ≤t} Σ x[τ] / N_t`,
    /// `σ²_t = Σ_{τ≤t} Σ (x[τ] − μ_τ)² / N_t` (each row's deviations from its own mean),
    /// `N_t = (t + 1)·F·C`; `y = (x − μ_t) / sqrt(σ²_t + eps) · w[c]`.
    CumulativeGroupNorm { eps: f32 },
    /// `[x: f32[T, ..], valid: u32[T]] -> x`: rows `t` with `valid[t] == 0` set to zero.
    MaskRows,
    /// `[x: [T, ..]] -> [ceil(T / stride), ..]` (f32 or u32): rows `0, stride, 2·stride, ..`
    /// (`x[::stride]`, a frame mask through a strided conv).
    StridedRows { stride: usize },
    /// `[x: f32[.., 2C]] -> f32[.., C]`: `a · sigmoid(b)` of the halves `a | b` (GLU).
    Glu,
    /// `[x: f32[T, C], w: f32-weight[C, K, 1]] -> f32[T, C]`: causal depthwise 1-D convolution,
    /// `y[t, c] = Σ_j w[c, j] · x[t − (K − 1) + j, c]` (zeros before row 0).
    DepthwiseConv1d,
    /// `[q, k, v: f32[T, H, D], valid: u32[T], per_dim_scale: f32-weight[D], rel: weight[H·D, C]]
    /// -> f32[T, H, D]`: the local audio attention of Gemma 4 and Gemma 3n, the exact form of
    /// their chunked one. `q ← q · D^−½ / ln 2 · softplus(per_dim_scale)`, `k ← k ·
    /// key_scale` (Gemma 4: `ln(1 + e) / ln 2`; Gemma 3n: 1); query `t`
    /// sees keys `s` with `0 ≤ t − s < window` and `valid[s]`; the logit is
    /// `q_t·k_s + q_t·R[t − s]` with `R[d] = rel · [sin(d·τ), cos(d·τ)]` (`C / 2` timescales
    /// `τ_i = 10⁴^(−i / (C/2 − 1))`), soft-capped at `softcap` (a query with no key: zeros).
    AudioAttention { window: usize, softcap: f32, key_scale: f32 },
}

/// Heads `start..start + count` of a value with more heads (a fused q/k/v projection's output).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HeadRange {
    pub start: usize,
    pub count: usize,
}

impl HeadRange {
    /// `x: [T, H, D]` restricted to the range (`None`: all of it), or why it does not fit.
    fn apply(range: Option<HeadRange>, x: &TensorType) -> Result<TensorType, String> {
        let Some(r) = range else { return Ok(x.clone()) };
        if x.shape.len() != 3 || r.count == 0 || r.start + r.count > x.shape[1] {
            return Err(format!("heads {}..{} of {}", r.start, r.start + r.count, x.describe()));
        }
        Ok(TensorType::f32(&[x.shape[0], r.count, x.shape[2]]))
    }

    /// `heads=a..b` for dumps (empty without a range).
    fn attr(range: Option<HeadRange>) -> String {
        range.map_or(String::new(), |r| format!(" heads={}..{}", r.start, r.start + r.count))
    }
}

/// The key and value heads of a one-token [`Op::NormRopeAttention`] that appends them to its
/// caches (no cache-write op in front: the attention pass writes the step's row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct KvAppend {
    pub k: HeadRange,
    pub v: HeadRange,
}

/// Number of u32 words of the sampling parameters.
pub const SAMPLE_PARAMS: usize = 8;

/// An op's inputs did not fit it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{op}: {msg}")]
pub struct ShapeError {
    pub op: String,
    pub msg: String,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::MatMul => "matmul",
            Op::GatherMatMul => "gather_matmul",
            Op::MoeGroup { .. } => "moe_group",
            Op::GroupedMatMul => "grouped_matmul",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormAdd { .. } => "rms_norm_add",
            Op::NormMatMul { .. } => "norm_matmul",
            Op::NormGeGlu { .. } => "norm_geglu",
            Op::Rope { .. } => "rope",
            Op::NormRope { .. } => "norm_rope",
            Op::KvWrite { .. } => "kv_write",
            Op::KvWriteBatched => "kv_write_batched",
            Op::AttentionBatched { .. } => "attention_batched",
            Op::ArgmaxRows => "argmax_rows",
            Op::SampleRows => "sample_rows",
            Op::KvWriteNormRope { .. } => "kv_write_norm_rope",
            Op::Attention { .. } => "attention",
            Op::NormRopeAttention { .. } => "norm_rope_attention",
            Op::Binary { f: BinaryOp::Add } => "add",
            Op::Binary { f: BinaryOp::Mul } => "mul",
            Op::Unary { f: UnaryOp::Scale { .. } } => "scale",
            Op::Unary { f: UnaryOp::Gelu } => "gelu",
            Op::Unary { f: UnaryOp::Softcap { .. } } => "softcap",
            Op::Unary { f: UnaryOp::Relu } => "relu",
            Op::Unary { f: UnaryOp::Silu } => "silu",
            Op::GeGlu => "geglu",
            Op::TopK { .. } => "top_k",
            Op::TopKSoftmax => "top_k_softmax",
            Op::WeightedSum => "weighted_sum",
            Op::Reshape { .. } => "reshape",
            Op::Slice { .. } => "slice",
            Op::Argmax => "argmax",
            Op::Sample => "sample",
            Op::Clamp => "clamp",
            Op::Rope2d { .. } => "rope_2d",
            Op::FullAttention { .. } => "full_attention",
            Op::AvgPool { .. } => "avg_pool",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Scatter => "scatter",
            Op::Conv2d { .. } => "conv2d",
            Op::CumulativeGroupNorm { .. } => "cumulative_group_norm",
            Op::MaskRows => "mask_rows",
            Op::StridedRows { .. } => "strided_rows",
            Op::Glu => "glu",
            Op::DepthwiseConv1d => "depthwise_conv1d",
            Op::AudioAttention { .. } => "audio_attention",
        }
    }

    /// Input slot of the norm weight of a norm or fused-norm op, when it has one.
    pub fn norm_weight_input(&self) -> Option<usize> {
        match self {
            Op::RmsNorm { scale, .. } | Op::NormMatMul { scale, .. } | Op::NormGeGlu { scale, .. } if *scale != NormScale::None => {
                Some(1)
            }
            Op::RmsNormAdd { scale, .. } | Op::NormRope { scale, .. } | Op::KvWriteNormRope { scale, .. } if *scale != NormScale::None => {
                Some(2)
            }
            Op::NormRopeAttention { norm, .. } if *norm != NormScale::None => Some(4),
            _ => None,
        }
    }

    /// Whether the op's output is a view of its first input (no buffer of its own).
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Reshape { .. })
    }

    /// Whether the op writes into the persistent state given as its last input.
    pub fn writes_state(&self) -> bool {
        matches!(self, Op::KvWrite { .. } | Op::KvWriteNormRope { .. } | Op::KvWriteBatched)
    }

    /// Attributes as a short human-readable string (for dumps).
    pub fn attrs(&self) -> String {
        match self {
            Op::Embed { scale, clamp } => match clamp {
                Some(c) => format!("scale={scale} clamp={c}"),
                None => format!("scale={scale}"),
            },
            Op::RmsNorm { eps, scale } | Op::NormMatMul { eps, scale } | Op::NormGeGlu { eps, scale } => {
                format!("eps={eps:e} scale={scale:?}")
            }
            Op::RmsNormAdd { eps, scale, scaled } => format!("eps={eps:e} scale={scale:?}{}", if *scaled { " scaled" } else { "" }),
            Op::Rope { theta, factor, rotary_pairs } => format!("theta={theta} factor={factor} pairs={rotary_pairs}"),
            Op::NormRope { eps, scale, theta, factor, rotary_pairs, heads }
            | Op::KvWriteNormRope { eps, scale, theta, factor, rotary_pairs, heads } => {
                format!("eps={eps:e} scale={scale:?} theta={theta} factor={factor} pairs={rotary_pairs}{}", HeadRange::attr(*heads))
            }
            Op::KvWrite { heads } => HeadRange::attr(*heads).trim_start().to_string(),
            Op::Attention { scale, window } | Op::AttentionBatched { scale, window } => match window {
                Some(w) => format!("scale={scale} window={w}"),
                None => format!("scale={scale} causal"),
            },
            Op::NormRopeAttention { scale, window, eps, norm, theta, factor, rotary_pairs, heads, append } => format!(
                "scale={scale} {} eps={eps:e} norm={norm:?} theta={theta} factor={factor} pairs={rotary_pairs}{}{}",
                window.map_or("causal".to_string(), |w| format!("window={w}")),
                HeadRange::attr(*heads),
                append.map_or(String::new(), |a| format!(
                    " append k={}..{} v={}..{}",
                    a.k.start,
                    a.k.start + a.k.count,
                    a.v.start,
                    a.v.start + a.v.count
                ))
            ),
            Op::Unary { f: UnaryOp::Scale { factor } } => format!("factor={factor}"),
            Op::Unary { f: UnaryOp::Softcap { cap } } => format!("cap={cap}"),
            Op::TopK { k } => format!("k={k}"),
            Op::MoeGroup { experts } => format!("experts={experts}"),
            Op::Reshape { shape } => format!("shape={shape:?}"),
            Op::Slice { axis, start, len } => format!("axis={axis} start={start} len={len}"),
            Op::Rope2d { theta } => format!("theta={theta}"),
            Op::FullAttention { scale } => format!("scale={scale} bidirectional"),
            Op::AvgPool { rows, cols, k } => format!("grid={rows}x{cols} k={k}"),
            Op::LayerNorm { eps } => format!("eps={eps:e}"),
            Op::Conv2d { stride, pad, time_pad } => format!("stride={stride} pad={pad} time_pad={}+{}", time_pad[0], time_pad[1]),
            Op::CumulativeGroupNorm { eps } => format!("eps={eps:e}"),
            Op::StridedRows { stride } => format!("stride={stride}"),
            Op::AudioAttention { window, softcap, key_scale } => format!("window={window} softcap={softcap} key_scale={key_scale}"),
            _ => String::new(),
        }
    }

    /// Output type from input types: the shape rule. `inputs` are in slot order;
    /// weights appear with their logical (float) shape and dtype f32.
    pub fn infer(&self, inputs: &[&TensorType]) -> Result<TensorType, ShapeError> {
        let err = |msg: String| ShapeError { op: self.name().to_string(), msg };
        let need = |n: usize| -> Result<(), ShapeError> {
            if inputs.len() == n {
                Ok(())
            } else {
                Err(err(format!("expects {n} inputs, got {}", inputs.len())))
            }
        };
        let f32_in = |i: usize| -> Result<&TensorType, ShapeError> {
            let t = inputs[i];
            if t.dtype == DType::F32 {
                Ok(t)
            } else {
                Err(err(format!("input {i} must be f32, got {}", t.describe())))
            }
        };
        let u32_in = |i: usize| -> Result<&TensorType, ShapeError> {
            let t = inputs[i];
            if t.dtype == DType::U32 {
                Ok(t)
            } else {
                Err(err(format!("input {i} must be u32, got {}", t.describe())))
            }
        };
        match self {
            Op::Embed { .. } => {
                need(2)?;
                let ids = u32_in(0)?;
                let tab = inputs[1];
                if ids.shape.len() != 1 || tab.shape.len() != 2 {
                    return Err(err(format!("ids {} table {}", ids.describe(), tab.describe())));
                }
                Ok(TensorType::f32(&[ids.shape[0], tab.shape[1]]))
            }
            Op::MatMul => {
                need(2)?;
                let x = f32_in(0)?;
                let w = inputs[1];
                if w.shape.len() != 2 || x.shape.is_empty() || x.last() != w.shape[1] {
                    return Err(err(format!("x {} vs w {}", x.describe(), w.describe())));
                }
                let mut s = x.shape.clone();
                *s.last_mut().unwrap() = w.shape[0];
                Ok(TensorType::f32(&s))
            }
            Op::GatherMatMul => {
                need(3)?;
                gather_shape(f32_in(0)?, u32_in(1)?, inputs[2]).map_err(err)
            }
            Op::MoeGroup { experts } => {
                need(1)?;
                let ids = u32_in(0)?;
                if ids.shape.len() != 2 || *experts == 0 {
                    return Err(err(format!("ids {} experts {experts}", ids.describe())));
                }
                Ok(TensorType::u32(&[experts + 1 + ids.numel()]))
            }
            Op::GroupedMatMul => {
                need(4)?;
                let ids = u32_in(1)?;
                let out = gather_shape(f32_in(0)?, ids, inputs[2]).map_err(err)?;
                let groups = u32_in(3)?;
                let e = inputs[2].shape[0];
                if groups.shape != [e + 1 + ids.numel()] {
                    return Err(err(format!("groups {} for {e} experts and ids {}", groups.describe(), ids.describe())));
                }
                Ok(out)
            }
            Op::RmsNorm { scale, .. } => {
                let x = f32_in(0)?;
                if *scale == NormScale::None {
                    need(1)?;
                } else {
                    need(2)?;
                    if inputs[1].shape != [x.last()] {
                        return Err(err(format!("weight {} for x {}", inputs[1].describe(), x.describe())));
                    }
                }
                Ok(x.clone())
            }
            Op::RmsNormAdd { scale, scaled, .. } => {
                need(if *scale == NormScale::None { 2 } else { 3 } + usize::from(*scaled))?;
                let x = f32_in(0)?;
                let r = f32_in(1)?;
                if r.shape != x.shape {
                    return Err(err(format!("residual {} for x {}", r.describe(), x.describe())));
                }
                if *scale != NormScale::None && inputs[2].shape != [x.last()] {
                    return Err(err(format!("weight {} for x {}", inputs[2].describe(), x.describe())));
                }
                if *scaled && inputs[inputs.len() - 1].shape != [1] {
                    return Err(err(format!("scalar {} for x {}", inputs[inputs.len() - 1].describe(), x.describe())));
                }
                Ok(x.clone())
            }
            Op::NormMatMul { scale, .. } => {
                let has_w = *scale != NormScale::None;
                let first_w = if has_w { 2 } else { 1 };
                if inputs.len() <= first_w {
                    return Err(err(format!("expects at least {} inputs, got {}", first_w + 1, inputs.len())));
                }
                let x = f32_in(0)?;
                let mut n = 0;
                for w in &inputs[first_w..] {
                    if w.shape.len() != 2 || x.shape.is_empty() || x.last() != w.shape[1] {
                        return Err(err(format!("x {} vs w {}", x.describe(), w.describe())));
                    }
                    n += w.shape[0];
                }
                if has_w && inputs[1].shape != [x.last()] {
                    return Err(err(format!("norm weight {} for x {}", inputs[1].describe(), x.describe())));
                }
                let mut s = x.shape.clone();
                *s.last_mut().unwrap() = n;
                Ok(TensorType::f32(&s))
            }
            Op::NormGeGlu { scale, .. } => {
                let has_w = *scale != NormScale::None;
                need(if has_w { 4 } else { 3 })?;
                let x = f32_in(0)?;
                let (wg, wu) = (inputs[inputs.len() - 2], inputs[inputs.len() - 1]);
                if wg.shape.len() != 2 || wg.shape != wu.shape || x.shape.is_empty() || x.last() != wg.shape[1] {
                    return Err(err(format!("x {} vs gate {} up {}", x.describe(), wg.describe(), wu.describe())));
                }
                if has_w && inputs[1].shape != [x.last()] {
                    return Err(err(format!("norm weight {} for x {}", inputs[1].describe(), x.describe())));
                }
                let mut s = x.shape.clone();
                *s.last_mut().unwrap() = wg.shape[0];
                Ok(TensorType::f32(&s))
            }
            Op::Rope { rotary_pairs, .. } | Op::NormRope { rotary_pairs, .. } => {
                match self {
                    Op::NormRope { scale, .. } if *scale != NormScale::None => {
                        need(3)?;
                        if inputs[2].shape != [inputs[0].last()] {
                            return Err(err(format!("weight {} for x {}", inputs[2].describe(), inputs[0].describe())));
                        }
                    }
                    _ => need(2)?,
                }
                let x = f32_in(0)?;
                let p = u32_in(1)?;
                if x.shape.len() != 3 || p.shape != [x.shape[0]] || x.shape[2] % 2 != 0 || *rotary_pairs > x.shape[2] / 2 {
                    return Err(err(format!("x {} pos {} pairs {rotary_pairs}", x.describe(), p.describe())));
                }
                let heads = match self {
                    Op::NormRope { heads, .. } => *heads,
                    _ => None,
                };
                HeadRange::apply(heads, x).map_err(err)
            }
            Op::KvWriteNormRope { scale, rotary_pairs, heads, .. } => {
                let has_w = *scale != NormScale::None;
                need(if has_w { 4 } else { 3 })?;
                let x = HeadRange::apply(*heads, f32_in(0)?).map_err(err)?;
                let p = u32_in(1)?;
                let c = f32_in(inputs.len() - 1)?;
                if x.shape.len() != 3 || p.shape != [x.shape[0]] || x.shape[2] % 2 != 0 || *rotary_pairs > x.shape[2] / 2 {
                    return Err(err(format!("x {} pos {} pairs {rotary_pairs}", x.describe(), p.describe())));
                }
                if has_w && inputs[2].shape != [x.last()] {
                    return Err(err(format!("weight {} for x {}", inputs[2].describe(), x.describe())));
                }
                if c.shape.len() != 3 || x.shape[1..] != c.shape[1..] || x.shape[0] > c.shape[0] {
                    return Err(err(format!("x {} cache {}", x.describe(), c.describe())));
                }
                Ok(c.clone())
            }
            Op::KvWrite { heads } => {
                need(3)?;
                let x = &HeadRange::apply(*heads, f32_in(0)?).map_err(err)?;
                let p = u32_in(1)?;
                let c = f32_in(2)?;
                if x.shape.len() != 3 || c.shape.len() != 3 || x.shape[1..] != c.shape[1..] || p.shape != [x.shape[0]] {
                    return Err(err(format!("x {} pos {} cache {}", x.describe(), p.describe(), c.describe())));
                }
                if x.shape[0] > c.shape[0] {
                    return Err(err(format!("{} rows do not fit a cache of {} slots", x.shape[0], c.shape[0])));
                }
                Ok(c.clone())
            }
            Op::KvWriteBatched => {
                need(4)?;
                let x = f32_in(0)?;
                let (p, s) = (u32_in(1)?, u32_in(2)?);
                let c = f32_in(3)?;
                if x.shape.len() != 3 || c.shape.len() != 4 || x.shape[1..] != c.shape[2..] || p.shape != [x.shape[0]] || s.shape != p.shape {
                    return Err(err(format!("x {} pos {} slot {} cache {}", x.describe(), p.describe(), s.describe(), c.describe())));
                }
                if c.shape[0] == 0 || c.shape[1] == 0 {
                    return Err(err(format!("cache {} has no slots", c.describe())));
                }
                Ok(c.clone())
            }
            Op::AttentionBatched { .. } => {
                need(5)?;
                let q = f32_in(0)?;
                let (p, s) = (u32_in(1)?, u32_in(2)?);
                let (k, v) = (f32_in(3)?, f32_in(4)?);
                // positions `[T]`, or attention bounds `[2, T]` (positions, then each row's last visible one)
                let bounds = p.shape == [q.shape.first().copied().unwrap_or(0)] || p.shape == [2, q.shape.first().copied().unwrap_or(0)];
                if q.shape.len() != 3 || k.shape.len() != 4 || k.shape != v.shape || !bounds || s.shape != [q.shape[0]] {
                    return Err(err(format!("q {} pos {} slot {} k {} v {}", q.describe(), p.describe(), s.describe(), k.describe(), v.describe())));
                }
                if q.shape[2] != k.shape[3] || k.shape[2] == 0 || q.shape[1] % k.shape[2] != 0 || k.shape[0] == 0 || k.shape[1] == 0 {
                    return Err(err(format!("heads/dims: q {} k {}", q.describe(), k.describe())));
                }
                Ok(q.clone())
            }
            Op::ArgmaxRows => {
                need(1)?;
                let l = f32_in(0)?;
                if l.shape.len() != 2 || l.shape[1] == 0 {
                    return Err(err(format!("logits {}", l.describe())));
                }
                Ok(TensorType::u32(&[l.shape[0]]))
            }
            Op::SampleRows => {
                need(3)?;
                let l = f32_in(0)?;
                let (p, r) = (u32_in(1)?, u32_in(2)?);
                if l.shape.len() != 2 || l.shape[1] == 0 || p.shape != [l.shape[0], SAMPLE_PARAMS] || r.shape.len() != 2 || r.shape[0] != l.shape[0] {
                    return Err(err(format!("logits {} params {} recent {}", l.describe(), p.describe(), r.describe())));
                }
                Ok(TensorType::u32(&[l.shape[0]]))
            }
            Op::Attention { .. } | Op::NormRopeAttention { .. } => {
                let q = match self {
                    Op::NormRopeAttention { norm, rotary_pairs, heads, append, .. } => {
                        let nw = if *norm == NormScale::None { 0 } else { 1 + append.is_some() as usize };
                        need(4 + nw)?;
                        let q = HeadRange::apply(*heads, f32_in(0)?).map_err(err)?;
                        if q.shape.len() != 3 || q.shape[2] % 2 != 0 || *rotary_pairs > q.shape[2] / 2 {
                            return Err(err(format!("q {} pairs {rotary_pairs}", q.describe())));
                        }
                        if let Some(i) = (4..4 + nw).find(|&i| inputs[i].shape != [q.shape[2]]) {
                            return Err(err(format!("weight {} for q {}", inputs[i].describe(), q.describe())));
                        }
                        if let Some(a) = append {
                            // the step's own rows: one token, heads of x shaped as the caches' rows
                            let k = HeadRange::apply(Some(a.k), f32_in(0)?).map_err(err)?;
                            let v = HeadRange::apply(Some(a.v), f32_in(0)?).map_err(err)?;
                            let c = f32_in(2)?;
                            if q.shape[0] != 1 || c.shape.len() != 3 || k.shape[1..] != c.shape[1..] || v.shape != k.shape {
                                return Err(err(format!("append: q {} k {} v {} cache {}", q.describe(), k.describe(), v.describe(), c.describe())));
                            }
                        }
                        q
                    }
                    _ => {
                        need(4)?;
                        f32_in(0)?.clone()
                    }
                };
                let q = &q;
                let p = u32_in(1)?;
                let k = f32_in(2)?;
                let v = f32_in(3)?;
                let spans = p.shape == [2, q.shape[0]];
                if q.shape.len() != 3 || k.shape.len() != 3 || k.shape != v.shape || (p.shape != [q.shape[0]] && !spans) {
                    return Err(err(format!("q {} k {} v {}", q.describe(), k.describe(), v.describe())));
                }
                if q.shape[2] != k.shape[2] || k.shape[1] == 0 || q.shape[1] % k.shape[1] != 0 {
                    return Err(err(format!("heads/dims: q {} k {}", q.describe(), k.describe())));
                }
                Ok(q.clone())
            }
            Op::Binary { .. } => {
                need(2)?;
                let a = f32_in(0)?;
                let b = f32_in(1)?;
                let suffix = b.shape.len() <= a.shape.len() && a.shape[a.shape.len() - b.shape.len()..] == b.shape[..];
                if !(suffix || b.shape == [1]) {
                    return Err(err(format!("cannot broadcast {} onto {}", b.describe(), a.describe())));
                }
                Ok(a.clone())
            }
            Op::Unary { .. } => {
                need(1)?;
                Ok(f32_in(0)?.clone())
            }
            Op::GeGlu => {
                need(2)?;
                let g = f32_in(0)?;
                let u = f32_in(1)?;
                if g.shape != u.shape {
                    return Err(err(format!("gate {} up {}", g.describe(), u.describe())));
                }
                Ok(g.clone())
            }
            Op::TopK { k } => {
                need(1)?;
                let l = f32_in(0)?;
                if l.shape.len() != 2 || *k == 0 || *k > l.shape[1] {
                    return Err(err(format!("k={k} of {}", l.describe())));
                }
                Ok(TensorType::u32(&[l.shape[0], *k]))
            }
            Op::TopKSoftmax => {
                if inputs.len() != 2 && inputs.len() != 3 {
                    return Err(err(format!("expects 2 or 3 inputs, got {}", inputs.len())));
                }
                let l = f32_in(0)?;
                let ids = u32_in(1)?;
                if l.shape.len() != 2 || ids.shape.len() != 2 || ids.shape[0] != l.shape[0] {
                    return Err(err(format!("logits {} ids {}", l.describe(), ids.describe())));
                }
                if inputs.len() == 3 && inputs[2].shape != [l.shape[1]] {
                    return Err(err(format!("scale {} for {} experts", inputs[2].describe(), l.shape[1])));
                }
                Ok(TensorType::f32(&ids.shape))
            }
            Op::WeightedSum => {
                need(2)?;
                let x = f32_in(0)?;
                let w = f32_in(1)?;
                if x.shape.len() != 3 || w.shape != x.shape[..2] {
                    return Err(err(format!("x {} w {}", x.describe(), w.describe())));
                }
                Ok(TensorType::f32(&[x.shape[0], x.shape[2]]))
            }
            Op::Reshape { shape } => {
                need(1)?;
                let x = inputs[0];
                if shape.iter().product::<usize>() != x.numel() {
                    return Err(err(format!("{} to {shape:?}", x.describe())));
                }
                Ok(TensorType { shape: shape.clone(), dtype: x.dtype })
            }
            Op::Slice { axis, start, len } => {
                need(1)?;
                let x = inputs[0];
                if *axis >= x.shape.len() || start + len > x.shape[*axis] || *len == 0 {
                    return Err(err(format!("{} axis {axis} [{start}, {})", x.describe(), start + len)));
                }
                let mut s = x.shape.clone();
                s[*axis] = *len;
                Ok(TensorType { shape: s, dtype: x.dtype })
            }
            Op::Argmax => {
                need(1)?;
                let l = f32_in(0)?;
                if l.shape.len() != 2 {
                    return Err(err(format!("logits {}", l.describe())));
                }
                Ok(TensorType::u32(&[1]))
            }
            Op::Clamp => {
                need(3)?;
                let x = f32_in(0)?;
                if inputs[1].numel() != 1 || inputs[2].numel() != 1 {
                    return Err(err(format!("bounds {} {} must be scalars", inputs[1].describe(), inputs[2].describe())));
                }
                Ok(x.clone())
            }
            Op::Rope2d { .. } => {
                need(3)?;
                let x = f32_in(0)?;
                let (px, py) = (u32_in(1)?, u32_in(2)?);
                if x.shape.len() != 3 || x.shape[2] % 4 != 0 || px.shape != [x.shape[0]] || py.shape != px.shape {
                    return Err(err(format!("x {} px {} py {}", x.describe(), px.describe(), py.describe())));
                }
                Ok(x.clone())
            }
            Op::FullAttention { .. } => {
                if inputs.len() != 3 && inputs.len() != 4 {
                    return Err(err(format!("expects 3 or 4 inputs, got {}", inputs.len())));
                }
                let q = f32_in(0)?;
                let k = f32_in(1)?;
                let v = f32_in(2)?;
                let ok = q.shape.len() == 3 && k.shape.len() == 3 && k.shape == v.shape && q.shape[2] == k.shape[2] && k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0;
                if !ok || k.shape[0] == 0 {
                    return Err(err(format!("q {} k {} v {}", q.describe(), k.describe(), v.describe())));
                }
                if inputs.len() == 4 && u32_in(3)?.shape != [k.shape[0]] {
                    return Err(err(format!("valid {} for {} keys", inputs[3].describe(), k.shape[0])));
                }
                Ok(q.clone())
            }
            Op::AvgPool { rows, cols, k } => {
                need(1)?;
                let x = f32_in(0)?;
                if x.shape.len() != 2 || x.shape[0] != rows * cols || *k == 0 || rows % k != 0 || cols % k != 0 {
                    return Err(err(format!("x {} as a {rows}x{cols} grid, k {k}", x.describe())));
                }
                Ok(TensorType::f32(&[(rows / k) * (cols / k), x.shape[1]]))
            }
            Op::LayerNorm { .. } => {
                if inputs.len() != 2 && inputs.len() != 3 {
                    return Err(err(format!("expects 2 or 3 inputs, got {}", inputs.len())));
                }
                let x = f32_in(0)?;
                if let Some(i) = (1..inputs.len()).find(|&i| inputs[i].shape != [x.last()]) {
                    return Err(err(format!("weight {} for x {}", inputs[i].describe(), x.describe())));
                }
                Ok(x.clone())
            }
            Op::Scatter => {
                need(3)?;
                let x = f32_in(0)?;
                let r = f32_in(1)?;
                let src = u32_in(2)?;
                if x.shape.len() != 2 || r.shape.len() != 2 || r.shape[1] != x.shape[1] || src.shape != [x.shape[0]] {
                    return Err(err(format!("x {} rows {} src {}", x.describe(), r.describe(), src.describe())));
                }
                Ok(x.clone())
            }
            Op::Conv2d { stride, pad, time_pad } => {
                need(2)?;
                let x = f32_in(0)?;
                let w = inputs[1];
                let ok = x.shape.len() == 3 && w.shape.len() == 4 && w.shape[3] == x.shape[2] && *stride > 0;
                let h = x.shape.first().map_or(0, |h| h + time_pad[0] + time_pad[1]);
                if !ok || h < w.shape[1] || x.shape[1] + 2 * pad < w.shape[2] {
                    return Err(err(format!("x {} w {}", x.describe(), w.describe())));
                }
                let ho = (h - w.shape[1]) / stride + 1;
                let wo = (x.shape[1] + 2 * pad - w.shape[2]) / stride + 1;
                Ok(TensorType::f32(&[ho, wo, w.shape[0]]))
            }
            Op::CumulativeGroupNorm { .. } => {
                need(2)?;
                let x = f32_in(0)?;
                if x.shape.len() != 3 || inputs[1].shape != [x.shape[2]] {
                    return Err(err(format!("x {} w {}", x.describe(), inputs[1].describe())));
                }
                Ok(x.clone())
            }
            Op::MaskRows => {
                need(2)?;
                let x = f32_in(0)?;
                let v = u32_in(1)?;
                if x.shape.is_empty() || v.shape != [x.shape[0]] {
                    return Err(err(format!("x {} valid {}", x.describe(), v.describe())));
                }
                Ok(x.clone())
            }
            Op::StridedRows { stride } => {
                need(1)?;
                let x = inputs[0];
                if x.shape.is_empty() || x.shape[0] == 0 || *stride == 0 {
                    return Err(err(format!("{} stride {stride}", x.describe())));
                }
                let mut s = x.shape.clone();
                s[0] = x.shape[0].div_ceil(*stride);
                Ok(TensorType { shape: s, dtype: x.dtype })
            }
            Op::Glu => {
                need(1)?;
                let x = f32_in(0)?;
                if x.last() % 2 != 0 || x.shape.is_empty() {
                    return Err(err(format!("{} has no even last dim", x.describe())));
                }
                let mut s = x.shape.clone();
                *s.last_mut().expect("non-empty") /= 2;
                Ok(TensorType::f32(&s))
            }
            Op::DepthwiseConv1d => {
                need(2)?;
                let x = f32_in(0)?;
                let w = inputs[1];
                if x.shape.len() != 2 || w.shape.len() != 3 || w.shape[0] != x.shape[1] || w.shape[2] != 1 || w.shape[1] == 0 {
                    return Err(err(format!("x {} w {}", x.describe(), w.describe())));
                }
                Ok(x.clone())
            }
            Op::AudioAttention { window, .. } => {
                need(6)?;
                let (q, k, v) = (f32_in(0)?, f32_in(1)?, f32_in(2)?);
                let valid = u32_in(3)?;
                let (pds, rel) = (inputs[4], inputs[5]);
                let ok = q.shape.len() == 3 && k.shape == q.shape && v.shape == q.shape && valid.shape == [q.shape[0]];
                if !ok || pds.shape != [q.shape[2]] || rel.shape.len() != 2 || rel.shape[0] != q.shape[1] * q.shape[2] || rel.shape[1] < 4 || *window == 0 {
                    return Err(err(format!("q {} k {} v {} valid {} per_dim_scale {} rel {}", q.describe(), k.describe(), v.describe(), valid.describe(), pds.describe(), rel.describe())));
                }
                Ok(q.clone())
            }
            Op::Sample => {
                need(3)?;
                let l = f32_in(0)?;
                let p = u32_in(1)?;
                let r = u32_in(2)?;
                if l.shape.len() != 2 || p.shape != [SAMPLE_PARAMS] || r.shape.len() != 1 {
                    return Err(err(format!("logits {} params {} recent {}", l.describe(), p.describe(), r.describe())));
                }
                Ok(TensorType::u32(&[1]))
            }
        }
    }
}

/// Output type of a gathered matmul `[x, ids, w]` (see [`Op::GatherMatMul`]).
fn gather_shape(x: &TensorType, ids: &TensorType, w: &TensorType) -> Result<TensorType, String> {
    if ids.shape.len() != 2 || w.shape.len() != 3 {
        return Err(format!("ids {} w {}", ids.describe(), w.describe()));
    }
    let (t, s) = (ids.shape[0], ids.shape[1]);
    let ok = match x.shape.as_slice() {
        [xt, xk] => *xt == t && *xk == w.shape[2],
        [xt, xs, xk] => *xt == t && *xs == s && *xk == w.shape[2],
        _ => false,
    };
    if !ok {
        return Err(format!("x {} ids {} w {}", x.describe(), ids.describe(), w.describe()));
    }
    Ok(TensorType::f32(&[t, s, w.shape[1]]))
}
