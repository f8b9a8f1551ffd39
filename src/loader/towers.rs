//! The vision tower and projector of a multimodal checkpoint: its configuration, the check of
//! every tensor it needs (the same diagnostics as the text model's, grouped by tower block),
//! loading them (any MLX quantization, or float beside a quantized text model); the same for
//! the audio towers (Gemma 4's, Gemma 3n's) and their projectors.

use std::collections::HashSet;

use markbase_graph::builder::WeightResolver;
use markbase_graph::ir::WeightParam;
use markbase_graph::audio::{audio_tower_params, AudioConfig};
use markbase_graph::tower::{build_audio_tower, build_gemma4_tower, build_siglip_tower, GEMMA3_PROJECTOR, GEMMA3_PROJECTOR_LINEAR, POSITION_TABLE, SIGLIP_PATCH};
use markbase_graph::vision::{tower_params, TowerKind, VisionConfig};
use markbase_graph::{Graph, WeightFormat};

use super::{Checkpoint, LoadError, Part, Problem, Report, Severity, TensorInfo};
use crate::audio::{FeatureConfig, FeatureExtractor};
use crate::memory::TowerNeeds;
use crate::vision::processor::{tower_grid, GEMMA4_BUDGETS};
use crate::weights::Weights;

/// Prefixes of the audio tower's tensors (not part of the vision check: listed, never fatal
/// there; [`Checkpoint::check_audio`] checks them).
const AUDIO: [&str; 2] = ["audio_tower.", "embed_audio."];

/// Tensors the tower graphs read that are views of a stored one: the x and y halves of Gemma
/// 4's `[2, N, hidden]` position table as `[N, hidden]` tables; SigLIP's conv patch embedding
/// `[O, kh, kw, C]` as the matrix `[O, kh·kw·C]` it is over (py, px, c)-ordered patches; Gemma 3's
/// `[hidden, D]` projector as the `[D, hidden]` matrix of a linear.
pub(super) fn derived(t: &TensorInfo) -> Vec<TensorInfo> {
    if t.defect.is_some() {
        return vec![];
    }
    let view = |name: String, shape: Vec<usize>, part: Part| TensorInfo { name, shape, part, ..t.clone() };
    let s = &t.shape;
    if t.name == POSITION_TABLE && s.len() == 3 && s[0] == 2 {
        return [("x", false), ("y", true)]
            .into_iter()
            .map(|(axis, second)| view(format!("{POSITION_TABLE}.{axis}.weight"), s[1..].to_vec(), Part::Half { second }))
            .collect();
    }
    if t.name == format!("{SIGLIP_PATCH}.weight") && s.len() == 4 {
        return vec![view(format!("{SIGLIP_PATCH}.matrix.weight"), vec![s[0], s[1] * s[2] * s[3]], Part::Whole)];
    }
    if t.name == GEMMA3_PROJECTOR && s.len() == 2 {
        return vec![view(format!("{GEMMA3_PROJECTOR_LINEAR}.weight"), vec![s[1], s[0]], Part::Transposed)];
    }
    vec![]
}

fn is_derived(name: &str) -> bool {
    [format!("{POSITION_TABLE}.x.weight"), format!("{POSITION_TABLE}.y.weight"), format!("{SIGLIP_PATCH}.matrix.weight"), format!("{GEMMA3_PROJECTOR_LINEAR}.weight")]
        .iter()
        .any(|d| d == name)
}

/// Resolves the tower graphs' weights from the tower tensors.
struct TowerResolver<'a>(&'a Checkpoint);

impl WeightResolver for TowerResolver<'_> {
    fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat {
        let cp = self.0;
        if module {
            return cp.module_format(&cp.tower_index, name, Some(shape));
        }
        let dtype = cp.tower_index.get(name).and_then(|t| super::float_type(t.dtype));
        WeightFormat::Float { dtype: dtype.unwrap_or(markbase_graph::FloatType::Bf16) }
    }

    fn exists(&self, name: &str) -> bool {
        self.0.tower_index.contains_key(name) || self.0.tower_index.contains_key(&format!("{name}.weight"))
    }
}

/// What the towers of a checkpoint hold.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TowerSummary {
    /// `gemma4 ViT` / `SigLIP`, when there is a vision tower.
    pub vision: Option<String>,
    pub vision_layers: usize,
    /// Parameters of the vision tower and projector.
    pub vision_params: u64,
    pub vision_bytes: u64,
    /// How the vision tensors are stored (`F32`, `BF16`, `4-bit affine g64`, ...), distinct values.
    pub vision_storage: Vec<String>,
    /// Soft tokens per image (Gemma 4: the default budget).
    pub soft_tokens: usize,
    /// Audio tower tensors, listed.
    pub audio_tensors: Vec<String>,
    /// Conformer blocks of the audio tower, where the engine runs it (Gemma 4's, Gemma 3n's),
    /// and which tower it is.
    pub audio_layers: Option<usize>,
    pub audio_tower: Option<&'static str>,
}

impl Checkpoint {
    /// The vision tower's configuration (`None`: a text-only checkpoint).
    pub fn vision_config(&self) -> Result<Option<VisionConfig>, LoadError> {
        VisionConfig::from_value(self.config_json(), self.config())
            .map_err(|e| LoadError::Config { path: self.dir().join("config.json"), msg: e.to_string() })
    }

    /// Names of the audio tower's tensors.
    pub fn audio_tensors(&self) -> Vec<&str> {
        self.towers.iter().filter(|n| AUDIO.iter().any(|a| n.starts_with(a))).map(String::as_str).collect()
    }

    /// The vision weights as graph parameters: module formats from the stored tensors.
    pub fn vision_params(&self, vc: &VisionConfig) -> Vec<WeightParam> {
        let res = TowerResolver(self);
        tower_params(vc)
            .into_iter()
            .map(|p| WeightParam { format: res.format(&p.name, &p.shape, p.module), name: p.name, shape: p.shape, module: p.module })
            .collect()
    }

    /// Prefix of the tower's blocks (`layers.N.` follows it), for the report.
    fn block_prefix(vc: &VisionConfig) -> &'static str {
        match vc.kind {
            TowerKind::Gemma4Vit => "vision_tower.encoder.",
            TowerKind::Siglip => "vision_tower.vision_model.encoder.",
        }
    }

    /// Checks every tensor of the vision tower and projector: missing, mis-shaped, mis-typed
    /// (by block, all at once). Vision tensors the tower does not use are warnings; the audio
    /// tower's tensors are one warning (listed, not used).
    pub fn check_vision(&self, vc: &VisionConfig) -> Report {
        let pre = Self::block_prefix(vc);
        let mut r = Report::new(self.dir(), pre);
        for (name, t) in &self.tower_index {
            if let Some(d) = &t.defect {
                r.push(Problem::tensor(Severity::Error, name, pre, d.message.clone()));
            }
        }
        let mut used = HashSet::new();
        for p in self.vision_params(vc) {
            self.check_param(&self.tower_index, pre, &p, &mut used, &mut r);
        }
        let audio = self.audio_tensors();
        for name in self.tower_index.keys() {
            let is_audio = audio.contains(&name.as_str());
            // HF's converter may write an unused pooler scale (never read by HF or mlx-vlm)
            if !used.contains(name.as_str()) && !is_audio && !is_derived(name) && !name.starts_with("vision_tower.pooler.") {
                r.push(Problem::tensor(Severity::Warning, name, pre, "unexpected tensor ignored: not used by the vision tower"));
            }
        }
        if !audio.is_empty() && self.audio_config().ok().flatten().is_none() {
            r.push(Problem::warning("audio_tower", format!("{} audio tensors ignored: this audio tower is not supported (Gemma 4's and Gemma 3n's are)", audio.len())));
        }
        r
    }

    /// Checks and copies the vision tower's and projector's weights; any error fails with the
    /// whole report (warnings come back with the weights).
    pub fn load_vision(&self, vc: &VisionConfig) -> Result<(Weights, Report), LoadError> {
        let report = self.check_vision(vc);
        if report.has_errors() {
            return Err(LoadError::Invalid(report));
        }
        let params = self.vision_params(vc);
        let refs: Vec<&WeightParam> = params.iter().collect();
        self.copy_params(&self.tower_index, &refs, report, &super::LoadOptions::default())
    }

    /// The graph of the vision tower over a `rows x cols` patch grid (Gemma 4's ViT; SigLIP's
    /// grid is fixed by its config and the sizes are ignored).
    pub fn tower_graph(&self, vc: &VisionConfig, rows: usize, cols: usize) -> Result<Graph, LoadError> {
        match vc.kind {
            TowerKind::Gemma4Vit => build_gemma4_tower(vc, &TowerResolver(self), rows, cols).map_err(|e| LoadError::Build(e.to_string())),
            TowerKind::Siglip => build_siglip_tower(vc, &TowerResolver(self)).map_err(|e| LoadError::Build(e.to_string())),
        }
    }

    /// Checks and copies the weights of a tower graph (see [`tower_graph`](Self::tower_graph)).
    pub fn load_tower(&self, vc: &VisionConfig, graph: &Graph) -> Result<(Weights, Report), LoadError> {
        self.load_graph_weights(Self::block_prefix(vc), graph)
    }

    /// The audio tower's configuration (`None`: no `audio_config`, or a family whose audio
    /// tower is not supported).
    pub fn audio_config(&self) -> Result<Option<AudioConfig>, LoadError> {
        AudioConfig::from_value(self.config_json(), self.config()).map_err(|e| LoadError::Config { path: self.dir().join("config.json"), msg: e.to_string() })
    }

    /// Checks every tensor of the audio tower and its projector: missing, mis-shaped,
    /// mis-typed (by block, all at once); audio tensors the tower does not use are warnings.
    pub fn check_audio(&self, ac: &AudioConfig) -> Report {
        let pre = "audio_tower.";
        let mut r = Report::new(self.dir(), pre);
        let res = TowerResolver(self);
        let mut used = HashSet::new();
        for p in audio_tower_params(ac) {
            let wp = WeightParam { format: res.format(&p.name, &p.shape, p.module), name: p.name, shape: p.shape, module: p.module };
            self.check_param(&self.tower_index, pre, &wp, &mut used, &mut r);
        }
        for name in self.audio_tensors() {
            if let Some(d) = self.tower_index.get(name).and_then(|t| t.defect.as_ref()) {
                r.push(Problem::tensor(Severity::Error, name, pre, d.message.clone()));
            } else if !used.contains(name) {
                r.push(Problem::tensor(Severity::Warning, name, pre, "unexpected tensor ignored: not used by the audio tower"));
            }
        }
        r
    }

    /// The graph of the audio tower (Gemma 4's or Gemma 3n's) over `frames` log-mel frames.
    pub fn audio_tower_graph(&self, ac: &AudioConfig, frames: usize) -> Result<Graph, LoadError> {
        build_audio_tower(ac, &TowerResolver(self), frames).map_err(|e| LoadError::Build(e.to_string()))
    }

    /// Checks and copies the weights of an audio tower graph (see
    /// [`audio_tower_graph`](Self::audio_tower_graph)).
    pub fn load_audio_tower(&self, graph: &Graph) -> Result<(Weights, Report), LoadError> {
        self.load_graph_weights("audio_tower.", graph)
    }

    fn load_graph_weights(&self, pre: &str, graph: &Graph) -> Result<(Weights, Report), LoadError> {
        let mut r = Report::new(self.dir(), pre);
        let mut used = HashSet::new();
        let mut params: Vec<&WeightParam> = vec![];
        for (_, p) in graph.weights() {
            if !params.iter().any(|q| q.name == p.name) {
                self.check_param(&self.tower_index, pre, p, &mut used, &mut r);
                params.push(p);
            }
        }
        if r.has_errors() {
            return Err(LoadError::Invalid(r));
        }
        self.copy_params(&self.tower_index, &params, r, &super::LoadOptions::default())
    }

    /// What the vision and audio towers need in memory, checked before the model loads: each
    /// tower's weights as stored and the buffers of one run over its largest input (Gemma 4's
    /// ViT at its largest budget, 1,120 soft tokens; SigLIP at its input size; the audio tower
    /// over the longest clip the feature extractor takes). A tower whose config, processor
    /// settings or graph cannot be made is left out: giving it an input reports that.
    pub fn tower_needs(&self) -> Vec<TowerNeeds> {
        let mut out = vec![];
        if let Ok(Some(vc)) = self.vision_config() {
            let bytes = self.vision_params(&vc).iter().map(|p| p.stored_bytes() as u64).sum();
            let grid = tower_grid(&vc, GEMMA4_BUDGETS[GEMMA4_BUDGETS.len() - 1]);
            if let Ok(g) = grid.and_then(|(r, c)| self.tower_graph(&vc, r, c).map_err(|e| e.to_string())) {
                let name = format!("the {} vision tower at {} patches", vc.kind.name(), g.tokens);
                out.extend(TowerNeeds::of(name, g, bytes).ok());
            }
        }
        if let Ok(Some(ac)) = self.audio_config() {
            let res = TowerResolver(self);
            let bytes = audio_tower_params(&ac).iter().map(|p| WeightParam { format: res.format(&p.name, &p.shape, p.module), name: p.name.clone(), shape: p.shape.clone(), module: p.module }.stored_bytes() as u64).sum();
            let frames = FeatureConfig::from_checkpoint(self.dir()).and_then(|c| {
                let longest = if c.max_length > 0 { c.max_length } else { 30 * c.sampling_rate as usize };
                let seconds = longest as f64 / c.sampling_rate.max(1) as f64;
                Ok((FeatureExtractor::new(c)?.frames(longest), seconds))
            });
            if let Ok((frames, seconds)) = frames {
                if let Ok(g) = self.audio_tower_graph(&ac, frames) {
                    out.extend(TowerNeeds::of(format!("the audio tower at a {seconds:.0} s clip"), g, bytes).ok());
                }
            }
        }
        out
    }

    /// What the towers hold, for `inspect` (`None` values when the config has no vision tower
    /// or cannot be read).
    pub fn tower_summary(&self) -> TowerSummary {
        let mut s = TowerSummary {
            audio_tensors: self.audio_tensors().iter().map(|n| n.to_string()).collect(),
            audio_layers: self.audio_config().ok().flatten().map(|a| a.layers),
            audio_tower: self.audio_config().ok().flatten().map(|a| a.kind.name()),
            ..Default::default()
        };
        let Ok(Some(vc)) = self.vision_config() else { return s };
        s.vision = Some(vc.kind.name().to_string());
        s.vision_layers = vc.layers;
        s.soft_tokens = vc.default_tokens;
        let mut storage = vec![];
        for p in self.vision_params(&vc) {
            s.vision_params += p.shape.iter().product::<usize>() as u64;
            s.vision_bytes += p.stored_bytes() as u64;
            let st = match p.format {
                markbase_graph::WeightFormat::Float { dtype } => format!("{dtype:?}").to_uppercase(),
                markbase_graph::WeightFormat::Quantized { spec, .. } => spec.describe(),
            };
            if !storage.contains(&st) {
                storage.push(st);
            }
        }
        s.vision_storage = storage;
        s
    }
}
