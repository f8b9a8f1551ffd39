//! `markbase encode`: image files to soft-token embeddings (`[N, D_text]` f32 .npy) against
//! the references, and its bad inputs (each a clear error, no file left behind).

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn vlm(p: &str) -> PathBuf {
    root().join("tests/fixtures/vlm").join(p)
}

fn encode(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_markbase")).arg("encode").args(args).output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("markbase-encode-{}-{name}.npy", std::process::id()))
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / m
}

/// Both images of each fixture, from their files, on the CPU executor: the rows of each image
/// follow the previous one's, within the tower test's bound on the soft tokens.
#[test]
fn encode_writes_the_soft_tokens_of_each_image() {
    for (family, per_image) in [("gemma4", [64usize, 60]), ("gemma3", [16, 16])] {
        let out = tmp(family);
        let (sq, wide) = (vlm(family).join("square.png"), vlm(family).join("wide.png"));
        let (ok, err) = encode(&["-m", vlm(family).to_str().unwrap(), "--image", sq.to_str().unwrap(), "--image", wide.to_str().unwrap(), "--out", out.to_str().unwrap(), "--backend", "cpu"]);
        assert!(ok, "{family}: {err}");
        assert!(err.contains(&format!("{per_image:?}")), "{err}");
        let got = markbase::npy::read_f32(&out).unwrap();
        assert_eq!(got.shape, vec![per_image[0] + per_image[1], 64]);
        let mut want = markbase::npy::read_f32(&vlm(family).join("ref/square_soft.npy")).unwrap().data;
        want.extend(markbase::npy::read_f32(&vlm(family).join("ref/wide_soft.npy")).unwrap().data);
        let e = rel_err(&got.data, &want);
        println!("{family}: {e:.2e}");
        assert!(e < 3e-5, "{family}: {e:.2e}");
        std::fs::remove_file(out).ok();
    }
}

#[test]
fn encode_bad_inputs_are_clear_errors() {
    let g4 = vlm("gemma4");
    let sq = g4.join("square.png");
    let bad = root().join("tests/fixtures/vlm/gemma4/config.json");
    let text_only = root().join("tests/fixtures/gemma3_text-bf16");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["-m".into(), g4.display().to_string(), "--image".into(), g4.join("none.png").display().to_string()], "cannot be read"),
        (vec!["-m".into(), g4.display().to_string(), "--image".into(), bad.display().to_string()], "not a PNG, JPEG or WebP"),
        (vec!["-m".into(), g4.display().to_string(), "--image".into(), sq.display().to_string(), "--max-soft-tokens".into(), "100".into()], "not a Gemma 4 budget"),
        (vec!["-m".into(), vlm("gemma3").display().to_string(), "--image".into(), sq.display().to_string(), "--max-soft-tokens".into(), "70".into()], "Gemma 4 only"),
        (vec!["-m".into(), text_only.display().to_string(), "--image".into(), sq.display().to_string()], "no vision tower"),
    ];
    for (i, (args, want)) in cases.into_iter().enumerate() {
        let out = tmp(&format!("bad{i}"));
        let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
        a.extend(["--out", out.to_str().unwrap(), "--backend", "cpu"]);
        let (ok, err) = encode(&a);
        assert!(!ok && err.contains(want), "case {i}: {err}");
        assert!(!err.contains("panicked"), "case {i}: {err}");
        assert!(!out.exists(), "case {i}: {} left behind", out.display());
    }
}

fn logits(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_markbase")).arg("logits").args(args).output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// `logits --image`: the placeholder runs of --tokens filled with the images' soft tokens, the
/// logits of every position against mlx-vlm's (5e-4 of max |logit|); a run count that
/// disagrees with the images is a clear error. Gemma 3's against HF's image-span mask.
#[test]
fn logits_with_images() {
    let g4 = vlm("gemma4");
    let ids: Vec<String> = markbase::npy::read_i32(&g4.join("ref/input_ids.npy")).unwrap().data.iter().map(|v| v.to_string()).collect();
    let ids = ids.join(",");
    let (sq, wide) = (g4.join("square.png"), g4.join("wide.png"));
    let out = tmp("logits");
    let o = out.to_str().unwrap();
    let (ok, err) = logits(&["-m", g4.to_str().unwrap(), "--tokens", &ids, "--image", sq.to_str().unwrap(), "--image", wide.to_str().unwrap(), "--out", o, "--backend", "cpu"]);
    assert!(ok, "{err}");
    let got = markbase::npy::read_f32(&out).unwrap();
    let want = markbase::npy::read_f32(&g4.join("ref/logits.npy")).unwrap();
    assert_eq!(got.shape, want.shape);
    let e = rel_err(&got.data, &want.data);
    println!("logits --image: {e:.2e} of max |logit|");
    assert!(e <= 5e-4, "{e:.2e}");
    std::fs::remove_file(&out).ok();
    // one image for two runs of placeholders
    let (ok, err) = logits(&["-m", g4.to_str().unwrap(), "--tokens", &ids, "--image", sq.to_str().unwrap(), "--out", o, "--backend", "cpu"]);
    assert!(!ok && err.contains("124 image placeholders") && err.contains("64 soft tokens"), "{err}");
    assert!(!out.exists());
    // Gemma 3: each image's span attends to itself bidirectionally (HF's mask)
    let g3 = vlm("gemma3");
    let ids: Vec<String> = markbase::npy::read_i32(&g3.join("ref/input_ids.npy")).unwrap().data.iter().map(|v| v.to_string()).collect();
    let (sq, wide) = (g3.join("square.png"), g3.join("wide.png"));
    let (ok, err) = logits(&["-m", g3.to_str().unwrap(), "--tokens", &ids.join(","), "--image", sq.to_str().unwrap(), "--image", wide.to_str().unwrap(), "--out", o, "--backend", "cpu"]);
    assert!(ok, "{err}");
    let got = markbase::npy::read_f32(&out).unwrap();
    let e = rel_err(&got.data, &markbase::npy::read_f32(&g3.join("ref/logits.npy")).unwrap().data);
    println!("gemma3 logits --image: {e:.2e} of max |logit|");
    assert!(e <= 5e-4, "{e:.2e}");
    std::fs::remove_file(&out).ok();
}
