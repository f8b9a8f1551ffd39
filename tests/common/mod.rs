//! Shared helpers of the model test suites: fixture references and the
//! comparison rule against mlx-lm's float32 logits.
#![allow(dead_code)]

use std::path::PathBuf;

use markbase::graph::ops::Op;
use markbase::model::{DeviceKind, GraphKey, Model, ModelOptions};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Reads the f32/i32 tensors of a `reference.safetensors`.
pub struct Reference {
    pub tokens: Vec<u32>,
    pub prefill: Vec<f32>,
    pub decode: Vec<f32>,
    pub vocab: usize,
}

pub fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).expect("reference.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse reference");
    let f32s = |n: &str| -> (Vec<f32>, Vec<usize>) {
        let t = st.tensor(n).unwrap_or_else(|_| panic!("{n} missing"));
        (t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(), t.shape().to_vec())
    };
    let tok = st.tensor("tokens").unwrap();
    let tokens = tok.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32).collect();
    let (prefill, shape) = f32s("logits_prefill");
    let (decode, _) = f32s("logits_decode");
    Reference { tokens, prefill, decode, vocab: shape[1] }
}

/// Compares logits rows with the acceptance rule: max |Δ| ≤ 5e-4 × max|ref| and the
/// same argmax wherever the reference's top-2 gap exceeds 1e-3 × max|ref|.
/// Returns (max |Δ|, max |ref|).
pub fn compare(what: &str, got: &[f32], want: &[f32], vocab: usize) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "{what}: logits size");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut maxd = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: non-finite logit at {i}");
        maxd = maxd.max((g - w).abs());
    }
    assert!(maxd <= 5e-4 * scale, "{what}: max |Δ| {maxd} > 5e-4 × {scale}");
    for (r, (gr, wr)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let mut idx: Vec<usize> = (0..vocab).collect();
        idx.sort_by(|&a, &b| wr[b].total_cmp(&wr[a]));
        let gap = wr[idx[0]] - wr[idx[1]];
        if gap > 1e-3 * scale {
            let ga = markbase::cpu::ops::argmax(gr) as usize;
            assert_eq!(ga, idx[0], "{what}: row {r} argmax {ga} != mlx-lm {}", idx[0]);
        }
    }
    (maxd, scale)
}

/// Prefill of all 24 tokens, then prefill of 20 + 4 decode steps, against mlx-lm.
pub fn check_fixture(name: &str, device: DeviceKind) -> (f32, f32) {
    check_fixture_with(name, fixture_options(device))
}

/// The options of the fixture checks on `device`.
pub fn fixture_options(device: DeviceKind) -> ModelOptions {
    ModelOptions { device, max_context: 64, prefill_chunk: 32, ..Default::default() }
}

/// [`check_fixture`] with the given options.
pub fn check_fixture_with(name: &str, opts: ModelOptions) -> (f32, f32) {
    let r = reference(name);
    let mut m = Model::load(fixture(name), opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    let rows = m.logits(&r.tokens).unwrap_or_else(|e| panic!("{name}: {e}"));
    let got: Vec<f32> = rows.concat();
    let (d1, s) = compare(&format!("{name} prefill"), &got, &r.prefill, r.vocab);
    if m.config.enable_moe_block {
        // the prompt's first step (prompts run in steps of a few sizes)
        let tokens = markbase::engine::prefill_steps(r.tokens.len(), m.engine().prefill_chunk())[0];
        check_expert_path(name, &mut m, GraphKey { tokens, all_logits: true, sample: false }, true);
    }
    m.reset();
    m.forward(&r.tokens[..20], false, None).unwrap();
    let mut dec = vec![];
    for j in 0..4 {
        let out = m.forward(&r.tokens[20 + j..21 + j], true, None).unwrap();
        dec.extend(out.logits.unwrap());
    }
    if m.config.enable_moe_block {
        check_expert_path(name, &mut m, GraphKey { tokens: 1, all_logits: true, sample: false }, false);
    }
    let (d2, _) = compare(&format!("{name} decode"), &dec, &r.decode, r.vocab);
    (d1.max(d2), s)
}

/// The expert matmuls of graph `key` (run once already): `grouped` (prefill) = one
/// `moe_group` per layer feeding three `grouped_matmul`s, which the GPU runs with the
/// grouped GEMM; else (decode) the gathered matmul, a gathered GEMV on the GPU.
pub fn check_expert_path(name: &str, m: &mut Model, key: GraphKey, grouped: bool) {
    let layers = m.config.num_layers;
    let g = m.graph(key).unwrap().graph.clone();
    let count = |f: &dyn Fn(&Op) -> bool| g.op_nodes().filter(|&n| f(g.node(n).op().unwrap())).count();
    let groups = count(&|o| matches!(o, Op::MoeGroup { .. }));
    let grouped_mm = count(&|o| matches!(o, Op::GroupedMatMul));
    let gather_mm = count(&|o| matches!(o, Op::GatherMatMul));
    if grouped {
        assert_eq!((groups, grouped_mm, gather_mm), (layers, 3 * layers, 0), "{name}: prefill expert ops");
    } else {
        assert_eq!((groups, grouped_mm, gather_mm), (0, 0, 3 * layers), "{name}: decode expert ops");
    }
    let Some(kernels) = m.gpu_kernels(key) else { return };
    let mut seen = 0;
    for (n, kernel) in kernels {
        let ok = match g.node(n).op().unwrap() {
            Op::MoeGroup { .. } => kernel == "moe_group",
            Op::GroupedMatMul => kernel.starts_with("gemm_grouped["),
            Op::GatherMatMul => kernel.starts_with("gemv[") && kernel.contains(" gather"),
            _ => continue,
        };
        assert!(ok, "{name}: node {} runs {kernel}", g.node(n).name);
        seen += 1;
    }
    assert!(seen >= if grouped { 4 * layers } else { 3 * layers }, "{name}: {seen} expert dispatches");
}

/// `check_fixture` for each fixture, printing the error and the time.
pub fn check_fixtures(names: &[&str], device: DeviceKind) {
    for name in names {
        let t = std::time::Instant::now();
        let (d, s) = check_fixture(name, device);
        println!("{name}: max |Δ| {d:.3e} (max |logit| {s:.2}), {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    }
}

/// A greedy decode of `n` tokens on the GPU from the fixture's first 10 tokens, with a
/// 640-slot context, agrees with the CPU reference's argmax at 99% of the steps, with no NaN.
pub fn long_decode_matches_cpu(name: &str, n: usize) {
    use markbase::model::GenerateParams;
    let r = reference(name);
    let prompt = &r.tokens[..10];
    let opts = ModelOptions { device: DeviceKind::Gpu(None), max_context: 640, prefill_chunk: 64, ..Default::default() };
    let mut gpu = Model::load(fixture(name), opts).unwrap();
    let p = GenerateParams { max_tokens: n, stop_at_eos: false, text: false, ..Default::default() };
    let gen: Vec<u32> = gpu.generate(prompt, p).unwrap().map(|x| x.unwrap().token).collect();
    assert_eq!(gen.len(), n);
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&gen[..n - 1]);
    let opts = ModelOptions { device: DeviceKind::Cpu, max_context: 640, prefill_chunk: 64, ..Default::default() };
    let mut cpu = Model::load(fixture(name), opts).unwrap();
    let rows = cpu.logits(&seq).unwrap();
    greedy_agrees(name, &rows, prompt.len(), &gen);
}

/// The CPU reference's logits `rows` (of the prompt and the generated tokens but the last)
/// are finite, and their argmax is the generated token `gen` at >= 99% of the steps.
pub fn greedy_agrees(name: &str, rows: &[Vec<f32>], prompt_len: usize, gen: &[u32]) {
    let mut agree = 0;
    for (j, &t) in gen.iter().enumerate() {
        let row = &rows[prompt_len - 1 + j];
        assert!(row.iter().all(|v| v.is_finite()), "{name}: NaN/Inf at step {j}");
        agree += (markbase::cpu::ops::argmax(row) == t) as usize;
    }
    let n = gen.len();
    println!("{name}: GPU greedy and CPU argmax agree at {agree}/{n} steps");
    assert!(agree * 100 >= 99 * n, "{name}: only {agree}/{n}");
}
