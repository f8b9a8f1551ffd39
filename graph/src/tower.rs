//! Vision towers as op graphs: Gemma 4's ViT over one image's patch grid, and Gemma 3's
//! SigLIP, through the pooled soft tokens and the projector into the text model's width.
//!
//! Inputs: `pixels` `f32[P, 3·patch²]` (the patches as the processor makes them, already
//! mapped to [-1, 1] by the host: `2x − 1`), `patch_x` and `patch_y` `u32[P]`. Outputs:
//! `soft` `[N, D_text]` (also `logits`, which executors expect, and `token`), and the
//! intermediates `patch_embed`, `layer<i>` `[P, hidden]` and `pooled` `[N, hidden]`.
//!
//! The audio towers of Gemma 4 and Gemma 3n are built here too ([`build_audio_tower`]), from
//! log-mel frames to their soft tokens.

use petgraph::graph::NodeIndex;

use crate::builder::WeightResolver;
use crate::ir::{BuildError, Graph, GraphKind, InputKind, WeightParam};
use crate::ops::{BinaryOp, NormScale, Op, TensorType, UnaryOp};
use crate::audio::{AudioConfig, AudioKind};
use crate::vision::{TowerKind, VisionConfig};

/// Name of the half of Gemma 4's `[2, N, hidden]` position table holding the x rows (`.x`)
/// or the y rows (`.y`), each a `[N, hidden]` table the loader serves from the stored one.
pub const POSITION_TABLE: &str = "vision_tower.patch_embedder.position_embedding_table";

struct T<'a> {
    g: Graph,
    res: &'a dyn WeightResolver,
    /// Whether the tower's clippable linears clip.
    clip: bool,
    /// Prefix of node names (`v`: vision, `a`: audio).
    tag: char,
}

impl T<'_> {
    fn w(&mut self, name: &str, shape: &[usize], module: bool, layer: Option<usize>) -> NodeIndex {
        let format = self.res.format(name, shape, module);
        let label = name.rsplit_once("layers.").map_or(name, |(_, r)| r).to_string();
        self.g.weight(&label, layer, WeightParam { name: name.to_string(), shape: shape.to_vec(), format, module })
    }

    fn op(&mut self, name: &str, layer: Option<usize>, op: Op, ins: &[NodeIndex]) -> Result<NodeIndex, BuildError> {
        let tag = self.tag;
        let name = match layer {
            Some(l) => format!("{tag}{l}.{name}"),
            None => format!("{tag}.{name}"),
        };
        self.g.op(&name, layer, op, ins)
    }

    /// `x @ W^T` of the module `p` (`[out, in]`). `clippable`: one of the encoder's clippable
    /// linears (the module is `p.linear`), between its input and output clips when the tower
    /// clips them.
    fn linear(&mut self, x: NodeIndex, p: &str, out: usize, clippable: bool, layer: Option<usize>) -> Result<NodeIndex, BuildError> {
        let inn = self.g.node(x).ty.last();
        let short = p.rsplit('.').next().unwrap_or(p).to_string();
        let clip = |t: &mut Self, x: NodeIndex, which: &str| -> Result<NodeIndex, BuildError> {
            let lo = t.w(&format!("{p}.{which}_min"), &[], false, layer);
            let hi = t.w(&format!("{p}.{which}_max"), &[], false, layer);
            t.op(&format!("{short}_{which}_clip"), layer, Op::Clamp, &[x, lo, hi])
        };
        let clipped = clippable && self.clip;
        let x = if clipped { clip(self, x, "input")? } else { x };
        let wname = if clippable { format!("{p}.linear") } else { p.to_string() };
        let w = self.w(&wname, &[out, inn], true, layer);
        let y = self.op(&short, layer, Op::MatMul, &[x, w])?;
        if clipped {
            clip(self, y, "output")
        } else {
            Ok(y)
        }
    }

    fn norm(&mut self, name: &str, x: NodeIndex, w: Option<&str>, eps: f32, layer: Option<usize>) -> Result<NodeIndex, BuildError> {
        let d = self.g.node(x).ty.last();
        match w {
            Some(w) => {
                let wn = self.w(w, &[d], false, layer);
                self.op(name, layer, Op::RmsNorm { eps, scale: NormScale::W }, &[x, wn])
            }
            None => self.op(name, layer, Op::RmsNorm { eps, scale: NormScale::None }, &[x]),
        }
    }
}

/// SigLIP's conv patch embedding (`.weight` `[hidden, kh, kw, 3]`, `.bias`); the graph reads
/// the weight as the matrix `<this>.matrix` `[hidden, kh·kw·3]`.
pub const SIGLIP_PATCH: &str = "vision_tower.vision_model.embeddings.patch_embedding";
/// Gemma 3's projector `[hidden, D]` (`y = x W`), and the `[D, hidden]` linear the graph reads.
pub const GEMMA3_PROJECTOR: &str = "multi_modal_projector.mm_input_projection_weight";
pub const GEMMA3_PROJECTOR_LINEAR: &str = "multi_modal_projector.mm_input_projection";

/// Gemma 3's SigLIP tower over its square input (`image_size / patch` patches a side), 4x4 (in
/// general `pool`) average pooling and the projector. Inputs: `pixels` `f32[P, 3·patch²]`
/// (normalised patches, (py, px, c) order) and `positions` `u32[P]` (the patch indices).
pub fn build_siglip_tower(vc: &VisionConfig, res: &dyn WeightResolver) -> Result<Graph, BuildError> {
    if vc.kind != TowerKind::Siglip {
        return Err(BuildError::Config(format!("{} is not a SigLIP tower", vc.kind.name())));
    }
    let side = vc.grid_side();
    let p = side * side;
    let (h, hd, heads) = (vc.hidden, vc.head_dim, vc.heads);
    let eps = vc.eps as f32;
    let mut t = T { g: Graph::new(p, GraphKind::Prefill), res, clip: vc.clipped, tag: 'v' };
    let k = vc.patch * vc.patch * 3;
    let pix = t.g.input("pixels", InputKind::Pixels, TensorType::f32(&[p, k]));
    let pos = t.g.input("positions", InputKind::Positions, TensorType::u32(&[p]));
    let vm = "vision_tower.vision_model";
    let biased = |t: &mut T, x: NodeIndex, name: &str, module: &str, out: usize, l: Option<usize>| -> Result<NodeIndex, BuildError> {
        let y = t.linear(x, module, out, false, l)?;
        let b = t.w(&format!("{module}.bias"), &[out], false, l);
        t.op(name, l, Op::Binary { f: BinaryOp::Add }, &[y, b])
    };
    let ln = |t: &mut T, x: NodeIndex, name: &str, module: &str, l: Option<usize>| -> Result<NodeIndex, BuildError> {
        let w = t.w(&format!("{module}.weight"), &[h], false, l);
        let b = t.w(&format!("{module}.bias"), &[h], false, l);
        t.op(name, l, Op::LayerNorm { eps }, &[x, w, b])
    };
    let w = t.w(&format!("{SIGLIP_PATCH}.matrix"), &[h, k], true, None);
    let e = t.op("patch_matmul", None, Op::MatMul, &[pix, w])?;
    let b = t.w(&format!("{SIGLIP_PATCH}.bias"), &[h], false, None);
    let e = t.op("patch_bias", None, Op::Binary { f: BinaryOp::Add }, &[e, b])?;
    let table = t.w(&format!("{vm}.embeddings.position_embedding"), &[vc.position_table, h], true, None);
    let pe = t.op("positions", None, Op::Embed { scale: 1.0, clamp: None }, &[pos, table])?;
    let mut x = t.op("patch_embed", None, Op::Binary { f: BinaryOp::Add }, &[e, pe])?;
    t.g.set_output("patch_embed", x);
    for i in 0..vc.layers {
        let l = Some(i);
        let pre = format!("{vm}.encoder.layers.{i}");
        let a = ln(&mut t, x, "ln1", &format!("{pre}.layer_norm1"), l)?;
        let mut qkv = vec![];
        for n in ["q", "k", "v"] {
            let y = biased(&mut t, a, &format!("{n}_proj"), &format!("{pre}.self_attn.{n}_proj"), heads * hd, l)?;
            qkv.push(t.op(&format!("{n}_heads"), l, Op::Reshape { shape: vec![p, heads, hd] }, &[y])?);
        }
        let o = t.op("attention", l, Op::FullAttention { scale: (hd as f32).powf(-0.5) }, &qkv)?;
        let o = t.op("attn_flat", l, Op::Reshape { shape: vec![p, heads * hd] }, &[o])?;
        let o = biased(&mut t, o, "out_proj", &format!("{pre}.self_attn.out_proj"), h, l)?;
        x = t.op("attn_residual", l, Op::Binary { f: BinaryOp::Add }, &[x, o])?;
        let a = ln(&mut t, x, "ln2", &format!("{pre}.layer_norm2"), l)?;
        let m = biased(&mut t, a, "fc1", &format!("{pre}.mlp.fc1"), vc.intermediate, l)?;
        let m = t.op("gelu", l, Op::Unary { f: UnaryOp::Gelu }, &[m])?;
        let m = biased(&mut t, m, "fc2", &format!("{pre}.mlp.fc2"), h, l)?;
        x = t.op("mlp_residual", l, Op::Binary { f: BinaryOp::Add }, &[x, m])?;
        t.g.set_output(&format!("layer{i}"), x);
    }
    let post = ln(&mut t, x, "post_ln", &format!("{vm}.post_layernorm"), None)?;
    t.g.set_output("post_ln", post);
    let pooled = t.op("pooled", None, Op::AvgPool { rows: side, cols: side, k: vc.pool }, &[post])?;
    t.g.set_output("pooled", pooled);
    let nw = t.w("multi_modal_projector.mm_soft_emb_norm.weight", &[h], false, None);
    let n = t.op("soft_norm", None, Op::RmsNorm { eps, scale: NormScale::OnePlusW }, &[pooled, nw])?;
    let soft = t.linear(n, GEMMA3_PROJECTOR_LINEAR, vc.text_hidden, false, None)?;
    finish(t, soft)
}

/// Sets the soft tokens as the graph's `soft` output (and as the `logits` and `token`
/// executors expect).
fn finish(mut t: T, soft: NodeIndex) -> Result<Graph, BuildError> {
    t.g.set_output("soft", soft);
    t.g.set_output("logits", soft);
    let tok = t.op("argmax", None, Op::Argmax, &[soft])?;
    t.g.set_output("token", tok);
    Ok(t.g)
}

/// The graph of Gemma 4's vision tower over a `rows x cols` patch grid (both multiples of the
/// pooling kernel).
pub fn build_gemma4_tower(vc: &VisionConfig, res: &dyn WeightResolver, rows: usize, cols: usize) -> Result<Graph, BuildError> {
    if vc.kind != TowerKind::Gemma4Vit {
        return Err(BuildError::Config(format!("{} is not Gemma 4's vision tower", vc.kind.name())));
    }
    if vc.standardize {
        return Err(BuildError::Config("vision towers with standardize (Gemma 4 26B/31B) are not supported yet".into()));
    }
    let k = vc.pool;
    if rows == 0 || cols == 0 || rows % k != 0 || cols % k != 0 {
        return Err(BuildError::Config(format!("a {rows}x{cols} patch grid does not pool by {k}x{k}")));
    }
    if rows > vc.position_table || cols > vc.position_table {
        return Err(BuildError::Config(format!("a {rows}x{cols} patch grid exceeds the position table ({} rows)", vc.position_table)));
    }
    let p = rows * cols;
    let (h, hd, heads) = (vc.hidden, vc.head_dim, vc.heads);
    let eps = vc.eps as f32;
    let mut t = T { g: Graph::new(p, GraphKind::Prefill), res, clip: vc.clipped, tag: 'v' };
    let pix = t.g.input("pixels", InputKind::Pixels, TensorType::f32(&[p, vc.patch * vc.patch * 3]));
    let px = t.g.input("patch_x", InputKind::PatchX, TensorType::u32(&[p]));
    let py = t.g.input("patch_y", InputKind::PatchY, TensorType::u32(&[p]));

    let emb = t.linear(pix, "vision_tower.patch_embedder.input_proj", h, false, None)?;
    let tx = t.w(&format!("{POSITION_TABLE}.x"), &[vc.position_table, h], true, None);
    let ty = t.w(&format!("{POSITION_TABLE}.y"), &[vc.position_table, h], true, None);
    let ex = t.op("pos_x", None, Op::Embed { scale: 1.0, clamp: None }, &[px, tx])?;
    let ey = t.op("pos_y", None, Op::Embed { scale: 1.0, clamp: None }, &[py, ty])?;
    let pos = t.op("pos", None, Op::Binary { f: BinaryOp::Add }, &[ex, ey])?;
    let mut x = t.op("patch_embed", None, Op::Binary { f: BinaryOp::Add }, &[emb, pos])?;
    t.g.set_output("patch_embed", x);

    for i in 0..vc.layers {
        let l = Some(i);
        let pre = format!("vision_tower.encoder.layers.{i}");
        let a = t.norm("input_norm", x, Some(&format!("{pre}.input_layernorm.weight")), eps, l)?;
        let mut qkv = vec![];
        for (n, norm) in [("q", true), ("k", true), ("v", false)] {
            let y = t.linear(a, &format!("{pre}.self_attn.{n}_proj"), heads * hd, true, l)?;
            let y = t.op(&format!("{n}_heads"), l, Op::Reshape { shape: vec![p, heads, hd] }, &[y])?;
            let y = if norm {
                let y = t.norm(&format!("{n}_norm"), y, Some(&format!("{pre}.self_attn.{n}_norm.weight")), eps, l)?;
                t.op(&format!("{n}_rope"), l, Op::Rope2d { theta: vc.rope_theta as f32 }, &[y, px, py])?
            } else {
                t.norm("v_norm", y, None, eps, l)?
            };
            qkv.push(y);
        }
        let o = t.op("attention", l, Op::FullAttention { scale: 1.0 }, &qkv)?;
        let o = t.op("attn_flat", l, Op::Reshape { shape: vec![p, heads * hd] }, &[o])?;
        let o = t.linear(o, &format!("{pre}.self_attn.o_proj"), h, true, l)?;
        let o = t.norm("post_attn_norm", o, Some(&format!("{pre}.post_attention_layernorm.weight")), eps, l)?;
        x = t.op("attn_residual", l, Op::Binary { f: BinaryOp::Add }, &[x, o])?;
        let a = t.norm("pre_ffw_norm", x, Some(&format!("{pre}.pre_feedforward_layernorm.weight")), eps, l)?;
        let gate = t.linear(a, &format!("{pre}.mlp.gate_proj"), vc.intermediate, true, l)?;
        let up = t.linear(a, &format!("{pre}.mlp.up_proj"), vc.intermediate, true, l)?;
        let gate = t.op("gelu", l, Op::Unary { f: UnaryOp::Gelu }, &[gate])?;
        let m = t.op("geglu", l, Op::Binary { f: BinaryOp::Mul }, &[gate, up])?;
        let m = t.linear(m, &format!("{pre}.mlp.down_proj"), h, true, l)?;
        let m = t.norm("post_ffw_norm", m, Some(&format!("{pre}.post_feedforward_layernorm.weight")), eps, l)?;
        x = t.op("ffw_residual", l, Op::Binary { f: BinaryOp::Add }, &[x, m])?;
        t.g.set_output(&format!("layer{i}"), x);
    }

    let pooled = t.op("pool", None, Op::AvgPool { rows, cols, k }, &[x])?;
    let pooled = t.op("pooled", None, Op::Unary { f: UnaryOp::Scale { factor: (h as f32).sqrt() } }, &[pooled])?;
    t.g.set_output("pooled", pooled);
    let s = t.norm("soft_norm", pooled, None, eps, None)?;
    let soft = t.linear(s, "embed_vision.embedding_projection", vc.text_hidden, false, None)?;
    finish(t, soft)
}

/// Names of a conformer block's tensors (under `<prefix>.<i>.`) and how the towers' blocks
/// differ.
struct Conformer {
    prefix: &'static str,
    ffw: [&'static str; 2],
    pre_attn_norm: &'static str,
    /// Holds `q_proj`, `k_proj`, `v_proj` and `per_dim_scale`.
    attn: &'static str,
    rel: &'static str,
    post: &'static str,
    post_norm: &'static str,
    out_norm: &'static str,
    /// Gemma 4's clippable linears (the modules are `<name>.linear`).
    clippable: bool,
    key_scale: f32,
}

const GEMMA4_BLOCK: Conformer = Conformer {
    prefix: "audio_tower.layers",
    ffw: ["feed_forward1", "feed_forward2"],
    pre_attn_norm: "norm_pre_attn",
    attn: "self_attn",
    rel: "self_attn.relative_k_proj",
    post: "self_attn.post",
    post_norm: "norm_post_attn",
    out_norm: "norm_out",
    clippable: true,
    // ln(1 + e) / ln 2, in f32 as the references compute it
    key_scale: 1.894_636_1,
};

const GEMMA3N_BLOCK: Conformer = Conformer {
    prefix: "audio_tower.conformer",
    ffw: ["ffw_layer_start", "ffw_layer_end"],
    pre_attn_norm: "attention.pre_attn_norm",
    attn: "attention.attn",
    rel: "attention.attn.relative_position_embedding.pos_proj",
    post: "attention.post",
    post_norm: "attention.post_norm",
    out_norm: "norm",
    clippable: false,
    key_scale: 1.0,
};

impl T<'_> {
    /// Conformer block `i` over `x` (`[T, hidden]`): half-step feed-forward, local
    /// relative-position attention, padded rows zeroed, light conv (GLU, causal depthwise
    /// conv), half-step feed-forward, output norm.
    fn conformer(&mut self, ac: &AudioConfig, b: &Conformer, i: usize, x: NodeIndex, valid: NodeIndex) -> Result<NodeIndex, BuildError> {
        let (h, heads, hd) = (ac.hidden, ac.heads, ac.head_dim());
        let rows = self.g.node(x).ty.shape[0];
        let eps = ac.eps as f32;
        let l = Some(i);
        let pre = format!("{}.{i}", b.prefix);
        let norm = |t: &mut Self, name: &str, x: NodeIndex, w: &str| t.norm(name, x, Some(&format!("{pre}.{w}.weight")), eps, l);
        let ffn = |t: &mut Self, x: NodeIndex, ff: &str| -> Result<NodeIndex, BuildError> {
            let y = norm(t, &format!("{ff}_pre_norm"), x, &format!("{ff}.pre_layer_norm"))?;
            let y = t.linear(y, &format!("{pre}.{ff}.ffw_layer_1"), 4 * h, b.clippable, l)?;
            let y = t.op(&format!("{ff}_silu"), l, Op::Unary { f: UnaryOp::Silu }, &[y])?;
            let y = t.linear(y, &format!("{pre}.{ff}.ffw_layer_2"), h, b.clippable, l)?;
            let y = norm(t, &format!("{ff}_post_norm"), y, &format!("{ff}.post_layer_norm"))?;
            let y = t.op(&format!("{ff}_scaled"), l, Op::Unary { f: UnaryOp::Scale { factor: ac.residual_weight } }, &[y])?;
            t.op(&format!("{ff}_residual"), l, Op::Binary { f: BinaryOp::Add }, &[x, y])
        };
        let mut x = ffn(self, x, b.ffw[0])?;

        let a = norm(self, "pre_attn_norm", x, b.pre_attn_norm)?;
        let mut qkv = vec![];
        for n in ["q", "k", "v"] {
            let y = self.linear(a, &format!("{pre}.{}.{n}_proj", b.attn), h, b.clippable, l)?;
            qkv.push(self.op(&format!("{n}_heads"), l, Op::Reshape { shape: vec![rows, heads, hd] }, &[y])?);
        }
        let pds = self.w(&format!("{pre}.{}.per_dim_scale", b.attn), &[hd], false, l);
        let rel = self.w(&format!("{pre}.{}", b.rel), &[h, h], true, l);
        let op = Op::AudioAttention { window: ac.window, softcap: ac.logit_cap, key_scale: b.key_scale };
        let o = self.op("attention", l, op, &[qkv[0], qkv[1], qkv[2], valid, pds, rel])?;
        let o = self.op("attn_flat", l, Op::Reshape { shape: vec![rows, h] }, &[o])?;
        let o = self.linear(o, &format!("{pre}.{}", b.post), h, b.clippable, l)?;
        let o = norm(self, "post_attn_norm", o, b.post_norm)?;
        let y = self.op("attn_residual", l, Op::Binary { f: BinaryOp::Add }, &[x, o])?;
        x = self.op("attn_masked", l, Op::MaskRows, &[y, valid])?;

        let y = norm(self, "lconv_pre_norm", x, "lconv1d.pre_layer_norm")?;
        let y = self.linear(y, &format!("{pre}.lconv1d.linear_start"), 2 * h, b.clippable, l)?;
        let y = self.op("glu", l, Op::Glu, &[y])?;
        let cw = self.w(&format!("{pre}.lconv1d.depthwise_conv1d.weight"), &[h, ac.conv_kernel, 1], false, l);
        let y = self.op("depthwise_conv1d", l, Op::DepthwiseConv1d, &[y, cw])?;
        let y = norm(self, "conv_norm", y, "lconv1d.conv_norm")?;
        let y = self.op("lconv_silu", l, Op::Unary { f: UnaryOp::Silu }, &[y])?;
        let y = self.linear(y, &format!("{pre}.lconv1d.linear_end"), h, b.clippable, l)?;
        x = self.op("lconv_residual", l, Op::Binary { f: BinaryOp::Add }, &[x, y])?;

        x = ffn(self, x, b.ffw[1])?;
        norm(self, "out_norm", x, b.out_norm)
    }

    /// The subsampling input projection of `x` (`[T, F, C]` flattened to `[T, F·C]`).
    fn subsample_proj(&mut self, ac: &AudioConfig, x: NodeIndex, module: &str) -> Result<NodeIndex, BuildError> {
        let s = self.g.node(x).ty.shape.clone();
        let x = self.op("sscp_flat", None, Op::Reshape { shape: vec![s[0], s[1] * s[2]] }, &[x])?;
        let x = self.linear(x, module, ac.hidden, false, None)?;
        self.g.set_output("subsample", x);
        Ok(x)
    }
}

/// The audio tower graph of the checkpoint's family over `frames` log-mel frames.
pub fn build_audio_tower(ac: &AudioConfig, res: &dyn WeightResolver, frames: usize) -> Result<Graph, BuildError> {
    match ac.kind {
        AudioKind::Gemma4 => build_gemma4_audio_tower(ac, res, frames),
        AudioKind::Gemma3n => build_gemma3n_audio_tower(ac, res, frames),
    }
}

/// The graph of Gemma 4's audio tower over `frames` log-mel frames, through `embed_audio`.
/// Inputs: `features` `f32[T, 128]` and `valid` `u32[T]` (1: a real frame). Outputs: `soft`
/// `[T'', D_text]` (T'' = ceil(ceil(T/2)/2); rows of padded frames are not soft tokens), the
/// intermediates `sscp0` `[T', 64, C0]`, `sscp1` `[T'', 32, C1]`, `subsample` and `block<i>`
/// `[T'', hidden]`, `encoder` `[T'', output_dims]` (padded rows zeroed), and `valid_rows`
/// `u32[T'']`.
pub fn build_gemma4_audio_tower(ac: &AudioConfig, res: &dyn WeightResolver, frames: usize) -> Result<Graph, BuildError> {
    if frames == 0 {
        return Err(BuildError::Config("an audio clip of no frames".into()));
    }
    if ac.kind != AudioKind::Gemma4 {
        return Err(BuildError::Config("not Gemma 4's audio tower".into()));
    }
    let eps = ac.eps as f32;
    let rows = AudioConfig::rows(frames);
    let mut t = T { g: Graph::new(rows, GraphKind::Prefill), res, clip: ac.clipped, tag: 'a' };
    let feats = t.g.input("features", InputKind::AudioFeatures, TensorType::f32(&[frames, ac.features]));
    let mut valid = t.g.input("valid", InputKind::AudioValid, TensorType::u32(&[frames]));

    // subsampling: (mask, 3x3 stride-2 conv, channel LayerNorm, ReLU) twice, then a linear
    let sc = "audio_tower.subsample_conv_projection";
    let mut x = t.op("features_3d", None, Op::Reshape { shape: vec![frames, ac.features, 1] }, &[feats])?;
    for (i, c) in ac.conv_channels.into_iter().enumerate() {
        let cin = t.g.node(x).ty.last();
        let m = t.op(&format!("sscp{i}_masked"), None, Op::MaskRows, &[x, valid])?;
        let w = t.w(&format!("{sc}.layer{i}.conv.weight"), &[c, 3, 3, cin], false, None);
        let y = t.op(&format!("sscp{i}_conv"), None, Op::Conv2d { stride: 2, pad: 1, time_pad: [1, 1] }, &[m, w])?;
        let nw = t.w(&format!("{sc}.layer{i}.norm.weight"), &[c], false, None);
        let y = t.op(&format!("sscp{i}_norm"), None, Op::LayerNorm { eps }, &[y, nw])?;
        x = t.op(&format!("sscp{i}"), None, Op::Unary { f: UnaryOp::Relu }, &[y])?;
        t.g.set_output(&format!("sscp{i}"), x);
        valid = t.op(&format!("sscp{i}_valid"), None, Op::StridedRows { stride: 2 }, &[valid])?;
    }
    t.g.set_output("valid_rows", valid);
    let mut x = t.subsample_proj(ac, x, &format!("{sc}.input_proj_linear"))?;
    for i in 0..ac.layers {
        x = t.conformer(ac, &GEMMA4_BLOCK, i, x, valid)?;
        t.g.set_output(&format!("block{i}"), x);
    }

    let y = t.linear(x, "audio_tower.output_proj", ac.output_dims, false, None)?;
    let b = t.w("audio_tower.output_proj.bias", &[ac.output_dims], false, None);
    let y = t.op("output_bias", None, Op::Binary { f: BinaryOp::Add }, &[y, b])?;
    let enc = t.op("encoder", None, Op::MaskRows, &[y, valid])?;
    t.g.set_output("encoder", enc);
    let s = t.norm("soft_norm", enc, None, eps, None)?;
    let soft = t.linear(s, "embed_audio.embedding_projection", ac.text_hidden, false, None)?;
    finish(t, soft)
}

/// The graph of Gemma 3n's audio tower over `frames` log-mel frames, through `embed_audio`
/// and the clip's padding slots. Inputs: `features` `f32[T, F]`, `valid` `u32[T]` (1: a real
/// frame), `tokens` `u32[S]` (S = `soft_slots`: each slot's row of `embed_audio.embedding`,
/// `pad_row` for HF's padding) and `soft_index` `u32[S]` (each slot's encoder row plus one, 0
/// for a padding slot). Outputs: `soft` `[S, D_text]`; the intermediates `sscp0`
/// `[T1, F/2, C0]`, `sscp1` `[T2, F/4, C1]`, `subsample` and `block<i>` `[T2, hidden]`
/// (T1 = ceil(T/2), T2 = ceil(T1/2)), `encoder` `[R, hidden]` (every `reduction`-th row,
/// R = ceil(T2/reduction), padded rows zeroed), `embedded` `[R, D_text]` (the encoder rows
/// through `embed_audio`) and `valid_rows` `u32[R]`.
pub fn build_gemma3n_audio_tower(ac: &AudioConfig, res: &dyn WeightResolver, frames: usize) -> Result<Graph, BuildError> {
    if frames == 0 {
        return Err(BuildError::Config("an audio clip of no frames".into()));
    }
    if ac.kind != AudioKind::Gemma3n {
        return Err(BuildError::Config("not Gemma 3n's audio tower".into()));
    }
    let out_rows = ac.encoder_rows(frames);
    if out_rows > ac.soft_slots {
        return Err(BuildError::Config(format!("an audio clip of {frames} frames makes {out_rows} soft tokens, over the {} a clip takes", ac.soft_slots)));
    }
    let eps = ac.eps as f32;
    let slots = ac.soft_slots;
    let mut t = T { g: Graph::new(slots, GraphKind::Prefill), res, clip: false, tag: 'a' };
    let feats = t.g.input("features", InputKind::AudioFeatures, TensorType::f32(&[frames, ac.features]));
    let valid = t.g.input("valid", InputKind::AudioValid, TensorType::u32(&[frames]));
    let ids = t.g.input("tokens", InputKind::Tokens, TensorType::u32(&[slots]));
    let index = t.g.input("soft_index", InputKind::SoftIndex, TensorType::u32(&[slots]));

    // subsampling: (3x3 stride-2 conv padded 0 above and 2 below, cumulative group norm over
    // every frame, ReLU) twice, then a linear; nothing masked
    let sc = "audio_tower.subsample_conv_projection";
    let mut x = t.op("features_3d", None, Op::Reshape { shape: vec![frames, ac.features, 1] }, &[feats])?;
    for (i, c) in ac.conv_channels.into_iter().enumerate() {
        let cin = t.g.node(x).ty.last();
        let w = t.w(&format!("{sc}.conv_{i}.conv.weight"), &[c, 3, 3, cin], false, None);
        let y = t.op(&format!("sscp{i}_conv"), None, Op::Conv2d { stride: 2, pad: 1, time_pad: [0, 2] }, &[x, w])?;
        let nw = t.w(&format!("{sc}.conv_{i}.norm.weight"), &[c], false, None);
        let y = t.op(&format!("sscp{i}_norm"), None, Op::CumulativeGroupNorm { eps: ac.group_norm_eps as f32 }, &[y, nw])?;
        x = t.op(&format!("sscp{i}"), None, Op::Unary { f: UnaryOp::Relu }, &[y])?;
        t.g.set_output(&format!("sscp{i}"), x);
    }
    let mut x = t.subsample_proj(ac, x, &format!("{sc}.input_proj_linear"))?;
    // a subsampled row is real where its first frame is (`valid[4t]`)
    let valid = t.op("sscp_valid", None, Op::StridedRows { stride: 4 }, &[valid])?;
    t.g.set_output("sscp_valid", valid);
    for i in 0..ac.layers {
        x = t.conformer(ac, &GEMMA3N_BLOCK, i, x, valid)?;
        t.g.set_output(&format!("block{i}"), x);
    }

    let (x, valid) = if ac.reduction > 1 {
        let x = t.op("reduced", None, Op::StridedRows { stride: ac.reduction }, &[x])?;
        (x, t.op("reduced_valid", None, Op::StridedRows { stride: ac.reduction }, &[valid])?)
    } else {
        (x, valid)
    };
    t.g.set_output("valid_rows", valid);
    let enc = t.op("encoder", None, Op::MaskRows, &[x, valid])?;
    t.g.set_output("encoder", enc);
    // embed_audio: soft rows from the encoder, hard rows (the padding slots') from the table
    let project = |t: &mut T, name: &str, x: NodeIndex, norm: &str| -> Result<NodeIndex, BuildError> {
        let y = t.norm(&format!("{name}_norm"), x, Some(&format!("embed_audio.{norm}.weight")), eps, None)?;
        let y = t.linear(y, "embed_audio.embedding_projection", ac.text_hidden, false, None)?;
        t.norm(&format!("{name}_post_norm"), y, None, eps, None)
    };
    let embedded = project(&mut t, "embedded", enc, "soft_embedding_norm")?;
    t.g.set_output("embedded", embedded);
    let table = t.w("embed_audio.embedding", &[ac.vocab_size, ac.hidden], true, None);
    let hard = t.op("hard", None, Op::Embed { scale: 1.0, clamp: None }, &[ids, table])?;
    let hard = project(&mut t, "hard", hard, "hard_embedding_norm")?;
    let soft = t.op("slots", None, Op::Scatter, &[hard, embedded, index])?;
    finish(t, soft)
}
