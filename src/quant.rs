//! Decoding of MLX quantized weights on the CPU.
//!
//! Every MLX storage mode is decoded to f32, bit-exact with `mx.dequantize(...,
//! dtype=float32)` given f32 (or uint8) scales:
//!
//! * affine (2/3/4/5/6/8 bits, groups 32/64/128): `w = s*q + b` evaluated in f32
//!   (one rounding after the multiply, one after the add; no FMA);
//! * mxfp4: `e2m1(q) * e8m0(s)`, mxfp8: `e4m3(q) * e8m0(s)`;
//! * nvfp4: `e2m1(q) * e4m3(s)`, with a global scale
//!   `e2m1(q) * (e4m3(s) * (global_scale[e] / 2688))` — this f32 evaluation order
//!   is the one MLX uses (2688 = 6 * 448);
//! * plain float tensors (bf16/f16/f32) are converted.
//!
//! Packing: each row is an LSB-first bit stream over little-endian u32 words;
//! element `j` occupies stream bits `[j*b, j*b+b)` (see docs in `mlx-format.md`).
//! Rows start word-aligned because `in*bits` is a multiple of 32.

use std::ops::Range;

use markbase_graph::quant::{QuantMode, QuantSpec, WeightFormat};
use rayon::prelude::*;

use crate::weights::{RawDType, RawTensor, WeightData};

/// E2M1 (fp4) code → value. Bit 3 is the sign; codes 0..7 are
/// `0, 0.5, 1, 1.5, 2, 3, 4, 6`. Only the low 4 bits of `code` are used.
pub fn e2m1(code: u8) -> f32 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAG[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// E4M3FN (OCP fp8) byte → value: sign bit 7, exponent bits 6..3 (bias 7),
/// mantissa bits 2..0; subnormals for exponent 0; `0x7F`/`0xFF` are NaN; no infinities.
pub fn e4m3(byte: u8) -> f32 {
    let e = ((byte >> 3) & 0xf) as i32;
    let m = (byte & 7) as f32;
    let mag = if e == 0xf && byte & 7 == 7 {
        f32::NAN
    } else if e == 0 {
        // m/8 * 2^-6, exact in f32.
        m * (1.0 / 512.0)
    } else {
        (1.0 + m / 8.0) * pow2(e - 7)
    };
    if byte & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// E8M0 (shared exponent) byte → `2^(u-127)`; 255 is NaN.
pub fn e8m0(byte: u8) -> f32 {
    match byte {
        255 => f32::NAN,
        // 2^-127 is an f32 subnormal.
        0 => f32::from_bits(0x0040_0000),
        u => f32::from_bits((u as u32) << 23),
    }
}

/// 2^e for small integer exponents, exactly.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Code of element `j` of one packed row (`words`, LSB-first bit stream) at
/// `bits` per element. Handles elements that straddle two words (3/5/6 bits).
pub fn unpack(bits: u32, words: &[u32], j: usize) -> u32 {
    let bitpos = j * bits as usize;
    let w = bitpos >> 5;
    let s = (bitpos & 31) as u32;
    let mask = if bits >= 32 { u32::MAX } else { (1u32 << bits) - 1 };
    let mut q = (words[w] >> s) & mask;
    if s + bits > 32 {
        q |= (words[w + 1] << (32 - s)) & mask;
    }
    q
}

/// Reads u32 word `i` of a little-endian byte slice (unaligned-safe).
#[inline(always)]
fn word(bytes: &[u8], i: usize) -> u32 {
    let b = &bytes[i * 4..i * 4 + 4];
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Scalar decoder for one float element of the given stored dtype.
#[inline(always)]
fn float_at(dtype: RawDType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        RawDType::Bf16 => f32::from_bits((u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32) << 16),
        RawDType::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        RawDType::F32 => f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]),
        // Callers validate the dtype first.
        _ => f32::NAN,
    }
}

fn is_float(d: RawDType) -> bool {
    matches!(d, RawDType::Bf16 | RawDType::F16 | RawDType::F32)
}

/// A validated view of a [`WeightData`]: how to decode row `r`.
enum Plan<'a> {
    Float {
        t: &'a RawTensor,
    },
    Quant {
        spec: QuantSpec,
        w: &'a [u8],
        scales: &'a RawTensor,
        biases: Option<&'a RawTensor>,
        /// Per-expert factor `global_scale[e] / 2688` (nvfp4 only) and rows per expert.
        global: Option<(Vec<f32>, usize)>,
    },
}

struct Layout<'a> {
    plan: Plan<'a>,
    rows: usize,
    cols: usize,
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Checks the tensors of `w` against its declared float shape and format.
fn layout(w: &WeightData) -> Result<Layout<'_>, String> {
    let name = &w.param.name;
    let shape = &w.param.shape;
    // a 0-d tensor (a scalar) is one row of one value
    let cols = match shape.last() {
        Some(&c) => c,
        None if !w.param.module => 1,
        None => return Err(format!("{name}: empty shape")),
    };
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| format!("{name}: shape overflows"))?;
    let rows = numel.checked_div(cols).unwrap_or(0);
    let lead = &shape[..shape.len().saturating_sub(1)];
    match w.param.format {
        WeightFormat::Float { .. } => {
            let t = &w.weight;
            if !is_float(t.dtype) {
                return Err(format!("{name}: float weight has dtype {}", t.dtype.name()));
            }
            if t.numel() != numel || t.bytes.len() != numel * t.dtype.bytes() {
                return Err(format!("{name}: tensor {} {} does not hold shape {}", t.dtype.name(), shape_str(&t.shape), shape_str(shape)));
            }
            Ok(Layout { plan: Plan::Float { t }, rows, cols })
        }
        WeightFormat::Quantized { spec, global_scale } => {
            spec.validate().map_err(|e| format!("{name}: {e}"))?;
            if !spec.fits(cols) {
                return Err(format!("{name}: input dim {cols} does not fit {}", spec.describe()));
            }
            let wcols = spec.packed_cols(cols);
            let groups = spec.groups(cols);
            let mut wshape = lead.to_vec();
            wshape.push(wcols);
            let mut sshape = lead.to_vec();
            sshape.push(groups);
            let t = &w.weight;
            if t.dtype != RawDType::U32 || t.shape != wshape || t.bytes.len() != rows * wcols * 4 {
                return Err(format!(
                    "{name}.weight: {} {} (bytes {}), expected U32 {} for {}",
                    t.dtype.name(),
                    shape_str(&t.shape),
                    t.bytes.len(),
                    shape_str(&wshape),
                    spec.describe()
                ));
            }
            let scales = w.scales.as_ref().ok_or_else(|| format!("{name}.scales missing"))?;
            let scale_ok = match spec.mode {
                QuantMode::Affine => is_float(scales.dtype),
                _ => scales.dtype == RawDType::U8,
            };
            if !scale_ok || scales.shape != sshape || scales.bytes.len() != rows * groups * scales.dtype.bytes() {
                return Err(format!("{name}.scales: {} {}, expected {} for {}", scales.dtype.name(), shape_str(&scales.shape), shape_str(&sshape), spec.describe()));
            }
            let biases = match (spec.mode, &w.biases) {
                (QuantMode::Affine, Some(b)) => {
                    if !is_float(b.dtype) || b.shape != sshape || b.bytes.len() != rows * groups * b.dtype.bytes() {
                        return Err(format!("{name}.biases: {} {}, expected float {}", b.dtype.name(), shape_str(&b.shape), shape_str(&sshape)));
                    }
                    Some(b)
                }
                (QuantMode::Affine, None) => return Err(format!("{name}.biases missing (affine)")),
                (_, Some(_)) => return Err(format!("{name}: {} has no biases but .biases is present", spec.mode.name())),
                (_, None) => None,
            };
            let global = match (&w.global_scale, spec.mode) {
                (Some(g), QuantMode::Nvfp4) => {
                    let e = g.numel();
                    if g.dtype != RawDType::F32 || e == 0 || g.bytes.len() != e * 4 || rows % e != 0 {
                        return Err(format!("{name}.global_scale: {} {} does not fit {rows} rows", g.dtype.name(), shape_str(&g.shape)));
                    }
                    // MLX: e4m3(s) * (global_scale / (6 * 448)), all in f32.
                    let f = g.to_f32().into_iter().map(|x| x / 2688.0f32).collect();
                    Some((f, rows / e))
                }
                (Some(_), m) => return Err(format!("{name}: .global_scale is only valid for nvfp4, not {}", m.name())),
                (None, _) => {
                    if global_scale {
                        return Err(format!("{name}.global_scale missing"));
                    }
                    None
                }
            };
            Ok(Layout { plan: Plan::Quant { spec, w: &t.bytes, scales, biases, global }, rows, cols })
        }
    }
}

/// Lookup tables for the element and scale codes of the fp modes.
struct Tables {
    e2m1: [f32; 16],
    e4m3: [f32; 256],
    e8m0: [f32; 256],
}

impl Tables {
    fn new() -> Self {
        let mut t = Tables { e2m1: [0.0; 16], e4m3: [0.0; 256], e8m0: [0.0; 256] };
        for i in 0..16 {
            t.e2m1[i] = e2m1(i as u8);
        }
        for i in 0..256 {
            t.e4m3[i] = e4m3(i as u8);
            t.e8m0[i] = e8m0(i as u8);
        }
        t
    }
}

/// Decodes the codes of one packed row (`bytes`: `cols*B/8` bytes) into `codes`
/// (`cols` entries). Every 32 elements occupy exactly `B` words, so the row is
/// processed in blocks of `B` words with a 64-bit accumulator; with `B` a
/// constant the block loop unrolls completely.
#[inline(always)]
fn decode_codes<const B: u32>(bytes: &[u8], codes: &mut [u8]) {
    let mask = (1u64 << B) - 1;
    for (blk, out) in bytes.chunks_exact(4 * B as usize).zip(codes.chunks_exact_mut(32)) {
        let mut acc = 0u64;
        let mut n = 0u32;
        let mut wi = 0usize;
        for o in out.iter_mut() {
            if n < B {
                acc |= (word(blk, wi) as u64) << n;
                wi += 1;
                n += 32;
            }
            *o = (acc & mask) as u8;
            acc >>= B;
            n -= B;
        }
    }
}

/// Codes of one row at `bits` per element (bits ∈ {1,2,3,4,5,6,8}).
fn decode_row_codes(bits: usize, bytes: &[u8], codes: &mut [u8]) {
    match bits {
        4 => {
            // The common case: two nibbles per byte, low nibble first.
            for (b, c) in bytes.iter().zip(codes.chunks_exact_mut(2)) {
                c[0] = b & 15;
                c[1] = b >> 4;
            }
        }
        8 => codes.copy_from_slice(bytes),
        1 => decode_codes::<1>(bytes, codes),
        2 => decode_codes::<2>(bytes, codes),
        3 => decode_codes::<3>(bytes, codes),
        5 => decode_codes::<5>(bytes, codes),
        6 => decode_codes::<6>(bytes, codes),
        _ => unreachable!("validated bits"),
    }
}

impl Layout<'_> {
    /// Decodes row `r` into `out` (`cols` values); `codes` is scratch space of `cols` bytes.
    fn row(&self, r: usize, out: &mut [f32], codes: &mut [u8], tab: &Tables) {
        let cols = self.cols;
        match &self.plan {
            Plan::Float { t } => {
                let base = r * cols;
                match t.dtype {
                    RawDType::Bf16 => {
                        for (o, c) in out.iter_mut().zip(t.bytes[2 * base..2 * (base + cols)].chunks_exact(2)) {
                            *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                        }
                    }
                    _ => {
                        for (j, o) in out.iter_mut().enumerate() {
                            *o = float_at(t.dtype, &t.bytes, base + j);
                        }
                    }
                }
            }
            Plan::Quant { spec, w, scales, biases, global } => {
                let gs = spec.group_size;
                let groups = cols / gs;
                let row_bytes = cols * spec.bits / 8;
                decode_row_codes(spec.bits, &w[r * row_bytes..(r + 1) * row_bytes], codes);
                let s0 = r * groups;
                let chunks = out.chunks_exact_mut(gs).zip(codes.chunks_exact(gs)).enumerate();
                match spec.mode {
                    QuantMode::Affine => {
                        let b = biases.expect("validated");
                        for (g, (o, q)) in chunks {
                            let s = float_at(scales.dtype, &scales.bytes, s0 + g);
                            let bb = float_at(b.dtype, &b.bytes, s0 + g);
                            for (o, &q) in o.iter_mut().zip(q) {
                                // Two separate roundings, like MLX (`s*q + b` in f32; no FMA).
                                *o = s * q as f32 + bb;
                            }
                        }
                    }
                    QuantMode::Mxfp4 | QuantMode::Nvfp4 => {
                        let gf = global.as_ref().map(|(f, per)| f[r / per]);
                        for (g, (o, q)) in chunks {
                            let sc = scales.bytes[s0 + g] as usize;
                            let mut s = if spec.mode == QuantMode::Mxfp4 { tab.e8m0[sc] } else { tab.e4m3[sc] };
                            if let Some(gf) = gf {
                                s *= gf;
                            }
                            for (o, &q) in o.iter_mut().zip(q) {
                                *o = tab.e2m1[(q & 15) as usize] * s;
                            }
                        }
                    }
                    QuantMode::Mxfp8 => {
                        for (g, (o, q)) in chunks {
                            let s = tab.e8m0[scales.bytes[s0 + g] as usize];
                            for (o, &q) in o.iter_mut().zip(q) {
                                *o = tab.e4m3[q as usize] * s;
                            }
                        }
                    }
                }
            }
        }
    }

    fn rows_into(&self, rows: Range<usize>, out: &mut [f32]) {
        let cols = self.cols;
        if cols == 0 {
            return;
        }
        let tab = Tables::new();
        let start = rows.start;
        // Parallel over chunks of rows; small requests stay on this thread.
        if rows.len() * cols < 1 << 16 {
            let mut codes = vec![0u8; cols];
            for (i, o) in out.chunks_mut(cols).enumerate() {
                self.row(start + i, o, &mut codes, &tab);
            }
        } else {
            let rows_per_task = ((1 << 16) / cols).max(1);
            out.par_chunks_mut(rows_per_task * cols).enumerate().for_each_init(
                || vec![0u8; cols],
                |codes, (c, chunk)| {
                    for (i, o) in chunk.chunks_mut(cols).enumerate() {
                        self.row(start + c * rows_per_task + i, o, codes, &tab);
                    }
                },
            );
        }
    }
}

/// Number of rows (flattened leading dims) and row length (last dim) of `w`'s float shape.
pub fn rows_cols(w: &WeightData) -> (usize, usize) {
    let cols = w.param.shape.last().copied().unwrap_or(0);
    let numel: usize = w.param.shape.iter().product();
    (numel.checked_div(cols).unwrap_or(0), cols)
}

/// Dequantizes (or converts) the whole tensor to f32, in its float shape.
pub fn dequantize(w: &WeightData) -> Result<Vec<f32>, String> {
    let l = layout(w)?;
    let mut out = vec![0f32; l.rows * l.cols];
    l.rows_into(0..l.rows, &mut out);
    Ok(out)
}

/// Dequantizes rows `rows` of the float shape flattened to `[rows, in]` (for a
/// 3-D expert stack `[E, out, in]`, row `e*out + r`) into `out`
/// (`rows.len() * in` values). Used for embedding lookups and chunked work.
///
/// # Panics
/// When `w` is inconsistent or `rows`/`out` do not fit; see [`try_dequantize_rows`]
/// for the fallible form. Weights from the loader are always consistent.
pub fn dequantize_rows(w: &WeightData, rows: Range<usize>, out: &mut [f32]) {
    if let Err(e) = try_dequantize_rows(w, rows, out) {
        panic!("dequantize_rows: {e}");
    }
}

/// Fallible form of [`dequantize_rows`].
pub fn try_dequantize_rows(w: &WeightData, rows: Range<usize>, out: &mut [f32]) -> Result<(), String> {
    let l = layout(w)?;
    if rows.start > rows.end || rows.end > l.rows {
        return Err(format!("{}: rows {rows:?} out of range (0..{})", w.param.name, l.rows));
    }
    if out.len() != rows.len() * l.cols {
        return Err(format!("{}: output holds {} values, {} rows need {}", w.param.name, out.len(), rows.len(), rows.len() * l.cols));
    }
    l.rows_into(rows, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table_facts() {
        assert_eq!(e4m3(0x7e), 448.0);
        assert!(e4m3(0x7f).is_nan() && e4m3(0xff).is_nan());
        assert_eq!(e4m3(0x01), 2f32.powi(-9));
        assert_eq!(e4m3(0x08), 2f32.powi(-6));
        assert_eq!(e4m3(0x80), -0.0);
    }

    #[test]
    fn e8m0_facts() {
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert_eq!(e8m0(254), 2f32.powi(127));
        assert!(e8m0(255).is_nan());
    }
}
