//! Gemma 3 (`gemma3_text`, and the text model of `gemma3`): a scaled embedding, layers of
//! q/k-normed attention (sliding and full, each with its own RoPE) and a GeGLU MLP, every
//! block between a pre-norm and a post-norm in the `1 + w` convention, and a tied head.

use crate::builder::{round_bf16, BuildOptions, WeightResolver};
use crate::config::ModelConfig;
use crate::ir::{BuildError, Graph};
use crate::ops::{NormScale, Op};

use super::{rope_op, Spans, B};

pub fn build(cfg: &ModelConfig, res: &dyn WeightResolver, o: &BuildOptions) -> Result<Graph, BuildError> {
    let (h, nq, d) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim);
    let (mut b, tokens) = B::new(cfg, res, o);
    let conv = NormScale::OnePlusW;

    let emb = b.w("embed_tokens", None, &[cfg.vocab_size, h], true);
    // Gemma 3 scales the embedding by bf16(sqrt(H)) whatever the weights' dtype.
    let scale = round_bf16((h as f32).sqrt());
    let mut x = b.op("embed", None, Op::Embed { scale, clamp: None }, &[tokens, emb])?;
    // image soft tokens unscaled; each image's span attends to itself bidirectionally (HF)
    x = b.soft_rows(x, o, Spans::AllLayers)?;

    for i in 0..cfg.num_layers {
        let l = Some(i);
        let p = |s: &str| format!("layers.{i}.{s}");
        let nkv = cfg.layer_kv_heads(i);
        let xn = b.norm("input_norm", l, x, Some(&p("input_layernorm.weight")), conv)?;
        let pr = b.projections(i, xn, d, &[("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)])?;
        let rope = rope_op(cfg, i, d / 2);
        let q = b.norm_rope("q", l, pr[0], &p("self_attn.q_norm.weight"), conv, &rope)?;
        let kv = b.kv_write(i, pr[1], &p("self_attn.k_norm.weight"), conv, &rope, pr[2], false, b.slots(i, o))?;
        x = b.attention_block(i, x, q, kv, conv)?;
        let m = b.norm("pre_ff_norm", l, x, Some(&p("pre_feedforward_layernorm.weight")), conv)?;
        let dn = b.mlp(i, m, cfg.layer_intermediate(i))?;
        x = b.norm_add("ff_residual", l, dn, x, &p("post_feedforward_layernorm.weight"), conv)?;
    }
    b.head(x, emb, conv, o)
}
