//! Log-mel features of the Gemma 4 and Gemma 3n audio towers, computed as HF transformers'
//! `Gemma4AudioFeatureExtractor` and `Gemma3nAudioFeatureExtractor` compute them.
//!
//! Both: pad the clip on the right to a multiple of 128 samples (mask 1 on real samples),
//! cut frames of `frame_length + 1` samples every `hop` samples, apply the optional
//! pre-emphasis (which uses the extra sample) or drop the extra sample, multiply by a
//! periodic Hann window, take `|rfft|` of length `fft_length`, project on an HTK mel
//! filterbank (no normalisation) and take the log. They differ in:
//!
//! | | Gemma 4 | Gemma 3n |
//! |---|---|---|
//! | left padding | `frame_length / 2` zeros ("semicausal") | none |
//! | log | `ln(mel + floor)` | `ln(max(mel, floor))` |
//! | a frame is valid when | its last sample is real | its first sample is real |
//! | invalid frames | set to 0 | kept |
//! | soft tokens | valid frames after two stride-2 steps (≈ 25/s) | always `audio_seq_length` (188) |
//!
//! The waveform, window and pre-emphasis arithmetic is done in f32 as HF does; the FFT,
//! the mel projection and the log in f64, and the result is rounded to f32.

use std::path::Path;
use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};
use serde_json::Value;

use super::{audio_err, split_clip, LongClips};
use crate::Error;

/// Which extractor: their defaults and their framing, mask and token rules differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `Gemma4AudioFeatureExtractor`.
    Gemma4,
    /// `Gemma3nAudioFeatureExtractor`.
    Gemma3n,
}

/// The extractor's settings, as named in a processor config.
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureConfig {
    pub family: Family,
    /// Mel bins per frame.
    pub feature_size: usize,
    pub sampling_rate: u32,
    pub frame_length_ms: f64,
    pub hop_length_ms: f64,
    pub min_frequency: f64,
    pub max_frequency: f64,
    pub preemphasis: f64,
    pub preemphasis_htk_flavor: bool,
    /// Doubles the FFT length.
    pub fft_overdrive: bool,
    pub input_scale_factor: f64,
    pub mel_floor: f64,
    pub per_bin_mean: Option<Vec<f64>>,
    pub per_bin_stddev: Option<Vec<f64>>,
    pub padding_value: f64,
    /// The most samples one clip may have (30 s at 16 kHz); 0 for no limit.
    pub max_length: usize,
    pub pad_to_multiple_of: usize,
    /// Gemma 4: the cap on soft tokens per clip; Gemma 3n: the fixed count per clip.
    pub audio_seq_length: usize,
}

impl FeatureConfig {
    /// HF's defaults for `family` (which the checkpoint converters save unchanged).
    pub fn defaults(family: Family) -> FeatureConfig {
        let common = FeatureConfig {
            family,
            feature_size: 128,
            sampling_rate: 16_000,
            frame_length_ms: 20.0,
            hop_length_ms: 10.0,
            min_frequency: 0.0,
            max_frequency: 8000.0,
            preemphasis: 0.0,
            preemphasis_htk_flavor: true,
            fft_overdrive: false,
            input_scale_factor: 1.0,
            mel_floor: 1e-3,
            per_bin_mean: None,
            per_bin_stddev: None,
            padding_value: 0.0,
            max_length: 480_000,
            pad_to_multiple_of: 128,
            audio_seq_length: 750,
        };
        match family {
            Family::Gemma4 => common,
            Family::Gemma3n => FeatureConfig {
                frame_length_ms: 32.0,
                min_frequency: 125.0,
                max_frequency: 7600.0,
                preemphasis: 0.97,
                fft_overdrive: true,
                mel_floor: 1e-5,
                audio_seq_length: 188,
                ..common
            },
        }
    }

    /// Reads the settings from a feature-extractor object (the keys of HF's
    /// `preprocessor_config.json`); missing keys keep `family`'s defaults. A
    /// `feature_extractor_type` naming the other family switches to it.
    pub fn from_json(v: &Value, family: Family) -> Result<FeatureConfig, Error> {
        let family = match v.get("feature_extractor_type").and_then(Value::as_str) {
            Some(t) if t.contains("Gemma3n") => Family::Gemma3n,
            Some(t) if t.contains("Gemma4") => Family::Gemma4,
            _ => family,
        };
        let mut c = FeatureConfig::defaults(family);
        let bad = |k: &str| Error::Config(format!("audio feature extractor: `{k}` has the wrong type"));
        let f = |k: &str, d: f64| -> Result<f64, Error> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(d),
                Some(x) => x.as_f64().ok_or_else(|| bad(k)),
            }
        };
        let u = |k: &str, d: usize| -> Result<usize, Error> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(d),
                Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| bad(k)),
            }
        };
        let b = |k: &str, d: bool| -> Result<bool, Error> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(d),
                Some(x) => x.as_bool().ok_or_else(|| bad(k)),
            }
        };
        let list = |k: &str| -> Result<Option<Vec<f64>>, Error> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) => a.iter().map(|x| x.as_f64().ok_or_else(|| bad(k))).collect::<Result<_, _>>().map(Some),
                Some(_) => Err(bad(k)),
            }
        };
        c.feature_size = u("feature_size", c.feature_size)?;
        c.sampling_rate = u("sampling_rate", c.sampling_rate as usize)? as u32;
        c.frame_length_ms = f("frame_length_ms", c.frame_length_ms)?;
        c.hop_length_ms = f("hop_length_ms", c.hop_length_ms)?;
        c.min_frequency = f("min_frequency", c.min_frequency)?;
        c.max_frequency = f("max_frequency", c.max_frequency)?;
        c.preemphasis = f("preemphasis", c.preemphasis)?;
        c.preemphasis_htk_flavor = b("preemphasis_htk_flavor", c.preemphasis_htk_flavor)?;
        c.fft_overdrive = b("fft_overdrive", c.fft_overdrive)?;
        c.input_scale_factor = f("input_scale_factor", c.input_scale_factor)?;
        c.mel_floor = f("mel_floor", c.mel_floor)?;
        c.per_bin_mean = list("per_bin_mean")?;
        c.per_bin_stddev = list("per_bin_stddev")?;
        c.padding_value = f("padding_value", c.padding_value)?;
        c.max_length = u("max_length", c.max_length)?;
        c.pad_to_multiple_of = u("pad_to_multiple_of", c.pad_to_multiple_of)?;
        c.audio_seq_length = u("audio_seq_length", c.audio_seq_length)?;
        if f("dither", 0.0)? != 0.0 {
            return Err(Error::Config(
                "audio feature extractor: `dither` adds random noise, which this extractor does not do; set it to 0".into(),
            ));
        }
        c.validate()?;
        Ok(c)
    }

    /// The settings of a checkpoint directory: `processor_config.json` (its
    /// `feature_extractor` object and `audio_seq_length`), else `preprocessor_config.json`,
    /// else the defaults of the family named by `config.json`'s `model_type`.
    pub fn from_checkpoint(dir: &Path) -> Result<FeatureConfig, Error> {
        let read = |name: &str| -> Result<Option<Value>, Error> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&p).map_err(|e| Error::Load(format!("{}: {e}", p.display())))?;
            serde_json::from_str(&text).map(Some).map_err(|e| Error::Config(format!("{}: {e}", p.display())))
        };
        let family = match read("config.json")?.as_ref().and_then(|c| c.get("model_type")).and_then(Value::as_str) {
            Some(t) if t.starts_with("gemma3n") => Some(Family::Gemma3n),
            Some(t) if t.starts_with("gemma4") => Some(Family::Gemma4),
            _ => None,
        };
        let processor = read("processor_config.json")?;
        let mut fe = processor.as_ref().and_then(|p| p.get("feature_extractor")).cloned();
        if fe.is_none() {
            fe = read("preprocessor_config.json")?.filter(|p| {
                p.get("feature_extractor_type").and_then(Value::as_str).is_some_and(|t| t.contains("Audio"))
            });
        }
        let family = match (&fe, family) {
            (_, Some(f)) => f,
            (Some(v), None) if v.get("feature_extractor_type").and_then(Value::as_str).is_some_and(|t| t.contains("Gemma3n")) => {
                Family::Gemma3n
            }
            (Some(_), None) => Family::Gemma4,
            (None, None) => {
                return Err(Error::Config(format!("{}: no audio feature extractor settings and no Gemma 4 or Gemma 3n model_type", dir.display())))
            }
        };
        let mut obj = fe.unwrap_or_else(|| Value::Object(Default::default()));
        if let (Some(n), Value::Object(m)) = (processor.as_ref().and_then(|p| p.get("audio_seq_length")), &mut obj) {
            m.entry("audio_seq_length").or_insert_with(|| n.clone());
        }
        FeatureConfig::from_json(&obj, family)
    }

    fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Config(format!("audio feature extractor: {m}")));
        if self.feature_size == 0 || self.feature_size > 4096 {
            return bad(format!("feature_size {} is outside 1..=4096", self.feature_size));
        }
        if !(1000..=768_000).contains(&self.sampling_rate) {
            return bad(format!("sampling_rate {} is outside 1000..=768000", self.sampling_rate));
        }
        let fl = self.frame_length();
        if !(2..=65_536).contains(&fl) || self.hop_length() == 0 || self.hop_length() > 65_536 {
            return bad(format!("frame of {fl} samples and hop of {} samples are not usable", self.hop_length()));
        }
        if !(self.min_frequency >= 0.0 && self.min_frequency < self.max_frequency && self.max_frequency.is_finite()) {
            return bad(format!("frequency range {}..{} Hz is not usable", self.min_frequency, self.max_frequency));
        }
        if !(self.mel_floor > 0.0 && self.mel_floor.is_finite()) {
            return bad(format!("mel_floor {} must be positive", self.mel_floor));
        }
        for (k, l) in [("per_bin_mean", &self.per_bin_mean), ("per_bin_stddev", &self.per_bin_stddev)] {
            if let Some(l) = l {
                if l.len() != self.feature_size {
                    return bad(format!("{k} has {} values for {} mel bins", l.len(), self.feature_size));
                }
            }
        }
        if self.pad_to_multiple_of > 1 << 20 || self.max_length > 1 << 28 {
            return bad("pad_to_multiple_of or max_length is absurd".into());
        }
        Ok(())
    }

    /// Samples per frame: `round(rate · ms / 1000)`, ties to even as Python rounds.
    pub fn frame_length(&self) -> usize {
        (self.sampling_rate as f64 * self.frame_length_ms / 1000.0).round_ties_even().max(0.0) as usize
    }

    /// Samples between frames.
    pub fn hop_length(&self) -> usize {
        (self.sampling_rate as f64 * self.hop_length_ms / 1000.0).round_ties_even().max(0.0) as usize
    }

    /// The next power of two ≥ the frame length, doubled with `fft_overdrive`.
    pub fn fft_length(&self) -> usize {
        let n = self.frame_length().next_power_of_two();
        if self.fft_overdrive {
            2 * n
        } else {
            n
        }
    }
}

/// `numpy.linspace(start, stop, num)`: `start + i·step`, the last point exactly `stop`.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let step = if num > 1 { (stop - start) / (num - 1) as f64 } else { 0.0 };
    let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    if num > 1 {
        v[num - 1] = stop;
    }
    v
}

/// The HTK mel filterbank, no normalisation, as a row-major `[fft_length/2 + 1, feature_size]`
/// matrix: triangles between consecutive points of `feature_size + 2` mel-spaced frequencies.
pub fn mel_filter_bank(c: &FeatureConfig) -> Vec<f64> {
    let bins = c.fft_length() / 2 + 1;
    let m = c.feature_size;
    let mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
    let hz = |m: f64| 700.0 * (10f64.powf(m / 2595.0) - 1.0);
    let pts: Vec<f64> = linspace(mel(c.min_frequency), mel(c.max_frequency), m + 2).into_iter().map(hz).collect();
    let freqs: Vec<f64> = match c.family {
        // linspace(0, rate // 2, bins)
        Family::Gemma4 => linspace(0.0, (c.sampling_rate / 2) as f64, bins),
        // arange(bins, f32) · (rate / fft_length), in f32
        Family::Gemma3n => {
            let step = (c.sampling_rate as f64 / c.fft_length() as f64) as f32;
            (0..bins).map(|k| (k as f32 * step) as f64).collect()
        }
    };
    let mut fb = vec![0.0f64; bins * m];
    for (k, &f) in freqs.iter().enumerate() {
        for j in 0..m {
            let down = -(pts[j] - f) / (pts[j + 1] - pts[j]);
            let up = (pts[j + 2] - f) / (pts[j + 2] - pts[j + 1]);
            fb[k * m + j] = down.min(up).max(0.0);
        }
    }
    fb
}

/// The features of one clip.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// Number of frames.
    pub frames: usize,
    /// Mel bins per frame.
    pub bins: usize,
    /// Row-major `[frames, bins]` log-mel features.
    pub data: Vec<f32>,
    /// Per frame: built from real samples (not padding).
    pub mask: Vec<bool>,
    /// The audio soft tokens this clip takes in the prompt.
    pub soft_tokens: usize,
    /// The clip's real samples.
    pub samples: usize,
}

/// A configured extractor: window, filterbank and FFT plan are built once.
pub struct FeatureExtractor {
    cfg: FeatureConfig,
    window: Vec<f32>,
    /// Per mel filter: its first non-zero bin and weights.
    filters: Vec<(usize, Vec<f64>)>,
    fft: Arc<dyn RealToComplex<f64>>,
}

impl std::fmt::Debug for FeatureExtractor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeatureExtractor").field("cfg", &self.cfg).finish()
    }
}

impl FeatureExtractor {
    /// Frames of a clip of `samples` samples (padding frames included).
    pub fn frames(&self, samples: usize) -> usize {
        self.frame_plan(samples).0
    }

    pub fn new(cfg: FeatureConfig) -> Result<FeatureExtractor, Error> {
        cfg.validate()?;
        let fl = cfg.frame_length();
        let window: Vec<f32> = match cfg.family {
            // numpy.hanning(fl + 1)[:-1] in f64, rounded to f32.
            Family::Gemma4 => (0..fl)
                .map(|i| {
                    let n = (1 - (fl as i64 + 1) + 2 * i as i64) as f64;
                    (0.5 + 0.5 * (std::f64::consts::PI * n / fl as f64).cos()) as f32
                })
                .collect(),
            // 0.5·(1 − cos(2π·n / fl)) computed in f32.
            Family::Gemma3n => (0..fl)
                .map(|i| {
                    let a = (std::f64::consts::TAU as f32) * i as f32 / fl as f32;
                    0.5f32 * (1.0f32 - a.cos())
                })
                .collect(),
        };
        let fb = mel_filter_bank(&cfg);
        let bins = cfg.fft_length() / 2 + 1;
        let m = cfg.feature_size;
        let filters = (0..m)
            .map(|j| {
                let col: Vec<f64> = (0..bins).map(|k| fb[k * m + j]).collect();
                let first = col.iter().position(|&w| w != 0.0).unwrap_or(bins);
                let last = col.iter().rposition(|&w| w != 0.0).map_or(first, |p| p + 1);
                (first, col[first..last].to_vec())
            })
            .collect();
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(cfg.fft_length());
        Ok(FeatureExtractor { cfg, window, filters, fft })
    }

    pub fn config(&self) -> &FeatureConfig {
        &self.cfg
    }

    /// The soft tokens a clip with this frame mask takes: Gemma 4 runs the mask through two
    /// stride-2 steps (`mask[::2]` twice) and counts the valid rows, capped at
    /// `audio_seq_length`; Gemma 3n always takes `audio_seq_length`.
    pub fn soft_tokens(&self, mask: &[bool]) -> usize {
        match self.cfg.family {
            Family::Gemma4 => mask.iter().step_by(4).filter(|&&v| v).count().min(self.cfg.audio_seq_length),
            Family::Gemma3n => self.cfg.audio_seq_length,
        }
    }

    /// For a clip of `n` samples: the left padding, the padded length (a multiple of
    /// `pad_to_multiple_of`) and the validity of each frame. A frame spans `frame_length + 1`
    /// samples of the left-padded waveform; the sample deciding its validity is its last one
    /// (Gemma 4) or its first one (Gemma 3n).
    fn frame_plan(&self, n: usize) -> (usize, usize, Vec<bool>) {
        let c = &self.cfg;
        let (fl, hop) = (c.frame_length(), c.hop_length());
        let multiple = c.pad_to_multiple_of.max(1);
        let padded = n.div_ceil(multiple) * multiple;
        let left = match c.family {
            Family::Gemma4 => fl / 2,
            Family::Gemma3n => 0,
        };
        let span = fl + 1;
        let total = left + padded;
        let frames = if total >= span { (total - span) / hop + 1 } else { 0 };
        let mask = (0..frames)
            .map(|t| {
                let probe = match c.family {
                    Family::Gemma4 => t * hop + span - 1,
                    Family::Gemma3n => t * hop,
                };
                probe >= left && probe - left < n
            })
            .collect();
        (left, padded, mask)
    }

    /// Features of one clip of at most `max_length` samples at `sampling_rate` Hz.
    pub fn extract(&self, samples: &[f32]) -> Result<Features, Error> {
        let c = &self.cfg;
        if samples.is_empty() {
            return Err(audio_err("the clip holds no samples".into()));
        }
        if c.max_length > 0 && samples.len() > c.max_length {
            return split_clip(samples, c.max_length, c.sampling_rate, LongClips::Refuse).and_then(|_| {
                Err(audio_err(format!("the clip is longer than {} samples", c.max_length)))
            });
        }
        if let Some(i) = samples.iter().position(|s| !s.is_finite()) {
            return Err(audio_err(format!("the clip holds a non-finite sample (NaN or infinity) at {i}")));
        }
        let fl = c.frame_length();
        let hop = c.hop_length();
        let span = fl + 1;
        let (left, padded, mask) = self.frame_plan(samples.len());
        let frames = mask.len();
        if !mask.iter().any(|&v| v) {
            return Err(audio_err(format!(
                "the clip is too short: {} samples give no complete {} ms frame",
                samples.len(),
                c.frame_length_ms
            )));
        }
        // The padded waveform, scaled in f32 as HF scales it.
        let scale = c.input_scale_factor as f32;
        let mut x = vec![0.0f32; left + padded];
        for (d, &s) in x[left..].iter_mut().zip(samples) {
            *d = s;
        }
        for d in &mut x[left + samples.len()..] {
            *d = c.padding_value as f32;
        }
        if c.input_scale_factor != 1.0 {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let bins = c.feature_size;
        if frames.saturating_mul(bins) > 1 << 28 {
            return Err(Error::Config(format!(
                "audio feature extractor: {frames} frames of {bins} bins is more than this extractor makes at once"
            )));
        }
        let mut data = vec![0.0f32; frames * bins];
        let nfft = c.fft_length();
        let mut buf = self.fft.make_input_vec();
        let mut spec = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut mag = vec![0.0f64; nfft / 2 + 1];
        let pre = c.preemphasis as f32;
        let first_scale = (1.0 - c.preemphasis) as f32;
        for t in 0..frames {
            let fr = &x[t * hop..t * hop + span];
            buf.fill(0.0);
            for n in 0..fl {
                let v = if c.preemphasis > 0.0 {
                    if c.preemphasis_htk_flavor {
                        if n == 0 {
                            fr[0] * first_scale
                        } else {
                            fr[n] - pre * fr[n - 1]
                        }
                    } else {
                        fr[n + 1] - pre * fr[n]
                    }
                } else {
                    fr[n]
                };
                buf[n] = (v * self.window[n]) as f64;
            }
            self.fft
                .process_with_scratch(&mut buf, &mut spec, &mut scratch)
                .map_err(|e| Error::Device(format!("audio FFT: {e}")))?;
            for (m, z) in mag.iter_mut().zip(&spec) {
                *m = z.re.hypot(z.im);
            }
            let row = &mut data[t * bins..(t + 1) * bins];
            for (j, (first, w)) in self.filters.iter().enumerate() {
                let mel: f64 = w.iter().zip(&mag[*first..]).map(|(a, b)| a * b).sum();
                let mut v = match c.family {
                    Family::Gemma4 => (mel + c.mel_floor).ln(),
                    Family::Gemma3n => mel.max(c.mel_floor).ln(),
                };
                if let Some(mean) = &c.per_bin_mean {
                    v -= mean[j];
                }
                if let Some(sd) = &c.per_bin_stddev {
                    v /= sd[j];
                }
                row[j] = v as f32;
            }
            if c.family == Family::Gemma4 && !mask[t] {
                row.fill(0.0);
            }
        }
        let soft_tokens = self.soft_tokens(&mask);
        Ok(Features { frames, bins, data, mask, soft_tokens, samples: samples.len() })
    }

    /// Features of a clip of any length: one [`Features`] per piece after `policy`. When
    /// splitting, a last piece too short to give one valid frame (about 10 ms for Gemma 4,
    /// 24 ms for Gemma 3n) is left out.
    pub fn extract_clip(&self, samples: &[f32], policy: LongClips) -> Result<Vec<Features>, Error> {
        let mut pieces = split_clip(samples, self.cfg.max_length, self.cfg.sampling_rate, policy)?;
        if pieces.len() > 1 && !self.frame_plan(pieces[pieces.len() - 1].len()).2.contains(&true) {
            pieces.pop();
        }
        pieces.into_iter().map(|piece| self.extract(piece)).collect()
    }
}
