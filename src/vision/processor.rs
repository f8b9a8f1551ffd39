//! The image processors of Gemma 3 and Gemma 4, reproduced from Hugging Face's PIL-backed
//! ones: their resize (through [`super::resample`]), their float arithmetic, their patch
//! order and positions. Settings come from the checkpoint's `preprocessor_config.json` (or
//! `processor_config.json`) where it has one, else Hugging Face's defaults.

use std::path::Path;

use serde_json::Value;

use super::image::RgbImage;
use super::resample::{resize, Filter};

/// Soft-token budgets Gemma 4's processor accepts.
pub const GEMMA4_BUDGETS: [usize; 5] = [70, 140, 280, 560, 1120];

/// The patch grid of an image of `tokens` soft tokens: SigLIP's square input (its fixed
/// count, whatever `tokens`), Gemma 4's [`gemma4_grid`].
pub fn tower_grid(vc: &markbase_graph::vision::VisionConfig, tokens: usize) -> Result<(usize, usize), String> {
    match vc.kind {
        markbase_graph::vision::TowerKind::Siglip => Ok((vc.grid_side(), vc.grid_side())),
        markbase_graph::vision::TowerKind::Gemma4Vit => gemma4_grid(tokens, vc.pool, vc.position_table),
    }
}

/// The patch grid (rows, columns) of `tokens` soft tokens of Gemma 4's tower pooling `pool x
/// pool` patches: `pool·a x pool·b` with `a·b = tokens` and `a ≤ b` as close as can be (an
/// image whose aspect ratio fills the budget exactly; no image has more patches than the
/// budget's). An error where a side exceeds the position table (`table` rows).
pub fn gemma4_grid(tokens: usize, pool: usize, table: usize) -> Result<(usize, usize), String> {
    let a = (1..=tokens).take_while(|a| a * a <= tokens).filter(|a| tokens % a == 0).last().unwrap_or(1);
    let (rows, cols) = (a * pool, tokens / a * pool);
    if cols > table {
        return Err(format!("{tokens} soft tokens make a {rows}x{cols} patch grid, over the tower's position table ({table} rows)"));
    }
    Ok((rows, cols))
}

/// Gemma 3's processor (SigLIP input).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Processor {
    /// Side of the square the image is squashed to (896).
    pub size: usize,
    pub filter: Filter,
    pub rescale: f64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub pan_and_scan: Option<PanAndScan>,
}

/// Gemma 3's pan-and-scan crops (off unless asked for).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PanAndScan {
    pub min_crop: usize,
    pub max_crops: usize,
    pub min_ratio: f64,
}

impl Default for PanAndScan {
    fn default() -> Self {
        PanAndScan { min_crop: 256, max_crops: 4, min_ratio: 1.2 }
    }
}

impl Default for Gemma3Processor {
    fn default() -> Self {
        Gemma3Processor { size: 896, filter: Filter::Bilinear, rescale: 1.0 / 255.0, mean: [0.5; 3], std: [0.5; 3], pan_and_scan: None }
    }
}

/// Gemma 4's processor (aspect-preserving, patches with positions).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Processor {
    /// Most soft tokens per image (one of [`GEMMA4_BUDGETS`]).
    pub max_soft_tokens: usize,
    pub patch: usize,
    pub pool: usize,
    pub filter: Filter,
    pub rescale: f64,
}

impl Default for Gemma4Processor {
    fn default() -> Self {
        Gemma4Processor { max_soft_tokens: 280, patch: 16, pool: 3, filter: Filter::Bicubic, rescale: 1.0 / 255.0 }
    }
}

/// One image ready for Gemma 3's tower: `pixels` `[3, S, S]` (CHW, normalised).
#[derive(Clone, Debug, PartialEq)]
pub struct SquashedImage {
    pub size: usize,
    pub pixels: Vec<f32>,
}

/// One image ready for Gemma 4's tower.
#[derive(Clone, Debug, PartialEq)]
pub struct PatchedImage {
    /// Patch grid: `rows x cols` patches.
    pub rows: usize,
    pub cols: usize,
    /// `[rows * cols, patch * patch * 3]`, row-major patches, each in `(py, px, c)` order, [0, 1].
    pub patches: Vec<f32>,
    /// `(x, y)` of each patch.
    pub positions: Vec<[u32; 2]>,
    /// Soft tokens the tower makes of it.
    pub soft_tokens: usize,
    /// The resized RGB image.
    pub resized: RgbImage,
}

/// Reads the processor settings next to a checkpoint: `preprocessor_config.json`, else
/// `processor_config.json` (its `image_processor` entry); `None` when neither exists.
pub fn read_processor_config(dir: &Path) -> Result<Option<Value>, String> {
    for name in ["preprocessor_config.json", "processor_config.json"] {
        let p = dir.join(name);
        if !p.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: not valid JSON: {e}", p.display()))?;
        return Ok(Some(v.get("image_processor").cloned().unwrap_or(v)));
    }
    Ok(None)
}

fn num(v: &Value, key: &str) -> Result<Option<f64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| format!("processor config: `{key}` must be a number, got {x}")),
    }
}

fn count(v: &Value, key: &str) -> Result<Option<usize>, String> {
    match num(v, key)? {
        Some(x) if x >= 1.0 && x.fract() == 0.0 && x <= 1e6 => Ok(Some(x as usize)),
        Some(x) => Err(format!("processor config: `{key}` must be a positive integer, got {x}")),
        None => Ok(None),
    }
}

fn triple(v: &Value, key: &str) -> Result<Option<[f32; 3]>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
            Ok(Some([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32)))
        }
        Some(x) if x.is_number() => Ok(Some([x.as_f64().unwrap_or(0.0) as f32; 3])),
        Some(x) => Err(format!("processor config: `{key}` must be 3 numbers, got {x}")),
    }
}

fn filter(v: &Value, default: Filter) -> Result<Filter, String> {
    match num(v, "resample")? {
        None => Ok(default),
        Some(c) => Filter::from_pil(c as u64).ok_or_else(|| format!("processor config: resample {c} is not supported (2 bilinear, 3 bicubic)")),
    }
}

fn flag(v: &Value, key: &str, default: bool) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(default)
}

impl Gemma3Processor {
    /// Settings from a processor config (HF's defaults where it is silent).
    pub fn from_config(v: Option<&Value>) -> Result<Self, String> {
        let mut p = Gemma3Processor::default();
        let Some(v) = v else { return Ok(p) };
        if let Some(s) = v.get("size") {
            let h = count(s, "height")?;
            let w = count(s, "width")?;
            match (h, w) {
                (Some(h), Some(w)) if h == w => p.size = h,
                (None, None) => {}
                _ => return Err(format!("processor config: size {s} must be square")),
            }
        }
        p.filter = filter(v, p.filter)?;
        if !flag(v, "do_rescale", true) {
            p.rescale = 1.0;
        } else if let Some(r) = num(v, "rescale_factor")? {
            p.rescale = r;
        }
        if flag(v, "do_normalize", true) {
            p.mean = triple(v, "image_mean")?.unwrap_or(p.mean);
            p.std = triple(v, "image_std")?.unwrap_or(p.std);
            if p.std.contains(&0.0) {
                return Err("processor config: image_std has a zero".into());
            }
        } else {
            p.mean = [0.0; 3];
            p.std = [1.0; 3];
        }
        if flag(v, "do_pan_and_scan", false) {
            let d = PanAndScan::default();
            p.pan_and_scan = Some(PanAndScan {
                min_crop: count(v, "pan_and_scan_min_crop_size")?.unwrap_or(d.min_crop),
                max_crops: count(v, "pan_and_scan_max_num_crops")?.unwrap_or(d.max_crops),
                min_ratio: num(v, "pan_and_scan_min_ratio_to_activate")?.unwrap_or(d.min_ratio),
            });
        }
        Ok(p)
    }

    /// The images the tower sees: the whole image, then its pan-and-scan crops when enabled.
    pub fn process(&self, img: &RgbImage) -> Vec<SquashedImage> {
        let mut out = vec![self.squash(img)];
        if let Some(ps) = self.pan_and_scan {
            out.extend(pan_and_scan_crops(img, &ps).iter().map(|c| self.squash(c)));
        }
        out
    }

    fn squash(&self, img: &RgbImage) -> SquashedImage {
        let s = self.size;
        let r = resize(img, s, s, self.filter);
        let mut pixels = vec![0f32; 3 * s * s];
        for (i, px) in r.data.chunks_exact(3).enumerate() {
            for c in 0..3 {
                // HF: f32(u8 * factor) in double, then (x - mean) / std in f32
                let x = (px[c] as f64 * self.rescale) as f32;
                pixels[c * s * s + i] = (x - self.mean[c]) / self.std[c];
            }
        }
        SquashedImage { size: s, pixels }
    }
}

/// Gemma 3's pan-and-scan crops of `img` (none when its aspect ratio is below the threshold
/// or a crop would be smaller than the minimum).
pub fn pan_and_scan_crops(img: &RgbImage, p: &PanAndScan) -> Vec<RgbImage> {
    let (w, h) = (img.width, img.height);
    let (nw, nh) = if w >= h {
        if (w as f64 / h as f64) < p.min_ratio {
            return vec![];
        }
        let n = ((w as f64 / h as f64 + 0.5).floor() as usize).min(w / p.min_crop);
        (n.max(2).min(p.max_crops), 1)
    } else {
        if (h as f64 / w as f64) < p.min_ratio {
            return vec![];
        }
        let n = ((h as f64 / w as f64 + 0.5).floor() as usize).min(h / p.min_crop);
        (1, n.max(2).min(p.max_crops))
    };
    let cw = w.div_ceil(nw);
    let ch = h.div_ceil(nh);
    if cw.min(ch) < p.min_crop {
        return vec![];
    }
    let mut out = vec![];
    for j in 0..nh {
        for i in 0..nw {
            out.push(img.crop(i * cw, j * ch, cw, ch));
        }
    }
    out
}

impl SquashedImage {
    /// The tower's input: the `patch x patch` patches of the CHW pixels, row-major, each in
    /// (py, px, c) order (the order of the conv weight `[O, kh, kw, C]`), and their indices.
    pub fn tower_input(&self, patch: usize) -> (Vec<f32>, Vec<u32>) {
        let (s, side) = (self.size, self.size / patch);
        let mut out = Vec::with_capacity(3 * s * s);
        for y in 0..side {
            for x in 0..side {
                for py in 0..patch {
                    for px in 0..patch {
                        for c in 0..3 {
                            out.push(self.pixels[c * s * s + (y * patch + py) * s + x * patch + px]);
                        }
                    }
                }
            }
        }
        (out, (0..(side * side) as u32).collect())
    }
}

impl PatchedImage {
    /// The tower's input: `2(x − 0.5)` of each patch value (the map to [-1, 1] Gemma 4's
    /// patch embedder makes first, done here on the host), and the patch columns and rows.
    pub fn tower_input(&self) -> (Vec<f32>, Vec<u32>, Vec<u32>) {
        let pixels = self.patches.iter().map(|&x| 2.0 * (x - 0.5)).collect();
        (pixels, self.positions.iter().map(|p| p[0]).collect(), self.positions.iter().map(|p| p[1]).collect())
    }
}

impl Gemma4Processor {
    /// Settings from a processor config (HF's defaults where it is silent); `budget` (soft
    /// tokens) overrides the config's `max_soft_tokens`.
    pub fn from_config(v: Option<&Value>, budget: Option<usize>) -> Result<Self, String> {
        let mut p = Gemma4Processor::default();
        if let Some(v) = v {
            p.max_soft_tokens = count(v, "max_soft_tokens")?.unwrap_or(p.max_soft_tokens);
            p.patch = count(v, "patch_size")?.unwrap_or(p.patch);
            p.pool = count(v, "pooling_kernel_size")?.unwrap_or(p.pool);
            p.filter = filter(v, p.filter)?;
            if !flag(v, "do_rescale", true) {
                p.rescale = 1.0;
            } else if let Some(r) = num(v, "rescale_factor")? {
                p.rescale = r;
            }
        }
        if let Some(b) = budget {
            p.max_soft_tokens = b;
        }
        if !GEMMA4_BUDGETS.contains(&p.max_soft_tokens) {
            return Err(format!("{} soft tokens per image is not a Gemma 4 budget (one of {GEMMA4_BUDGETS:?})", p.max_soft_tokens));
        }
        Ok(p)
    }

    /// The size `(height, width)` an `h x w` image is resized to: the largest with sides that
    /// are multiples of `pool * patch` and at most `max_soft_tokens * pool²` patches.
    pub fn target_size(&self, h: usize, w: usize) -> Result<(usize, usize), String> {
        let max_patches = self.max_soft_tokens * self.pool * self.pool;
        let target_px = (max_patches * self.patch * self.patch) as f64;
        let f = (target_px / (h as f64 * w as f64)).sqrt();
        let m = self.pool * self.patch;
        let mut th = (f * h as f64 / m as f64).floor() as usize * m;
        let mut tw = (f * w as f64 / m as f64).floor() as usize * m;
        if th == 0 && tw == 0 {
            return Err(format!("a {w}x{h} image cannot be resized for {} soft tokens", self.max_soft_tokens));
        }
        let max_side = (max_patches / (self.pool * self.pool)) * m;
        if th == 0 {
            th = m;
            tw = ((w as f64 / h as f64).floor() as usize * m).min(max_side);
        } else if tw == 0 {
            tw = m;
            th = ((h as f64 / w as f64).floor() as usize * m).min(max_side);
        }
        if th * tw > target_px as usize {
            return Err(format!("a {w}x{h} image would need {th}x{tw} pixels, more than {max_patches} patches"));
        }
        Ok((th, tw))
    }

    /// The soft tokens an `h x w` image makes (what [`Gemma4Processor::process`] would count,
    /// without resizing it).
    pub fn soft_tokens(&self, h: usize, w: usize) -> Result<usize, String> {
        let (th, tw) = self.target_size(h, w)?;
        Ok((th / self.patch) * (tw / self.patch) / (self.pool * self.pool))
    }

    pub fn process(&self, img: &RgbImage) -> Result<PatchedImage, String> {
        let (th, tw) = self.target_size(img.height, img.width)?;
        let resized = resize(img, tw, th, self.filter);
        let p = self.patch;
        let (rows, cols) = (th / p, tw / p);
        let mut patches = Vec::with_capacity(rows * cols * p * p * 3);
        let mut positions = Vec::with_capacity(rows * cols);
        for y in 0..rows {
            for x in 0..cols {
                for py in 0..p {
                    let start = ((y * p + py) * tw + x * p) * 3;
                    for &v in &resized.data[start..start + p * 3] {
                        patches.push((v as f64 * self.rescale) as f32);
                    }
                }
                positions.push([x as u32, y as u32]);
            }
        }
        let soft_tokens = rows * cols / (self.pool * self.pool);
        Ok(PatchedImage { rows, cols, patches, positions, soft_tokens, resized })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma4_sizes_match_the_spec() {
        let p = Gemma4Processor::default();
        assert_eq!(p.target_size(224, 224).unwrap(), (768, 768));
        assert_eq!(p.target_size(160, 256).unwrap(), (624, 1008));
        // very thin: one row of pooled patches
        let (h, w) = p.target_size(2, 5000).unwrap();
        assert_eq!(h, 48);
        assert!(w <= 280 * 48 && w % 48 == 0);
    }

    #[test]
    fn budgets_are_checked() {
        assert!(Gemma4Processor::from_config(None, Some(100)).is_err());
        assert_eq!(Gemma4Processor::from_config(None, Some(1120)).unwrap().max_soft_tokens, 1120);
    }

    #[test]
    fn pan_and_scan_crop_counts() {
        let img = RgbImage::new(1000, 300, vec![0; 900_000]);
        let c = pan_and_scan_crops(&img, &PanAndScan::default());
        assert_eq!(c.len(), 3);
        assert_eq!((c[0].width, c[0].height), (334, 300));
        assert_eq!(c[2].width, 1000 - 2 * 334);
        let sq = RgbImage::new(300, 300, vec![0; 270_000]);
        assert!(pan_and_scan_crops(&sq, &PanAndScan::default()).is_empty());
    }
}
