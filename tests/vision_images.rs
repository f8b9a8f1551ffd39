//! Images in: decoding, EXIF orientation, and the Gemma 3 / Gemma 4 image processors against
//! Hugging Face's PIL-backed processors (`tools/make_image_refs.py`, `tools/make_vlm_fixtures.py`),
//! and bad input.

use std::path::PathBuf;

use markbase::vision::image::{check_size, decode_image, load_image, RgbImage};
use markbase::vision::processor::{read_processor_config, Gemma3Processor, Gemma4Processor};

fn images() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images")
}

fn manifest() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(images().join("manifest.json")).unwrap()).unwrap()
}

/// Largest per-channel difference, and how many values differ.
fn diff(a: &RgbImage, b: &RgbImage) -> (u8, usize) {
    assert_eq!((a.width, a.height), (b.width, b.height), "sizes differ");
    let mut m = 0;
    let mut n = 0;
    for (x, y) in a.data.iter().zip(&b.data) {
        let d = x.abs_diff(*y);
        m = m.max(d);
        n += (d != 0) as usize;
    }
    (m, n)
}

/// The decoder agrees with PIL's: exactly for PNG and lossless WebP (and PIL's alpha
/// compositing); JPEG decoders may differ by a few levels, so those are bounded.
#[test]
fn decoding_matches_pil() {
    let m = manifest();
    for (stem, e) in m.as_object().unwrap() {
        let src = images().join("src").join(e["source"].as_str().unwrap());
        let got = load_image(&src).unwrap();
        let want = load_image(&images().join("decoded").join(format!("{stem}.png"))).unwrap();
        assert_eq!([got.height, got.width], [want.height, want.width], "{stem}: size (EXIF orientation applied?)");
        let (max, n) = diff(&got, &want);
        let jpeg = src.extension().unwrap() == "jpg";
        println!("{stem}: decoded max |d| {max}, {n} values differ");
        if jpeg {
            let mean_ok = n * 4 < got.data.len();
            assert!(max <= 8 && mean_ok, "{stem}: JPEG decode differs from PIL's by up to {max} ({n} values)");
        } else {
            assert_eq!(max, 0, "{stem}: decode differs from PIL's ({n} values)");
        }
    }
}

/// The processors' resized images equal Hugging Face's, starting from PIL's decoded pixels:
/// Pillow's resampling arithmetic is reproduced, so the match is exact.
#[test]
fn processors_match_hugging_face_exactly() {
    let m = manifest();
    let mut cases = 0;
    for (stem, e) in m.as_object().unwrap() {
        let decoded = load_image(&images().join("decoded").join(format!("{stem}.png"))).unwrap();
        for (label, c) in e["cases"].as_object().unwrap() {
            let want = load_image(&images().join("out").join(format!("{stem}.{label}.png"))).unwrap();
            let got = match c["family"].as_str().unwrap() {
                "gemma4" => {
                    let p = Gemma4Processor::from_config(None, Some(c["max_soft_tokens"].as_u64().unwrap() as usize)).unwrap();
                    let out = p.process(&decoded).unwrap();
                    assert_eq!(out.soft_tokens as u64, c["soft_tokens"].as_u64().unwrap(), "{stem} {label}: soft tokens");
                    out.resized
                }
                _ => {
                    let s = c["size"][0].as_u64().unwrap() as usize;
                    let p = Gemma3Processor { size: s, ..Default::default() };
                    let out = p.process(&decoded);
                    assert_eq!(out.len(), 1);
                    // the pixel values are the resized image, normalised
                    let r = markbase::vision::resample::resize(&decoded, s, s, p.filter);
                    assert_eq!(out[0].pixels[0], ((r.data[0] as f64 / 255.0) as f32 - 0.5) / 0.5);
                    r
                }
            };
            let (max, n) = diff(&got, &want);
            assert_eq!(max, 0, "{stem} {label}: {n} values differ from Hugging Face's, by up to {max}");
            cases += 1;
        }
    }
    assert!(cases >= 20, "only {cases} cases");
}

fn vlm(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm").join(family)
}

/// Gemma 3's float pixel values (rescale, then normalise, in HF's f32 arithmetic) are exact,
/// with the settings read from the checkpoint's processor config.
#[test]
fn gemma3_pixel_values_are_exact() {
    let dir = vlm("gemma3");
    let cfg = read_processor_config(&dir).unwrap();
    let p = Gemma3Processor::from_config(cfg.as_ref()).unwrap();
    assert_eq!(p.size, 224);
    for name in ["square", "wide"] {
        let img = load_image(&dir.join(format!("{name}.png"))).unwrap();
        let got = p.process(&img);
        let want = markbase::npy::read_f32(&dir.join(format!("ref/{name}_pixels.npy"))).unwrap();
        assert_eq!(want.shape, vec![3, 224, 224]);
        let bad = got[0].pixels.iter().zip(&want.data).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(bad, 0, "{name}: {bad} pixel values differ");
    }
}

/// Gemma 4: the resized image, the patch order, the pixel values and the positions, from the
/// checkpoint's processor config (budget 70).
#[test]
fn gemma4_patches_and_positions_are_exact() {
    let dir = vlm("gemma4");
    let cfg = read_processor_config(&dir).unwrap();
    let p = Gemma4Processor::from_config(cfg.as_ref(), None).unwrap();
    assert_eq!(p.max_soft_tokens, 70);
    for name in ["square", "wide"] {
        let img = load_image(&dir.join(format!("{name}.png"))).unwrap();
        let out = p.process(&img).unwrap();
        let resized = markbase::npy::read_u8(&dir.join(format!("ref/{name}_resized.npy"))).unwrap();
        assert_eq!(resized.shape, vec![out.rows * 16, out.cols * 16, 3]);
        assert_eq!(out.resized.data, resized.data, "{name}: resized image");
        let pos = markbase::npy::read_i32(&dir.join(format!("ref/{name}_positions.npy"))).unwrap();
        let got: Vec<i32> = out.positions.iter().flat_map(|p| [p[0] as i32, p[1] as i32]).collect();
        assert_eq!(got, pos.data, "{name}: positions");
        // patch k, value (py, px, c) = resized[16y + py][16x + px][c] / 255
        let (k, py, px, c) = (out.cols + 1, 5, 7, 2);
        let (x, y) = (k % out.cols, k / out.cols);
        let v = resized.data[((16 * y + py) * out.cols * 16 + 16 * x + px) * 3 + c];
        assert_eq!(out.patches[k * 768 + (py * 16 + px) * 3 + c], (v as f64 * (1.0 / 255.0)) as f32);
    }
}

#[test]
fn bad_images_are_clear_errors() {
    let src = std::fs::read(images().join("src/coffee.jpg")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "empty"),
        ("text", b"hello, not an image".to_vec(), "not a PNG, JPEG or WebP"),
        ("truncated jpeg", src[..src.len() / 3].to_vec(), "truncated"),
        ("truncated png", {
            let png = std::fs::read(images().join("src/astronaut.png")).unwrap();
            png[..png.len() / 2].to_vec()
        }, "corrupt or truncated"),
        ("truncated webp", {
            let w = std::fs::read(images().join("src/chelsea.webp")).unwrap();
            w[..w.len() / 2].to_vec()
        }, "corrupt or truncated"),
        ("bmp", {
            let mut b = b"BM".to_vec();
            b.extend_from_slice(&[0; 60]);
            b
        }, "not supported"),
        ("gif", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;".to_vec(), "not supported"),
    ];
    for (what, bytes, want) in cases {
        let e = match decode_image(&bytes) {
            Ok(img) => panic!("{what}: decoded as a {}x{} image", img.width, img.height),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "{what}: {e}");
    }
    // a PNG whose header claims 30000 x 30000: refused from the header, nothing allocated
    let e = decode_image(&png_header(30000, 30000)).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("30000x30000") && e.contains("larger than accepted"), "{e}");
    // a 0 x 0 image
    assert!(check_size(0, 0).unwrap_err().contains("no pixels"));
    let e = decode_image(&png_header(0, 0)).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("no pixels") || e.contains("cannot be decoded"), "{e}");
    // a missing file names the file
    let e = load_image(&images().join("src/none.png")).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("none.png") && e.contains("cannot be read"), "{e}");
}

/// A PNG of a `w x h` RGB image with no pixel data: signature, IHDR, empty IDAT, IEND.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    out.extend_from_slice(&13u32.to_be_bytes());
    out.extend_from_slice(&ihdr);
    out.extend_from_slice(&crc32(&ihdr).to_be_bytes());
    for chunk in [&b"IDAT"[..], &b"IEND"[..]] {
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(chunk);
        out.extend_from_slice(&crc32(chunk).to_be_bytes());
    }
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}
