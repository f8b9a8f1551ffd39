//! Resizing 8-bit RGB images the way Pillow's `Image.resize` does (no reducing gap), so that
//! the pixels equal those of the Hugging Face processors, which resize through Pillow.
//!
//! Pillow's convolution resampler: for each output pixel, filter weights over the input
//! pixels whose centres fall inside the filter's support (widened by the scale when
//! downscaling), normalised to sum 1 in double precision, then turned into fixed point with
//! 22 fraction bits; two passes, one per axis, the first rounded and clipped to 8 bits.

use super::image::RgbImage;

/// A resampling filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// Triangle filter, support 1 (PIL `BILINEAR`).
    Bilinear,
    /// Keys cubic with a = -0.5, support 2 (PIL `BICUBIC`).
    Bicubic,
}

impl Filter {
    /// From PIL's resample code in a processor config (2 bilinear, 3 bicubic).
    pub fn from_pil(code: u64) -> Option<Filter> {
        match code {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The fixed-point weights of one axis: for output `i`, input `first[i]..first[i] + len[i]`
/// with weights `w[i * ksize..]`.
struct Coeffs {
    ksize: usize,
    first: Vec<usize>,
    len: Vec<usize>,
    w: Vec<i32>,
}

fn coeffs(in_size: usize, out_size: usize, f: Filter) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = f.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut first = Vec::with_capacity(out_size);
    let mut len = Vec::with_capacity(out_size);
    let mut w = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for i in 0..out_size {
        let center = (i as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // truncation toward zero, as C's (int) cast
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut total = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(n) {
            *kx = f.weight((x as f64 + xmin as f64 - center + 0.5) * ss);
            total += *kx;
        }
        for (x, kx) in k.iter().enumerate().take(n) {
            let v = if total != 0.0 { kx / total } else { *kx };
            let fixed = v * (1u32 << PRECISION_BITS) as f64;
            w[i * ksize + x] = if v < 0.0 { (fixed - 0.5) as i32 } else { (fixed + 0.5) as i32 };
        }
        first.push(xmin);
        len.push(n);
    }
    Coeffs { ksize, first, len, w }
}

#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Horizontal pass: rows of `src` (`w` pixels wide) resampled to `c`'s output width.
fn pass_h(src: &[u8], w: usize, c: &Coeffs) -> Vec<u8> {
    let ow = c.first.len();
    let rows = src.len() / (w * 3);
    let mut out = vec![0u8; rows * ow * 3];
    for (srow, dst) in src.chunks_exact(w * 3).zip(out.chunks_exact_mut(ow * 3)) {
        for x in 0..ow {
            let k = &c.w[x * c.ksize..x * c.ksize + c.len[x]];
            let base = c.first[x] * 3;
            let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
            for (j, &kw) in k.iter().enumerate() {
                let p = &srow[base + j * 3..base + j * 3 + 3];
                for ch in 0..3 {
                    acc[ch] += p[ch] as i32 * kw;
                }
            }
            for ch in 0..3 {
                dst[x * 3 + ch] = clip8(acc[ch]);
            }
        }
    }
    out
}

/// Vertical pass: `src` (rows `w` pixels wide, its first row being input row `row0`)
/// resampled to `c`'s output height.
fn pass_v(src: &[u8], w: usize, row0: usize, c: &Coeffs) -> Vec<u8> {
    let stride = w * 3;
    let oh = c.first.len();
    let mut out = vec![0u8; oh * stride];
    for (y, dst) in out.chunks_exact_mut(stride).enumerate() {
        let k = &c.w[y * c.ksize..y * c.ksize + c.len[y]];
        let first = c.first[y] - row0;
        for (i, d) in dst.iter_mut().enumerate() {
            let mut acc = 1i32 << (PRECISION_BITS - 1);
            for (j, &kw) in k.iter().enumerate() {
                acc += src[(first + j) * stride + i] as i32 * kw;
            }
            *d = clip8(acc);
        }
    }
    out
}

/// `img` resized to `width x height` with filter `f`, as Pillow 13 resizes an RGB image.
///
/// Pillow resamples horizontally first (over the rows the vertical pass reads), except when
/// the height shrinks by more than twice as many pixels as the width does: then vertically
/// first. The order matters: the intermediate image is rounded to 8 bits.
pub fn resize(img: &RgbImage, width: usize, height: usize, f: Filter) -> RgbImage {
    assert!(width > 0 && height > 0 && img.width > 0 && img.height > 0, "resize of an empty image");
    let (w, h) = (img.width, img.height);
    if width == w && height == h {
        return img.clone();
    }
    let cv = coeffs(h, height, f);
    if width == w {
        return RgbImage::new(width, height, pass_v(&img.data, w, 0, &cv));
    }
    let ch = coeffs(w, width, f);
    if height == h {
        return RgbImage::new(width, height, pass_h(&img.data, w, &ch));
    }
    let vertical_first = height < h && (h - height) as i64 > 2 * (w as i64 - width as i64);
    let data = if vertical_first {
        pass_h(&pass_v(&img.data, w, 0, &cv), w, &ch)
    } else {
        // only the rows the vertical pass reads
        let y0 = cv.first[0];
        let y1 = cv.first[height - 1] + cv.len[height - 1];
        let tmp = pass_h(&img.data[y0 * w * 3..y1 * w * 3], w, &ch);
        pass_v(&tmp, width, y0, &cv)
    };
    RgbImage::new(width, height, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(7, 3), (3, 7), (100, 33), (1, 5), (5, 1)] {
            for f in [Filter::Bilinear, Filter::Bicubic] {
                let c = coeffs(i, o, f);
                for x in 0..o {
                    let s: i64 = c.w[x * c.ksize..x * c.ksize + c.len[x]].iter().map(|&v| v as i64).sum();
                    assert!((s - (1 << PRECISION_BITS)).abs() <= c.len[x] as i64, "{i}->{o} {f:?} row {x}: {s}");
                }
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat() {
        let img = RgbImage::new(5, 3, [10u8, 200, 77].repeat(15));
        for f in [Filter::Bilinear, Filter::Bicubic] {
            let r = resize(&img, 11, 2, f);
            assert!(r.data.chunks(3).all(|p| p == [10, 200, 77]), "{f:?}");
        }
    }
}
