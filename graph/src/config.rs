//! `config.json` of a Gemma checkpoint, normalized into one [`ModelConfig`].
//!
//! Defaults are mlx-lm's (they differ from Hugging Face's in places, see the
//! Gemma 4 table of the architecture notes). Wrapper configs (`gemma3`,
//! `gemma4`, `gemma3n`) carry the language model in `text_config`.

use serde_json::{Map, Value};
use std::collections::BTreeMap;

use crate::quant::{QuantMode, QuantSpec};

/// The model families markbase knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Family {
    Gemma3,
    Gemma3n,
    Gemma4,
}

/// Attention type of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LayerType {
    Sliding,
    Full,
}

/// RoPE frequencies of one layer type.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RopeSpec {
    pub theta: f64,
    /// Linear scaling factor: inverse frequencies are divided by it.
    pub factor: f64,
    /// Fraction of the head's pairs that rotate (proportional RoPE); 1.0 = all.
    pub partial: f64,
}

impl RopeSpec {
    fn plain(theta: f64) -> Self {
        RopeSpec { theta, factor: 1.0, partial: 1.0 }
    }
}

/// Quantization block of `config.json`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct QuantConfig {
    /// Global entry (`None` when the checkpoint is not quantized).
    pub global: Option<QuantSpec>,
    /// Per-module overrides by full module path (tensor name minus `.weight`).
    /// `None` means the override says the module is not quantized.
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantConfig {
    /// What the config says about the module at `path` (override, else global).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(o) => *o,
            None => self.global,
        }
    }
}

/// Language-model configuration, normalized over all families.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelConfig {
    pub model_type: String,
    pub family: Family,
    /// True for the multimodal wrappers (`gemma3`, `gemma4`, `gemma3n`).
    pub wrapper: bool,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// Per-layer MLP width (before double-wide).
    pub intermediate: Vec<usize>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub layer_types: Vec<LayerType>,
    pub sliding_window: usize,
    pub rope_sliding: RopeSpec,
    pub rope_full: RopeSpec,
    /// Attention scale (`query_pre_attn_scalar^-0.5` for Gemma 3, 1.0 for Gemma 3n/4).
    pub attn_scale: f64,
    pub final_logit_softcap: Option<f64>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    // Gemma 4 / 3n extras.
    pub global_head_dim: usize,
    pub num_global_kv_heads: Option<usize>,
    pub attention_k_eq_v: bool,
    /// Gemma 4 26B/31B (`use_bidirectional_attention: "vision"`): the tokens of each image's
    /// placeholder run see each other on sliding layers (HF: `AND(sliding, OR(causal, same
    /// block))`); full-attention layers stay causal. E2B/E4B: off (`null`).
    pub vision_spans_sliding: bool,
    pub num_kv_shared_layers: usize,
    pub use_double_wide_mlp: bool,
    pub hidden_size_per_layer_input: usize,
    pub vocab_size_per_layer_input: usize,
    pub enable_moe_block: bool,
    pub num_experts: Option<usize>,
    pub top_k_experts: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    // Gemma 3n.
    pub altup_num_inputs: usize,
    pub altup_active_idx: usize,
    pub altup_coef_clip: Option<f64>,
    pub altup_correct_scale: bool,
    pub laurel_rank: usize,
    pub activation_sparsity: Vec<f64>,
    // Tokens.
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub quant: QuantConfig,
}

/// A config that cannot be used, with the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("unknown model_type {0:?} (known: gemma3_text, gemma3, gemma4_text, gemma4, gemma3n)")]
    UnknownModelType(String),
    #[error("missing model_type")]
    MissingModelType,
    #[error("field `{field}`: {msg}")]
    Field { field: String, msg: String },
}

fn field_err(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Field { field: field.to_string(), msg: msg.into() }
}

struct Fields<'a> {
    m: &'a Map<String, Value>,
    prefix: &'static str,
}

impl<'a> Fields<'a> {
    fn name(&self, k: &str) -> String {
        format!("{}{}", self.prefix, k)
    }
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.m.get(k).filter(|v| !v.is_null())
    }
    fn usize_or(&self, k: &str, d: usize) -> Result<usize, ConfigError> {
        self.usize_opt(k).map(|v| v.unwrap_or(d))
    }
    fn usize_opt(&self, k: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) if x <= (1 << 40) => Ok(Some(x as usize)),
                Some(_) => Err(field_err(&self.name(k), format!("{v} is beyond any model (at most 2^40)"))),
                None => Err(field_err(&self.name(k), format!("expected a non-negative integer, got {v}"))),
            },
        }
    }
    fn usize_req(&self, k: &str) -> Result<usize, ConfigError> {
        self.usize_opt(k)?.ok_or_else(|| field_err(&self.name(k), "required but missing"))
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| field_err(&self.name(k), format!("expected a number, got {v}"))),
        }
    }
    fn f64_or(&self, k: &str, d: f64) -> Result<f64, ConfigError> {
        self.f64_opt(k).map(|v| v.unwrap_or(d))
    }
    fn bool_or(&self, k: &str, d: bool) -> Result<bool, ConfigError> {
        match self.get(k) {
            None => Ok(d),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(field_err(&self.name(k), format!("expected true/false, got {v}"))),
        }
    }
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

fn parse_quant_spec(v: &Value, field: &str, default_mode: QuantMode) -> Result<Option<QuantSpec>, ConfigError> {
    match v {
        Value::Bool(false) => Ok(None),
        Value::Object(o) => {
            let mode = match o.get("mode").and_then(|m| m.as_str()) {
                None => default_mode,
                Some(s) => QuantMode::parse(s).ok_or_else(|| field_err(field, format!("unknown quantization mode {s:?}")))?,
            };
            let (dg, db) = mode.defaults();
            let group_size = match o.get("group_size") {
                None | Some(Value::Null) => dg,
                Some(x) => x.as_u64().ok_or_else(|| field_err(field, "group_size must be an integer"))? as usize,
            };
            let bits = match o.get("bits") {
                None | Some(Value::Null) => db,
                Some(x) => x.as_u64().ok_or_else(|| field_err(field, "bits must be an integer"))? as usize,
            };
            let spec = QuantSpec { mode, bits, group_size };
            spec.validate().map_err(|m| field_err(field, m))?;
            Ok(Some(spec))
        }
        other => Err(field_err(field, format!("expected an object, got {other}"))),
    }
}

fn parse_quant(root: &Map<String, Value>) -> Result<QuantConfig, ConfigError> {
    let q = match root.get("quantization").or_else(|| root.get("quantization_config")) {
        None | Some(Value::Null) => return Ok(QuantConfig::default()),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(field_err("quantization", format!("expected an object, got {v}"))),
    };
    if q.contains_key("quant_method") {
        return Err(field_err(
            "quantization",
            "a non-MLX quantization_config (quant_method) is not MLX format; convert with mlx_lm.convert",
        ));
    }
    if q.get("quantize_activations").and_then(|v| v.as_bool()) == Some(true) {
        return Err(field_err("quantization.quantize_activations", "activation quantization is not supported"));
    }
    let mut globals = Map::new();
    let mut overrides = BTreeMap::new();
    for (k, v) in q {
        match k.as_str() {
            "group_size" | "bits" | "mode" => {
                globals.insert(k.clone(), v.clone());
            }
            _ => {}
        }
    }
    // Global mode defaults to affine (pre-`mode` checkpoints).
    let global = parse_quant_spec(&Value::Object(globals), "quantization", QuantMode::Affine)?;
    for (k, v) in q {
        if matches!(k.as_str(), "group_size" | "bits" | "mode") {
            continue;
        }
        let spec = match v {
            Value::Bool(true) => global,
            // An override without `mode` is affine, not the global mode.
            _ => parse_quant_spec(v, &format!("quantization.{k}"), QuantMode::Affine)?,
        };
        overrides.insert(k.clone(), spec);
    }
    Ok(QuantConfig { global, overrides })
}

fn layer_types_from(f: &Fields, n: usize, default_pattern: usize) -> Result<Vec<LayerType>, ConfigError> {
    if let Some(Value::Array(a)) = f.get("layer_types") {
        if a.len() != n {
            return Err(field_err(&f.name("layer_types"), format!("has {} entries for {} layers", a.len(), n)));
        }
        return a
            .iter()
            .map(|v| match v.as_str() {
                Some("sliding_attention") => Ok(LayerType::Sliding),
                Some("full_attention") => Ok(LayerType::Full),
                _ => Err(field_err(&f.name("layer_types"), format!("unknown layer type {v}"))),
            })
            .collect();
    }
    let p = f.usize_or("sliding_window_pattern", default_pattern)?;
    if p == 0 {
        return Err(field_err(&f.name("sliding_window_pattern"), "must be > 0"));
    }
    Ok((0..n).map(|i| if (i + 1) % p == 0 { LayerType::Full } else { LayerType::Sliding }).collect())
}

fn rope_from_params(p: &Value, default: RopeSpec) -> RopeSpec {
    let mut r = default;
    if let Some(t) = p.get("rope_theta").and_then(|v| v.as_f64()) {
        r.theta = t;
    }
    let ty = p.get("rope_type").or_else(|| p.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
    if ty == "linear" || ty == "proportional" {
        if let Some(fct) = p.get("factor").and_then(|v| v.as_f64()) {
            r.factor = fct;
        }
    }
    if ty == "proportional" {
        r.partial = p.get("partial_rotary_factor").and_then(|v| v.as_f64()).unwrap_or(1.0);
    }
    r
}

/// Most layers markbase builds (real Gemma models have fewer than 100; the graph passes
/// take seconds beyond a few hundred).
pub const MAX_LAYERS: usize = 256;

/// Refuses a layer count beyond [`MAX_LAYERS`] before per-layer lists are allocated.
fn check_layers(n: usize, f: &Fields) -> Result<(), ConfigError> {
    if n > MAX_LAYERS {
        return Err(field_err(&f.name("num_hidden_layers"), format!("{n} exceeds the largest value markbase accepts, {MAX_LAYERS}")));
    }
    Ok(())
}

impl ModelConfig {
    /// Parses the text of a `config.json`.
    pub fn from_json_str(s: &str) -> Result<Self, ConfigError> {
        let v: Value = serde_json::from_str(s).map_err(|e| ConfigError::Json(e.to_string()))?;
        Self::from_value(&v)
    }

    /// Parses a `config.json` already read as JSON.
    pub fn from_value(v: &Value) -> Result<Self, ConfigError> {
        let root = v.as_object().ok_or_else(|| ConfigError::Json("top level is not an object".into()))?;
        let model_type = root.get("model_type").and_then(|m| m.as_str()).ok_or(ConfigError::MissingModelType)?;
        let (family, wrapper) = match model_type {
            "gemma3_text" => (Family::Gemma3, false),
            "gemma3" => (Family::Gemma3, true),
            "gemma4_text" => (Family::Gemma4, false),
            "gemma4" | "gemma4_unified" => (Family::Gemma4, true),
            "gemma3n" => (Family::Gemma3n, true),
            other => return Err(ConfigError::UnknownModelType(other.to_string())),
        };
        let empty = Map::new();
        let (text, prefix) = if wrapper {
            match root.get("text_config") {
                Some(Value::Object(t)) => (t, "text_config."),
                None | Some(Value::Null) if family != Family::Gemma3n => (&empty, "text_config."),
                _ => return Err(field_err("text_config", "missing or not an object")),
            }
        } else {
            (root, "")
        };
        let f = Fields { m: text, prefix };
        let top = Fields { m: root, prefix: "" };
        let quant = parse_quant(root)?;
        let eos = {
            let mut e = token_ids(root.get("eos_token_id"));
            if e.is_empty() {
                e = token_ids(text.get("eos_token_id"));
            }
            e
        };
        let bos = root
            .get("bos_token_id")
            .or_else(|| text.get("bos_token_id"))
            .and_then(|v| v.as_u64())
            .map(|x| x as u32);

        let mut c = match family {
            Family::Gemma3 => Self::gemma3(&f, &top, wrapper)?,
            Family::Gemma4 => Self::gemma4(&f, &top, wrapper)?,
            Family::Gemma3n => Self::gemma3n(&f)?,
        };
        c.model_type = model_type.to_string();
        c.wrapper = wrapper;
        c.quant = quant;
        c.bos_token_id = bos.or(Some(2));
        c.eos_token_ids = if eos.is_empty() { vec![1] } else { eos };
        c.validate()?;
        Ok(c)
    }

    fn base(family: Family) -> Self {
        ModelConfig {
            model_type: String::new(),
            family,
            wrapper: false,
            hidden_size: 0,
            num_layers: 0,
            intermediate: vec![],
            num_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            vocab_size: 0,
            rms_norm_eps: 1e-6,
            layer_types: vec![],
            sliding_window: 512,
            rope_sliding: RopeSpec::plain(1e4),
            rope_full: RopeSpec::plain(1e6),
            attn_scale: 1.0,
            final_logit_softcap: None,
            tie_word_embeddings: true,
            max_position_embeddings: 32768,
            global_head_dim: 0,
            num_global_kv_heads: None,
            attention_k_eq_v: false,
            vision_spans_sliding: false,
            num_kv_shared_layers: 0,
            use_double_wide_mlp: false,
            hidden_size_per_layer_input: 0,
            vocab_size_per_layer_input: 0,
            enable_moe_block: false,
            num_experts: None,
            top_k_experts: None,
            moe_intermediate_size: None,
            altup_num_inputs: 0,
            altup_active_idx: 0,
            altup_coef_clip: None,
            altup_correct_scale: false,
            laurel_rank: 0,
            activation_sparsity: vec![],
            bos_token_id: None,
            eos_token_ids: vec![],
            quant: QuantConfig::default(),
        }
    }

    fn gemma3(f: &Fields, top: &Fields, wrapper: bool) -> Result<Self, ConfigError> {
        let mut c = Self::base(Family::Gemma3);
        c.hidden_size = f.usize_or("hidden_size", 1152)?;
        c.num_layers = f.usize_or("num_hidden_layers", 26)?;
        check_layers(c.num_layers, f)?;
        let i = f.usize_or("intermediate_size", 6912)?;
        c.intermediate = vec![i; c.num_layers];
        let (dh, dkv) = if wrapper { (8, 4) } else { (4, 1) };
        c.num_heads = f.usize_or("num_attention_heads", dh)?;
        c.num_kv_heads = f.usize_or("num_key_value_heads", dkv)?;
        c.head_dim = f.usize_or("head_dim", 256)?;
        c.rms_norm_eps = f.f64_or("rms_norm_eps", 1e-6)?;
        // mlx-lm copies the wrapper's top-level vocab_size into the text config.
        c.vocab_size = if wrapper { top.usize_or("vocab_size", 262208)? } else { f.usize_or("vocab_size", 262144)? };
        c.sliding_window = f.usize_or("sliding_window", 512)?;
        // mlx-lm uses the pattern; real configs' layer_types agree with it.
        c.layer_types = {
            let p = f.usize_or("sliding_window_pattern", 6)?;
            if p == 0 {
                return Err(field_err(&f.name("sliding_window_pattern"), "must be > 0"));
            }
            (0..c.num_layers).map(|i| if (i + 1) % p == 0 { LayerType::Full } else { LayerType::Sliding }).collect()
        };
        let qpas = f.f64_or("query_pre_attn_scalar", 256.0)?;
        if qpas <= 0.0 {
            return Err(field_err(&f.name("query_pre_attn_scalar"), "must be > 0"));
        }
        c.attn_scale = qpas.powf(-0.5);
        c.rope_full = RopeSpec::plain(f.f64_or("rope_theta", 1e6)?);
        c.rope_sliding = RopeSpec::plain(f.f64_or("rope_local_base_freq", 1e4)?);
        if let Some(rs) = f.get("rope_scaling") {
            let ty = rs.get("rope_type").or_else(|| rs.get("type")).and_then(|v| v.as_str()).unwrap_or("");
            if ty == "linear" {
                c.rope_full.factor = rs.get("factor").and_then(|v| v.as_f64()).unwrap_or(1.0);
            }
        }
        // transformers-v5 style: only rope_parameters present.
        if f.get("rope_theta").is_none() && f.get("rope_scaling").is_none() {
            if let Some(rp) = f.get("rope_parameters") {
                if let Some(full) = rp.get("full_attention") {
                    c.rope_full = rope_from_params(full, c.rope_full.clone());
                }
                if let Some(sl) = rp.get("sliding_attention") {
                    c.rope_sliding = rope_from_params(sl, c.rope_sliding.clone());
                }
            }
        }
        c.max_position_embeddings = f.usize_or("max_position_embeddings", 32768)?;
        c.tie_word_embeddings = true;
        Ok(c)
    }

    fn gemma4(f: &Fields, top: &Fields, wrapper: bool) -> Result<Self, ConfigError> {
        let mut c = Self::base(Family::Gemma4);
        c.hidden_size = f.usize_or("hidden_size", 1536)?;
        c.num_layers = f.usize_or("num_hidden_layers", 35)?;
        check_layers(c.num_layers, f)?;
        let i = f.usize_or("intermediate_size", 6144)?;
        c.intermediate = vec![i; c.num_layers];
        c.num_heads = f.usize_or("num_attention_heads", 8)?;
        c.num_kv_heads = f.usize_or("num_key_value_heads", 1)?;
        c.num_global_kv_heads = f.usize_opt("num_global_key_value_heads")?;
        c.head_dim = f.usize_or("head_dim", 256)?;
        c.global_head_dim = f.usize_or("global_head_dim", 512)?;
        c.rms_norm_eps = f.f64_or("rms_norm_eps", 1e-6)?;
        c.vocab_size = if wrapper {
            f.usize_opt("vocab_size")?.map(Ok).unwrap_or_else(|| top.usize_or("vocab_size", 262144))?
        } else {
            f.usize_or("vocab_size", 262144)?
        };
        c.sliding_window = f.usize_or("sliding_window", 512)?;
        c.layer_types = layer_types_from(f, c.num_layers, 5)?;
        c.rope_full = RopeSpec { theta: 1e6, factor: 1.0, partial: 0.25 };
        c.rope_sliding = RopeSpec::plain(1e4);
        if let Some(rp) = f.get("rope_parameters") {
            if let Some(full) = rp.get("full_attention") {
                c.rope_full = rope_from_params(full, RopeSpec::plain(1e6));
            }
            if let Some(sl) = rp.get("sliding_attention") {
                c.rope_sliding = rope_from_params(sl, RopeSpec::plain(1e4));
            }
        }
        c.attn_scale = 1.0;
        c.attention_k_eq_v = f.bool_or("attention_k_eq_v", false)?;
        c.vision_spans_sliding = match f.get("use_bidirectional_attention") {
            None | Some(Value::Bool(false)) => false,
            Some(Value::String(s)) if s == "vision" => true,
            Some(v) => {
                let msg = format!("{v} is not supported (null or \"vision\": image spans on sliding layers)");
                return Err(field_err(&f.name("use_bidirectional_attention"), msg));
            }
        };
        c.num_kv_shared_layers = f.usize_or("num_kv_shared_layers", 20)?;
        c.use_double_wide_mlp = f.bool_or("use_double_wide_mlp", true)?;
        c.hidden_size_per_layer_input = f.usize_or("hidden_size_per_layer_input", 256)?;
        c.vocab_size_per_layer_input = f.usize_or("vocab_size_per_layer_input", 262144)?;
        c.enable_moe_block = f.bool_or("enable_moe_block", false)?;
        c.num_experts = f.usize_opt("num_experts")?;
        c.top_k_experts = f.usize_opt("top_k_experts")?;
        c.moe_intermediate_size = f.usize_opt("moe_intermediate_size")?;
        c.final_logit_softcap = Some(f.f64_or("final_logit_softcapping", 30.0)?);
        c.tie_word_embeddings = f.bool_or("tie_word_embeddings", true)?;
        c.max_position_embeddings = f.usize_or("max_position_embeddings", 131072)?;
        Ok(c)
    }

    fn gemma3n(f: &Fields) -> Result<Self, ConfigError> {
        let mut c = Self::base(Family::Gemma3n);
        c.hidden_size = f.usize_req("hidden_size")?;
        c.num_layers = f.usize_req("num_hidden_layers")?;
        check_layers(c.num_layers, f)?;
        c.intermediate = match f.get("intermediate_size") {
            Some(Value::Array(a)) => {
                let v: Option<Vec<usize>> = a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect();
                let v = v.ok_or_else(|| field_err(&f.name("intermediate_size"), "expected integers"))?;
                if v.len() != c.num_layers {
                    return Err(field_err(&f.name("intermediate_size"), "list length differs from num_hidden_layers"));
                }
                v
            }
            _ => vec![f.usize_req("intermediate_size")?; c.num_layers],
        };
        c.num_heads = f.usize_req("num_attention_heads")?;
        c.num_kv_heads = f.usize_req("num_key_value_heads")?;
        c.head_dim = f.usize_req("head_dim")?;
        c.global_head_dim = c.head_dim;
        c.vocab_size = f.usize_req("vocab_size")?;
        c.vocab_size_per_layer_input = f.usize_req("vocab_size_per_layer_input")?;
        c.hidden_size_per_layer_input = f.usize_req("hidden_size_per_layer_input")?;
        c.num_kv_shared_layers = f.usize_req("num_kv_shared_layers")?;
        c.layer_types = layer_types_from(f, c.num_layers, 5)?;
        c.sliding_window = f.usize_req("sliding_window")?;
        c.rope_full = RopeSpec::plain(f.f64_opt("rope_theta")?.ok_or_else(|| field_err(&f.name("rope_theta"), "required"))?);
        c.rope_sliding = RopeSpec::plain(
            f.f64_opt("rope_local_base_freq")?.ok_or_else(|| field_err(&f.name("rope_local_base_freq"), "required"))?,
        );
        c.final_logit_softcap = f.f64_opt("final_logit_softcapping")?;
        c.rms_norm_eps = f.f64_or("rms_norm_eps", 1e-6)?;
        c.attn_scale = 1.0;
        c.altup_num_inputs = f.usize_req("altup_num_inputs")?;
        c.altup_active_idx = f.usize_req("altup_active_idx")?;
        c.altup_coef_clip = f.f64_opt("altup_coef_clip")?;
        c.altup_correct_scale = f.bool_or("altup_correct_scale", true)?;
        c.laurel_rank = f.usize_req("laurel_rank")?;
        c.activation_sparsity = match f.get("activation_sparsity_pattern") {
            Some(Value::Array(a)) => a.iter().map(|x| x.as_f64().unwrap_or(0.0)).collect(),
            _ => vec![0.0; c.num_layers],
        };
        if c.activation_sparsity.len() != c.num_layers {
            return Err(field_err(&f.name("activation_sparsity_pattern"), "length differs from num_hidden_layers"));
        }
        c.max_position_embeddings = f.usize_or("max_position_embeddings", 32768)?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let nz = |v: usize, n: &str| if v == 0 { Err(field_err(n, "must be > 0")) } else { Ok(()) };
        nz(self.hidden_size, "hidden_size")?;
        nz(self.num_layers, "num_hidden_layers")?;
        nz(self.num_heads, "num_attention_heads")?;
        nz(self.num_kv_heads, "num_key_value_heads")?;
        nz(self.head_dim, "head_dim")?;
        nz(self.vocab_size, "vocab_size")?;
        nz(self.sliding_window, "sliding_window")?;
        for (v, name, limit) in [
            (self.num_layers, "num_hidden_layers", MAX_LAYERS),
            (self.hidden_size, "hidden_size", 1 << 20),
            (self.head_dim, "head_dim", 4096),
            (self.vocab_size, "vocab_size", 1 << 24),
        ] {
            if v > limit {
                return Err(field_err(name, format!("{v} exceeds the largest value markbase accepts, {limit}")));
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(field_err("num_attention_heads", "must be a multiple of num_key_value_heads"));
        }
        if self.num_kv_shared_layers >= self.num_layers && self.num_kv_shared_layers > 0 {
            return Err(field_err("num_kv_shared_layers", "must be smaller than num_hidden_layers"));
        }
        if self.head_dim % 2 != 0 || (self.global_head_dim != 0 && self.global_head_dim % 2 != 0) {
            return Err(field_err("head_dim", "must be even"));
        }
        Ok(())
    }

    /// Prefix of the language model's tensors in an MLX checkpoint of this type.
    pub fn default_prefix(&self) -> &'static str {
        match (self.family, self.wrapper) {
            (Family::Gemma3n, _) => "model.language_model.",
            (_, true) => "language_model.model.",
            (_, false) => "model.",
        }
    }

    /// Head dim of layer `i`.
    pub fn layer_head_dim(&self, i: usize) -> usize {
        if self.family == Family::Gemma4 && self.layer_types[i] == LayerType::Full {
            self.global_head_dim
        } else {
            self.head_dim
        }
    }

    /// KV heads of layer `i`.
    pub fn layer_kv_heads(&self, i: usize) -> usize {
        if self.family == Family::Gemma4 && self.layer_types[i] == LayerType::Full && self.attention_k_eq_v {
            self.num_global_kv_heads.unwrap_or(self.num_kv_heads)
        } else {
            self.num_kv_heads
        }
    }

    /// First layer that reuses another layer's K/V.
    pub fn first_shared_layer(&self) -> usize {
        self.num_layers - self.num_kv_shared_layers
    }

    /// The layer whose KV cache layer `i` reads (itself unless KV-shared).
    pub fn kv_source(&self, i: usize) -> usize {
        let m = self.first_shared_layer();
        if i < m || self.family == Family::Gemma3 {
            return i;
        }
        let t = self.layer_types[i];
        (0..m).rev().find(|&j| self.layer_types[j] == t).unwrap_or(i)
    }

    /// MLP width of layer `i` (double-wide on KV-shared Gemma 4 layers).
    pub fn layer_intermediate(&self, i: usize) -> usize {
        let base = self.intermediate[i];
        if self.family == Family::Gemma4 && self.use_double_wide_mlp && i >= self.first_shared_layer() && self.num_kv_shared_layers > 0 {
            2 * base
        } else {
            base
        }
    }

    /// RoPE of layer `i`.
    pub fn layer_rope(&self, i: usize) -> &RopeSpec {
        match self.layer_types[i] {
            LayerType::Full => &self.rope_full,
            LayerType::Sliding => &self.rope_sliding,
        }
    }

    /// Per-token KV-cache bytes (f32 K and V) summed over layers that own a cache.
    pub fn kv_bytes_per_token(&self) -> usize {
        (0..self.num_layers)
            .filter(|&i| self.kv_source(i) == i)
            .map(|i| 2 * self.layer_kv_heads(i) * self.layer_head_dim(i) * 4)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_defaults_and_pattern() {
        let c = ModelConfig::from_json_str(r#"{"model_type":"gemma3_text","hidden_size":640,"num_hidden_layers":18,"intermediate_size":2048,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":256}"#).unwrap();
        assert_eq!(c.layer_types.iter().filter(|t| **t == LayerType::Full).count(), 3);
        assert_eq!(c.layer_types[5], LayerType::Full);
        assert!((c.attn_scale - 1.0 / 16.0).abs() < 1e-12);
        assert_eq!(c.default_prefix(), "model.");
    }

    #[test]
    fn override_without_mode_is_affine() {
        let c = ModelConfig::from_json_str(r#"{"model_type":"gemma4_text","quantization":{"group_size":32,"bits":4,"mode":"mxfp4","model.layers.0.router.proj":{"group_size":64,"bits":8}}}"#).unwrap();
        assert_eq!(c.quant.global.unwrap().mode, QuantMode::Mxfp4);
        let o = c.quant.for_module("model.layers.0.router.proj").unwrap();
        assert_eq!((o.mode, o.bits, o.group_size), (QuantMode::Affine, 8, 64));
    }

    #[test]
    fn unknown_type_is_an_error() {
        assert!(matches!(ModelConfig::from_json_str(r#"{"model_type":"llama"}"#), Err(ConfigError::UnknownModelType(_))));
        assert!(matches!(ModelConfig::from_json_str("{"), Err(ConfigError::Json(_))));
    }
}
