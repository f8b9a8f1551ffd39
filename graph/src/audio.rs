//! The audio side of a multimodal `config.json`: the audio towers of Gemma 4 and Gemma 3n
//! (USM conformers: subsampling convs, conformer blocks with local relative-position
//! attention; Gemma 4's output projection, Gemma 3n's x4 time reduction) and their
//! `embed_audio` projectors, and every tensor they are made of ([`audio_tower_params`]).

use serde_json::{Map, Value};

use crate::config::{ConfigError, Family, ModelConfig};
use crate::vision::{get_f64, get_usize, TowerParam};

/// Which audio tower.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum AudioKind {
    /// Gemma 4 E2B/E4B: masked subsampling convs with a channel LayerNorm, clipped linears,
    /// `output_proj`, a soft token per real row.
    Gemma4,
    /// Gemma 3n: subsampling convs with a cumulative group norm, the x4 time reduction, a
    /// fixed count of soft tokens per clip (padding slots take a hard embedding).
    Gemma3n,
}

impl AudioKind {
    pub fn name(self) -> &'static str {
        match self {
            AudioKind::Gemma4 => "Gemma 4",
            AudioKind::Gemma3n => "Gemma 3n",
        }
    }
}

/// An audio tower's and its projector's configuration (`audio_config`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AudioConfig {
    pub kind: AudioKind,
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
    /// Keys a query sees, itself included (Gemma 4: `attention_context_left − 1`; Gemma 3n:
    /// `conf_attention_context_left`).
    pub window: usize,
    pub logit_cap: f32,
    pub eps: f64,
    pub clipped: bool,
    /// Width of the tower's output (Gemma 4: `output_proj`; Gemma 3n: `hidden`), the
    /// projector's input.
    pub output_dims: usize,
    /// Gemma 3n: eps of the subsampling convs' cumulative group norm (0 for Gemma 4).
    pub group_norm_eps: f64,
    /// Rows the tower keeps after its conformer blocks: every `reduction`-th (Gemma 3n 4,
    /// Gemma 4 1).
    pub reduction: usize,
    /// Gemma 3n: soft tokens per clip (`audio_soft_tokens_per_image`, 188), the rows of
    /// `embed_audio.embedding` (128) and the one padding slots take (the last text id's:
    /// `text vocab − 1 − vocab_offset`). Zero for Gemma 4.
    pub soft_slots: usize,
    pub vocab_size: usize,
    pub pad_row: usize,
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
    /// The audio configuration of `config.json` (`v`): `None` without an `audio_config`.
    pub fn from_value(v: &Value, text: &ModelConfig) -> Result<Option<AudioConfig>, ConfigError> {
        let Some(root) = v.as_object() else { return Ok(None) };
        let ac = match root.get("audio_config") {
            Some(Value::Object(m)) if text.wrapper => m,
            _ => return Ok(None),
        };
        match text.family {
            Family::Gemma4 => Self::gemma4(root, ac, text).map(Some),
            Family::Gemma3n => Self::gemma3n(root, ac, text).map(Some),
            _ => Ok(None),
        }
    }

    fn gemma4(root: &Map<String, Value>, ac: &Map<String, Value>, text: &ModelConfig) -> Result<AudioConfig, ConfigError> {
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
        Ok(AudioConfig {
            kind: AudioKind::Gemma4,
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
            group_norm_eps: 0.0,
            reduction: 1,
            soft_slots: 0,
            vocab_size: 0,
            pad_row: 0,
        })
    }

    /// Gemma 3n's `audio_config` (HF's `Gemma3nAudioConfig` names and defaults).
    fn gemma3n(root: &Map<String, Value>, ac: &Map<String, Value>, text: &ModelConfig) -> Result<AudioConfig, ConfigError> {
        let field = |k: &str, msg: String| ConfigError::Field { field: format!("audio_config.{k}"), msg };
        let hidden = usize_of(ac, "hidden_size", 1536)?;
        let heads = usize_of(ac, "conf_num_attention_heads", 8)?;
        if heads == 0 || hidden % heads != 0 {
            return Err(field("conf_num_attention_heads", format!("{heads} does not divide {hidden}")));
        }
        let features = usize_of(ac, "input_feat_size", 128)?;
        let channels = match ac.get("sscp_conv_channel_size") {
            None | Some(Value::Null) => [128, 32],
            Some(Value::Array(a)) if a.len() == 2 && a.iter().all(|c| c.as_u64().is_some_and(|c| c > 0)) => {
                [a[0].as_u64().unwrap_or(0) as usize, a[1].as_u64().unwrap_or(0) as usize]
            }
            Some(v) => return Err(field("sscp_conv_channel_size", format!("must be two channel counts, got {v}"))),
        };
        for (k, want) in [("sscp_conv_kernel_size", 3), ("sscp_conv_stride_size", 2)] {
            let ok = match ac.get(k) {
                None | Some(Value::Null) => true,
                Some(Value::Array(a)) => a.len() == 2 && a.iter().all(|p| p.as_array().is_some_and(|p| p.len() == 2 && p.iter().all(|x| x.as_u64() == Some(want)))),
                _ => false,
            };
            if !ok {
                return Err(field(k, format!("only [[{want}, {want}], [{want}, {want}]] is supported, got {}", ac[k])));
            }
        }
        if f64_of(ac, "conf_attention_context_right", 0.0)? != 0.0 {
            return Err(field("conf_attention_context_right", "only 0 (causal local attention) is supported".into()));
        }
        let left = usize_of(ac, "conf_attention_context_left", 13)?;
        if left == 0 {
            return Err(field("conf_attention_context_left", "must be at least 1".into()));
        }
        let reduction = usize_of(ac, "conf_reduction_factor", 4)?.max(1);
        let vocab_size = usize_of(ac, "vocab_size", 128)?;
        let offset = usize_of(ac, "vocab_offset", 262_272)?;
        // HF pads with the hard embedding of the text vocabulary's last id
        let pad_row = text.vocab_size.checked_sub(1 + offset).filter(|&r| r < vocab_size).ok_or_else(|| {
            field("vocab_offset", format!("{offset}: the text vocabulary's last id ({}) is not an audio id (offset + {vocab_size})", text.vocab_size.saturating_sub(1)))
        })?;
        let soft_slots = root.get("audio_soft_tokens_per_image").and_then(Value::as_u64).unwrap_or(188) as usize;
        if soft_slots == 0 {
            return Err(ConfigError::Field { field: "audio_soft_tokens_per_image".into(), msg: "must be at least 1".into() });
        }
        Ok(AudioConfig {
            kind: AudioKind::Gemma3n,
            hidden,
            layers: usize_of(ac, "conf_num_hidden_layers", 12)?,
            heads,
            conv_channels: channels,
            features,
            conv_kernel: usize_of(ac, "conf_conv_kernel_size", 5)?,
            residual_weight: f64_of(ac, "conf_residual_weight", 0.5)? as f32,
            window: left,
            logit_cap: f64_of(ac, "conf_attention_logit_cap", 50.0)? as f32,
            eps: f64_of(ac, "rms_norm_eps", 1e-6)?,
            clipped: false,
            output_dims: hidden,
            text_hidden: text.hidden_size,
            audio_token: id_of(root, &["audio_token_id"], 262273),
            boa_token: id_of(root, &["boa_token_id"], 256000),
            eoa_token: id_of(root, &["eoa_token_id"], 262272),
            group_norm_eps: f64_of(ac, "sscp_conv_group_norm_eps", 1e-3)?,
            reduction,
            soft_slots,
            vocab_size,
            pad_row,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Rows of the encoder's output for `frames` input frames: the subsampled rows, every
    /// `reduction`-th of them kept.
    pub fn encoder_rows(&self, frames: usize) -> usize {
        Self::rows(frames).div_ceil(self.reduction)
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

/// The subsampling convs' tensors (block `i` is `<block>i`: Gemma 4 `layer`, Gemma 3n
/// `conv_`) and the input projection.
fn subsampling_params(c: &AudioConfig, block: &str) -> Vec<TowerParam> {
    let mut o = vec![];
    let sc = "audio_tower.subsample_conv_projection";
    let [c0, c1] = c.conv_channels;
    for (i, (cout, cin)) in [(c0, 1), (c1, c0)].into_iter().enumerate() {
        push(&mut o, format!("{sc}.{block}{i}.conv.weight"), &[cout, 3, 3, cin], false, None);
        push(&mut o, format!("{sc}.{block}{i}.norm.weight"), &[cout], false, None);
    }
    push(&mut o, format!("{sc}.input_proj_linear"), &[c.hidden, c.subsampled_features() * c1], true, None);
    o
}

/// Every tensor of the audio tower and its projector, in model order.
pub fn audio_tower_params(c: &AudioConfig) -> Vec<TowerParam> {
    if c.kind == AudioKind::Gemma3n {
        return gemma3n_params(c);
    }
    let mut o = subsampling_params(c, "layer");
    let h = c.hidden;
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

/// Every tensor of Gemma 3n's audio tower and `embed_audio`, in model order.
fn gemma3n_params(c: &AudioConfig) -> Vec<TowerParam> {
    let mut o = subsampling_params(c, "conv_");
    let h = c.hidden;
    for l in 0..c.layers {
        let p = format!("audio_tower.conformer.{l}");
        let b = Some(l);
        for ff in ["ffw_layer_start", "ffw_layer_end"] {
            push(&mut o, format!("{p}.{ff}.pre_layer_norm.weight"), &[h], false, b);
            push(&mut o, format!("{p}.{ff}.ffw_layer_1"), &[4 * h, h], true, b);
            push(&mut o, format!("{p}.{ff}.ffw_layer_2"), &[h, 4 * h], true, b);
            push(&mut o, format!("{p}.{ff}.post_layer_norm.weight"), &[h], false, b);
        }
        push(&mut o, format!("{p}.attention.pre_attn_norm.weight"), &[h], false, b);
        for n in ["q_proj", "k_proj", "v_proj"] {
            push(&mut o, format!("{p}.attention.attn.{n}"), &[h, h], true, b);
        }
        push(&mut o, format!("{p}.attention.attn.per_dim_scale"), &[c.head_dim()], false, b);
        push(&mut o, format!("{p}.attention.attn.relative_position_embedding.pos_proj"), &[h, h], true, b);
        push(&mut o, format!("{p}.attention.post"), &[h, h], true, b);
        push(&mut o, format!("{p}.attention.post_norm.weight"), &[h], false, b);
        push(&mut o, format!("{p}.lconv1d.pre_layer_norm.weight"), &[h], false, b);
        push(&mut o, format!("{p}.lconv1d.linear_start"), &[2 * h, h], true, b);
        push(&mut o, format!("{p}.lconv1d.depthwise_conv1d.weight"), &[h, c.conv_kernel, 1], false, b);
        push(&mut o, format!("{p}.lconv1d.conv_norm.weight"), &[h], false, b);
        push(&mut o, format!("{p}.lconv1d.linear_end"), &[h, h], true, b);
        push(&mut o, format!("{p}.norm.weight"), &[h], false, b);
    }
    push(&mut o, "embed_audio.embedding".into(), &[c.vocab_size, h], true, None);
    push(&mut o, "embed_audio.hard_embedding_norm.weight".into(), &[h], false, None);
    push(&mut o, "embed_audio.soft_embedding_norm.weight".into(), &[h], false, None);
    push(&mut o, "embed_audio.embedding_projection".into(), &[c.text_hidden, h], true, None);
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config of the tiny audio tower fixture `family` with `audio_config` replaced.
    fn fixture_config(family: &str, audio: Value) -> Result<Option<AudioConfig>, ConfigError> {
        let path = format!("{}/../tests/fixtures/audio_tower/{family}/config.json", env!("CARGO_MANIFEST_DIR"));
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture config")).expect("json");
        v["audio_config"] = audio;
        let text = ModelConfig::from_value(&v).expect("text config");
        AudioConfig::from_value(&v, &text)
    }

    fn config(audio: Value) -> Result<Option<AudioConfig>, ConfigError> {
        fixture_config("gemma4", audio)
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

    fn config_3n(audio: Value) -> Result<Option<AudioConfig>, ConfigError> {
        fixture_config("gemma3n", audio)
    }

    #[test]
    fn gemma3n_defaults_give_the_e2b_tower() {
        // the fixture's text vocabulary (512) ends with the audio ids
        let ac = config_3n(serde_json::json!({"vocab_offset": 384})).unwrap().unwrap();
        assert_eq!(ac.kind, AudioKind::Gemma3n);
        assert_eq!((ac.hidden, ac.layers, ac.heads, ac.head_dim(), ac.window, ac.reduction), (1536, 12, 8, 192, 13, 4));
        assert_eq!((ac.conv_channels, ac.subsampled_features(), ac.soft_slots, ac.pad_row), ([128, 32], 32, 188, 127));
        assert_eq!((ac.group_norm_eps, ac.logit_cap, ac.clipped), (1e-3, 50.0, false));
        // the tower alone: about 680 M parameters (24 hidden² per block)
        let n: usize = audio_tower_params(&ac).iter().filter(|p| !p.name.starts_with("embed_audio.")).map(|p| p.shape.iter().product::<usize>()).sum();
        assert!((675_000_000..685_000_000).contains(&n), "{n}");
        // 30 s: 2997 frames, 750 subsampled rows, 188 encoder rows
        assert_eq!((AudioConfig::rows(2997), ac.encoder_rows(2997)), (750, 188));
    }

    #[test]
    fn gemma3n_unsupported_settings_are_refused() {
        for (bad, field) in [
            (serde_json::json!({"vocab_offset": 384, "conf_attention_context_right": 2}), "conf_attention_context_right"),
            (serde_json::json!({"vocab_offset": 384, "sscp_conv_stride_size": [[2, 2], [1, 1]]}), "sscp_conv_stride_size"),
            (serde_json::json!({"vocab_offset": 384, "sscp_conv_kernel_size": [[3, 3]]}), "sscp_conv_kernel_size"),
            (serde_json::json!({"vocab_offset": 384, "hidden_size": 100, "conf_num_attention_heads": 8}), "conf_num_attention_heads"),
            (serde_json::json!({"vocab_offset": 384, "conf_attention_context_left": 0}), "conf_attention_context_left"),
            (serde_json::json!({}), "vocab_offset"),
        ] {
            let e = config_3n(bad).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
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
