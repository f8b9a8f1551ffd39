//! Gemma 4 (`gemma4_text`, and the text model of `gemma4`): the Gemma 3 layout with norms in
//! the `w` convention, a weightless norm on V, per-layer head dims and KV heads, partial RoPE
//! on full layers, K = V on full layers (`attention_k_eq_v`), layers that read an earlier
//! layer's cache (KV sharing), per-layer inputs (PLE), a layer scalar, and an optional
//! mixture-of-experts block beside the dense MLP.

use crate::builder::{round_bf16, BuildOptions, WeightResolver};
use crate::config::{LayerType, ModelConfig};
use crate::ir::{BuildError, Graph};
use crate::ops::{NormScale, Op};
use petgraph::graph::NodeIndex;

use super::{rope_op, Spans, B};

pub fn build(cfg: &ModelConfig, res: &dyn WeightResolver, o: &BuildOptions) -> Result<Graph, BuildError> {
    let t = o.tokens;
    let (h, nq) = (cfg.hidden_size, cfg.num_heads);
    let nl = cfg.num_layers;
    let pd = cfg.hidden_size_per_layer_input;
    let (mut b, tokens) = B::new(cfg, res, o);
    let conv = NormScale::W;
    let k_const = |x: f32| if o.bf16_constants { round_bf16(x) } else { x };

    let emb = b.w("embed_tokens", None, &[cfg.vocab_size, h], true);
    let mut x = b.op("embed", None, Op::Embed { scale: k_const((h as f32).sqrt()), clamp: None }, &[tokens, emb])?;
    // image soft tokens take their rows, unscaled (the PLE projection reads the merged rows);
    // E2B/E4B decoders stay causal over them, 26B/31B's sliding layers see each image's span
    x = b.soft_rows(x, o, if cfg.vision_spans_sliding { Spans::SlidingLayers } else { Spans::Off })?;

    // Per-layer inputs: [T, L, Pd], one slice per layer.
    let pli = if pd > 0 {
        let tab = b.w("embed_tokens_per_layer", None, &[cfg.vocab_size_per_layer_input, nl * pd], true);
        let tok = b.op("ple_embed", None, Op::Embed { scale: k_const((pd as f32).sqrt()), clamp: None }, &[tokens, tab])?;
        let proj = b.linear("ple_proj", None, x, "per_layer_model_projection", nl * pd)?;
        let proj = b.scale("ple_proj_scale", None, proj, k_const((h as f32).powf(-0.5)))?;
        let proj = b.reshape("ple_proj_slots", None, proj, &[t, nl, pd])?;
        let proj = b.norm("ple_proj_norm", None, proj, Some("per_layer_projection_norm.weight"), conv)?;
        let tok = b.reshape("ple_embed_slots", None, tok, &[t, nl, pd])?;
        let sum = b.add("ple_sum", None, proj, tok)?;
        Some(b.scale("ple_inputs", None, sum, k_const(0.5f32.sqrt()))?)
    } else {
        None
    };

    // One-token graphs take every layer's slot up front: copies that depend on nothing a layer
    // computes, run back to back before the layers instead of one on each layer's path.
    let mut early_slots = vec![];
    if let (Some(pli), 1) = (pli, t) {
        for i in 0..nl {
            early_slots.push(ple_slot(&mut b, pli, i, &format!("ple_slot{i}"), None)?);
        }
    }

    let first_shared = cfg.first_shared_layer();
    let mut caches: Vec<Option<(NodeIndex, NodeIndex)>> = vec![None; nl];
    for i in 0..nl {
        let l = Some(i);
        let p = |s: &str| format!("layers.{i}.{s}");
        let full = cfg.layer_types[i] == LayerType::Full;
        let d = cfg.layer_head_dim(i);
        let nkv = cfg.layer_kv_heads(i);
        let xn = b.norm("input_norm", l, x, Some(&p("input_layernorm.weight")), conv)?;
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
        let rope = cfg.layer_rope(i);
        let pairs = if rope.partial < 1.0 { ((d as f64 * rope.partial) as usize) / 2 } else { d / 2 };
        let rope = rope_op(cfg, i, pairs);
        let q = b.norm_rope("q", l, pr[0], &p("self_attn.q_norm.weight"), conv, &rope)?;
        let kv = if own_kv {
            let v = if k_eq_v { pr[1] } else { pr[2] };
            let kv = b.kv_write(i, pr[1], &p("self_attn.k_norm.weight"), conv, &rope, v, true, b.slots(i, o))?;
            caches[i] = Some(kv);
            kv
        } else {
            let src = cfg.kv_source(i);
            caches[src].ok_or_else(|| BuildError::Config(format!("layer {i}: KV source layer {src} has no cache")))?
        };
        x = b.attention_block(i, x, q, kv, conv)?;

        let m = b.norm("pre_ff_norm", l, x, Some(&p("pre_feedforward_layernorm.weight")), conv)?;
        let mut u = b.mlp(i, m, cfg.layer_intermediate(i))?;
        if cfg.enable_moe_block {
            u = moe(&mut b, i, x, u, &k_const)?;
        }
        // the layer scalar multiplies the layer's last residual sum
        let ls = b.w(&p("layer_scalar"), l, &[1], false);
        let post_ff = p("post_feedforward_layernorm.weight");
        let Some(pli) = pli else {
            x = b.norm_add_scaled("ff_residual", l, u, x, &post_ff, conv, ls)?;
            continue;
        };
        x = b.norm_add("ff_residual", l, u, x, &post_ff, conv)?;
        let gate = b.linear("ple_gate", l, x, &p("per_layer_input_gate"), pd)?;
        let slot = match early_slots.get(i) {
            Some(&s) => s,
            None => ple_slot(&mut b, pli, i, "ple_slot", l)?,
        };
        // gelu(gate) * slot
        let gated = b.gelu_mul("ple_gelu_mul", l, gate, slot)?;
        let pr = b.linear("ple_projection", l, gated, &p("per_layer_projection"), h)?;
        x = b.norm_add_scaled("ple_residual", l, pr, x, &p("post_per_layer_input_norm.weight"), conv, ls)?;
    }
    b.head(x, emb, conv, o)
}

/// Layer `i`'s slot `[T, Pd]` of the per-layer inputs `pli` `[T, L, Pd]`.
fn ple_slot(b: &mut B, pli: NodeIndex, i: usize, name: &str, layer: Option<usize>) -> Result<NodeIndex, BuildError> {
    let t = b.g.tokens;
    let pd = b.g.node(pli).ty.last();
    let slot = b.op(name, layer, Op::Slice { axis: 1, start: i, len: 1 }, &[pli])?;
    b.reshape(&format!("{name}_flat"), layer, slot, &[t, pd])
}

/// The mixture-of-experts block of layer `i` beside the dense MLP's output `u`: the router
/// over the residual `x`, the top-k experts' GeGLU, their weighted sum, the two post-norms.
fn moe(b: &mut B, i: usize, x: NodeIndex, u: NodeIndex, k_const: &dyn Fn(f32) -> f32) -> Result<NodeIndex, BuildError> {
    let (l, cfg) = (Some(i), b.cfg);
    let p = |s: &str| format!("layers.{i}.{s}");
    let (h, t) = (cfg.hidden_size, b.g.tokens);
    let conv = NormScale::W;
    let e = cfg.num_experts.ok_or_else(|| BuildError::Config("MoE without num_experts".into()))?;
    let k = cfg.top_k_experts.ok_or_else(|| BuildError::Config("MoE without top_k_experts".into()))?;
    let im = cfg.moe_intermediate_size.ok_or_else(|| BuildError::Config("MoE without moe_intermediate_size".into()))?;
    let h1 = b.norm("post_ff_norm_1", l, u, Some(&p("post_feedforward_layernorm_1.weight")), conv)?;
    // Router: rms(h) * router.scale * H^-0.5, projected, top-k, softmax over the k.
    let z = b.norm("router_norm", l, x, Some(&p("router.scale")), conv)?;
    let z = b.scale("router_in", l, z, k_const((h as f32).powf(-0.5)))?;
    let logits = b.linear("router", l, z, &p("router.proj"), e)?;
    let ids = b.op("top_k", l, Op::TopK { k }, &[logits])?;
    let pes = b.w(&p("router.per_expert_scale"), l, &[e], false);
    let wgt = b.op("route_weights", l, Op::TopKSoftmax, &[logits, ids, pes])?;
    let x2 = b.norm("pre_ff_norm_2", l, x, Some(&p("pre_feedforward_layernorm_2.weight")), conv)?;
    let wg = b.w(&p("experts.switch_glu.gate_proj"), l, &[e, im, h], true);
    let wu = b.w(&p("experts.switch_glu.up_proj"), l, &[e, im, h], true);
    let wd = b.w(&p("experts.switch_glu.down_proj"), l, &[e, h, im], true);
    // Several tokens (or a batch's decode step, one row included: a row's sums the same at every
    // row count): the pairs are grouped by expert once, and each expert's weights are multiplied
    // with all its rows at once. One token of one sequence: a gathered GEMV.
    let groups = if t > 1 || b.batch > 0 { Some(b.op("expert_groups", l, Op::MoeGroup { experts: e }, &[ids])?) } else { None };
    let expert_mm = |b: &mut B, name: &str, x: NodeIndex, w: NodeIndex| match groups {
        Some(gr) => b.op(name, l, Op::GroupedMatMul, &[x, ids, w, gr]),
        None => b.op(name, l, Op::GatherMatMul, &[x, ids, w]),
    };
    let eg = expert_mm(b, "expert_gate", x2, wg)?;
    let eu = expert_mm(b, "expert_up", x2, wu)?;
    let egu = b.gelu_mul("expert_geglu", l, eg, eu)?;
    let ed = expert_mm(b, "expert_down", egu, wd)?;
    let h2 = b.op("expert_sum", l, Op::WeightedSum, &[ed, wgt])?;
    // h1 + norm(h2)
    b.norm_add("ff_sum", l, h2, h1, &p("post_feedforward_layernorm_2.weight"), conv)
}
