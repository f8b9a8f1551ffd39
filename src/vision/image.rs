//! Image files in: PNG, JPEG and WebP decoded with the `image` crate, EXIF orientation
//! applied, converted to 8-bit RGB as the Hugging Face processors do (`convert_to_rgb`:
//! transparent pixels composited over white with PIL's arithmetic).
//!
//! Memory is bounded before anything is decoded: the header's size is checked against
//! [`MAX_SIDE`] and [`MAX_PIXELS`], and the decoder runs under an allocation limit.

use std::io::Cursor;
use std::path::Path;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};

/// Longest accepted side, in pixels.
pub const MAX_SIDE: u32 = 16384;
/// Most pixels accepted in one image (64 megapixels: 192 MiB as RGB).
pub const MAX_PIXELS: u64 = 64 << 20;

/// Why an image cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {msg}")]
pub struct ImageError {
    /// The file (or `image` for bytes without a name).
    pub what: String,
    pub msg: String,
}

/// An 8-bit RGB image, rows top to bottom, pixels interleaved (`HWC`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl RgbImage {
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Self {
        assert_eq!(data.len(), width * height * 3, "RGB data of {width}x{height}");
        RgbImage { width, height, data }
    }

    /// The `w x h` region at `(x, y)`, clipped to the image.
    pub fn crop(&self, x: usize, y: usize, w: usize, h: usize) -> RgbImage {
        let x1 = (x + w).min(self.width);
        let y1 = (y + h).min(self.height);
        let (w, h) = (x1.saturating_sub(x), y1.saturating_sub(y));
        let mut data = Vec::with_capacity(w * h * 3);
        for row in y..y + h {
            let start = (row * self.width + x) * 3;
            data.extend_from_slice(&self.data[start..start + w * 3]);
        }
        RgbImage { width: w, height: h, data }
    }
}

/// Reads and decodes an image file.
pub fn load_image(path: &Path) -> Result<RgbImage, ImageError> {
    let what = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| ImageError { what: what.clone(), msg: format!("cannot be read: {e}") })?;
    decode_named(&bytes, &what)
}

/// Decodes an image held in memory.
pub fn decode_image(bytes: &[u8]) -> Result<RgbImage, ImageError> {
    decode_named(bytes, "image")
}

fn decode_named(bytes: &[u8], what: &str) -> Result<RgbImage, ImageError> {
    let err = |msg: String| ImageError { what: what.to_string(), msg };
    let format = image::guess_format(bytes).map_err(|_| err(unsupported(bytes)))?;
    if !matches!(format, ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) {
        return Err(err(format!("{format:?} images are not supported (PNG, JPEG and WebP are)")));
    }
    if format == ImageFormat::Jpeg && !jpeg_complete(bytes) {
        // the decoder would fill the missing rows with grey instead of failing
        return Err(err("the JPEG data is truncated (no end-of-image marker after the last scan)".into()));
    }
    // The header alone first: the size is refused before a pixel is decoded.
    let (w, h) = ImageReader::with_format(Cursor::new(bytes), format).into_dimensions().map_err(|e| err(decode_msg(format, e)))?;
    check_size(w, h).map_err(err)?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.limits(limits());
    let mut decoder = reader.into_decoder().map_err(|e| err(decode_msg(format, e)))?;
    let orientation = decoder.orientation().map_err(|e| err(decode_msg(format, e)))?;
    let mut img = DynamicImage::from_decoder(decoder).map_err(|e| err(decode_msg(format, e)))?;
    img.apply_orientation(orientation);
    Ok(to_rgb(img))
}

/// Whether a JPEG stream ends its last scan: an end-of-image marker after the last
/// start-of-scan (entropy-coded data never holds a bare marker; an EXIF thumbnail's markers
/// come before the main image's).
fn jpeg_complete(bytes: &[u8]) -> bool {
    let last = |m: u8| bytes.windows(2).rposition(|w| w == [0xFF, m]);
    matches!((last(0xD9), last(0xDA)), (Some(eoi), Some(sos)) if eoi > sos)
}

fn limits() -> Limits {
    let mut l = Limits::default();
    l.max_image_width = Some(MAX_SIDE);
    l.max_image_height = Some(MAX_SIDE);
    // RGBA at 16 bits per channel of the largest accepted image, and the decoder's own buffers
    l.max_alloc = Some(MAX_PIXELS * 8 + (64 << 20));
    l
}

/// Whether a `w x h` image is accepted.
pub fn check_size(w: u32, h: u32) -> Result<(), String> {
    if w == 0 || h == 0 {
        return Err(format!("the image is {w}x{h} pixels: it has no pixels"));
    }
    if w > MAX_SIDE || h > MAX_SIDE || w as u64 * h as u64 > MAX_PIXELS {
        return Err(format!(
            "the image is {w}x{h} pixels, larger than accepted (at most {MAX_SIDE} pixels a side and {} megapixels); downscale it first",
            MAX_PIXELS >> 20
        ));
    }
    Ok(())
}

fn unsupported(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        "the file is empty".to_string()
    } else {
        "not a PNG, JPEG or WebP image (unrecognised file signature)".to_string()
    }
}

fn decode_msg(format: ImageFormat, e: image::ImageError) -> String {
    match e {
        image::ImageError::Limits(l) => format!("the image exceeds the decoder's memory limit ({l})"),
        e => format!("cannot be decoded as {format:?} (corrupt or truncated file?): {e}"),
    }
}

/// 8-bit RGB, as HF's `convert_to_rgb` makes it: images with alpha are composited over an
/// opaque white background with PIL's `alpha_composite` arithmetic; grey is replicated.
fn to_rgb(img: DynamicImage) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    if !img.color().has_alpha() {
        return RgbImage::new(w, h, img.into_rgb8().into_raw());
    }
    let rgba = img.into_rgba8().into_raw();
    let mut data = Vec::with_capacity(w * h * 3);
    for px in rgba.chunks_exact(4) {
        let a = px[3] as u32;
        for &c in &px[..3] {
            data.push(over_white(c as u32, a));
        }
    }
    RgbImage::new(w, h, data)
}

/// One channel of `src` (alpha `a`) over opaque white, in PIL's fixed point (7 fraction bits,
/// division by 255 as `((x >> 8) + x) >> 8`).
fn over_white(c: u32, a: u32) -> u8 {
    if a == 0 {
        return 255;
    }
    const BITS: u32 = 7;
    let coef1 = a << BITS; // a * 255 * 255 * 2^7 / (255 * 255)
    let coef2 = (255 << BITS) - coef1;
    let t = c * coef1 + 255 * coef2 + (0x80 << BITS);
    ((((t >> 8) + t) >> 8) >> BITS) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_white_matches_the_ends() {
        assert_eq!(over_white(10, 255), 10);
        assert_eq!(over_white(10, 0), 255);
        assert_eq!(over_white(0, 128), 127);
    }

    #[test]
    fn crop_clips_to_the_image() {
        let img = RgbImage::new(3, 2, (0..18).collect());
        let c = img.crop(1, 1, 5, 5);
        assert_eq!((c.width, c.height), (2, 1));
        assert_eq!(c.data, vec![12, 13, 14, 15, 16, 17]);
    }
}
