//! Synthetic models for benchmarks: real Gemma shapes, random weights in MLX's
//! quantized layout (affine 4-bit g64 by default, router 8-bit), held in memory.
//! They read the same bytes per token as a real checkpoint of that shape.

use rayon::prelude::*;
use serde_json::json;

use markbase_graph::builder::{BuildOptions, WeightResolver};
use markbase_graph::config::ModelConfig;
use markbase_graph::ir::{Graph, WeightParam};
use markbase_graph::quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
use markbase_graph::tower::{build_gemma4_tower, build_siglip_tower};
use markbase_graph::vision::{TowerKind, VisionConfig};

use crate::weights::{RawDType, RawTensor, WeightData, Weights};

/// Names of the built-in synthetic shapes.
pub const NAMES: &[&str] = &[
    "gemma3-270m",
    "gemma3-1b",
    "gemma3-4b",
    "gemma3-12b",
    "gemma4-e2b",
    "gemma4-e4b",
    "gemma4-26b-a4b",
    "gemma4-31b",
    "tiny-gemma3",
    "tiny-gemma4",
    "gemma3-4b-vision",
    "gemma4-e2b-vision",
    "tiny-gemma3-vision",
    "tiny-gemma4-vision",
];

/// The `config.json` of a synthetic shape (quantized affine 4-bit g64).
pub fn config_json(name: &str) -> Option<serde_json::Value> {
    if let Some(v) = with_vision(name) {
        return Some(v);
    }
    let q = json!({"group_size": 64, "bits": 4, "mode": "affine"});
    let mut v = match name {
        "gemma3-270m" => json!({"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
            "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}),
        "gemma3-1b" => json!({"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26,
            "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}),
        "gemma3-4b" => json!({"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
            "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
        "gemma3-12b" => json!({"model_type": "gemma3_text", "hidden_size": 3840, "num_hidden_layers": 48,
            "intermediate_size": 15360, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
        "gemma4-e2b" => json!({"model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35,
            "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "sliding_window_pattern": 5, "num_kv_shared_layers": 20,
            "use_double_wide_mlp": true, "hidden_size_per_layer_input": 256, "vocab_size": 262144}),
        "gemma4-e4b" => json!({"model_type": "gemma4_text", "hidden_size": 2560, "num_hidden_layers": 42,
            "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "sliding_window_pattern": 6, "num_kv_shared_layers": 18,
            "use_double_wide_mlp": false, "hidden_size_per_layer_input": 256, "vocab_size": 262144}),
        "gemma4-26b-a4b" => json!({"model_type": "gemma4_text", "hidden_size": 2816, "num_hidden_layers": 30,
            "intermediate_size": 2112, "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
            "attention_k_eq_v": true, "head_dim": 256, "global_head_dim": 512, "sliding_window": 1024,
            "sliding_window_pattern": 6, "num_kv_shared_layers": 0, "use_double_wide_mlp": false,
            "hidden_size_per_layer_input": 0, "enable_moe_block": true, "num_experts": 128, "top_k_experts": 8,
            "moe_intermediate_size": 704, "vocab_size": 262144}),
        "gemma4-31b" => json!({"model_type": "gemma4_text", "hidden_size": 5376, "num_hidden_layers": 60,
            "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
            "attention_k_eq_v": true, "head_dim": 256, "global_head_dim": 512, "sliding_window": 1024,
            "sliding_window_pattern": 6, "num_kv_shared_layers": 0, "use_double_wide_mlp": false,
            "hidden_size_per_layer_input": 0, "vocab_size": 262144}),
        // Small shapes for tests on a software rasterizer.
        "tiny-gemma3" => json!({"model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 3,
            "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "query_pre_attn_scalar": 64, "sliding_window": 16, "sliding_window_pattern": 3, "vocab_size": 1000}),
        "tiny-gemma4" => json!({"model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "global_head_dim": 64, "sliding_window": 16, "sliding_window_pattern": 2, "num_kv_shared_layers": 1,
            "use_double_wide_mlp": true, "hidden_size_per_layer_input": 64, "vocab_size": 1000,
            "vocab_size_per_layer_input": 1000}),
        _ => return None,
    };
    v["quantization"] = q;
    v["bos_token_id"] = json!(2);
    v["eos_token_id"] = json!([1, 106]);
    Some(v)
}

/// The multimodal `config.json` (mlx-vlm's wrapper) of a synthetic shape with a vision tower:
/// a text shape above and the tower of the real checkpoint (Gemma 3 4B: SigLIP So400m/14 at
/// 896 px; Gemma 4 E2B: the 16-layer ViT), or a very small tower for tests.
fn with_vision(name: &str) -> Option<serde_json::Value> {
    let siglip = |hidden: usize, inter: usize, layers: usize, heads: usize, size: usize| {
        json!({"model_type": "siglip_vision_model", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "patch_size": 14, "image_size": size,
            "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": false})
    };
    let vit = |hidden: usize, inter: usize, layers: usize, heads: usize, head_dim: usize, table: usize| {
        json!({"model_type": "gemma4_vision", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "patch_size": 16, "pooling_kernel_size": 3,
            "position_embedding_size": table, "default_output_length": 280, "use_clipped_linears": true,
            "standardize": false, "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}, "attention_bias": false})
    };
    // (text shape, wrapper type, vision config, soft tokens per image, image / boi / eoi ids)
    let (text, wrapper, vision, tokens, ids) = match name {
        "gemma3-4b-vision" => ("gemma3-4b", "gemma3", siglip(1152, 4304, 27, 16, 896), 256, [262144, 255999, 256000]),
        "tiny-gemma3-vision" => ("tiny-gemma3", "gemma3", siglip(64, 128, 2, 2, 224), 16, [999, 997, 998]),
        "gemma4-e2b-vision" => ("gemma4-e2b", "gemma4", vit(768, 3072, 16, 12, 64, 10240), 280, [258880, 255999, 258882]),
        "tiny-gemma4-vision" => ("tiny-gemma4", "gemma4", vit(32, 64, 2, 2, 16, 128), 280, [999, 997, 998]),
        _ => return None,
    };
    let mut t = config_json(text)?;
    let top: Vec<(String, serde_json::Value)> = ["quantization", "bos_token_id", "eos_token_id"]
        .iter()
        .filter_map(|k| t.as_object_mut()?.remove(*k).map(|v| (k.to_string(), v)))
        .collect();
    let vocab = t["vocab_size"].clone();
    let mut v = json!({"model_type": wrapper, "text_config": t, "vision_config": vision, "vocab_size": vocab});
    for (k, x) in top {
        v[k] = x;
    }
    let keys = if wrapper == "gemma3" {
        v["mm_tokens_per_image"] = json!(tokens);
        ["image_token_index", "boi_token_index", "eoi_token_index"]
    } else {
        v["vision_soft_tokens_per_image"] = json!(tokens);
        ["image_token_id", "boi_token_id", "eoi_token_id"]
    };
    for (k, id) in keys.into_iter().zip(ids) {
        v[k] = json!(id);
    }
    Some(v)
}

/// The vision tower of a synthetic shape (`None`: a text-only shape).
pub fn vision_config(name: &str) -> Result<Option<VisionConfig>, String> {
    let v = config_json(name).ok_or_else(|| format!("unknown synthetic model {name:?}; known: {}", NAMES.join(", ")))?;
    let text = ModelConfig::from_value(&v).map_err(|e| e.to_string())?;
    VisionConfig::from_value(&v, &text).map_err(|e| e.to_string())
}

/// Random weights of a vision tower and its projector, every tensor bf16 as mlx-vlm's
/// checkpoints ship them (its converter quantizes no tower module), generated in parallel.
/// Clip bounds are ±8 (finite, so the clamps run); biases are small.
pub fn tower_weights(vc: &VisionConfig) -> Result<Weights, String> {
    struct Bf16;
    impl WeightResolver for Bf16 {
        fn format(&self, _: &str, _: &[usize], _: bool) -> WeightFormat {
            WeightFormat::Float { dtype: FloatType::Bf16 }
        }
    }
    // the weights are those of every grid: take them from the smallest
    let g = match vc.kind {
        TowerKind::Gemma4Vit => build_gemma4_tower(vc, &Bf16, vc.pool, vc.pool),
        TowerKind::Siglip => build_siglip_tower(vc, &Bf16),
    }
    .map_err(|e| e.to_string())?;
    let mut params: Vec<WeightParam> = vec![];
    for (_, p) in g.weights() {
        if !params.iter().any(|q| q.name == p.name) {
            params.push(p.clone());
        }
    }
    let mut weights = Weights::default();
    for (i, p) in params.iter().enumerate() {
        let numel: usize = p.shape.iter().product();
        let seed = 0x7e11_0000 + i as u64;
        let mut w = random_weight(p, seed, false);
        if let Some(bound) = [("_min", -8.0), ("_max", 8.0)].iter().find(|b| p.name.ends_with(b.0)).map(|b| b.1) {
            w.weight.bytes = bf16_fill(numel, |_| bound);
        } else if p.name.ends_with(".bias") {
            w.weight.bytes = bf16_fill(numel, |i| 0.02 * (hash01(i, seed) - 0.5));
        }
        weights.insert(w);
    }
    Ok(weights)
}

/// Parsed config of a synthetic shape.
pub fn config(name: &str) -> Result<ModelConfig, String> {
    let v = config_json(name).ok_or_else(|| format!("unknown synthetic model {name:?}; known: {}", NAMES.join(", ")))?;
    ModelConfig::from_value(&v).map_err(|e| e.to_string())
}

/// Resolution for synthetic weights: every module whose input dim fits is
/// quantized with the global spec, routers at 8 bits (as mlx-lm does).
pub struct SyntheticResolver {
    pub spec: QuantSpec,
}

impl WeightResolver for SyntheticResolver {
    fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat {
        let inn = *shape.last().unwrap_or(&0);
        if module && inn % self.spec.group_size == 0 {
            let spec = if name.ends_with("router.proj") { QuantSpec::affine(8, 64) } else { self.spec };
            if spec.fits(inn) {
                return WeightFormat::Quantized { spec, global_scale: false };
            }
        }
        WeightFormat::Float { dtype: FloatType::Bf16 }
    }
}

/// A fast deterministic generator (splitmix64) per chunk of output.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; n];
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(ci, c)| {
        let mut s = splitmix(seed ^ (ci as u64).wrapping_mul(0x1234_5678_9abc_def1));
        for w in c.chunks_mut(8) {
            s = splitmix(s);
            let b = s.to_le_bytes();
            w.copy_from_slice(&b[..w.len()]);
        }
    });
    out
}

fn bf16_fill(n: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<u8> {
    // a task per 8192 values, not per value
    const CHUNK: usize = 8192;
    let mut out = vec![0u8; 2 * n];
    out.par_chunks_mut(2 * CHUNK).enumerate().for_each(|(ci, c)| {
        for (j, v) in c.chunks_mut(2).enumerate() {
            let b = (f(ci * CHUNK + j).to_bits() >> 16) as u16;
            v.copy_from_slice(&b.to_le_bytes());
        }
    });
    out
}

fn hash01(i: usize, seed: u64) -> f32 {
    (splitmix(i as u64 ^ seed) >> 40) as f32 / (1u64 << 24) as f32
}

/// Random weights for one parameter in its stored layout.
pub fn random_weight(p: &WeightParam, seed: u64, one_plus_w_norms: bool) -> WeightData {
    let numel: usize = p.shape.iter().product();
    let inn = *p.shape.last().unwrap_or(&1);
    match p.format {
        WeightFormat::Quantized { spec, global_scale } => {
            let rows = numel / inn;
            let mut wshape = p.shape.clone();
            *wshape.last_mut().unwrap() = spec.packed_cols(inn);
            let mut sshape = p.shape.clone();
            *sshape.last_mut().unwrap() = spec.groups(inn);
            let groups = rows * spec.groups(inn);
            let weight = RawTensor { dtype: RawDType::U32, shape: wshape, bytes: random_bytes(rows * spec.packed_cols(inn) * 4, seed) };
            // Affine: w = s*q + b with q in [0, 2^bits): centre the values at 0
            // with a spread that keeps activations O(1) through RMSNorm.
            let qmax = ((1u32 << spec.bits) - 1) as f32;
            let amp = 1.0 / (inn as f32).sqrt();
            let (scales, biases) = match spec.mode {
                QuantMode::Affine => {
                    let s = bf16_fill(groups, |i| amp * (0.5 + hash01(i, seed ^ 1)) * 2.0 / qmax);
                    let b = bf16_fill(groups, |i| -amp * (0.5 + hash01(i, seed ^ 1)));
                    (
                        Some(RawTensor { dtype: RawDType::Bf16, shape: sshape.clone(), bytes: s }),
                        Some(RawTensor { dtype: RawDType::Bf16, shape: sshape, bytes: b }),
                    )
                }
                _ => {
                    // E8M0 (mx) or E4M3 (nv) scales: a small power of two.
                    let e = (127.0 + (amp / 4.0).log2()).round() as u8;
                    let v = if spec.mode == QuantMode::Nvfp4 { 0x20u8 } else { e };
                    (Some(RawTensor { dtype: RawDType::U8, shape: sshape, bytes: vec![v; groups] }), None)
                }
            };
            let gs = if global_scale {
                let e = if p.shape.len() == 3 { p.shape[0] } else { 1 };
                Some(RawTensor::from_f32(&[e], &vec![1.0; e]))
            } else {
                None
            };
            WeightData { param: p.clone(), weight, scales, biases, global_scale: gs }
        }
        WeightFormat::Float { .. } => {
            let is_norm = p.name.contains("norm") || p.name.ends_with("router.scale");
            let bytes = if p.name.ends_with("layer_scalar") || p.name.ends_with("per_expert_scale") {
                bf16_fill(numel, |_| 1.0)
            } else if is_norm {
                let base = if one_plus_w_norms { 0.0 } else { 1.0 };
                bf16_fill(numel, |i| base + 0.1 * (hash01(i, seed) - 0.5))
            } else {
                let amp = 1.0 / (inn as f32).sqrt();
                bf16_fill(numel, |i| amp * 2.0 * (hash01(i, seed) - 0.5))
            };
            WeightData {
                param: WeightParam { format: WeightFormat::Float { dtype: FloatType::Bf16 }, ..p.clone() },
                weight: RawTensor { dtype: RawDType::Bf16, shape: p.shape.clone(), bytes },
                scales: None,
                biases: None,
                global_scale: None,
            }
        }
    }
}

/// Config and random weights for a synthetic shape, resolved with `spec`.
pub fn model(name: &str, spec: QuantSpec) -> Result<(ModelConfig, Weights), String> {
    let cfg = config(name)?;
    let weights = weights(&cfg, spec)?;
    Ok((cfg, weights))
}

/// Random weights for any config (a synthetic shape's, or one derived from it), resolved with `spec`.
pub fn weights(cfg: &ModelConfig, spec: QuantSpec) -> Result<Weights, String> {
    let res = SyntheticResolver { spec };
    let g = markbase_graph::build(cfg, &res, &BuildOptions::decode(64, 16)).map_err(|e| e.to_string())?;
    Ok(graph_weights(&g, cfg.family == markbase_graph::Family::Gemma3))
}

/// Random weights for every weight of graph `g`, in the formats its resolver gave them.
pub fn graph_weights(g: &Graph, one_plus_w_norms: bool) -> Weights {
    let params: Vec<WeightParam> = g.weights().map(|(_, p)| p.clone()).collect();
    let mut weights = Weights::default();
    for (i, p) in params.iter().enumerate() {
        if weights.get(&p.name).is_none() {
            weights.insert(random_weight(p, 0x5eed_0000 + i as u64, one_plus_w_norms));
        }
    }
    weights
}
