//! The audio side of a multimodal `config.json`: Gemma 4's audio tower (a USM conformer:
//! subsampling convs, conformer blocks with local relative-position attention, the output
//! projection) and its `embed_audio` projector, and every tensor they are made of
//! ([`audio_tower_params`]).

use serde_json::{Map, Value};

use crate::config::{ConfigError, Family, ModelConfig};
use crate::vision::{get_f64, get_usize, TowerParam};

/// Gemma 4's audio tower and projector configuration (`audio_config`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AudioConfig {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    /// Channels of the two subsampling convs.
    pub conv_channels: [usize; 2],
    /// Log-mel bins of the input (128).
    pub features: usize,
    /// Kernel of the causal depthwise conv of each block.
    pub conv_kernel: usize,
    /// Weight of each feed-forward's residual (0.5).
    pub residual_weight: f32,
    /// Keys a query sees: itself and `attention_context_left − 2` past rows.
    pub window: usize,
    pub logit_cap: f32,
    pub eps: f64,
    pub clipped: bool,
    /// Width of the tower's output (`output_proj`), the projector's input.
    pub output_dims: usize,
    /// Text hidden size (the projector's output).
    pub text_hidden: usize,
    /// Audio placeholder ids: soft token, begin, end of audio.
    pub audio_token: u32,
    pub boa_token: u32,
    pub eoa_token: u32,
}

const F: &str = "audio_config.";

fn usize_of(m: &Map<String, Value>, k: &str, d: usize) -> Result<usize, ConfigError> {
    get_usize(m, k, d, F)
}

fn f64_of(m: &Map<String, Value>, k: &str, d: f64) -> Result<f64, ConfigError> {
    get_f64(m, k, d, F)
}

fn id_of(m: &Map<String, Value>, keys: &[&str], d: u32) -> u32 {
    keys.iter().find_map(|k| m.get(*k).and_then(Value::as_u64)).map_or(d, |v| v as u32)
}

impl AudioConfig {
    /// The audio configuration of `config.json` (`v`): `None` without an `audio_config` (or
    /// for a family whose audio tower is not supported: Gemma 3n).
    pub fn from_value(v: &Value, text: &ModelConfig) -> Result<Option<AudioConfig>, ConfigError> {
        let Some(root) = v.as_object() else { return Ok(None) };
        let ac = match root.get("audio_config") {
            Some(Value::Object(m)) if text.wrapper && text.family == Family::Gemma4 => m,
            _ => return Ok(None),
        };
        let hidden = usize_of(ac, "hidden_size", 1024)?;
        let heads = usize_of(ac, "num_attention_heads", 8)?;
        if hidden % heads != 0 {
            return Err(ConfigError::Field { field: "audio_config.num_attention_heads".into(), msg: format!("{heads} does not divide {hidden}") });
        }
        let channels = match ac.get("subsampling_conv_channels") {
            None | Some(Value::Null) => [128, 32],
            Some(Value::Array(a)) if a.len() == 2 && a.iter().all(|c| c.as_u64().is_some_and(|c| c > 0)) => {
                [a[0].as_u64().unwrap_or(0) as usize, a[1].as_u64().unwrap_or(0) as usize]
            }
            Some(v) => {
                return Err(ConfigError::Field { field: "audio_config.subsampling_conv_channels".into(), msg: format!("must be two channel counts, got {v}") })
            }
        };
        for (k, want) in [("attention_context_right", 0.0)] {
            if f64_of(ac, k, want)? != want {
                return Err(ConfigError::Field { field: format!("audio_config.{k}"), msg: "only 0 (causal local attention) is supported".into() });
            }
        }
        if let Some(act) = ac.get("hidden_act").filter(|a| !a.is_null() && a.as_str() != Some("silu")) {
            return Err(ConfigError::Field { field: "audio_config.hidden_act".into(), msg: format!("only silu is supported, got {act}") });
        }
        let left = usize_of(ac, "attention_context_left", 13)?;
        if left < 2 {
            return Err(ConfigError::Field { field: "audio_config.attention_context_left".into(), msg: format!("must be at least 2, got {left}") });
        }
        Ok(Some(AudioConfig {
            hidden,
            layers: usize_of(ac, "num_hidden_layers", 12)?,
            heads,
            conv_channels: channels,
            features: 128,
            conv_kernel: usize_of(ac, "conv_kernel_size", 5)?,
            residual_weight: f64_of(ac, "residual_weight", 0.5)? as f32,
            window: left - 1,
            logit_cap: f64_of(ac, "attention_logit_cap", 50.0)? as f32,
            eps: f64_of(ac, "rms_norm_eps", 1e-6)?,
            clipped: ac.get("use_clipped_linears").and_then(Value::as_bool).unwrap_or(true),
            output_dims: usize_of(ac, "output_proj_dims", 1536)?,
            text_hidden: text.hidden_size,
            audio_token: id_of(root, &["audio_token_id"], 258881),
            boa_token: id_of(root, &["boa_token_id"], 256000),
            eoa_token: id_of(root, &["eoa_token_id", "eoa_token_index"], 258883),
        }))
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Frequency bins after the two stride-2 subsampling convs (128 → 32).
    pub fn subsampled_features(&self) -> usize {
        let f = (self.features - 1) / 2 + 1;
        (f - 1) / 2 + 1
    }

    /// Rows of the tower's output for `frames` input frames (two stride-2 steps).
    pub fn rows(frames: usize) -> usize {
        frames.div_ceil(2).div_ceil(2)
    }
}

fn push(out: &mut Vec<TowerParam>, name: String, shape: &[usize], module: bool, block: Option<usize>) {
    out.push(TowerParam { name, shape: shape.to_vec(), module, block });
}

/// Every tensor of Gemma 4's audio tower and its projector, in model order.
pub fn audio_tower_params(c: &AudioConfig) -> Vec<TowerParam> {
    let mut o = vec![];
    let h = c.hidden;
    let sc = "audio_tower.subsample_conv_projection";
    let [c0, c1] = c.conv_channels;
    push(&mut o, format!("{sc}.layer0.conv.weight"), &[c0, 3, 3, 1], false, None);
    push(&mut o, format!("{sc}.layer0.norm.weight"), &[c0], false, None);
    push(&mut o, format!("{sc}.layer1.conv.weight"), &[c1, 3, 3, c0], false, None);
    push(&mut o, format!("{sc}.layer1.norm.weight"), &[c1], false, None);
    push(&mut o, format!("{sc}.input_proj_linear"), &[h, c.subsampled_features() * c1], true, None);
    for l in 0..c.layers {
        let p = format!("audio_tower.layers.{l}");
        let b = Some(l);
        let clippable = |o: &mut Vec<TowerParam>, n: &str, s: [usize; 2]| {
            push(o, format!("{p}.{n}.linear"), &s, true, b);
            if c.clipped {
                for bound in ["input_min", "input_max", "output_min", "output_max"] {
                    push(o, format!("{p}.{n}.{bound}"), &[], false, b);
                }
            }
        };
        for ff in ["feed_forward1", "feed_forward2"] {
            push(&mut o, format!("{p}.{ff}.pre_layer_norm.weight"), &[h], false, b);
            clippable(&mut o, &format!("{ff}.ffw_layer_1"), [4 * h, h]);
            clippable(&mut o, &format!("{ff}.ffw_layer_2"), [h, 4 * h]);
            push(&mut o, format!("{p}.{ff}.post_layer_norm.weight"), &[h], false, b);
        }
        for n in ["q_proj", "k_proj", "v_proj", "post"] {
            clippable(&mut o, &format!("self_attn.{n}"), [h, h]);
        }
        push(&mut o, format!("{p}.self_attn.relative_k_proj"), &[h, h], true, b);
        push(&mut o, format!("{p}.self_attn.per_dim_scale"), &[c.head_dim()], false, b);
        push(&mut o, format!("{p}.lconv1d.pre_layer_norm.weight"), &[h], false, b);
        clippable(&mut o, "lconv1d.linear_start", [2 * h, h]);
        push(&mut o, format!("{p}.lconv1d.depthwise_conv1d.weight"), &[h, c.conv_kernel, 1], false, b);
        push(&mut o, format!("{p}.lconv1d.conv_norm.weight"), &[h], false, b);
        clippable(&mut o, "lconv1d.linear_end", [h, h]);
        for n in ["norm_pre_attn", "norm_post_attn", "norm_out"] {
            push(&mut o, format!("{p}.{n}.weight"), &[h], false, b);
        }
    }
    push(&mut o, "audio_tower.output_proj".into(), &[c.output_dims, h], true, None);
    push(&mut o, "audio_tower.output_proj.bias".into(), &[c.output_dims], false, None);
    push(&mut o, "embed_audio.embedding_projection".into(), &[c.text_hidden, c.output_dims], true, None);
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny Gemma 4 fixture's config with `audio_config` replaced.
    fn config(audio: Value) -> Result<Option<AudioConfig>, ConfigError> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/audio_tower/gemma4/config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture config")).expect("json");
        v["audio_config"] = audio;
        let text = ModelConfig::from_value(&v).expect("text config");
        AudioConfig::from_value(&v, &text)
    }

    #[test]
    fn real_defaults_give_the_e2b_tower() {
        let ac = config(serde_json::json!({})).unwrap().unwrap();
        assert_eq!((ac.hidden, ac.layers, ac.heads, ac.head_dim(), ac.window), (1024, 12, 8, 128, 12));
        assert_eq!((ac.subsampled_features(), ac.conv_channels, ac.output_dims), (32, [128, 32], 1536));
        // about 305 M parameters (the tower alone; the projector's width is the tiny text's)
        let n: usize = audio_tower_params(&ac).iter().filter(|p| !p.name.starts_with("embed_audio.")).map(|p| p.shape.iter().product::<usize>()).sum();
        assert!((300_000_000..310_000_000).contains(&n), "{n}");
        assert_eq!(AudioConfig::rows(199), 50);
        assert_eq!(AudioConfig::rows(30), 8);
    }

    #[test]
    fn unsupported_settings_are_refused() {
        for (bad, field) in [
            (serde_json::json!({"attention_context_right": 2}), "attention_context_right"),
            (serde_json::json!({"subsampling_conv_channels": [128]}), "subsampling_conv_channels"),
            (serde_json::json!({"hidden_size": 100, "num_attention_heads": 8}), "num_attention_heads"),
            (serde_json::json!({"hidden_act": "gelu"}), "hidden_act"),
        ] {
            let e = config(bad).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }
}
