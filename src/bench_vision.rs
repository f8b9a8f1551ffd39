//! `markbase bench` of a model with a vision tower: the time to encode one image (pixels to
//! soft tokens, through the tower and the projector) with its TFLOP/s, and the time to first
//! token of a prompt of that image and 32 text tokens (its prefill, after the encode).
//!
//! FLOPs of an encode are counted on the tower's graph: `2·M·N·K` per matmul (`[M, K]` by an
//! `[N, K]` weight: the patch embedding, q/k/v/o, the MLP, the projector) and `4·P·S·H·d` per
//! attention (`QKᵀ` and `PV` of `H` heads of `d` over `P` queries and `S` keys); norms,
//! activations, RoPE, pooling and residuals are left out (well under 1% of the total at the real
//! shapes).

use std::sync::Arc;

use serde_json::{json, Value};

use markbase_graph::ir::Graph;
use markbase_graph::ops::Op;
use markbase_graph::passes::{compile, PhasePolicy};
use markbase_graph::tower::{build_gemma4_tower, build_siglip_tower};
use markbase_graph::vision::{TowerKind, VisionConfig};
use markbase_graph::ModelConfig;

use crate::cpu::exec::StepInputs;
use crate::engine::{Engine, ModelOptions, WeightsResolver};
use crate::exec::{Executor, Profile};
use crate::model::{DeviceKind, SampleParams};
use crate::vision::encode::{Modality, Runner, SoftTokens};
use crate::vision::processor::{tower_grid, GEMMA4_BUDGETS};
use crate::weights::Weights;

/// Text tokens after the image in the time-to-first-token prompt.
pub const TEXT_TOKENS: usize = 32;

/// A vision tower to benchmark: its config and weights (tower and projector).
pub struct VisionSource {
    pub vc: VisionConfig,
    pub weights: Arc<Weights>,
}

/// The vision tower of what `bench` runs (`None`: a text-only model): a checkpoint's, or a
/// synthetic shape's with random bf16 weights.
pub fn source(model: Option<&std::path::Path>, synthetic: Option<&str>) -> Result<Option<VisionSource>, String> {
    if let Some(name) = synthetic {
        let Some(vc) = crate::synthetic::vision_config(name)? else { return Ok(None) };
        let t = std::time::Instant::now();
        let w = crate::synthetic::tower_weights(&vc)?;
        eprintln!("synthetic {name}: {:.2} GB of {} weights (bf16) generated in {:.1}s", w.stored_bytes() as f64 / 1e9, vc.kind.name(), t.elapsed().as_secs_f64());
        return Ok(Some(VisionSource { vc, weights: Arc::new(w) }));
    }
    let Some(dir) = model else { return Ok(None) };
    let cp = crate::loader::Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let Some(vc) = cp.vision_config().map_err(|e| e.to_string())? else { return Ok(None) };
    let g = cp.tower_graph(&vc, vc.pool, vc.pool).map_err(|e| e.to_string())?;
    let (w, _) = cp.load_tower(&vc, &g).map_err(|e| e.to_string())?;
    Ok(Some(VisionSource { vc, weights: Arc::new(w) }))
}

/// The soft-token counts to encode: SigLIP's fixed count; for Gemma 4, `asked` (each one of
/// the processor's budgets), by default 280 and 1,120.
pub fn image_tokens(vc: &VisionConfig, asked: &[usize]) -> Result<Vec<usize>, String> {
    match vc.kind {
        TowerKind::Siglip if asked.is_empty() => Ok(vec![vc.tokens_per_image]),
        TowerKind::Siglip => Err(format!("--image-tokens applies to Gemma 4's ViT (SigLIP makes {} soft tokens per image)", vc.tokens_per_image)),
        TowerKind::Gemma4Vit => {
            if let Some(bad) = asked.iter().find(|n| !GEMMA4_BUDGETS.contains(n)) {
                return Err(format!("--image-tokens {bad} is not one of Gemma 4's budgets {GEMMA4_BUDGETS:?}"));
            }
            Ok(if asked.is_empty() { vec![280, 1120] } else { asked.to_vec() })
        }
    }
}

/// The tower's graph over a `rows x cols` patch grid.
pub fn tower_graph(vc: &VisionConfig, weights: &Weights, (rows, cols): (usize, usize)) -> Result<Graph, String> {
    match vc.kind {
        TowerKind::Gemma4Vit => build_gemma4_tower(vc, &WeightsResolver(weights), rows, cols),
        TowerKind::Siglip => build_siglip_tower(vc, &WeightsResolver(weights)),
    }
    .map_err(|e| e.to_string())
}

/// FLOPs of one run of a tower graph (see the module's documentation).
pub fn tower_flops(g: &Graph) -> f64 {
    let mut f = 0.0;
    for n in g.op_nodes() {
        let shape = |i: usize| g.node(g.inputs(n)[i]).ty.shape.clone();
        match g.node(n).op() {
            Some(Op::MatMul) => {
                let out: usize = g.node(n).ty.shape.iter().product();
                f += 2.0 * out as f64 * *shape(0).last().unwrap_or(&0) as f64;
            }
            Some(Op::FullAttention { .. }) => {
                let (q, k) = (shape(0), shape(1));
                f += 4.0 * (q[0] * q[1] * q[2]) as f64 * k[0] as f64;
            }
            _ => {}
        }
    }
    f
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A deterministic image's tower inputs over `grid`: pixels in [-1, 1], and the patch
/// indices (SigLIP) or columns and rows (Gemma 4).
fn inputs(vc: &VisionConfig, (rows, cols): (usize, usize)) -> (Vec<f32>, Vec<u32>, Vec<u32>) {
    let p = rows * cols;
    let k = 3 * vc.patch * vc.patch;
    let pixels = (0..p * k).map(|i| ((i.wrapping_mul(2654435761) >> 7) % 2001) as f32 / 1000.0 - 1.0).collect();
    match vc.kind {
        TowerKind::Siglip => (pixels, (0..p as u32).collect(), vec![]),
        TowerKind::Gemma4Vit => (pixels, (0..p).map(|i| (i % cols) as u32).collect(), (0..p).map(|i| (i / cols) as u32).collect()),
    }
}

/// One encode: its soft tokens, its wall time and its GPU time (timestamps; `None` where there
/// are none).
fn encode(runner: &mut Runner, c: &markbase_graph::passes::Compiled, step: &StepInputs) -> Result<(Vec<f32>, f64, Option<f64>), String> {
    if let Runner::Gpu(g) = runner {
        g.set_profile(Profile::Phases);
    }
    let t = std::time::Instant::now();
    let soft = runner.soft(c, step).map_err(|e| e.to_string())?;
    let wall = t.elapsed().as_secs_f64();
    let gpu = match runner {
        Runner::Gpu(g) => g.profile().map(|p| p.phases.iter().sum::<f64>()).filter(|&s| s > 0.0),
        Runner::Cpu(_) => None,
    };
    Ok((soft, wall, gpu))
}

/// Encodes one image of each of `tokens` soft tokens (a warm-up, then `runs` timed), then feeds
/// each image's prompt (`bos, boi, N × image, eoi`, 32 text tokens) to the decoder
/// (`text_weights`) up to its first token, as `generate` does (prefill chunks of 256). One
/// record per image size.
/// With `profile` (a GPU), also one encode with a timestamp after every dispatch, summed by op.
pub fn bench_images(cfg: &ModelConfig, text_weights: Arc<Weights>, v: &VisionSource, device: DeviceKind, tokens: &[usize], runs: usize, profile: bool) -> Result<Vec<Value>, String> {
    let vc = &v.vc;
    let mut runner = Runner::new(v.weights.clone(), device, false).map_err(|e| e.to_string())?;
    let mut recs = vec![];
    let mut softs = vec![];
    for &n in tokens {
        let grid = tower_grid(vc, n)?;
        let g = tower_graph(vc, &v.weights, grid)?;
        let flops = tower_flops(&g);
        let c = compile(g, PhasePolicy::EmbedLayersHead).map_err(|e| e.to_string())?;
        let (pixels, a, b) = inputs(vc, grid);
        let step = match vc.kind {
            TowerKind::Siglip => StepInputs { pixels: &pixels, positions: &a, ..Default::default() },
            TowerKind::Gemma4Vit => StepInputs { pixels: &pixels, patch_x: &a, patch_y: &b, ..Default::default() },
        };
        let t = std::time::Instant::now();
        let (soft, _, _) = encode(&mut runner, &c, &step)?;
        eprintln!("{}: {n} image tokens: tower warmed up in {:.1}s", crate::bench::short_device(&device_name(&runner)), t.elapsed().as_secs_f64());
        if soft.len() != n * vc.text_hidden || soft.iter().any(|x| !x.is_finite()) {
            return Err(format!("the tower made {} values (expected {n} x {}), or a non-finite one", soft.len(), vc.text_hidden));
        }
        let (mut walls, mut gpus) = (vec![], vec![]);
        for _ in 0..runs.max(1) {
            let (_, wall, gpu) = encode(&mut runner, &c, &step)?;
            walls.push(wall);
            gpus.extend(gpu);
        }
        let wall = median(&mut walls);
        let timed_on_gpu = gpus.len() == walls.len();
        let secs = if timed_on_gpu { median(&mut gpus) } else { wall };
        recs.push(json!({
            "tower": vc.kind.name(),
            "soft_tokens": n,
            "patches": grid.0 * grid.1,
            "grid": [grid.0, grid.1],
            "encode_ms": secs * 1e3,
            "encode_timing": if timed_on_gpu { "gpu" } else { "wall" },
            "encode_wall_ms": wall * 1e3,
            "tower_tflop": flops / 1e12,
            "encode_tflop_s": flops / secs / 1e12,
        }));
        if let (true, Runner::Gpu(g)) = (profile, &mut runner) {
            g.set_profile(Profile::Kernels);
            runner.soft(&c, &step).map_err(|e| e.to_string())?;
            if let Runner::Gpu(g) = &mut runner {
                if let Some(p) = g.profile() {
                    // with each op's kernels (the attention's: `full_attention_f16[...]` on the
                    // f16 tiles, `full_attention[...]` in f32)
                    let key = crate::exec::GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
                    let kernels = g.dispatch_kernels(key);
                    let (total, by_op) = crate::bench::ops_by_weight_kernels(&c, &p, kernels.as_deref());
                    let last = recs.len() - 1;
                    recs[last]["encode_profile_total_ms"] = json!(total * 1e3);
                    recs[last]["encode_profile_by_op"] = json!(by_op);
                }
                g.set_profile(Profile::Off);
            }
        }
        softs.push(SoftTokens { tokens: n, width: vc.text_hidden, data: soft, kind: Modality::Image });
    }
    drop(runner);
    // the first token of each image's prompt
    let lowest = vc.image_token.min(vc.boi_token).min(vc.eoi_token).min(cfg.vocab_size as u32);
    let text: Vec<u32> = (0..TEXT_TOKENS as u32).map(|i| 3 + (i * 7919) % lowest.saturating_sub(3).max(1)).collect();
    let longest = tokens.iter().max().copied().unwrap_or(0) + 3 + TEXT_TOKENS;
    let opts = ModelOptions { device, max_context: longest + 8, ..Default::default() };
    let engine = Engine::from_parts_with_vision(cfg.clone(), text_weights, None, Some(vc.clone()), &opts).map_err(|e| e.to_string())?;
    let mut s = engine.session().map_err(|e| e.to_string())?;
    let greedy = SampleParams::default();
    for (rec, soft) in recs.iter_mut().zip(&softs) {
        let mut ids = vec![cfg.bos_token_id.unwrap_or(2), vc.boi_token];
        ids.extend(std::iter::repeat_n(vc.image_token, soft.tokens));
        ids.push(vc.eoi_token);
        ids.extend(&text);
        let mut times = vec![];
        for i in 0..=runs.max(1) {
            s.reset();
            let t = std::time::Instant::now();
            s.forward_with_images(&ids, std::slice::from_ref(soft), false, Some(&greedy)).map_err(|e| e.to_string())?;
            // the first run builds the graphs and pipelines
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let ttft = median(&mut times);
        rec["prompt_tokens"] = json!(ids.len());
        rec["ttft_ms"] = json!(ttft * 1e3);
        rec["ttft_with_encode_ms"] = json!(ttft * 1e3 + rec["encode_wall_ms"].as_f64().unwrap_or(f64::NAN));
    }
    Ok(recs)
}

fn device_name(r: &Runner) -> String {
    match r {
        Runner::Gpu(g) => g.describe(),
        Runner::Cpu(_) => "cpu".into(),
    }
}

/// The image rows of the records, a table (empty where no record has any).
pub fn table(rows: &[Value]) -> String {
    let mut s = String::new();
    for r in rows {
        let images = r.get("image").and_then(Value::as_array);
        let failed = r.get("image_error").and_then(Value::as_str);
        if images.is_none() && failed.is_none() {
            continue;
        }
        if s.is_empty() {
            s.push_str(&format!(
                "\n| model | device | tower | soft tokens | patches | encode ms | TFLOP | TFLOP/s | TTFT ms (image + {TEXT_TOKENS} text) | TTFT + encode ms |\n|---|---|---|---|---|---|---|---|---|---|\n"
            ));
        }
        if let Some(e) = failed {
            let dev = crate::bench::short_device(r["device"].as_str().unwrap_or(""));
            s.push_str(&format!("| {} | {dev} | error: {e} |\n", r["model"].as_str().unwrap_or("")));
        }
        for i in images.into_iter().flatten() {
            // small values (tiny towers) in three significant digits
            let f = |k: &str, d: usize| match i.get(k).and_then(Value::as_f64) {
                Some(v) if v != 0.0 && v.abs() < 0.01 => format!("{v:.2e}"),
                Some(v) => format!("{v:.d$}"),
                None => "-".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} |\n",
                r["model"].as_str().unwrap_or(""),
                crate::bench::short_device(r["device"].as_str().unwrap_or("")),
                i["tower"].as_str().unwrap_or(""),
                i["soft_tokens"],
                i["patches"],
                f("encode_ms", 2),
                i["encode_timing"].as_str().unwrap_or(""),
                f("tower_tflop", 3),
                f("encode_tflop_s", 2),
                f("ttft_ms", 2),
                f("ttft_with_encode_ms", 2),
            ));
        }
    }
    s
}
