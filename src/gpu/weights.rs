//! GPU weight layout and upload.
//!
//! Tensors are uploaded with their stored bytes (zero-padded to 4 bytes, a weight's packed words
//! to 16): packed u32 words
//! `[rows, K*bits/32]`; mx/nv u8 scales four per word; the nvfp4 `global_scale` as f32; float
//! weights as bf16/f16 pairs or f32. Affine scales and biases are interleaved, in their stored
//! dtype: group g's scale then its bias (one u32 word for bf16/f16, two for f32), so that a
//! kernel brings both in one load. The kernels decode all of these (weights.wgsl).
//!
//! A tensor whose parts exceed the binding limit is split into row chunks (expert
//! stacks: whole experts), each chunk its own buffers starting at its first row.

use markbase_graph::quant::{FloatType, QuantMode, WeightFormat};

use super::device::{Gpu, GpuError};
use crate::weights::{RawDType, RawTensor, WeightData};

/// A weight's storage format as the kernels see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuFormat {
    /// Plain float matrix, row-major `[rows, K]`.
    Float(FloatType),
    /// MLX affine: `scale * q + bias`, scales/biases stored as `scale` dtype.
    Affine { bits: u32, group: u32, scale: FloatType },
    Mxfp4,
    Mxfp8,
    /// `global`: a per-expert f32 `global_scale` is bound too.
    Nvfp4 { global: bool },
}

impl GpuFormat {
    /// Bits per element of the packed data (floats: their width).
    pub fn bits(&self) -> u32 {
        match self {
            GpuFormat::Float(t) => 8 * t.bytes() as u32,
            GpuFormat::Affine { bits, .. } => *bits,
            GpuFormat::Mxfp4 | GpuFormat::Nvfp4 { .. } => 4,
            GpuFormat::Mxfp8 => 8,
        }
    }
    pub fn group(&self) -> u32 {
        match self {
            GpuFormat::Float(_) => 1,
            GpuFormat::Affine { group, .. } => *group,
            GpuFormat::Mxfp4 | GpuFormat::Mxfp8 => 32,
            GpuFormat::Nvfp4 { .. } => 16,
        }
    }
    pub fn is_quantized(&self) -> bool {
        !matches!(self, GpuFormat::Float(_))
    }
    /// Bytes of one stored scale (and bias) entry.
    pub fn scale_bytes(&self) -> usize {
        match self {
            GpuFormat::Float(_) => 0,
            GpuFormat::Affine { scale, .. } => scale.bytes(),
            _ => 1,
        }
    }
    pub fn has_biases(&self) -> bool {
        matches!(self, GpuFormat::Affine { .. })
    }
    pub fn has_global(&self) -> bool {
        matches!(self, GpuFormat::Nvfp4 { global: true })
    }
    /// Stored bytes of one row of `k` elements: (packed weights, scales, biases).
    pub fn row_bytes(&self, k: usize) -> (usize, usize, usize) {
        match self {
            GpuFormat::Float(t) => (k * t.bytes(), 0, 0),
            _ => {
                let g = k / self.group() as usize;
                let s = g * self.scale_bytes();
                (k * self.bits() as usize / 8, s, if self.has_biases() { s } else { 0 })
            }
        }
    }
    /// Whether rows of `k` elements are valid for this format.
    pub fn check_k(&self, k: usize) -> Result<(), String> {
        let ok = match self {
            GpuFormat::Float(_) => k > 0,
            GpuFormat::Affine { bits, group, .. } => {
                matches!(bits, 1..=6 | 8) && matches!(group, 32 | 64 | 128) && k % *group as usize == 0
            }
            _ => k % self.group() as usize == 0 && k > 0,
        };
        if ok {
            Ok(())
        } else {
            Err(format!("{self:?}: row length {k} not supported"))
        }
    }
    pub fn describe(&self) -> String {
        match self {
            GpuFormat::Float(t) => t.name().to_string(),
            GpuFormat::Affine { bits, group, scale } => format!("affine{bits}g{group}({})", scale.name()),
            GpuFormat::Mxfp4 => "mxfp4".into(),
            GpuFormat::Mxfp8 => "mxfp8".into(),
            GpuFormat::Nvfp4 { global: false } => "nvfp4".into(),
            GpuFormat::Nvfp4 { global: true } => "nvfp4+global".into(),
        }
    }
}

fn float_type(d: RawDType) -> Option<FloatType> {
    match d {
        RawDType::Bf16 => Some(FloatType::Bf16),
        RawDType::F16 => Some(FloatType::F16),
        RawDType::F32 => Some(FloatType::F32),
        _ => None,
    }
}

/// The kernel format of a loaded weight (from its description and the stored dtypes).
pub fn gpu_format(w: &WeightData) -> Result<GpuFormat, String> {
    match w.param.format {
        WeightFormat::Float { .. } => float_type(w.weight.dtype)
            .map(GpuFormat::Float)
            .ok_or_else(|| format!("{}: float weight stored as {}", w.param.name, w.weight.dtype.name())),
        WeightFormat::Quantized { spec, global_scale } => Ok(match spec.mode {
            QuantMode::Affine => {
                let sd = w.scales.as_ref().ok_or_else(|| format!("{}: no scales", w.param.name))?.dtype;
                let scale = float_type(sd).ok_or_else(|| format!("{}: scales stored as {}", w.param.name, sd.name()))?;
                GpuFormat::Affine { bits: spec.bits as u32, group: spec.group_size as u32, scale }
            }
            QuantMode::Mxfp4 => GpuFormat::Mxfp4,
            QuantMode::Mxfp8 => GpuFormat::Mxfp8,
            QuantMode::Nvfp4 => GpuFormat::Nvfp4 { global: global_scale && w.global_scale.is_some() },
        }),
    }
}

/// Rows `[row_start, row_start + rows)` of a weight, in buffers of their own.
pub struct WeightChunk {
    pub row_start: usize,
    pub rows: usize,
    pub w: wgpu::Buffer,
    /// Scales (affine: each group's scale and bias side by side).
    pub scales: Option<wgpu::Buffer>,
}

/// A weight on the GPU.
pub struct GpuWeight {
    pub name: String,
    pub format: GpuFormat,
    /// Float shape (`[N, K]`, `[E, N, K]`, `[D]`).
    pub shape: Vec<usize>,
    /// Row length.
    pub k: usize,
    /// Rows in total (`E * N` for expert stacks).
    pub rows: usize,
    /// Experts (1 for 2-D weights) and rows per expert.
    pub experts: usize,
    pub rows_per_expert: usize,
    pub chunks: Vec<WeightChunk>,
    /// nvfp4 per-expert global scale (f32 `[E]`), shared by all chunks.
    pub global: Option<wgpu::Buffer>,
}

impl GpuWeight {
    /// The weight bindings (8 packed, 9 scales, 11 global) of chunk `c`.
    pub fn bindings(&self, c: usize) -> Vec<(u32, wgpu::BindingResource<'_>)> {
        let ch = &self.chunks[c];
        let mut v = vec![(8, ch.w.as_entire_binding())];
        if let Some(s) = &ch.scales {
            v.push((9, s.as_entire_binding()));
        }
        if let Some(g) = &self.global {
            v.push((11, g.as_entire_binding()));
        }
        v
    }
    /// First expert and expert count of chunk `c` (expert stacks).
    pub fn chunk_experts(&self, c: usize) -> (usize, usize) {
        let ch = &self.chunks[c];
        (ch.row_start / self.rows_per_expert, ch.rows / self.rows_per_expert)
    }
}

fn slice_bytes(t: &RawTensor, row_bytes: usize, r0: usize, r1: usize) -> &[u8] {
    &t.bytes[r0 * row_bytes..r1 * row_bytes]
}

/// `bytes` zero-padded to a multiple of 16, so that kernels may bind the words as vec4<u32>
/// (a binding's array holds whole elements only), where that stays within `limit` (a chunk's
/// bytes; rows of 4-bit codes with K % 32 == 0, the only ones read that way, need no padding).
fn pad16(bytes: &[u8], limit: u64) -> std::borrow::Cow<'_, [u8]> {
    let padded = bytes.len().div_ceil(16).max(1) * 16;
    if bytes.len() == padded || padded as u64 > limit {
        return std::borrow::Cow::Borrowed(bytes);
    }
    let mut v = bytes.to_vec();
    v.resize(padded, 0);
    std::borrow::Cow::Owned(v)
}

/// Scales and biases of equal length, stored as `dtype`, interleaved entry by entry.
fn interleave(scales: &[u8], biases: &[u8], dtype: FloatType) -> Vec<u8> {
    fn pairs<const S: usize>(scales: &[u8], biases: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; scales.len() + biases.len()];
        for ((o, s), b) in out.chunks_exact_mut(2 * S).zip(scales.chunks_exact(S)).zip(biases.chunks_exact(S)) {
            o[..S].copy_from_slice(s);
            o[S..].copy_from_slice(b);
        }
        out
    }
    match dtype {
        FloatType::Bf16 | FloatType::F16 => pairs::<2>(scales, biases),
        FloatType::F32 => pairs::<4>(scales, biases),
    }
}

/// Uploads a weight, split into chunks whose buffers each stay within
/// `max_chunk_bytes` (default: the device's binding limit).
pub fn upload_weight(gpu: &Gpu, w: &WeightData, max_chunk_bytes: Option<u64>) -> Result<GpuWeight, GpuError> {
    let name = w.param.name.clone();
    let err = |msg: String| GpuError::Other(format!("weight {name}: {msg}"));
    let format = gpu_format(w).map_err(err)?;
    let shape = w.param.shape.clone();
    let k = *shape.last().ok_or_else(|| err("empty shape".into()))?;
    let rows: usize = shape[..shape.len() - 1].iter().product();
    let (experts, rows_per_expert) = if shape.len() == 3 { (shape[0], shape[1]) } else { (1, rows.max(1)) };
    let rows = rows.max(1);
    format.check_k(k).map_err(err)?;
    let (wb, sb, bb) = format.row_bytes(k);
    let check = |t: &RawTensor, per_row: usize, what: &str| -> Result<(), GpuError> {
        if t.bytes.len() != per_row * rows {
            return Err(err(format!("{what}: {} bytes, expected {} x {per_row}", t.bytes.len(), rows)));
        }
        Ok(())
    };
    check(&w.weight, wb, "weight")?;
    if format.is_quantized() {
        check(w.scales.as_ref().ok_or_else(|| err("missing scales".into()))?, sb, "scales")?;
    }
    if format.has_biases() {
        check(w.biases.as_ref().ok_or_else(|| err("missing biases".into()))?, bb, "biases")?;
    }
    let limit = max_chunk_bytes.unwrap_or_else(|| gpu.max_binding_bytes());
    let per_row = wb.max(sb + bb).max(1);
    let unit = if shape.len() == 3 { rows_per_expert } else { 1 };
    let units_per_chunk = (limit as usize / (per_row * unit)).min(rows / unit);
    if units_per_chunk == 0 {
        return Err(err(format!("one row block of {} bytes exceeds the chunk limit {limit}", per_row * unit)));
    }
    let chunk_rows = units_per_chunk * unit;
    let mut chunks = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + chunk_rows).min(rows);
        let label = format!("weight {name} chunk {} (rows {r0}..{r1})", chunks.len());
        let wbuf = gpu.try_upload(&label, &pad16(slice_bytes(&w.weight, wb, r0, r1), gpu.max_binding_bytes()))?;
        let scales = match format {
            GpuFormat::Affine { scale, .. } => {
                let s = slice_bytes(w.scales.as_ref().unwrap(), sb, r0, r1);
                let b = slice_bytes(w.biases.as_ref().unwrap(), bb, r0, r1);
                Some(gpu.try_upload(&format!("{label}.scales+biases"), &interleave(s, b, scale))?)
            }
            GpuFormat::Float(_) => None,
            _ => Some(gpu.try_upload(&format!("{label}.scales"), slice_bytes(w.scales.as_ref().unwrap(), sb, r0, r1))?),
        };
        chunks.push(WeightChunk { row_start: r0, rows: r1 - r0, w: wbuf, scales });
        r0 = r1;
    }
    let global = if format.has_global() {
        let g = w.global_scale.as_ref().unwrap();
        let v = g.to_f32();
        Some(gpu.try_upload(&format!("{name}.global_scale"), bytemuck::cast_slice(&v))?)
    } else {
        None
    };
    Ok(GpuWeight { name, format, shape, k, rows, experts, rows_per_expert, chunks, global })
}

/// A 1-D float weight (norm weight, per-expert scale, ...) uploaded as stored;
/// returns the buffer and its dtype for the kernels' `*DT` variants.
pub fn upload_vector(gpu: &Gpu, t: &RawTensor, label: &str) -> Result<(wgpu::Buffer, FloatType), GpuError> {
    let ft = float_type(t.dtype).ok_or_else(|| GpuError::Other(format!("{label}: {} is not a float tensor", t.dtype.name())))?;
    Ok((gpu.try_upload(label, &t.bytes)?, ft))
}

#[cfg(test)]
mod tests {
    use super::{interleave, FloatType};

    #[test]
    fn scales_and_biases_interleave_by_entry() {
        let s: Vec<u8> = (0..12).collect();
        let b: Vec<u8> = (100..112).collect();
        assert_eq!(interleave(&s, &b, FloatType::Bf16), [0, 1, 100, 101, 2, 3, 102, 103, 4, 5, 104, 105, 6, 7, 106, 107, 8, 9, 108, 109, 10, 11, 110, 111]);
        assert_eq!(interleave(&s, &b, FloatType::F32), [0, 1, 2, 3, 100, 101, 102, 103, 4, 5, 6, 7, 104, 105, 106, 107, 8, 9, 10, 11, 108, 109, 110, 111]);
    }
}
