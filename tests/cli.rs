//! The `markbase` binary: graph dumps, inspect, generate, logits, bench, and clear errors.

use std::path::PathBuf;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_markbase"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(args: &[&str]) -> (bool, String, String) {
    let o = bin().args(args).current_dir(root()).output().expect("run markbase");
    (o.status.success(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

#[test]
fn graph_dumps_are_byte_identical_and_valid() {
    for cfg in ["configs/gemma3-270m", "configs/gemma3-1b", "configs/gemma3-12b"] {
        for fmt in ["text", "json", "dot"] {
            let a = run(&["graph", cfg, "--format", fmt, "--tokens", "12"]);
            let b = run(&["graph", cfg, "--format", fmt, "--tokens", "12"]);
            assert!(a.0, "{cfg} {fmt}: {}", a.2);
            assert_eq!(a.1, b.1, "{cfg} {fmt}: dumps differ between runs");
            match fmt {
                "json" => {
                    let v: serde_json::Value = serde_json::from_str(&a.1).unwrap();
                    assert_eq!(v["schema"], 1);
                    let n = v["nodes"].as_array().unwrap();
                    assert_eq!(n.len() as u64, v["summary"]["nodes"].as_u64().unwrap());
                    assert!(v["phases"].as_array().unwrap().len() == 2);
                    // Every matmul names its weight and has a pool buffer distinct from its input's.
                    for node in n.iter().filter(|x| x["op"] == "matmul") {
                        assert_eq!(node["weights"].as_array().unwrap().len(), 1);
                        let inp = node["inputs"][0].as_u64().unwrap() as usize;
                        assert_ne!(n[inp]["storage"], node["storage"]);
                    }
                }
                "dot" => assert!(a.1.starts_with("digraph markbase {") && a.1.trim_end().ends_with('}')),
                _ => assert!(a.1.contains("phase 0")),
            }
        }
    }
}

#[test]
fn moe_graph_dumps_show_the_expert_grouping() {
    let model = "tests/fixtures/gemma4_moe-q4";
    for tokens in ["12", "1"] {
        let a = run(&["graph", model, "--format", "json", "--tokens", tokens]);
        assert!(a.0, "{}", a.2);
        assert_eq!(a.1, run(&["graph", model, "--format", "json", "--tokens", tokens]).1, "dumps differ between runs");
        let v: serde_json::Value = serde_json::from_str(&a.1).unwrap();
        let n = v["nodes"].as_array().unwrap();
        let ops = |name: &str| n.iter().filter(|x| x["op"] == name).collect::<Vec<_>>();
        if tokens == "1" {
            // decode: the gathered GEMV, no grouping
            assert!(ops("moe_group").is_empty() && ops("grouped_matmul").is_empty());
            assert_eq!(ops("gather_matmul").len(), 3 * ops("top_k").len());
            continue;
        }
        let groups = ops("moe_group");
        assert_eq!(groups.len(), ops("top_k").len());
        assert!(ops("gather_matmul").is_empty());
        for g in &groups {
            // E + 1 offsets and the 12 * 2 pairs
            assert_eq!(g["dtype"], "u32");
            assert_eq!(g["shape"], serde_json::json!([8 + 1 + 24]));
            assert_eq!(g["attrs"]["experts"], 8);
        }
        let mm = ops("grouped_matmul");
        assert_eq!(mm.len(), 3 * groups.len());
        for node in mm {
            let group = node["inputs"][3].as_u64().unwrap() as usize;
            assert_eq!(n[group]["op"], "moe_group");
            assert_eq!(node["weights"].as_array().unwrap().len(), 1);
            assert_ne!(n[group]["storage"], node["storage"]);
        }
    }
}

#[test]
fn inspect_describes_fixtures_and_reports_broken_ones() {
    let (ok, out, _) = run(&["inspect", "tests/fixtures/gemma4_moe-q4", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(out.contains("experts"), "{v}");
    let (ok, out, err) = run(&["inspect", "tests/fixtures/broken/missing-tensor"]);
    assert!(!ok);
    assert!(out.contains("self_attn.k_proj.weight missing"), "{out}{err}");
    let (ok, _, err) = run(&["generate", "-m", "tests/fixtures/broken/truncated-file", "--backend", "cpu", "-p", "hi"]);
    assert!(!ok);
    assert!(err.starts_with("error: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn generate_and_logits_run_on_a_fixture() {
    let (ok, out, err) = run(&["generate", "-m", "tests/fixtures/gemma3_text-q4", "--backend", "cpu", "-p", "w1 w2 w3", "--max-tokens", "5"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("w1 w2 w3"), "{out}");
    assert!(err.contains("5 generated"), "{err}");
    let npy = std::env::temp_dir().join(format!("markbase-logits-{}.npy", std::process::id()));
    let (ok, _, err) = run(&["logits", "-m", "tests/fixtures/gemma3_text-q4", "--backend", "cpu", "--tokens", "2,5,9", "--out", npy.to_str().unwrap()]);
    assert!(ok, "{err}");
    let b = std::fs::read(&npy).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!(b.len(), 10 + hlen + 3 * 512 * 4);
    assert!(String::from_utf8_lossy(&b[10..10 + hlen]).contains("(3, 512)"));
    let _ = std::fs::remove_file(npy);
    let (ok, _, err) = run(&["logits", "-m", "tests/fixtures/gemma3_text-q4", "--backend", "cpu", "--tokens", "2,99999"]);
    assert!(!ok && err.contains("outside the vocabulary"), "{err}");
}

#[test]
fn bench_runs_on_gpu_and_cpu() {
    let (ok, out, err) = run(&["bench", "--synthetic", "tiny-gemma3", "--prompt", "8", "--gen", "4", "--runs", "1", "--backend", "all", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    assert!(rows.len() >= 2, "expected a GPU and the CPU: {out}");
    for r in rows {
        assert!(r.get("error").is_none(), "{r}");
        assert!(r["decode_tok_s_median"].as_f64().unwrap() > 0.0);
    }
    // a decode step is one phase: one submission
    assert!(rows.iter().any(|r| r["submits_per_step"] == 1), "{out}");
}

#[test]
fn bench_profile_names_ops_and_weights() {
    let (ok, out, err) = run(&["bench", "--synthetic", "tiny-gemma3", "--prompt", "8", "--gen", "2", "--runs", "1", "--profile"]);
    assert!(ok, "{err}");
    assert!(out.contains("one decode step, a timestamp after every dispatch"), "no GPU profile: {out}");
    // one row per op and projection, summed over the layers
    for want in ["| matmul [", "mlp.down_proj |", "self_attn.o_proj |", "mlp.gate_proj+mlp.up_proj |", "| rms_norm_add |"] {
        assert!(out.contains(want), "{want} missing: {out}");
    }
    assert!(!out.contains("layers."), "layer indices left in the profile: {out}");
    // and one prefill of the prompt, by op
    let prefill = out.split("one prefill of 8 tokens").nth(1).unwrap_or_else(|| panic!("no prefill profile: {out}"));
    for want in ["| matmul [", "mlp.down_proj |", "| attention |"] {
        assert!(prefill.contains(want), "{want} missing from the prefill profile: {out}");
    }
    // the device column names the backend (one adapter may be found through several)
    assert!(["(vulkan) |", "(metal) |", "(dx12) |", "(gl) |"].iter().any(|b| out.contains(b)), "no backend in the device column: {out}");
}
