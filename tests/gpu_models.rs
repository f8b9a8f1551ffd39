//! Whole models on the GPU against mlx-lm's float32 logits (the same checks as
//! the CPU reference suite). Without an adapter these tests fail, never skip.

mod common;

use markbase::model::DeviceKind;

fn run(names: &[&str]) {
    common::check_fixtures(names, DeviceKind::Gpu(None));
}

#[test]
fn gemma3_fixtures_match_mlx_lm_on_gpu() {
    run(&[
        "gemma3_text-bf16", "gemma3_text-q4", "gemma3_text-q8", "gemma3_mm-bf16", "gemma3_mm-q4", "gemma3_text-q4sharded",
    ]);
}

#[test]
fn every_quant_mode_matches_mlx_lm_on_gpu() {
    run(&[
        "gemma3_text-q2g64", "gemma3_text-q3g32", "gemma3_text-q5g64", "gemma3_text-q6g128", "gemma3_text-mixed36",
        "gemma3_text-mxfp4", "gemma3_text-mxfp8", "gemma3_text-nvfp4",
    ]);
}

#[test]
fn gemma4_dense_fixtures_match_mlx_lm_on_gpu() {
    run(&["gemma4_dense_ple-bf16", "gemma4_dense_ple-q4", "gemma4_dense_ple-mxfp4"]);
}

#[test]
fn gemma4_moe_fixtures_match_mlx_lm_on_gpu() {
    run(&["gemma4_moe-bf16", "gemma4_moe-q4", "gemma4_moe-nvfp4gs", "gemma4_moe-q4-hfnames", "gemma4_moe-bf16-hffused"]);
}

/// The prefill of a MoE fixture picks the same experts on the GPU as the CPU reference,
/// and the GPU groups the pairs exactly as the CPU's stable grouping of those ids.
#[test]
fn moe_prefill_expert_choice_matches_cpu() {
    use markbase::cpu::exec::{run, CpuState, CpuWeights, StepInputs};
    use markbase::graph::ops::Op;
    use markbase::graph::passes::{compile, PhasePolicy};
    use markbase::graph::BuildOptions;
    use markbase::gpu::runtime::GpuExecutor;
    use markbase::loader::Checkpoint;
    use markbase::model::{Executor, GraphKey};
    use std::sync::Arc;
    for name in ["gemma4_moe-q4", "gemma4_moe-nvfp4gs", "gemma4_moe-bf16"] {
        let r = common::reference(name);
        let t = r.tokens.len();
        let ck = Checkpoint::open(common::fixture(name)).unwrap();
        let mut g = ck.build(BuildOptions::prefill(t, 64)).unwrap();
        let (w, _) = ck.load_weights(&g).unwrap();
        let w = Arc::new(w);
        // the router logits, expert ids and groups of every layer become outputs
        let mut layers = vec![];
        for n in g.op_nodes().collect::<Vec<_>>() {
            let node = g.node(n);
            if let Some(Op::MoeGroup { experts }) = node.op() {
                let l = node.layer.unwrap();
                layers.push((l, *experts));
                for (what, x) in [("router", g.inputs(g.inputs(n)[0])[0]), ("ids", g.inputs(n)[0]), ("groups", n)] {
                    g.set_output(&format!("l{l}.{what}"), x);
                }
            }
        }
        assert_eq!(layers.len(), ck.config().num_layers, "{name}: moe_group nodes");
        let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
        let positions: Vec<u32> = (0..t as u32).collect();
        let step = StepInputs { tokens: &r.tokens, positions: &positions, ..Default::default() };
        let cpu = run(&c, &mut CpuWeights::new(w.clone()), &mut CpuState::default(), &step).unwrap();
        let mut gpu = GpuExecutor::new(None, w.clone(), false).unwrap();
        let key = GraphKey { tokens: t, all_logits: true, sample: false, images: false };
        gpu.run(key, &c, &step, false).unwrap();
        let mut near_ties = 0;
        for (l, experts) in layers {
            let out = |what: &str| format!("l{l}.{what}");
            let (cpu_ids, cpu_groups) = (cpu[&out("ids")].u().to_vec(), cpu[&out("groups")].u().to_vec());
            let logits = cpu[&out("router")].f().to_vec();
            let gpu_ids = gpu.read_output(key, &c, &out("ids")).unwrap();
            let gpu_groups = gpu.read_output(key, &c, &out("groups")).unwrap();
            // the GPU's grouping is the stable grouping of its own ids
            assert_eq!(gpu_groups, markbase::cpu::ops::moe_group(&gpu_ids, experts).unwrap(), "{name} layer {l}: grouping");
            let k = gpu_ids.len() / t;
            for tok in 0..t {
                let (a, b) = (&cpu_ids[tok * k..(tok + 1) * k], &gpu_ids[tok * k..(tok + 1) * k]);
                if a == b {
                    continue;
                }
                // only where the CPU's router logits of the two choices nearly tie
                let row = &logits[tok * experts..(tok + 1) * experts];
                let scale = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (&x, &y) in a.iter().zip(b) {
                    let gap = (row[x as usize] - row[y as usize]).abs();
                    assert!(gap <= 1e-4 * scale, "{name} layer {l} token {tok}: experts cpu {a:?} gpu {b:?} (logit gap {gap})");
                }
                near_ties += 1;
            }
            if cpu_ids == gpu_ids {
                assert_eq!(cpu_groups, gpu_groups, "{name} layer {l}: groups");
            }
        }
        println!("{name}: expert choice identical on CPU and GPU except {near_ties} near-tie tokens");
        assert!(near_ties <= 2, "{name}: {near_ties} tokens route differently");
    }
}

/// How far token `tok` is from the CPU sampler's draw on logits `row` with sampling words
/// `words`: 0 when it is the token drawn, else the distance of the draw from `tok`'s slice
/// of the cumulative kept mass (in index order), as a fraction of that mass; `None` when
/// the sampler's filters drop `tok`.
fn draw_distance(row: &[f32], words: &[u32; 8], tok: u32) -> Option<f64> {
    use markbase::cpu::ops::{sample_distribution, uniform, SampleDistribution};
    let d = match sample_distribution(row, words, &[]) {
        SampleDistribution::Greedy(t) => return (t == tok).then_some(0.0),
        SampleDistribution::Kept(d) => d,
    };
    let (mass, u) = (d.kept_mass(), uniform(words[5], words[6]) as f64);
    let mut acc = 0f64;
    for (i, &v) in d.z.iter().enumerate() {
        if v >= d.threshold {
            let w = d.weight(v) / mass;
            if i == tok as usize {
                return Some(if u < acc { acc - u } else if u > acc + w { u - acc - w } else { 0.0 });
            }
            acc += w;
        }
    }
    None
}

/// Pipelined GPU generation (next step queued before the token is read, the token
/// fed back on the device) gives the CPU reference's greedy tokens; its sampled tokens
/// are, at every one of 40 steps, the token the CPU's sampler draws with the same seed
/// and step from the CPU's logits of the same sequence, but where the draw falls within
/// 1e-3 of the kept mass from a token's edge (the logits differ by ~1e-5), once at most;
/// the CPU's own sampled generation is the same tokens up to such a step.
#[test]
fn pipelined_generation_matches_cpu() {
    use markbase::model::{GenerateParams, Model, ModelOptions, SampleParams};
    for name in ["gemma3_text-q4", "gemma4_dense_ple-q4"] {
        let r = common::reference(name);
        let prompt = &r.tokens[..12];
        let model = |device: DeviceKind| {
            let opts = ModelOptions { device, max_context: 64, prefill_chunk: 16, ..Default::default() };
            Model::load(common::fixture(name), opts).unwrap()
        };
        let (mut cpu_model, mut gpu_model) = (model(DeviceKind::Cpu), model(DeviceKind::Gpu(None)));
        let run = |m: &mut Model, sampling: SampleParams| -> Vec<u32> {
            let p = GenerateParams { max_tokens: 40, sampling, stop_at_eos: false, text: false };
            m.generate(prompt, p).unwrap().map(|x| x.unwrap().token).collect()
        };
        let greedy = SampleParams::default();
        let cpu = run(&mut cpu_model, greedy);
        let gpu = run(&mut gpu_model, greedy);
        assert_eq!(cpu.len(), 40);
        assert_eq!(cpu, gpu, "{name}: greedy tokens differ");
        let hot = SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.0, repetition_penalty: 1.0, seed: 7 };
        assert!(gpu_model.can_pipeline(&hot), "{name}: sampled GPU steps are pipelined");
        let gpu = run(&mut gpu_model, hot);
        assert_eq!(gpu.len(), 40);
        // the CPU's logits of the GPU's sequence; token j is drawn at sampler step j
        let mut seq = prompt.to_vec();
        seq.extend_from_slice(&gpu[..39]);
        let rows = cpu_model.logits(&seq).unwrap();
        let mut off_draw = vec![];
        for (j, &t) in gpu.iter().enumerate() {
            let words = hot.words(j as u32, 0);
            let row = &rows[prompt.len() - 1 + j];
            match draw_distance(row, &words, t) {
                Some(d) if d == 0.0 => {}
                Some(d) if d <= 1e-3 => off_draw.push((j, d)),
                d => panic!("{name}: step {j}: GPU sampled {t}, the CPU's sampler draws {} (distance {d:?}); GPU {gpu:?}", markbase::cpu::ops::sample(row, &words, &[])),
            }
        }
        let differs = gpu.iter().enumerate().filter(|&(j, &t)| t != markbase::cpu::ops::argmax(&rows[prompt.len() - 1 + j])).count();
        println!("{name}: sampled tokens are the CPU sampler's at every step but {off_draw:?}; {differs} of 40 differ from the argmax");
        assert!(off_draw.len() <= 1, "{name}: GPU tokens off the CPU's draw at {off_draw:?}");
        // the CPU's own sampled generation is the GPU's, token for token, up to such a step
        let cpu = run(&mut cpu_model, hot);
        let upto = off_draw.first().map_or(40, |&(j, _)| j);
        assert_eq!(cpu[..upto], gpu[..upto], "{name}: sampled generations differ before step {upto}");
        assert!(differs > 0, "{name}: sampling at temperature 0.8 always took the argmax");
    }
}

/// `--check-nan` (one submission per node, each output read back) stops at the
/// first node that produces NaN and names it and its weights; a weight with a
/// planted NaN is found at the node that multiplies by it.
#[test]
fn check_nan_finds_a_planted_nan() {
    use markbase::graph::BuildOptions;
    use markbase::loader::Checkpoint;
    use markbase::model::{Model, ModelOptions};
    use std::sync::Arc;
    let name = "gemma3_text-q4";
    let ck = Checkpoint::open(common::fixture(name)).unwrap();
    let g = ck.build(BuildOptions::decode(64, 16)).unwrap();
    let (mut w, _) = ck.load_weights(&g).unwrap();
    let target = "model.layers.3.mlp.down_proj";
    let wd = w.map.get_mut(target).unwrap();
    // bf16 NaN in the first scale of row 5.
    let sc = wd.scales.as_mut().unwrap();
    let per_row = sc.shape[1] * 2;
    sc.bytes[5 * per_row] = 0xc0;
    sc.bytes[5 * per_row + 1] = 0x7f;
    let r = common::reference(name);
    let opts = ModelOptions { device: DeviceKind::Gpu(None), max_context: 64, prefill_chunk: 32, check_nan: true, ..Default::default() };
    let mut m = Model::from_parts(ck.config().clone(), Arc::new(w.clone()), None, &opts).unwrap();
    let e = m.logits(&r.tokens[..5]).unwrap_err();
    assert!(matches!(e, markbase::Error::Device(_)), "a NaN found on the device is a device error: {e:?}");
    let e = e.to_string();
    println!("{e}");
    assert!(e.contains("l3.down_proj"), "wrong node: {e}");
    assert!(e.contains(target), "weight not named: {e}");
    // Without the NaN the same path runs clean.
    let clean = Checkpoint::open(common::fixture(name)).unwrap().load_weights(&g).unwrap().0;
    let mut m = Model::from_parts(ck.config().clone(), Arc::new(clean), None, &opts).unwrap();
    assert!(m.logits(&r.tokens[..5]).is_ok());
}

/// Each phase is one submission: a step submits exactly as many command buffers as
/// the schedule has phases (and one compute pass each).
#[test]
fn one_submission_per_phase() {
    use markbase::model::{GraphKey, Model, ModelOptions};
    for name in ["gemma3_text-q4", "gemma4_moe-q4"] {
        let opts = ModelOptions { device: DeviceKind::Gpu(None), max_context: 64, prefill_chunk: 32, ..Default::default() };
        let mut m = Model::load(common::fixture(name), opts).unwrap();
        let r = common::reference(name);
        // 8 tokens: one prefill step (prompts run in power-of-two steps below the chunk)
        m.forward(&r.tokens[..8], false, None).unwrap();
        let phases = m.graph(GraphKey { tokens: 8, all_logits: false, sample: false, images: false }).unwrap().schedule.phases.len();
        let s = m.gpu_stats().unwrap();
        assert_eq!(s.submits, phases, "{name}: prefill");
        m.forward(&r.tokens[8..9], false, None).unwrap();
        let c = m.graph(GraphKey { tokens: 1, all_logits: false, sample: false, images: false }).unwrap();
        let (phases, ops) = (c.schedule.phases.len(), c.schedule.phases.iter().map(|p| p.len()).sum::<usize>());
        let s = m.gpu_stats().unwrap();
        assert_eq!(s.submits, phases, "{name}: decode");
        assert_eq!(phases, 1, "{name}: a decode step is one phase");
        assert!(s.dispatches <= ops, "{name}: {} dispatches for {ops} ops", s.dispatches);
    }
}

/// A 600-token greedy decode far past the sliding window (8 on these fixtures; the
/// ring of sliding caches wraps dozens of times) agrees with the CPU reference run
/// on the same tokens, with no NaN.
#[test]
fn long_decode_past_the_window_matches_cpu() {
    for name in ["gemma3_text-q4", "gemma4_dense_ple-q4", "gemma4_moe-q4"] {
        common::long_decode_matches_cpu(name, 600);
    }
}
