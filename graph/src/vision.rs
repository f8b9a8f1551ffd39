//! The vision side of a multimodal `config.json`: which tower the checkpoint has (Gemma 4's ViT
//! or Gemma 3's SigLIP), its shapes, the projector into the text model, the image token ids,
//! and every tensor the tower and projector are made of ([`tower_params`]).

use serde_json::{Map, Value};

use crate::config::{ConfigError, Family, ModelConfig};

/// The kind of vision tower.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum TowerKind {
    /// Gemma 4's ViT: 2-D RoPE, learned x/y position tables, RMSNorms, clipped linears,
    /// 3x3 position-based pooling, `embed_vision` projector.
    Gemma4Vit,
    /// Gemma 3's SigLIP: conv patch embedding, 1-D position table, LayerNorms with bias,
    /// 4x4 average pooling, `multi_modal_projector`.
    Siglip,
}

impl TowerKind {
    pub fn name(self) -> &'static str {
        match self {
            TowerKind::Gemma4Vit => "gemma4 ViT",
            TowerKind::Siglip => "SigLIP",
        }
    }
}

/// Vision tower and projector configuration.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct VisionConfig {
    pub kind: TowerKind,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub patch: usize,
    pub eps: f64,
    /// Text hidden size (the projector's output).
    pub text_hidden: usize,
    /// Image placeholder ids: soft token, begin, end of image.
    pub image_token: u32,
    pub boi_token: u32,
    pub eoi_token: u32,
    // Gemma 4
    /// Pooling kernel side (3).
    pub pool: usize,
    /// Rows of each position table.
    pub position_table: usize,
    pub clipped: bool,
    pub standardize: bool,
    pub rope_theta: f64,
    /// Soft tokens per image by default (Gemma 4: the processor budget).
    pub default_tokens: usize,
    // SigLIP
    /// Side of the square input image (SigLIP).
    pub image_size: usize,
    /// Soft tokens per image (SigLIP: after pooling).
    pub tokens_per_image: usize,
}

pub(crate) fn get_usize(m: &Map<String, Value>, k: &str, d: usize, field: &str) -> Result<usize, ConfigError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(d),
        Some(v) => v
            .as_u64()
            .filter(|&x| x > 0 && x < (1 << 24))
            .map(|x| x as usize)
            .ok_or_else(|| ConfigError::Field { field: format!("{field}{k}"), msg: format!("must be a positive integer, got {v}") }),
    }
}

pub(crate) fn get_f64(m: &Map<String, Value>, k: &str, d: f64, field: &str) -> Result<f64, ConfigError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(d),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| ConfigError::Field { field: format!("{field}{k}"), msg: format!("must be a number, got {v}") }),
    }
}

fn get_id(m: &Map<String, Value>, keys: &[&str], d: u32) -> Result<u32, ConfigError> {
    for k in keys {
        if let Some(v) = m.get(*k).filter(|v| !v.is_null()) {
            return v
                .as_u64()
                .filter(|&x| x < u32::MAX as u64)
                .map(|x| x as u32)
                .ok_or_else(|| ConfigError::Field { field: k.to_string(), msg: format!("must be a token id, got {v}") });
        }
    }
    Ok(d)
}

impl VisionConfig {
    /// The vision configuration of `config.json` (`v`), `None` for a text-only checkpoint.
    /// Gemma 3n's MobileNet tower is not supported: an error.
    pub fn from_value(v: &Value, text: &ModelConfig) -> Result<Option<VisionConfig>, ConfigError> {
        let Some(root) = v.as_object() else { return Ok(None) };
        let vc = match root.get("vision_config") {
            Some(Value::Object(m)) if text.wrapper => m,
            _ => return Ok(None),
        };
        let f = "vision_config.";
        let text_hidden = text.hidden_size;
        match text.family {
            Family::Gemma4 => {
                let hidden = get_usize(vc, "hidden_size", 768, f)?;
                let heads = get_usize(vc, "num_attention_heads", 12, f)?;
                let head_dim = get_usize(vc, "head_dim", hidden / heads, f)?;
                if vc.get("num_key_value_heads").and_then(Value::as_u64).is_some_and(|k| k as usize != heads) {
                    return Err(ConfigError::Field { field: format!("{f}num_key_value_heads"), msg: "must equal num_attention_heads".into() });
                }
                let theta = vc
                    .get("rope_parameters")
                    .and_then(|r| r.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .unwrap_or(100.0);
                Ok(Some(VisionConfig {
                    kind: TowerKind::Gemma4Vit,
                    hidden,
                    intermediate: get_usize(vc, "intermediate_size", 3072, f)?,
                    layers: get_usize(vc, "num_hidden_layers", 16, f)?,
                    heads,
                    head_dim,
                    patch: get_usize(vc, "patch_size", 16, f)?,
                    eps: get_f64(vc, "rms_norm_eps", 1e-6, f)?,
                    text_hidden,
                    image_token: get_id(root, &["image_token_id"], 258880)?,
                    boi_token: get_id(root, &["boi_token_id"], 255999)?,
                    eoi_token: get_id(root, &["eoi_token_id"], 258882)?,
                    pool: get_usize(vc, "pooling_kernel_size", 3, f)?,
                    position_table: get_usize(vc, "position_embedding_size", 10240, f)?,
                    clipped: vc.get("use_clipped_linears").and_then(Value::as_bool).unwrap_or(false),
                    standardize: vc.get("standardize").and_then(Value::as_bool).unwrap_or(false),
                    rope_theta: theta,
                    default_tokens: get_usize(root, "vision_soft_tokens_per_image", 280, "")?,
                    image_size: 0,
                    tokens_per_image: 0,
                }))
            }
            Family::Gemma3 => {
                let hidden = get_usize(vc, "hidden_size", 1152, f)?;
                let heads = get_usize(vc, "num_attention_heads", 16, f)?;
                let patch = get_usize(vc, "patch_size", 14, f)?;
                let image_size = get_usize(vc, "image_size", 896, f)?;
                let tpi = get_usize(root, "mm_tokens_per_image", 256, "")?;
                let side = image_size / patch;
                let tside = (tpi as f64).sqrt() as usize;
                if image_size % patch != 0 || tside * tside != tpi || tside == 0 || side % tside != 0 {
                    return Err(ConfigError::Field {
                        field: "mm_tokens_per_image".into(),
                        msg: format!("{tpi} tokens do not tile a {side}x{side} patch grid ({image_size} px, patch {patch})"),
                    });
                }
                if hidden % heads != 0 {
                    return Err(ConfigError::Field { field: format!("{f}num_attention_heads"), msg: format!("{heads} does not divide {hidden}") });
                }
                Ok(Some(VisionConfig {
                    kind: TowerKind::Siglip,
                    hidden,
                    intermediate: get_usize(vc, "intermediate_size", 4304, f)?,
                    layers: get_usize(vc, "num_hidden_layers", 27, f)?,
                    heads,
                    head_dim: hidden / heads,
                    patch,
                    eps: get_f64(vc, "layer_norm_eps", 1e-6, f)?,
                    text_hidden,
                    image_token: get_id(root, &["image_token_index", "image_token_id"], 262144)?,
                    boi_token: get_id(root, &["boi_token_index", "boi_token_id"], 255999)?,
                    eoi_token: get_id(root, &["eoi_token_index", "eoi_token_id"], 256000)?,
                    pool: side / tside,
                    position_table: side * side,
                    clipped: false,
                    standardize: false,
                    rope_theta: 0.0,
                    default_tokens: tpi,
                    image_size,
                    tokens_per_image: tpi,
                }))
            }
            Family::Gemma3n => Err(ConfigError::Field {
                field: "vision_config".into(),
                msg: "Gemma 3n's MobileNet vision tower is not supported".into(),
            }),
        }
    }

    /// Patches along one side of Gemma 3's square input.
    pub fn grid_side(&self) -> usize {
        self.image_size / self.patch.max(1)
    }
}

/// One tensor of a tower or projector: full name, float shape, and whether it is a module
/// (`<name>.weight`, quantizable) or a plain tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TowerParam {
    pub name: String,
    pub shape: Vec<usize>,
    pub module: bool,
    /// The transformer block it belongs to (`None`: embeddings, final norm, projector).
    pub block: Option<usize>,
}

fn push(out: &mut Vec<TowerParam>, name: String, shape: &[usize], module: bool, block: Option<usize>) {
    out.push(TowerParam { name, shape: shape.to_vec(), module, block });
}

/// Every tensor of the vision tower and its projector, in model order.
pub fn tower_params(c: &VisionConfig) -> Vec<TowerParam> {
    let mut o = vec![];
    let (h, i) = (c.hidden, c.intermediate);
    let qd = c.heads * c.head_dim;
    match c.kind {
        TowerKind::Gemma4Vit => {
            let pe = "vision_tower.patch_embedder";
            push(&mut o, format!("{pe}.input_proj"), &[h, c.patch * c.patch * 3], true, None);
            push(&mut o, format!("{pe}.position_embedding_table"), &[2, c.position_table, h], false, None);
            for l in 0..c.layers {
                let p = format!("vision_tower.encoder.layers.{l}");
                let b = Some(l);
                for n in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                    push(&mut o, format!("{p}.{n}.weight"), &[h], false, b);
                }
                let lin: [(&str, [usize; 2]); 7] = [
                    ("self_attn.q_proj", [qd, h]),
                    ("self_attn.k_proj", [qd, h]),
                    ("self_attn.v_proj", [qd, h]),
                    ("self_attn.o_proj", [h, qd]),
                    ("mlp.gate_proj", [i, h]),
                    ("mlp.up_proj", [i, h]),
                    ("mlp.down_proj", [h, i]),
                ];
                for (n, s) in lin {
                    push(&mut o, format!("{p}.{n}.linear"), &s, true, b);
                    if c.clipped {
                        for bound in ["input_min", "input_max", "output_min", "output_max"] {
                            push(&mut o, format!("{p}.{n}.{bound}"), &[], false, b);
                        }
                    }
                }
                push(&mut o, format!("{p}.self_attn.q_norm.weight"), &[c.head_dim], false, b);
                push(&mut o, format!("{p}.self_attn.k_norm.weight"), &[c.head_dim], false, b);
            }
            if c.standardize {
                push(&mut o, "vision_tower.std_bias".into(), &[h], false, None);
                push(&mut o, "vision_tower.std_scale".into(), &[h], false, None);
            }
            push(&mut o, "embed_vision.embedding_projection".into(), &[c.text_hidden, h], true, None);
        }
        TowerKind::Siglip => {
            let vm = "vision_tower.vision_model";
            push(&mut o, format!("{vm}.embeddings.patch_embedding.weight"), &[h, c.patch, c.patch, 3], false, None);
            push(&mut o, format!("{vm}.embeddings.patch_embedding.bias"), &[h], false, None);
            push(&mut o, format!("{vm}.embeddings.position_embedding"), &[c.position_table, h], true, None);
            for l in 0..c.layers {
                let p = format!("{vm}.encoder.layers.{l}");
                let b = Some(l);
                for n in ["layer_norm1", "layer_norm2"] {
                    push(&mut o, format!("{p}.{n}.weight"), &[h], false, b);
                    push(&mut o, format!("{p}.{n}.bias"), &[h], false, b);
                }
                let lin: [(&str, [usize; 2]); 6] = [
                    ("self_attn.q_proj", [h, h]),
                    ("self_attn.k_proj", [h, h]),
                    ("self_attn.v_proj", [h, h]),
                    ("self_attn.out_proj", [h, h]),
                    ("mlp.fc1", [i, h]),
                    ("mlp.fc2", [h, i]),
                ];
                for (n, s) in lin {
                    push(&mut o, format!("{p}.{n}"), &s, true, b);
                    push(&mut o, format!("{p}.{n}.bias"), &[s[0]], false, b);
                }
            }
            push(&mut o, format!("{vm}.post_layernorm.weight"), &[h], false, None);
            push(&mut o, format!("{vm}.post_layernorm.bias"), &[h], false, None);
            push(&mut o, "multi_modal_projector.mm_soft_emb_norm.weight".into(), &[h], false, None);
            push(&mut o, "multi_modal_projector.mm_input_projection_weight".into(), &[h, c.text_hidden], false, None);
        }
    }
    o
}
