//! Clips to soft tokens: the checkpoint's feature extractor and its audio tower (Gemma 4's or
//! Gemma 3n's; a compiled graph per frame count), on the CPU reference executor or the GPU.

use std::collections::HashMap;
use std::path::Path;

use markbase_graph::audio::{AudioConfig, AudioKind};
use markbase_graph::passes::{compile, Compiled, PhasePolicy};

use crate::cpu::exec::StepInputs;
use crate::loader::Checkpoint;
use crate::model::DeviceKind;
use crate::vision::encode::{Modality, Runner, SoftTokens};
use crate::Error;

use super::{FeatureConfig, FeatureExtractor, Features, LoadOptions, LongClips};

/// A checkpoint's audio tower, ready to encode clips.
pub struct AudioEncoder {
    cp: Checkpoint,
    ac: AudioConfig,
    fx: FeatureExtractor,
    runner: Runner,
    /// Compiled tower graphs by frame count.
    graphs: HashMap<usize, Compiled>,
}

/// The audio config of the checkpoint in `dir`, or the error of giving it clips.
pub fn audio_config(cp: &Checkpoint) -> Result<AudioConfig, Error> {
    cp.audio_config()?.ok_or_else(|| {
        Error::Input(format!("{} has no audio tower markbase runs (no Gemma 4 or Gemma 3n audio_config in config.json): it takes no audio", cp.dir().display()))
    })
}

impl AudioEncoder {
    /// Opens the checkpoint in `dir` and loads its audio tower onto `device`.
    pub fn open(dir: &Path, device: DeviceKind, check_nan: bool) -> Result<Self, Error> {
        let cp = Checkpoint::open(dir)?;
        let ac = audio_config(&cp)?;
        let fx = FeatureExtractor::new(FeatureConfig::from_checkpoint(dir)?)?;
        if fx.config().feature_size != ac.features {
            return Err(Error::Config(format!("the feature extractor makes {} mel bins, the audio tower takes {}", fx.config().feature_size, ac.features)));
        }
        // the weights are the same for every frame count: load them through a small graph
        let runner = Runner::open(&cp, "audio", device, check_nan, || {
            let r = cp.check_audio(&ac);
            if r.has_errors() {
                return Err(Error::Load(r.to_string()));
            }
            let g = cp.audio_tower_graph(&ac, 4)?;
            Ok(cp.load_audio_tower(&g)?.0)
        })?;
        Ok(AudioEncoder { cp, ac, fx, runner, graphs: HashMap::new() })
    }

    pub fn audio_config(&self) -> &AudioConfig {
        &self.ac
    }

    /// How clips are read for this extractor (its sample rate).
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions { rate: self.fx.config().sampling_rate, ..LoadOptions::default() }
    }

    /// The features of a clip (mono samples at the extractor's rate); a clip longer than the
    /// model takes (30 s) is refused.
    pub fn features(&self, samples: &[f32]) -> Result<Features, Error> {
        let mut f = self.fx.extract_clip(samples, LongClips::Refuse)?;
        f.pop().ok_or_else(|| Error::Audio("the clip holds no samples".into()))
    }

    /// The soft tokens of a clip's features. Gemma 4: the tower's rows of real frames (HF
    /// keeps those and drops the rows of padding); Gemma 3n: the clip's fixed count of slots
    /// (188), the rows of real frames first, then HF's padding embedding.
    pub fn encode_features(&mut self, f: &Features) -> Result<SoftTokens, Error> {
        if f.bins != self.ac.features || f.frames == 0 || f.mask.len() != f.frames {
            return Err(Error::Input(format!("audio features of {} frames x {} bins for a tower taking {} bins", f.frames, f.bins, self.ac.features)));
        }
        if !self.graphs.contains_key(&f.frames) {
            let g = self.cp.audio_tower_graph(&self.ac, f.frames)?;
            let c = compile(g, PhasePolicy::EmbedLayersHead).map_err(|e| Error::Config(e.to_string()))?;
            self.graphs.insert(f.frames, c);
        }
        let inputs = TowerInputs::new(&self.ac, &f.mask);
        let rows = self.runner.soft(&self.graphs[&f.frames], &inputs.step(&f.data))?;
        inputs.soft_tokens(&self.ac, rows)
    }

    /// The soft tokens of a clip (mono samples at the extractor's rate).
    pub fn encode(&mut self, samples: &[f32]) -> Result<SoftTokens, Error> {
        let f = self.features(samples)?;
        self.encode_features(&f)
    }
}

/// A clip's inputs to the tower graph besides its features: the frame mask, Gemma 3n's slot
/// inputs ([`slot_inputs`]), and which encoder rows stand for real frames.
pub struct TowerInputs {
    pub valid: Vec<u32>,
    pub ids: Vec<u32>,
    pub index: Vec<u32>,
    pub real: Vec<bool>,
}

impl TowerInputs {
    /// The inputs of a clip whose frames are real where `mask` is.
    pub fn new(ac: &AudioConfig, mask: &[bool]) -> Self {
        let valid = mask.iter().map(|&v| v as u32).collect();
        // a row is real where its frame is, after the two stride-2 steps and the reduction
        // (`mask[::4 · reduction]`)
        let real: Vec<bool> = mask.iter().step_by(4 * ac.reduction).copied().collect();
        let (ids, index) = slot_inputs(ac, &real);
        TowerInputs { valid, ids, index, real }
    }

    /// The step running the tower over `features`.
    pub fn step<'a>(&'a self, features: &'a [f32]) -> StepInputs<'a> {
        StepInputs { features, audio_valid: &self.valid, tokens: &self.ids, soft_index: &self.index, ..Default::default() }
    }

    /// The soft tokens of the tower's `soft` output `rows`. Gemma 4: the rows of real frames
    /// (HF keeps those and drops the rows of padding); Gemma 3n: every slot.
    pub fn soft_tokens(&self, ac: &AudioConfig, rows: Vec<f32>) -> Result<SoftTokens, Error> {
        let width = ac.text_hidden;
        let data: Vec<f32> = match ac.kind {
            AudioKind::Gemma4 => rows.chunks(width).zip(&self.real).filter(|(_, &v)| v).flat_map(|(r, _)| r.iter().copied()).collect(),
            AudioKind::Gemma3n => rows,
        };
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            return Err(Error::Device(format!("the audio tower made a non-finite soft token value (at {i})")));
        }
        Ok(SoftTokens { tokens: data.len() / width, width, data, kind: Modality::Audio })
    }
}

/// Gemma 3n's slot inputs for a clip whose encoder rows are `real` or padding: each slot's
/// hard-embedding row (the padding one) and its encoder row plus one (0: padding). Empty for
/// Gemma 4.
pub fn slot_inputs(ac: &AudioConfig, real: &[bool]) -> (Vec<u32>, Vec<u32>) {
    if ac.kind != AudioKind::Gemma3n {
        return (vec![], vec![]);
    }
    let ids = vec![ac.pad_row as u32; ac.soft_slots];
    let index = (0..ac.soft_slots).map(|s| if real.get(s).copied().unwrap_or(false) { s as u32 + 1 } else { 0 }).collect();
    (ids, index)
}

/// Encodes audio files with the tower of the checkpoint in `dir`: all rows, their width, and
/// the soft tokens of each clip. Files are read first ([`read_clips`]).
pub fn encode_files(dir: &Path, clips: &[std::path::PathBuf], device: DeviceKind, check_nan: bool) -> Result<(Vec<f32>, usize, Vec<usize>), Error> {
    let samples = read_clips(dir, clips)?;
    let mut enc = AudioEncoder::open(dir, device, check_nan)?;
    let (mut rows, mut counts) = (vec![], vec![]);
    for s in &samples {
        let soft = enc.encode(s)?;
        counts.push(soft.tokens);
        rows.extend(soft.data);
    }
    Ok((rows, enc.ac.text_hidden, counts))
}

/// Reads audio files as mono clips at the extractor's rate, for the model in `dir`, which must
/// have an audio tower; a clip over what the model takes (30 s) is refused. What the commands
/// do before any weight is loaded, so that a bad file is reported first.
pub fn read_clips(dir: &Path, paths: &[std::path::PathBuf]) -> Result<Vec<Vec<f32>>, Error> {
    if paths.is_empty() {
        return Ok(vec![]);
    }
    audio_config(&Checkpoint::open(dir)?)?;
    let cfg = FeatureConfig::from_checkpoint(dir)?;
    let opts = LoadOptions { rate: cfg.sampling_rate, ..LoadOptions::default() };
    let fx = FeatureExtractor::new(cfg)?;
    paths
        .iter()
        .map(|p| {
            let c = super::load(p, &opts)?;
            fx.extract_clip(&c, LongClips::Refuse).map_err(|e| Error::Audio(format!("{}: {e}", p.display())))?;
            Ok(c)
        })
        .collect()
}
