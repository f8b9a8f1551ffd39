//! Property tests of the compiler passes on random DAGs, and the same checks on
//! the Gemma 3 270M / 1B / 12B graphs and the Gemma 4 fixtures' one-token fusions.

use std::path::PathBuf;

use markbase_graph::builder::{build, build_from_config, BuildOptions, ConfigResolver, WeightResolver};
use markbase_graph::ir::{Graph, GraphKind, InputKind, StateKind, WeightParam};
use markbase_graph::ops::{BinaryOp, NormScale, Op, TensorType, UnaryOp};
use markbase_graph::passes::{check, compile, Compiled, PhasePolicy, Storage};
use markbase_graph::quant::{FloatType, WeightFormat};
use markbase_graph::{dump, ModelConfig};
use petgraph::graph::NodeIndex;
use proptest::prelude::*;

/// Independent re-statement of the four properties (not via `check`).
fn assert_properties(c: &Compiled) {
    let g = &c.graph;
    let order = g.order();
    let pos = |n: NodeIndex| order.iter().position(|&m| m == n).unwrap();
    // Live range of each pooled root value.
    let mut ranges: Vec<(NodeIndex, usize, usize, u32)> = vec![];
    for n in g.g.node_indices() {
        if g.storage_root(n) != n || g.node(n).op().is_none() {
            continue;
        }
        let Storage::Pool(b) = c.alloc.storage[n.index()] else { panic!("op value without pool storage") };
        let mut last = pos(n);
        for m in g.g.node_indices() {
            if g.storage_root(m) == n {
                for u in g.users(m) {
                    last = last.max(pos(u));
                }
            }
        }
        if g.outputs.iter().any(|(_, o)| g.storage_root(*o) == n) {
            last = usize::MAX;
        }
        ranges.push((n, pos(n), last, b));
        // Every buffer is large enough.
        assert!(c.alloc.pool_sizes[b as usize] >= g.node(n).ty.bytes(), "buffer too small");
    }
    // No two values alive at the same time share a buffer.
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[i + 1..] {
            if a.3 == b.3 {
                let disjoint = a.2 < b.1 || b.2 < a.1;
                assert!(disjoint, "nodes {:?} and {:?} overlap in buffer {}", a.0, b.0, a.3);
            }
        }
    }
    // No node's output buffer equals one of its input buffers.
    for n in g.op_nodes() {
        let op = g.node(n).op().unwrap();
        if op.is_view() {
            continue;
        }
        let ins = g.inputs(n);
        let reads = if op.writes_state() { &ins[..ins.len() - 1] } else { &ins[..] };
        for &i in reads {
            assert_ne!(c.alloc.storage[i.index()], c.alloc.storage[n.index()], "node {:?} reads its own output buffer", n);
        }
    }
    // Phases respect dependencies.
    for n in g.op_nodes() {
        let pn = c.schedule.phase_of[n.index()].expect("op not scheduled");
        for i in g.inputs(n) {
            if let Some(pi) = c.schedule.phase_of[i.index()] {
                assert!(pi <= pn, "dependency goes backwards across phases");
            }
        }
    }
    assert!(c.alloc.bytes_after <= c.alloc.bytes_before);
}

/// A random DAG: a few inputs and weights, then ops picking earlier values.
fn random_graph(choices: &[(u8, usize, usize, usize)], width: usize) -> Graph {
    let mut g = Graph::new(4, GraphKind::Prefill);
    let t = 4;
    let pos = g.input("positions", InputKind::Positions, TensorType::u32(&[t]));
    let _tok = g.input("tokens", InputKind::Tokens, TensorType::u32(&[t]));
    let w = g.weight(
        "w",
        None,
        WeightParam { name: "w".into(), shape: vec![width, width], format: WeightFormat::Float { dtype: FloatType::F32 }, module: true },
    );
    let w2 = g.weight(
        "w2",
        None,
        WeightParam { name: "w2".into(), shape: vec![2 * width, width], format: WeightFormat::Float { dtype: FloatType::F32 }, module: true },
    );
    let experts = g.weight(
        "experts",
        None,
        WeightParam {
            name: "experts".into(),
            shape: vec![width, width, width],
            format: WeightFormat::Float { dtype: FloatType::F32 },
            module: true,
        },
    );
    let cache = g.state("cache", None, StateKind::KvCache { layer: 0, value: false }, TensorType::f32(&[8, 1, width]));
    // Seed value: x = tokens-independent matmul chain needs an f32 start.
    let seed = g.weight(
        "seed",
        None,
        WeightParam { name: "seed".into(), shape: vec![4, width], format: WeightFormat::Float { dtype: FloatType::F32 }, module: false },
    );
    let mut vals: Vec<NodeIndex> = vec![];
    let first = g.op("rows", None, Op::Binary { f: BinaryOp::Mul }, &[seed, seed]).unwrap();
    vals.push(first);
    let mut wrote_cache = false;
    for (i, &(kind, a, b, layer)) in choices.iter().enumerate() {
        let pick = |k: usize| vals[k % vals.len()];
        let (x, y) = (pick(a), pick(b));
        let layer = Some(layer % 3);
        let name = format!("n{i}");
        let r = match kind % 10 {
            0 => g.op(&name, layer, Op::Binary { f: BinaryOp::Add }, &[x, y]),
            1 => g.op(&name, layer, Op::Unary { f: UnaryOp::Gelu }, &[x]),
            2 => g.op(&name, layer, Op::MatMul, &[x, w]),
            3 => g.op(&name, layer, Op::GeGlu, &[x, y]),
            4 => g.op(&name, layer, Op::RmsNorm { eps: 1e-6, scale: NormScale::None }, &[x]),
            5 => {
                // view chain: reshape and back
                let v = g.op(&format!("{name}.v"), layer, Op::Reshape { shape: vec![t, 1, width] }, &[x]).unwrap();
                g.op(&name, layer, Op::Reshape { shape: vec![t, width] }, &[v])
            }
            6 => {
                let wide = g.op(&format!("{name}.wide"), layer, Op::MatMul, &[x, w2]).unwrap();
                g.op(&name, layer, Op::Slice { axis: 1, start: width / 2, len: width }, &[wide])
            }
            7 if !wrote_cache => {
                wrote_cache = true;
                let v = g.op(&format!("{name}.v"), layer, Op::Reshape { shape: vec![t, 1, width] }, &[x]).unwrap();
                let kc = g.op(&format!("{name}.kw"), layer, Op::KvWrite { heads: None }, &[v, pos, cache]).unwrap();
                let q = g.op(&format!("{name}.q"), layer, Op::Reshape { shape: vec![t, 1, width] }, &[y]).unwrap();
                let a = g.op(&format!("{name}.att"), layer, Op::Attention { scale: 1.0, window: None }, &[q, pos, kc, kc]).unwrap();
                g.op(&name, layer, Op::Reshape { shape: vec![t, width] }, &[a])
            }
            8 => {
                // MoE routing: 2 of `width` experts per token, grouped, two grouped matmuls
                let logits = g.op(&format!("{name}.router"), layer, Op::MatMul, &[x, w]).unwrap();
                let ids = g.op(&format!("{name}.ids"), layer, Op::TopK { k: 2 }, &[logits]).unwrap();
                let wt = g.op(&format!("{name}.wt"), layer, Op::TopKSoftmax, &[logits, ids]).unwrap();
                let gr = g.op(&format!("{name}.groups"), layer, Op::MoeGroup { experts: width }, &[ids]).unwrap();
                let h = g.op(&format!("{name}.up"), layer, Op::GroupedMatMul, &[y, ids, experts, gr]).unwrap();
                let h = g.op(&format!("{name}.down"), layer, Op::GroupedMatMul, &[h, ids, experts, gr]).unwrap();
                g.op(&name, layer, Op::WeightedSum, &[h, wt])
            }
            _ => g.op(&name, layer, Op::Binary { f: BinaryOp::Mul }, &[y, x]),
        };
        vals.push(r.unwrap());
    }
    // Layers must be monotonic for the per-layer schedule to be contiguous by stage;
    // the random layer tags test that the scheduler never reorders regardless.
    let last = *vals.last().unwrap();
    let head = g.op("head", None, Op::MatMul, &[last, w]).unwrap();
    let tok = g.op("argmax", None, Op::Argmax, &[head]).unwrap();
    g.set_output("logits", head);
    g.set_output("token", tok);
    g
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn random_dags_keep_invariants(
        choices in proptest::collection::vec((0u8..10, 0usize..64, 0usize..64, 0usize..3), 1..60),
        width in 2usize..40,
        per_layer in any::<bool>(),
    ) {
        let g = random_graph(&choices, width);
        let policy = if per_layer { PhasePolicy::PerLayer } else { PhasePolicy::EmbedLayersHead };
        let c = compile(g, policy).expect("compile");
        assert_properties(&c);
    }
}

/// The checker is not vacuous: corrupting each pass result is caught.
#[test]
fn checker_catches_corruption() {
    let choices: Vec<(u8, usize, usize, usize)> = (0..30).map(|i| ((i * 7 % 9) as u8, i * 3, i * 5 + 1, i % 3)).collect();
    let c = compile(random_graph(&choices, 16), PhasePolicy::EmbedLayersHead).unwrap();
    check(&c).unwrap();
    // 1. Output bound to an input's buffer.
    let mut bad = c.clone();
    let n = bad.graph.op_nodes().find(|&n| bad.graph.node(n).op() == Some(&Op::MatMul)).unwrap();
    let i = bad.graph.inputs(n)[0];
    let victim = bad.graph.storage_root(n);
    bad.alloc.storage[victim.index()] = bad.alloc.storage[i.index()];
    assert!(check(&bad).is_err());
    // 2. A buffer too small.
    let mut bad = c.clone();
    for s in bad.alloc.pool_sizes.iter_mut() {
        *s = 1;
    }
    assert!(check(&bad).is_err());
    // 3. Two live values merged into one buffer.
    let mut bad = c.clone();
    let pools: Vec<usize> = (0..bad.graph.g.node_count())
        .filter(|&k| matches!(bad.alloc.storage[k], Storage::Pool(_)) && bad.alloc.live[k].is_some())
        .collect();
    for &k in &pools {
        bad.alloc.storage[k] = Storage::Pool(0);
    }
    let max = *bad.alloc.pool_sizes.iter().max().unwrap();
    bad.alloc.pool_sizes = vec![max; bad.alloc.pool_sizes.len()];
    assert!(check(&bad).is_err());
    // 4. Phases out of order.
    let mut bad = c.clone();
    bad.schedule.phases.reverse();
    assert!(check(&bad).is_err());
}

#[test]
fn checker_catches_a_second_user_of_an_appended_cache() {
    let cfg = load("gemma3-270m");
    let mut g = build_from_config(&cfg, &BuildOptions::decode(256, 32)).unwrap();
    let att = g.op_nodes().find(|&n| matches!(g.node(n).op(), Some(Op::NormRopeAttention { append: Some(_), .. }))).unwrap();
    let Some(Op::NormRopeAttention { append: Some(a), .. }) = g.node(att).op().cloned() else { unreachable!() };
    let (ins, layer) = (g.inputs(att), g.node(att).layer);
    // the value row written again by an op of its own: the cache has a second user
    g.op("v_write_again", layer, Op::KvWrite { heads: Some(a.v) }, &[ins[0], ins[1], ins[3]]).unwrap();
    let e = compile(g, PhasePolicy::Step).unwrap_err();
    assert!(e.0.contains("appends to") && e.0.contains("also uses"), "{e}");
}

/// Layer 0's key norm stored as f32, its query norm as bf16: that layer's caches are written in
/// front of its attention (the appending pass reads both norms as one dtype), and each norm
/// weight is one node.
#[test]
fn mixed_norm_dtypes_keep_the_cache_writes() {
    struct F32KeyNorm<'a>(ConfigResolver<'a>);
    impl WeightResolver for F32KeyNorm<'_> {
        fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat {
            if name.ends_with("layers.0.self_attn.k_norm.weight") {
                return WeightFormat::Float { dtype: FloatType::F32 };
            }
            self.0.format(name, shape, module)
        }
    }
    let cfg = load("gemma3-270m");
    let g = build(&cfg, &F32KeyNorm(ConfigResolver(&cfg)), &BuildOptions::decode(256, 32)).unwrap();
    let gr = &g;
    let layer_ops = |l: usize| gr.op_nodes().filter(|&n| gr.node(n).layer == Some(l)).map(|n| gr.node(n).op().unwrap().clone()).collect::<Vec<_>>();
    let appends = |ops: &[Op]| ops.iter().filter(|op| matches!(op, Op::NormRopeAttention { append: Some(_), .. })).count();
    let writes = |ops: &[Op]| ops.iter().filter(|op| op.writes_state()).count();
    assert_eq!((appends(&layer_ops(0)), writes(&layer_ops(0))), (0, 2));
    assert_eq!((appends(&layer_ops(1)), writes(&layer_ops(1))), (1, 0));
    let k_norms = g.weights().filter(|(_, w)| w.name.ends_with("layers.0.self_attn.k_norm.weight")).count();
    assert_eq!(k_norms, 1);
    compile(g, PhasePolicy::Step).unwrap();
}

fn configs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

fn load(name: &str) -> ModelConfig {
    let s = std::fs::read_to_string(configs_dir().join(name).join("config.json")).unwrap();
    ModelConfig::from_json_str(&s).unwrap()
}

#[test]
fn gemma3_graphs_pass_checks() {
    for (name, layers, hidden) in [("gemma3-270m", 18, 640), ("gemma3-1b", 26, 1152), ("gemma3-12b", 48, 3840)] {
        let cfg = load(name);
        assert_eq!(cfg.num_layers, layers);
        assert_eq!(cfg.hidden_size, hidden);
        for opts in [BuildOptions::decode(4096, 512), BuildOptions::prefill(37, 4096)] {
            for policy in [PhasePolicy::EmbedLayersHead, PhasePolicy::PerLayer, PhasePolicy::Step] {
                let g = build_from_config(&cfg, &opts).unwrap();
                let c = compile(g, policy).unwrap();
                assert_properties(&c);
                let expect_phases = match policy {
                    PhasePolicy::PerLayer => layers + 2,
                    PhasePolicy::EmbedLayersHead => 2,
                    PhasePolicy::Step => 1,
                };
                assert_eq!(c.schedule.phases.len(), expect_phases, "{name}");
                // the logits (one buffer no other value can share) dominate both sums
                let logits = c.graph.node(c.graph.output("logits").unwrap()).ty.bytes();
                let (after, before) = (c.alloc.bytes_after - logits, c.alloc.bytes_before - logits);
                assert!(after * 2 < before, "{name}: sharing saves little ({after} of {before} bytes besides the logits, {policy:?})");
                // One-token graphs: each layer's attention appends its own key and value (no
                // cache-write op); prefill graphs write the caches in front of the attention.
                let count = |f: &dyn Fn(&Op) -> bool| c.graph.op_nodes().filter(|&n| f(c.graph.node(n).op().unwrap())).count();
                let appends = count(&|op| matches!(op, Op::NormRopeAttention { append: Some(_), .. }));
                let writes = count(&|op| op.writes_state());
                let one = opts.tokens == 1;
                assert_eq!((appends, writes), if one { (layers, 0) } else { (0, 2 * layers) }, "{name} tokens {}", opts.tokens);
                // Every weight of a Gemma 3 layer is present.
                let names: Vec<&str> = c.graph.weights().map(|(_, w)| w.name.as_str()).collect();
                let prefix = cfg.default_prefix();
                for i in [0, layers - 1] {
                    for t in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.q_norm.weight", "input_layernorm.weight"] {
                        let full = format!("{prefix}layers.{i}.{t}");
                        assert!(names.contains(&full.as_str()), "{name}: missing {full}");
                    }
                }
            }
        }
    }
}

#[test]
fn dumps_are_deterministic() {
    for name in ["gemma3-270m", "gemma3-12b"] {
        let mk = || {
            let c = compile(build_from_config(&load(name), &BuildOptions::prefill(9, 1024)).unwrap(), PhasePolicy::EmbedLayersHead).unwrap();
            (dump::to_text(&c), serde_json::to_string(&dump::to_json(&c)).unwrap(), dump::to_dot(&c))
        };
        assert_eq!(mk(), mk());
    }
}

#[test]
fn gemma3_12b_uses_linear_rope_on_global_layers_only() {
    let cfg = load("gemma3-12b");
    let g = build_from_config(&cfg, &BuildOptions::decode(1024, 64)).unwrap();
    let ropes: Vec<(usize, f32)> = g
        .g
        .node_indices()
        .filter_map(|n| match g.node(n).op() {
            Some(Op::Rope { factor, .. }) => Some((g.node(n).layer.unwrap(), *factor)),
            _ => None,
        })
        .collect();
    for (l, f) in ropes {
        let global = (l + 1) % 6 == 0;
        assert_eq!(f, if global { 8.0 } else { 1.0 }, "layer {l}");
    }
    assert_eq!(cfg.vocab_size, 262208);
}

#[test]
fn gemma4_moe_prefill_groups_pairs_and_decode_gathers() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4_moe-q4/config.json");
    let cfg = ModelConfig::from_json_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (layers, experts) = (cfg.num_layers, cfg.num_experts.unwrap());
    for (opts, grouped) in [(BuildOptions::decode(256, 32), false), (BuildOptions::prefill(2, 256), true), (BuildOptions::prefill(37, 256), true)] {
        for policy in [PhasePolicy::EmbedLayersHead, PhasePolicy::PerLayer] {
            let c = compile(build_from_config(&cfg, &opts).unwrap(), policy).unwrap();
            assert_properties(&c);
            let g = &c.graph;
            let (mut groups, mut grouped_mm, mut gather_mm) = (0, 0, 0);
            for n in g.op_nodes() {
                match g.node(n).op().unwrap() {
                    Op::MoeGroup { experts: e } => {
                        assert_eq!(*e, experts);
                        assert!(matches!(g.node(g.inputs(n)[0]).op(), Some(Op::TopK { .. })));
                        assert_eq!(g.node(n).ty, TensorType::u32(&[experts + 1 + opts.tokens * cfg.top_k_experts.unwrap()]));
                        groups += 1;
                    }
                    Op::GroupedMatMul => {
                        // the groups of its own ids
                        let ins = g.inputs(n);
                        assert!(matches!(g.node(ins[3]).op(), Some(Op::MoeGroup { .. })));
                        assert_eq!(g.inputs(ins[3])[0], ins[1]);
                        grouped_mm += 1;
                    }
                    Op::GatherMatMul => gather_mm += 1,
                    _ => {}
                }
            }
            let want = if grouped { (layers, 3 * layers, 0) } else { (0, 0, 3 * layers) };
            assert_eq!((groups, grouped_mm, gather_mm), want, "tokens {}", opts.tokens);
        }
    }
    let mk = || {
        let c = compile(build_from_config(&cfg, &BuildOptions::prefill(9, 256)).unwrap(), PhasePolicy::EmbedLayersHead).unwrap();
        (dump::to_text(&c), serde_json::to_string(&dump::to_json(&c)).unwrap(), dump::to_dot(&c))
    };
    let a = mk();
    assert!(a.0.contains("moe_group") && a.1.contains("\"grouped_matmul\""));
    assert_eq!(a, mk());
}

#[test]
fn expert_op_shape_rules() {
    let ids = TensorType::u32(&[5, 2]);
    let x = TensorType::f32(&[5, 16]);
    let w = TensorType::f32(&[4, 8, 16]);
    let groups = Op::MoeGroup { experts: 4 }.infer(&[&ids]).unwrap();
    assert_eq!(groups, TensorType::u32(&[15]));
    assert!(Op::MoeGroup { experts: 0 }.infer(&[&ids]).is_err());
    assert!(Op::MoeGroup { experts: 4 }.infer(&[&x]).is_err());
    assert_eq!(Op::GroupedMatMul.infer(&[&x, &ids, &w, &groups]).unwrap(), TensorType::f32(&[5, 2, 8]));
    let x3 = TensorType::f32(&[5, 2, 16]);
    assert_eq!(Op::GroupedMatMul.infer(&[&x3, &ids, &w, &groups]).unwrap(), TensorType::f32(&[5, 2, 8]));
    // groups of another expert count or pair count
    assert!(Op::GroupedMatMul.infer(&[&x, &ids, &w, &TensorType::u32(&[14])]).is_err());
    assert!(Op::GroupedMatMul.infer(&[&x, &ids, &w]).is_err());
    assert!(Op::GroupedMatMul.infer(&[&x, &ids, &w, &x]).is_err());
}

/// One-token Gemma 4 layers run V's weightless norm with its cache write, the layer scalar in
/// the layer's last residual norm-add, the per-layer input gate as one GeGLU with every slot
/// copied before the layers, and (MoE) the experts' post-norm sum as one norm-add; prefill
/// graphs scale in the norm-add too.
#[test]
fn gemma4_layers_fuse_v_norm_layer_scalar_and_sums() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    for fixture in ["gemma4_dense_ple-q4", "gemma4_moe-q4"] {
        let cfg = ModelConfig::from_json_str(&std::fs::read_to_string(fixtures.join(fixture).join("config.json")).unwrap()).unwrap();
        let ple = cfg.hidden_size_per_layer_input > 0;
        for opts in [BuildOptions::decode(256, 32), BuildOptions::prefill(5, 256)] {
            let c = compile(build_from_config(&cfg, &opts).unwrap(), PhasePolicy::EmbedLayersHead).unwrap();
            assert_properties(&c);
            let g = &c.graph;
            let one = opts.tokens == 1;
            let mut scaled = vec![0usize; cfg.num_layers];
            let mut v_norm_writes = 0;
            let mut first_layer_op = None;
            for (pos, n) in g.op_nodes().into_iter().enumerate() {
                let node = g.node(n);
                if node.layer.is_some() && first_layer_op.is_none() {
                    first_layer_op = Some(pos);
                }
                match node.op().unwrap() {
                    Op::RmsNormAdd { scaled: true, .. } => {
                        scaled[node.layer.unwrap()] += 1;
                        assert_eq!(g.node(g.inputs(n)[3]).ty.shape, [1], "{fixture}: {}", node.name);
                    }
                    Op::KvWriteNormRope { scale: NormScale::None, rotary_pairs: 0, .. } => v_norm_writes += 1,
                    Op::Binary { f: BinaryOp::Mul } | Op::Unary { f: UnaryOp::Gelu } => {
                        panic!("{fixture}: {} runs as its own op", node.name)
                    }
                    Op::NormRope { .. } if one => panic!("{fixture}: {} is not fused into a cache write", node.name),
                    Op::Binary { f: BinaryOp::Add } if node.layer.is_some() => panic!("{fixture}: {} is a separate add", node.name),
                    Op::Slice { .. } if one && ple => {
                        assert!(node.layer.is_none() && first_layer_op.is_none(), "{fixture}: {} inside the layers", node.name)
                    }
                    _ => {}
                }
            }
            assert_eq!(scaled, vec![1; cfg.num_layers], "{fixture} tokens {}", opts.tokens);
            if one {
                let own_kv = (0..cfg.num_layers).filter(|&i| i < cfg.first_shared_layer()).count();
                assert_eq!(v_norm_writes, own_kv, "{fixture}");
            }
        }
    }
}
