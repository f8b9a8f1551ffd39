//! Images to soft tokens: a checkpoint's image processor and vision tower (a compiled graph
//! per patch grid), on the CPU reference executor or the GPU. What `markbase encode` writes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use markbase_graph::passes::{compile, Compiled, PhasePolicy};
use markbase_graph::vision::{TowerKind, VisionConfig};

use crate::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use crate::exec::{Executor, GraphKey};
use crate::gpu::runtime::GpuExecutor;
use crate::loader::Checkpoint;
use crate::model::DeviceKind;
use crate::weights::Weights;
use crate::Error;

use super::processor::{read_processor_config, Gemma3Processor, Gemma4Processor};
use super::RgbImage;

enum Processor {
    Gemma3(Gemma3Processor),
    Gemma4(Gemma4Processor),
}

/// A tower's weights on the CPU reference executor or the GPU.
pub(crate) enum Runner {
    Cpu(CpuWeights),
    Gpu(Box<GpuExecutor>),
}

impl Runner {
    /// The tower of `cp` whose needs are named with `which` ("vision", "audio") onto `device`,
    /// its memory checked first (its weights and the buffers of a run over its largest input
    /// against the host's memory, or the adapter's binding and buffer limits), then its weights
    /// loaded by `load`: a tower that cannot fit is refused before any weight is read.
    pub(crate) fn open(cp: &Checkpoint, which: &str, device: DeviceKind, check_nan: bool, load: impl FnOnce() -> Result<Weights, Error>) -> Result<Runner, Error> {
        let needs = crate::memory::Needs { towers: cp.tower_needs().into_iter().filter(|t| t.name.contains(which)).collect(), ..Default::default() };
        Ok(match device {
            DeviceKind::Cpu => {
                needs.fit_host().map_err(Error::Device)?;
                Runner::Cpu(CpuWeights::new(Arc::new(load()?)))
            }
            DeviceKind::Gpu(b) => {
                use crate::gpu::device::{Gpu, GpuOptions};
                let gpu = Gpu::with_options(&GpuOptions { backend: b, ..Default::default() }).map_err(|e| Error::Device(e.to_string()))?;
                needs.fit_gpu(&gpu.info.name, gpu.limits(), u64::MAX, gpu.info.device_type == "cpu").map_err(Error::Device)?;
                let shared = crate::gpu::runtime::GpuShared::with_gpu(gpu, &load()?, check_nan, None).map_err(Error::Device)?;
                Runner::Gpu(Box::new(GpuExecutor::for_session(&shared)))
            }
        })
    }

    pub(crate) fn new(weights: impl Into<Arc<Weights>>, device: DeviceKind, check_nan: bool) -> Result<Runner, Error> {
        let weights = weights.into();
        Ok(match device {
            DeviceKind::Cpu => Runner::Cpu(CpuWeights::new(weights)),
            DeviceKind::Gpu(b) => Runner::Gpu(Box::new(GpuExecutor::new(b, weights, check_nan).map_err(Error::Device)?)),
        })
    }

    /// The `soft` output of a tower graph run once over `step`.
    pub(crate) fn soft(&mut self, c: &Compiled, step: &StepInputs) -> Result<Vec<f32>, Error> {
        Ok(match self {
            Runner::Cpu(w) => exec::run(c, w, &mut CpuState::default(), step).map_err(Error::Device)?["soft"].f().to_vec(),
            Runner::Gpu(g) => {
                let key = GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
                g.run(key, c, step, true).map_err(Error::Device)?.logits.ok_or_else(|| Error::Device("no soft tokens read back".into()))?
            }
        })
    }
}

/// What a run of soft tokens stands for: the placeholder id it fills.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Modality {
    #[default]
    Image,
    Audio,
}

impl Modality {
    pub fn name(self) -> &'static str {
        match self {
            Modality::Image => "image",
            Modality::Audio => "audio",
        }
    }
}

/// One image's or clip's soft tokens: `[tokens, width]` row-major.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SoftTokens {
    pub tokens: usize,
    pub width: usize,
    pub data: Vec<f32>,
    pub kind: Modality,
}

/// The placeholder ids of a decoder's soft tokens (`None`: it takes no such input).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placeholders {
    pub image: Option<u32>,
    pub audio: Option<u32>,
}

impl Placeholders {
    pub fn id(&self, kind: Modality) -> Option<u32> {
        match kind {
            Modality::Image => self.image,
            Modality::Audio => self.audio,
        }
    }

    /// Whether `t` is a placeholder of any kind.
    pub fn holds(&self, t: u32) -> bool {
        self.image == Some(t) || self.audio == Some(t)
    }
}

/// A checkpoint's vision tower, ready to encode images.
pub struct ImageEncoder {
    cp: Checkpoint,
    vc: VisionConfig,
    proc: Processor,
    /// The checkpoint's processor config (other budgets' processors are made from it).
    pc: Option<serde_json::Value>,
    runner: Runner,
    /// Compiled tower graphs by patch grid.
    graphs: HashMap<(usize, usize), Compiled>,
}

impl ImageEncoder {
    /// Opens the checkpoint in `dir` and loads its vision tower onto `device`. `budget`: Gemma
    /// 4's soft tokens per image (else the processor config's, else 280).
    pub fn open(dir: &Path, device: DeviceKind, budget: Option<usize>, check_nan: bool) -> Result<Self, Error> {
        let cp = Checkpoint::open(dir)?;
        let vc = cp.vision_config()?.ok_or_else(|| Error::Config(format!("{}: the checkpoint has no vision tower (no vision_config)", dir.display())))?;
        let pc = read_processor_config(dir).map_err(Error::Config)?;
        let proc = match vc.kind {
            TowerKind::Gemma4Vit => Processor::Gemma4(Gemma4Processor::from_config(pc.as_ref(), budget).map_err(Error::Input)?),
            TowerKind::Siglip => {
                if budget.is_some() {
                    return Err(Error::Input("a soft-token budget applies to Gemma 4 only (Gemma 3 makes a fixed count per image)".into()));
                }
                Processor::Gemma3(Gemma3Processor::from_config(pc.as_ref()).map_err(Error::Input)?)
            }
        };
        // the weights are the same for every grid: load them through the smallest graph
        let runner = Runner::open(&cp, "vision", device, check_nan, || {
            let g = cp.tower_graph(&vc, vc.pool, vc.pool)?;
            Ok(cp.load_tower(&vc, &g)?.0)
        })?;
        Ok(ImageEncoder { cp, vc, proc, pc, runner, graphs: HashMap::new() })
    }

    pub fn vision_config(&self) -> &VisionConfig {
        &self.vc
    }

    /// The soft tokens of `img` (Gemma 3 with pan-and-scan: the whole image's, then each
    /// crop's, one after the other).
    pub fn encode(&mut self, img: &RgbImage) -> Result<SoftTokens, Error> {
        self.encode_with_budget(img, None)
    }

    /// Gemma 4's processor for `budget` (`None`: the encoder's own).
    fn gemma4_processor(&self, budget: Option<usize>) -> Result<Option<Gemma4Processor>, Error> {
        match (&self.proc, budget) {
            (Processor::Gemma4(p), Some(b)) if b != p.max_soft_tokens => Gemma4Processor::from_config(self.pc.as_ref(), Some(b)).map(Some).map_err(Error::Input),
            _ => Ok(None),
        }
    }

    /// How many soft tokens [`ImageEncoder::encode_with_budget`] makes of `img`, without
    /// running the tower.
    pub fn soft_tokens(&self, img: &RgbImage, budget: Option<usize>) -> Result<usize, Error> {
        match &self.proc {
            Processor::Gemma4(p) => self.gemma4_processor(budget)?.as_ref().unwrap_or(p).soft_tokens(img.height, img.width).map_err(Error::Input),
            Processor::Gemma3(p) => Ok(self.vc.tokens_per_image * (1 + p.pan_and_scan.map_or(0, |ps| super::processor::pan_and_scan_crops(img, &ps).len()))),
        }
    }

    /// [`ImageEncoder::encode`] with Gemma 4's soft-token budget for this image (`None`: the
    /// encoder's); Gemma 3 makes its fixed count whatever the budget.
    pub fn encode_with_budget(&mut self, img: &RgbImage, budget: Option<usize>) -> Result<SoftTokens, Error> {
        let mut inputs = vec![];
        match &self.proc {
            Processor::Gemma4(p) => {
                let other = self.gemma4_processor(budget)?;
                let pi = other.as_ref().unwrap_or(p).process(img).map_err(Error::Input)?;
                let (pixels, px, py) = pi.tower_input();
                inputs.push(((pi.rows, pi.cols), pixels, px, py));
            }
            Processor::Gemma3(p) => {
                for s in p.process(img) {
                    let (pixels, pos) = s.tower_input(self.vc.patch);
                    let side = self.vc.grid_side();
                    inputs.push(((side, side), pixels, pos, vec![]));
                }
            }
        }
        let mut data = vec![];
        for (grid, pixels, a, b) in inputs {
            if !self.graphs.contains_key(&grid) {
                let g = self.cp.tower_graph(&self.vc, grid.0, grid.1)?;
                let c = compile(g, PhasePolicy::EmbedLayersHead).map_err(|e| Error::Config(e.to_string()))?;
                self.graphs.insert(grid, c);
            }
            let c = &self.graphs[&grid];
            // Gemma 4 reads patch columns and rows; SigLIP the patch indices as positions
            let step = match self.vc.kind {
                TowerKind::Gemma4Vit => StepInputs { pixels: &pixels, patch_x: &a, patch_y: &b, ..Default::default() },
                TowerKind::Siglip => StepInputs { pixels: &pixels, positions: &a, ..Default::default() },
            };
            data.extend(self.runner.soft(c, &step)?);
        }
        let width = self.vc.text_hidden;
        Ok(SoftTokens { tokens: data.len() / width, width, data, kind: Modality::Image })
    }
}

/// Encodes image files with the tower of the checkpoint in `dir`: all rows, their width, and
/// the soft tokens of each image.
pub fn encode_files(dir: &Path, images: &[std::path::PathBuf], device: DeviceKind, budget: Option<usize>, check_nan: bool) -> Result<(Vec<f32>, usize, Vec<usize>), String> {
    // decode first: a bad file is reported before any weight is loaded
    let decoded = images.iter().map(|p| super::load_image(p).map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
    let mut enc = ImageEncoder::open(dir, device, budget, check_nan)?;
    let (mut rows, mut counts) = (vec![], vec![]);
    for img in &decoded {
        let s = enc.encode(img)?;
        counts.push(s.tokens);
        rows.extend(s.data);
    }
    Ok((rows, enc.vision_config().text_hidden, counts))
}

/// A prompt's inputs with its images' soft tokens in place (see `BuildOptions::soft_rows`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImagePrompt {
    /// The ids, each image placeholder read as id 0 (its embedding is replaced; Gemma 4's
    /// per-layer inputs read id 0 there, as HF does).
    pub tokens: Vec<u32>,
    /// The soft-token rows, image after image `[N, D]`.
    pub soft_rows: Vec<f32>,
    /// Per token: the row it takes plus one, 0 for text.
    pub soft_index: Vec<u32>,
    /// Per token: the index of the last token it attends to within the prompt when image
    /// spans are bidirectional (Gemma 3): the last of its run of image tokens, else its own.
    pub span_ends: Vec<u32>,
}

impl ImagePrompt {
    /// `span_ends` as absolute positions of a prompt fed from position `p0`.
    pub fn attend_until(&self, p0: u32) -> Vec<u32> {
        self.span_ends.iter().map(|&e| p0 + e).collect()
    }
}

/// For each token of `ids`, the index of the last token of its run of `image_token`s (HF's
/// image blocks: each contiguous run is one), else its own index.
pub fn span_ends(ids: &[u32], image_token: u32) -> Vec<u32> {
    let mut ends: Vec<u32> = (0..ids.len() as u32).collect();
    let mut i = ids.len();
    while i > 0 {
        i -= 1;
        if ids[i] == image_token {
            let end = i as u32;
            while i > 0 && ids[i - 1] == image_token {
                i -= 1;
                ends[i] = end;
            }
        }
    }
    ends
}

/// Puts the soft tokens of `soft` into the placeholder runs of `ids`: every image
/// placeholder takes the next image row, every audio placeholder the next audio row, in
/// order (as HF scatters each kind). The placeholders of each kind must match its rows
/// exactly.
pub fn soft_prompt(ids: &[u32], ph: &Placeholders, soft: &[SoftTokens]) -> Result<ImagePrompt, Error> {
    if let Some(w) = soft.iter().map(|s| s.width).find(|&w| w != soft[0].width) {
        return Err(Error::Input(format!("soft tokens of widths {} and {w}", soft[0].width)));
    }
    // per kind: its placeholder id and the index of its first row in `soft_rows`
    let mut first = vec![];
    let mut soft_rows = vec![];
    for kind in [Modality::Image, Modality::Audio] {
        let of_kind: Vec<&SoftTokens> = soft.iter().filter(|s| s.kind == kind).collect();
        let rows: usize = of_kind.iter().map(|s| s.tokens).sum();
        let placeholders = ph.id(kind).map_or(0, |id| ids.iter().filter(|&&t| t == id).count());
        let what = kind.name();
        match ph.id(kind) {
            None if rows > 0 => return Err(Error::Input(format!("this model takes no {what} input, but {} {what} soft tokens were given", rows))),
            _ if placeholders != rows => {
                let per: Vec<usize> = of_kind.iter().map(|s| s.tokens).collect();
                let id = ph.id(kind).unwrap_or_default();
                return Err(Error::Input(format!(
                    "the prompt has {placeholders} {what} placeholders (id {id}) but the {what} inputs make {rows} soft tokens {per:?}"
                )));
            }
            _ => {}
        }
        if let Some(id) = ph.id(kind) {
            first.push((id, (soft_rows.len() / soft.first().map_or(1, |s| s.width.max(1))) as u32));
        }
        soft_rows.extend(of_kind.iter().flat_map(|s| s.data.iter().copied()));
    }
    let mut next: Vec<u32> = first.iter().map(|f| f.1).collect();
    let mut soft_index = Vec::with_capacity(ids.len());
    let mut tokens = Vec::with_capacity(ids.len());
    for &t in ids {
        match first.iter().position(|f| f.0 == t) {
            Some(k) => {
                next[k] += 1;
                soft_index.push(next[k]);
                tokens.push(0);
            }
            None => {
                soft_index.push(0);
                tokens.push(t);
            }
        }
    }
    let span_ends = span_ends(ids, ph.image.unwrap_or(u32::MAX));
    Ok(ImagePrompt { tokens, soft_rows, soft_index, span_ends })
}

/// The logits of every position of `ids` (holding each image's and clip's placeholder run, in
/// order) with the soft tokens of `images` and `clips` in place: the files read first, then
/// encoded, the prompt's graph built with their rows (Gemma 3: each image's span attending to
/// itself bidirectionally), run once on `device`. Returns the logits `[T, V]` and V.
pub fn logits_with_soft(dir: &Path, ids: &[u32], images: &[std::path::PathBuf], clips: &[std::path::PathBuf], device: DeviceKind, check_nan: bool) -> Result<(Vec<f32>, usize), String> {
    let decoded = images.iter().map(|p| super::load_image(p).map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
    let samples = crate::audio::encode::read_clips(dir, clips)?;
    let cp = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let mut soft = vec![];
    let mut ph = Placeholders::default();
    if !decoded.is_empty() {
        let mut enc = ImageEncoder::open(dir, device, None, check_nan)?;
        ph.image = Some(enc.vision_config().image_token);
        for img in &decoded {
            soft.push(enc.encode(img)?);
        }
    }
    if !samples.is_empty() {
        let mut enc = crate::audio::AudioEncoder::open(dir, device, check_nan)?;
        ph.audio = Some(enc.audio_config().audio_token);
        for s in &samples {
            soft.push(enc.encode(s)?);
        }
    }
    let p = soft_prompt(ids, &ph, &soft)?;
    let width = cp.config().hidden_size;
    let t = ids.len();
    let max = cp.config().max_position_embeddings;
    if t > max {
        return Err(format!("{t} tokens exceed the model's {max} positions"));
    }
    let opts = markbase_graph::BuildOptions { soft_rows: p.soft_rows.len() / width, ..markbase_graph::BuildOptions::prefill(t, t) };
    let g = cp.build(opts).map_err(|e| e.to_string())?;
    let (w, _) = cp.load_weights(&g).map_err(|e| e.to_string())?;
    let c = compile(g, PhasePolicy::EmbedLayersHead).map_err(|e| e.to_string())?;
    let positions: Vec<u32> = (0..t as u32).collect();
    let until = p.attend_until(0);
    let step = StepInputs { tokens: &p.tokens, positions: &positions, soft_rows: &p.soft_rows, soft_index: &p.soft_index, attend_until: &until, ..Default::default() };
    let w = Arc::new(w);
    let logits = match device {
        DeviceKind::Cpu => exec::run(&c, &mut CpuWeights::new(w), &mut CpuState::default(), &step)?["logits"].f().to_vec(),
        DeviceKind::Gpu(b) => {
            let mut g = GpuExecutor::new(b, w, check_nan)?;
            let key = GraphKey { tokens: t, all_logits: true, sample: false, images: false };
            g.run(key, &c, &step, true)?.logits.ok_or("no logits read back")?
        }
    };
    let vocab = logits.len() / t.max(1);
    Ok((logits, vocab))
}
