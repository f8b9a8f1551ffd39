//! The vision towers (Gemma 4's ViT, Gemma 3's SigLIP) as compiled graphs against mlx-vlm's
//! references (the tiny fixtures of `tools/make_vlm_fixtures.py`, with HF's semantics where
//! the two differ), intermediate by intermediate, on the CPU reference executor and on the GPU
//! (lavapipe in CI; fails, never skips, without an adapter), NaN checks on.

use std::path::PathBuf;
use std::sync::Arc;

use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::exec::{Executor, GraphKey};
use markbase::graph::passes::{compile, Compiled, PhasePolicy};
use markbase::gpu::runtime::GpuExecutor;
use markbase::loader::Checkpoint;
use markbase::vision::processor::{read_processor_config, Gemma3Processor, Gemma4Processor};
use markbase::vision::load_image;

fn fixture(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm").join(family)
}

fn dir() -> PathBuf {
    fixture("gemma4")
}

fn reference_of(family: &str, name: &str) -> Vec<f32> {
    markbase::npy::read_f32(&fixture(family).join(format!("ref/{name}.npy"))).unwrap_or_else(|e| panic!("{e}")).data
}

fn reference(name: &str) -> Vec<f32> {
    reference_of("gemma4", name)
}

/// Max |got − want| over max |want|.
fn rel_err(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: {} values, the reference has {}", got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite values");
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / m
}

/// Bounds (relative to the reference's largest magnitude), about 10x the error observed on
/// the CPU reference and on lavapipe, both images (in brackets: the largest seen of either).
const BOUNDS: [(&str, f32); 5] = [
    ("patch_embed", 1e-5), // [7.8e-7]
    ("layer0", 3e-5),      // [2.8e-6]
    ("layer1", 8e-5),      // [8.1e-6]
    ("pooled", 2e-5),      // [2.0e-6]
    ("soft", 3e-5),        // [2.9e-6]
];

/// The graph of one fixture image, its weights and inputs.
fn setup(name: &str) -> (Compiled, markbase::weights::Weights, Vec<f32>, Vec<u32>, Vec<u32>) {
    let cp = Checkpoint::open(dir()).unwrap();
    let vc = cp.vision_config().unwrap().unwrap();
    let proc = Gemma4Processor::from_config(read_processor_config(&dir()).unwrap().as_ref(), None).unwrap();
    let img = proc.process(&load_image(&dir().join(format!("{name}.png"))).unwrap()).unwrap();
    let g = cp.tower_graph(&vc, img.rows, img.cols).unwrap();
    let (w, rep) = cp.load_tower(&vc, &g).unwrap();
    assert!(rep.is_empty(), "{rep}");
    let (pixels, px, py) = img.tower_input();
    (compile(g, PhasePolicy::EmbedLayersHead).unwrap(), w, pixels, px, py)
}

#[test]
fn gemma4_tower_matches_mlx_vlm_on_the_cpu() {
    for name in ["square", "wide"] {
        let (c, w, pixels, px, py) = setup(name);
        let mut cw = CpuWeights::new(Arc::new(w));
        let step = StepInputs { pixels: &pixels, patch_x: &px, patch_y: &py, ..Default::default() };
        let out = exec::run(&c, &mut cw, &mut CpuState::default(), &step).unwrap();
        for (what, bound) in BOUNDS {
            let e = rel_err(what, out[what].f(), &reference(&format!("{name}_{what}")));
            println!("cpu {name} {what}: {e:.2e}");
            assert!(e <= bound, "cpu {name} {what}: {e:.2e} > {bound:.0e}");
        }
    }
}

#[test]
fn gemma4_tower_matches_mlx_vlm_on_the_gpu() {
    for name in ["square", "wide"] {
        let (c, w, pixels, px, py) = setup(name);
        // NaN checks on: a NaN anywhere fails the step
        let mut gpu = GpuExecutor::new(None, Arc::new(w), true).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
        let key = GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
        let step = StepInputs { pixels: &pixels, patch_x: &px, patch_y: &py, ..Default::default() };
        let soft = gpu.run(key, &c, &step, true).unwrap().logits.unwrap();
        for (what, bound) in BOUNDS {
            let got: Vec<f32> = if what == "soft" { soft.clone() } else { gpu.read_output(key, &c, what).unwrap().into_iter().map(f32::from_bits).collect() };
            let e = rel_err(what, &got, &reference(&format!("{name}_{what}")));
            println!("gpu {name} {what}: {e:.2e}");
            assert!(e <= bound, "gpu {name} {what}: {e:.2e} > {bound:.0e}");
        }
    }
}

#[test]
fn bad_grids_are_refused() {
    let cp = Checkpoint::open(dir()).unwrap();
    let vc = cp.vision_config().unwrap().unwrap();
    let e = cp.tower_graph(&vc, 4, 6).unwrap_err().to_string();
    assert!(e.contains("4x6") && e.contains("3x3"), "{e}");
    let e = cp.tower_graph(&vc, 300, 3).unwrap_err().to_string();
    assert!(e.contains("position table"), "{e}");
}

/// SigLIP bounds, as [`BOUNDS`] (observed in brackets).
const SIGLIP_BOUNDS: [(&str, f32); 6] = [
    ("patch_embed", 8e-6), // [7.2e-7]
    ("layer0", 7e-6),      // [6.9e-7]
    ("layer1", 7e-6),      // [6.2e-7]
    ("post_ln", 1e-5),     // [8.2e-7]
    ("pooled", 3e-6),      // [2.4e-7]
    ("soft", 6e-6),        // [5.3e-7]
];

fn siglip_setup(name: &str) -> (Compiled, markbase::weights::Weights, Vec<f32>, Vec<u32>) {
    let d = fixture("gemma3");
    let cp = Checkpoint::open(&d).unwrap();
    let vc = cp.vision_config().unwrap().unwrap();
    let proc = Gemma3Processor::from_config(read_processor_config(&d).unwrap().as_ref()).unwrap();
    let img = proc.process(&load_image(&d.join(format!("{name}.png"))).unwrap());
    let g = cp.tower_graph(&vc, 0, 0).unwrap();
    let (w, rep) = cp.load_tower(&vc, &g).unwrap();
    assert!(rep.is_empty(), "{rep}");
    let (pixels, pos) = img[0].tower_input(vc.patch);
    (compile(g, PhasePolicy::EmbedLayersHead).unwrap(), w, pixels, pos)
}

#[test]
fn siglip_tower_matches_the_reference_on_cpu_and_gpu() {
    for name in ["square", "wide"] {
        let (c, w, pixels, pos) = siglip_setup(name);
        let w = Arc::new(w);
        let step = StepInputs { positions: &pos, pixels: &pixels, ..Default::default() };
        let out = exec::run(&c, &mut CpuWeights::new(w.clone()), &mut CpuState::default(), &step).unwrap();
        let mut gpu = GpuExecutor::new(None, w, true).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
        let key = GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
        let soft = gpu.run(key, &c, &step, true).unwrap().logits.unwrap();
        for (what, bound) in SIGLIP_BOUNDS {
            let want = reference_of("gemma3", &format!("{name}_{what}"));
            let e = rel_err(what, out[what].f(), &want);
            let got: Vec<f32> = if what == "soft" { soft.clone() } else { gpu.read_output(key, &c, what).unwrap().into_iter().map(f32::from_bits).collect() };
            let eg = rel_err(what, &got, &want);
            println!("siglip {name} {what}: cpu {e:.2e} gpu {eg:.2e}");
            assert!(e <= bound && eg <= bound, "siglip {name} {what}: cpu {e:.2e} gpu {eg:.2e} > {bound:.0e}");
        }
    }
}
