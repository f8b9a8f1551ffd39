//! The fusion pass: every fixture runs with every rule off (the graphs as the builders emit
//! them) on the CPU reference and on the GPU, and must agree with mlx-lm as the fused graphs
//! do; the fused graphs hold the ops each rule produces, the unfused ones none of them.

mod common;

use markbase::graph::fuse::{FuseOptions, RULES};
use markbase::graph::ops::Op;
use markbase::model::{DeviceKind, GraphKey, Model};

/// Every fixture of a family that has a graph builder.
fn fixtures() -> Vec<String> {
    let idx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(common::fixture("index.json")).unwrap()).unwrap();
    let names: Vec<String> = idx.as_object().unwrap().keys().filter(|n| !n.starts_with("gemma3n")).cloned().collect();
    assert!(names.len() >= 20, "fixture index lists {} models", names.len());
    names
}

fn is_fused(op: &Op) -> bool {
    matches!(
        op,
        Op::NormMatMul { .. }
            | Op::NormGeGlu { .. }
            | Op::RmsNormAdd { .. }
            | Op::NormRope { .. }
            | Op::KvWriteNormRope { .. }
            | Op::NormRopeAttention { .. }
            | Op::GeGlu
    )
}

/// Every fixture unfused: logits and every layer's output within the fixture's bound.
fn run_unfused(device: DeviceKind) {
    for name in fixtures() {
        let e = common::check_fixture_fused(&name, device, None, FuseOptions::none()).unwrap_or_else(|e| panic!("{e}"));
        println!("{name} unfused: prefill {:.2e}, decode {:.2e} of max |logit|", e.prefill, e.decode);
    }
}

#[test]
fn unfused_fixtures_match_mlx_lm_on_cpu() {
    run_unfused(DeviceKind::Cpu);
}

#[test]
fn unfused_fixtures_match_mlx_lm_on_gpu() {
    run_unfused(DeviceKind::Gpu(None));
}

/// Decode and prefill graphs: with every rule off no op is fused and no node names a rule;
/// with all on, each one-token rule fires in each family that has its pattern, and every fused
/// node names the rule that made it.
#[test]
fn rules_fire_and_switch_off() {
    for name in ["gemma3_text-q4", "gemma4_dense_ple-q4", "gemma4_moe-q4"] {
        for key in [GraphKey { tokens: 1, all_logits: false, sample: false, images: false }, GraphKey { tokens: 5, all_logits: true, sample: false, images: false }] {
            let mut o = common::fixture_options(DeviceKind::Cpu);
            o.fuse = FuseOptions::none();
            let mut m = Model::load(common::fixture(name), o).unwrap();
            let g = m.graph(key).unwrap().graph.clone();
            for n in g.op_nodes() {
                let node = g.node(n);
                assert!(!is_fused(node.op().unwrap()) && node.rule.is_none(), "{name}: {} is fused", node.name);
            }
            let mut m = Model::load(common::fixture(name), common::fixture_options(DeviceKind::Cpu)).unwrap();
            let g = m.graph(key).unwrap().graph.clone();
            let mut fired: Vec<&str> = vec![];
            for n in g.op_nodes() {
                let node = g.node(n);
                // fused ops name their rule; so does the reshape of a q/k/v concatenation
                let op = node.op().unwrap();
                let of_concat = g.inputs(n).first().is_some_and(|&i| matches!(g.node(i).op(), Some(Op::NormMatMul { .. })) && g.inputs(i).len() > 3);
                let made = is_fused(op) || matches!(op, Op::Reshape { .. }) && of_concat;
                assert_eq!(made, node.rule.is_some(), "{name}: {} {:?}", node.name, node.rule);
                fired.extend(node.rule);
            }
            fired.sort_unstable();
            fired.dedup();
            let want: Vec<&str> = match (name, key.tokens) {
                (_, 5) => vec!["gelu_mul", "norm_add", "norm_rope"],
                ("gemma3_text-q4", _) => vec!["geglu", "kv_append", "norm_add", "norm_matmul"],
                // the PLE gate and the experts' GeGLU stay plain GeGLUs
                _ => vec!["attention_rope", "geglu", "gelu_mul", "kv_write", "norm_add", "norm_matmul"],
            };
            assert_eq!(fired, want, "{name} tokens {}", key.tokens);
        }
    }
}

/// Turning one rule off removes exactly the nodes it makes, and the graph still agrees with
/// mlx-lm on the CPU.
#[test]
fn each_rule_has_a_switch() {
    let name = "gemma3_text-q4";
    for rule in RULES {
        let mut o = common::fixture_options(DeviceKind::Cpu);
        o.fuse = FuseOptions::without(rule).unwrap();
        assert!(!o.fuse.enabled(rule) && RULES.iter().filter(|r| o.fuse.enabled(r)).count() == RULES.len() - 1);
        let mut m = Model::load(common::fixture(name), o).unwrap();
        for key in [GraphKey { tokens: 1, all_logits: false, sample: false, images: false }, GraphKey { tokens: 5, all_logits: true, sample: false, images: false }] {
            let g = &m.graph(key).unwrap().graph;
            assert!(g.op_nodes().all(|n| g.node(n).rule != Some(rule)), "{rule} off, yet it fused");
        }
        common::check_fixture_fused(name, DeviceKind::Cpu, None, FuseOptions::without(rule).unwrap()).unwrap_or_else(|e| panic!("{rule} off: {e}"));
    }
    assert!(FuseOptions::without("norm_add,bogus").unwrap_err().contains("bogus"));
    assert_eq!(FuseOptions::without("all").unwrap(), FuseOptions::none());
}

/// The fused graphs keep the shape the kernels were tuned on: ops by kind for decode and a
/// 12-token prefill (the graphs of the builders before the fusion pass existed, op for op).
#[test]
fn fused_graphs_keep_their_op_counts() {
    use markbase::graph::{build_from_config, BuildOptions};
    let cases: [(&str, usize, usize, &str); 6] = [
        ("configs/gemma3-270m", 4096, 1, "argmax 1, embed 1, matmul 36, norm_geglu 18, norm_matmul 19, norm_rope_attention 18, reshape 36, rms_norm_add 36"),
        ("configs/gemma3-270m", 4096, 12, "argmax 1, attention 18, embed 1, geglu 18, kv_write 36, matmul 127, norm_rope 36, reshape 72, rms_norm 37, rms_norm_add 36"),
        ("tests/fixtures/gemma4_moe-q4", 64, 1, "argmax 1, embed 1, gather_matmul 18, geglu 6, kv_write_norm_rope 12, matmul 18, norm_geglu 6, norm_matmul 7, norm_rope_attention 6, reshape 12, rms_norm 18, rms_norm_add 18, scale 6, softcap 1, top_k 6, top_k_softmax 6, weighted_sum 6"),
        ("tests/fixtures/gemma4_moe-q4", 64, 12, "argmax 1, attention 6, embed 1, geglu 12, grouped_matmul 18, kv_write 12, matmul 47, moe_group 6, norm_rope 12, reshape 22, rms_norm 37, rms_norm_add 18, scale 6, softcap 1, top_k 6, top_k_softmax 6, weighted_sum 6"),
        ("tests/fixtures/gemma4_dense_ple-q4", 64, 1, "add 1, argmax 1, embed 2, geglu 6, kv_write_norm_rope 8, matmul 25, norm_geglu 6, norm_matmul 7, norm_rope_attention 6, reshape 20, rms_norm 1, rms_norm_add 18, scale 2, slice 6, softcap 1"),
        ("tests/fixtures/gemma4_dense_ple-q4", 64, 12, "add 1, argmax 1, attention 6, embed 2, geglu 12, kv_write 8, matmul 52, norm_rope 10, reshape 28, rms_norm 18, rms_norm_add 18, scale 2, slice 6, softcap 1"),
    ];
    for (dir, max_context, tokens, want) in cases {
        let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join("config.json")).unwrap();
        let cfg = markbase::graph::ModelConfig::from_json_str(&text).unwrap();
        let o = if tokens == 1 { BuildOptions::decode(max_context, 512.min(max_context)) } else { BuildOptions::prefill(tokens, max_context) };
        let g = build_from_config(&cfg, &o).unwrap();
        let mut counts = std::collections::BTreeMap::new();
        for n in g.op_nodes() {
            *counts.entry(g.node(n).op().unwrap().name()).or_insert(0) += 1;
        }
        let got: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        assert_eq!(got.join(", "), want, "{dir} tokens {tokens}");
    }
}
