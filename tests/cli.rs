//! The `markbase` binary: graph dumps, inspect, generate, logits, bench, and clear errors.

use std::path::PathBuf;
use std::process::Command;

#[path = "common/wav.rs"]
mod wav;

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
    // progress within each backend, as each run finishes, with the time still to go
    for dev in ["cpu", "gpu: llvmpipe"] {
        for line in ["warmed up in ", "prefill run 1/1: ", "decode run 1/1: "] {
            assert!(err.lines().any(|l| l.starts_with(dev) && l.contains(line)), "{dev} {line}: {err}");
        }
        assert!(err.lines().any(|l| l.starts_with(dev) && l.contains("s to go")), "{dev}: {err}");
    }
}

/// `bench` of the tiny synthetic vision shapes: each backend encodes an image (SigLIP's 16
/// soft tokens; Gemma 4's ViT at two budgets) and times the first token of it and 32 text
/// tokens; the FLOPs follow the documented count.
#[test]
fn bench_encodes_images_on_gpu_and_cpu() {
    // SigLIP, 256 patches of 14 (3x14x14 = 588 values), hidden 64, MLP 128, 2 layers, 2 heads
    // x 32, 16 soft tokens into a text width of 128: 2·M·N·K per matmul, 4·P·S·H·d per attention
    let layer = 4.0 * 2.0 * 256.0 * 64.0 * 64.0 + 2.0 * 2.0 * 256.0 * 64.0 * 128.0 + 4.0 * 256.0 * 256.0 * 64.0;
    let siglip_flop = 2.0 * 256.0 * 64.0 * 588.0 + 2.0 * layer + 2.0 * 16.0 * 64.0 * 128.0;
    // (lavapipe's attention over Gemma 4's 630 patches takes seconds: one budget there)
    let runs = [
        ("tiny-gemma3-vision", "vulkan", None, vec![16]),
        ("tiny-gemma3-vision", "cpu", None, vec![16]),
        ("tiny-gemma4-vision", "vulkan", Some("70"), vec![70]),
        ("tiny-gemma4-vision", "cpu", Some("70,140"), vec![70, 140]),
    ];
    for (model, backend, tokens, want) in runs {
        {
            let mut args = vec!["bench", "--synthetic", model, "--prompt", "8", "--gen", "2", "--runs", "1", "--backend", backend, "--json"];
            args.extend(tokens.iter().flat_map(|t| ["--image-tokens", *t]));
            let (ok, out, err) = run(&args);
            assert!(ok, "{model} {backend}: {err}");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let r = &v[0];
            assert!(r.get("error").is_none(), "{r}");
            // the text bench's fields are still there
            assert!(r["decode_tok_s_median"].as_f64().unwrap() > 0.0, "{r}");
            let images = r["image"].as_array().unwrap_or_else(|| panic!("no image records: {r}"));
            assert_eq!(images.iter().map(|i| i["soft_tokens"].as_u64().unwrap() as usize).collect::<Vec<_>>(), want, "{r}");
            for i in images {
                for k in ["encode_ms", "encode_wall_ms", "tower_tflop", "encode_tflop_s", "ttft_ms", "ttft_with_encode_ms"] {
                    let x = i[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {i}"));
                    assert!(x.is_finite() && x > 0.0, "{k} = {x}: {i}");
                }
                let n = i["soft_tokens"].as_u64().unwrap();
                assert_eq!(i["prompt_tokens"].as_u64().unwrap(), n + 3 + 32, "{i}");
                // the patches pool into the soft tokens
                let pool = if model.contains("gemma3") { 16 } else { 9 };
                assert_eq!(i["patches"].as_u64().unwrap(), n * pool, "{i}");
                let timing = i["encode_timing"].as_str().unwrap();
                assert!(if backend == "cpu" { timing == "wall" } else { ["gpu", "wall"].contains(&timing) }, "{i}");
            }
            if model.contains("gemma3") {
                let f = images[0]["tower_tflop"].as_f64().unwrap() * 1e12;
                assert!((f - siglip_flop).abs() < 1e-6 * siglip_flop, "{f} FLOP, counted {siglip_flop}");
            }
        }
    }
    // the table: a row per image after the text rows
    let (ok, out, err) = run(&["bench", "--synthetic", "tiny-gemma4-vision", "--prompt", "8", "--gen", "2", "--runs", "1", "--backend", "cpu", "--image-tokens", "70"]);
    assert!(ok, "{err}");
    assert!(out.contains("| soft tokens | patches | encode ms |") && out.contains("| gemma4 ViT | 70 | 630 |"), "{out}");
    let tiny = ["bench", "--prompt", "8", "--gen", "2", "--runs", "1", "--backend", "cpu", "--synthetic"];
    fails_with(&[&tiny[..], &["tiny-gemma3-vision", "--image-tokens", "280"]].concat(), "applies to Gemma 4's ViT");
    // a checkpoint whose tower cannot run still benchmarks its text, unless images are asked for
    let dir = std::env::temp_dir().join(format!("markbase-cli-{}-standardize", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(root().join("tests/fixtures/vlm/gemma4").join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["vision_config"]["standardize"] = serde_json::json!(true);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let m = dir.to_str().unwrap();
    let (ok, out, err) = run(&["bench", "-m", m, "--prompt", "8", "--gen", "2", "--runs", "1", "--backend", "cpu"]);
    assert!(ok && err.contains("no image bench") && err.contains("standardize") && out.contains("| cpu |"), "{out}{err}");
    fails_with(&["bench", "-m", m, "--prompt", "8", "--gen", "2", "--runs", "1", "--backend", "cpu", "--image-tokens", "70"], "standardize");
    let _ = std::fs::remove_dir_all(&dir);
    fails_with(&[&tiny[..], &["tiny-gemma4-vision", "--image-tokens", "100"]].concat(), "not one of Gemma 4's budgets");
    fails_with(&[&tiny[..], &["tiny-gemma3", "--image-tokens", "280"]].concat(), "no vision tower");
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

const Q4: &str = "tests/fixtures/gemma3_text-q4";

/// Runs with extra environment (`Some`) or variables removed (`None`), and stdin.
fn run_env(args: &[&str], env: &[(&str, Option<&str>)], stdin: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut c = bin();
    c.args(args).current_dir(root());
    for (k, v) in env {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    let mut child = c
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run markbase");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

/// Fails with a one-line `error:` naming `want`, without a panic.
fn fails_with(args: &[&str], want: &str) -> String {
    let (ok, out, err) = run(args);
    assert!(!ok, "{args:?} succeeded: {out}{err}");
    assert!(err.contains("error: ") && err.contains(want), "{args:?}: wanted {want:?} in {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

/// A copy of a fixture in a fresh temporary directory, with `edit` applied.
fn fixture_copy(name: &str, edit: impl Fn(&std::path::Path)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("markbase-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(root().join(Q4)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    edit(&dir);
    dir
}

#[test]
fn sampling_parameters_out_of_range_are_refused() {
    let base = ["generate", "-m", Q4, "--backend", "cpu", "-p", "w1"];
    for (flag, v, want) in [
        ("--min-p", "5", "min-p must be in [0, 1]"),
        ("--temp", "nan", "temperature must be a finite number"),
        ("--temp", "-1", "temperature must be a finite number"),
        ("--top-p", "0", "top-p must be in (0, 1]"),
        ("--repetition-penalty", "0", "repetition penalty must be"),
    ] {
        let mut a = base.to_vec();
        a.extend([flag, v]);
        fails_with(&a, want);
    }
    fails_with(&["chat", "-m", Q4, "--backend", "cpu", "--min-p", "2"], "min-p");
}

#[test]
fn context_limits_are_errors_in_the_users_terms() {
    let base = ["generate", "-m", Q4, "--backend", "cpu", "-p", "w1"];
    fails_with(&[&base[..], &["--max-context", "0"]].concat(), "--max-context) must be at least 1 token");
    fails_with(&[&base[..], &["--max-context", "2000000"]].concat(), "exceeds this model's 1024 positions");
    // a model claiming 4e9 positions: the caches cannot be allocated
    let big = fixture_copy("bigctx", |d| {
        let c = std::fs::read_to_string(d.join("config.json")).unwrap();
        std::fs::write(d.join("config.json"), c.replace("\"max_position_embeddings\": 1024", "\"max_position_embeddings\": 4000000000")).unwrap();
    });
    let m = big.to_str().unwrap();
    let err = fails_with(&["generate", "-m", m, "--backend", "cpu", "-p", "w1", "--max-context", "2000000000"], "lower --max-context");
    assert!(err.contains("GiB"), "{err}");
    // on a GPU the caches are split across bindings: what stops them is memory (host memory on
    // a software adapter) or the chunks the attention merges, never one binding's limit
    let err = fails_with(&["generate", "-m", m, "--backend", "vulkan", "-p", "w1", "--max-context", "2000000000"], "lower --max-context");
    assert!(err.contains("GiB") && !err.contains("binding limit"), "{err}");
    let _ = std::fs::remove_dir_all(big);
}

#[test]
fn a_full_context_is_said_to_stop_the_generation() {
    let (ok, out, err) = run(&["generate", "-m", Q4, "--backend", "cpu", "-p", "w1 w2 w3 w4 w5 w6", "--max-context", "12", "--max-tokens", "40"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("w1 w2"), "{out}");
    assert!(err.contains("stopped: context full (12 tokens"), "{err}");
    assert!(err.contains("6 generated"), "{err}");
    let (ok, _, err) = run(&["generate", "-m", Q4, "--backend", "cpu", "-p", "w1", "--max-tokens", "3"]);
    assert!(ok && err.contains("stopped: max tokens (3)"), "{err}");
}

#[test]
fn rates_need_an_interval() {
    let (ok, _, err) = run(&["generate", "-m", Q4, "--backend", "cpu", "-p", "w1 w2", "--max-tokens", "1"]);
    assert!(ok, "{err}");
    assert!(err.contains("1 generated, decode n/a"), "{err}");
    assert!(err.contains("prefill"), "{err}");
    let (ok, _, err) = run(&["generate", "-m", Q4, "--backend", "cpu", "-p", "w1 w2", "--max-tokens", "3"]);
    assert!(ok, "{err}");
    assert!(err.contains("3 generated, decode ") && !err.contains("decode n/a"), "{err}");
}

#[test]
fn prompts_come_from_files_and_stdin() {
    let f = std::env::temp_dir().join(format!("markbase-prompt-{}.txt", std::process::id()));
    std::fs::write(&f, "w7 w8 w9").unwrap();
    let args = ["generate", "-m", Q4, "--backend", "cpu", "--max-tokens", "2"];
    let (ok, out, err) = run(&[&args[..], &["-f", f.to_str().unwrap()]].concat());
    assert!(ok && out.starts_with("w7 w8 w9"), "{out}{err}");
    let (ok, out, err) = run_env(&[&args[..], &["-p", "-"]].concat(), &[], "w4 w5");
    assert!(ok && out.starts_with("w4 w5"), "{out}{err}");
    let _ = std::fs::remove_file(&f);
    fails_with(&[&args[..], &["-p", "w1", "-f", "x.txt"]].concat(), "give the prompt once");
    fails_with(&args, "no prompt");
    fails_with(&[&args[..], &["-f", "/nonexistent/prompt.txt"]].concat(), "/nonexistent/prompt.txt");
}

/// Control characters in a prompt (ESC sequences, CR, BEL, a C1 CSI) reach the terminal
/// as visible escapes, never raw; newlines and tabs stay.
#[test]
fn control_characters_are_not_echoed_raw() {
    let prompt = "w1\x1b[2J\x1b]0;title\x07 w2\rw3\u{9b}31m\tw4\nw5";
    let (ok, out, err) = run(&["generate", "-m", Q4, "--backend", "cpu", "-p", prompt, "--max-tokens", "2"]);
    assert!(ok, "{err}");
    assert!(!out.chars().any(|c| c.is_control() && c != '\n' && c != '\t'), "{out:?}");
    assert!(out.starts_with("w1\\u{1b}[2J\\u{1b}]0;title\\u{7} w2\\u{d}w3\\u{9b}31m\tw4\nw5"), "{out:?}");
}

#[test]
fn what_is_not_a_checkpoint_is_named_with_the_way_to_get_one() {
    let gguf = std::env::temp_dir().join(format!("markbase-{}.gguf", std::process::id()));
    std::fs::write(&gguf, b"GGUF").unwrap();
    for (m, want) in [(gguf.to_str().unwrap(), "is a file"), ("google/gemma-3-270m", "Hugging Face"), ("/nonexistent/model", "no such directory")] {
        for args in [&["generate", "-m", m, "--backend", "cpu", "-p", "hi"][..], &["inspect", m], &["graph", m], &["bench", "-m", m, "--backend", "cpu"]] {
            let err = fails_with(args, want);
            assert!(err.contains("MLX checkpoint") && err.contains("mlx_lm.convert"), "{err}");
        }
    }
    let _ = std::fs::remove_file(gguf);
    fails_with(&["generate", "-m", "tests/fixtures", "--backend", "cpu", "-p", "hi"], "has no config.json");
}

#[test]
fn cheap_checks_come_before_loading() {
    let no_tok = fixture_copy("notok", |d| std::fs::remove_file(d.join("tokenizer.json")).unwrap());
    let err = fails_with(&["generate", "-m", no_tok.to_str().unwrap(), "--backend", "cpu", "-p", "hi"], "tokenizer.json: no such file");
    assert!(err.contains(no_tok.to_str().unwrap()) && !err.contains("loaded"), "{err}");
    // logits need no tokenizer
    let (ok, out, err) = run(&["logits", "-m", no_tok.to_str().unwrap(), "--backend", "cpu", "--tokens", "2,5", "--top", "1"]);
    assert!(ok && out.lines().count() == 2, "{out}{err}");
    let _ = std::fs::remove_dir_all(no_tok);
    let (ok, _, err) = run_env(&["generate", "-m", Q4, "-p", "hi"], &[("MARKBASE_BACKEND", Some("bogus"))], "");
    assert!(!ok && err.contains("\"bogus\"") && !err.contains("loaded"), "{err}");
    let err = fails_with(&["generate", "-m", Q4, "--backend", "bogus", "-p", "hi"], "unknown backend");
    assert!(!err.contains("loaded"), "{err}");
    let err = fails_with(&["logits", "-m", Q4, "--backend", "cpu", "--tokens", "2,5", "--out", "/nonexistent/dir/l.npy"], "/nonexistent/dir/l.npy");
    assert!(!err.contains("loaded"), "{err}");
    fails_with(&["logits", "-m", Q4, "--backend", "cpu", "--tokens", "2,,818"], "empty token id at position 2");
    fails_with(&["logits", "-m", Q4, "--backend", "cpu", "--tokens", "2,-1"], "bad token id \"-1\"");
    fails_with(&["logits", "-m", Q4, "--backend", "cpu", "--tokens", " "], "no tokens given");
}

#[test]
fn logits_of_the_last_position_and_their_top_ids() {
    let npy = std::env::temp_dir().join(format!("markbase-last-{}.npy", std::process::id()));
    let (ok, out, err) =
        run(&["logits", "-m", Q4, "--backend", "cpu", "--tokens", "2,5,9", "--last", "--top", "3", "--out", npy.to_str().unwrap()]);
    assert!(ok, "{err}");
    let b = std::fs::read(&npy).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert!(String::from_utf8_lossy(&b[10..10 + hlen]).contains("(1, 512)"));
    let row: Vec<f32> = b[10 + hlen..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    // `position token id:logit ...`
    let line: Vec<&str> = out.trim().split('\t').collect();
    assert_eq!(out.lines().count(), 1, "{out}");
    assert_eq!(&line[..2], ["2", "9"]);
    let ids: Vec<usize> = line[2].split(' ').map(|p| p.split(':').next().unwrap().parse().unwrap()).collect();
    assert_eq!(ids, idx[..3]);
    let _ = std::fs::remove_file(npy);
    // --top alone prints and writes nothing
    let (ok, out, err) = run(&["logits", "-m", Q4, "--backend", "cpu", "--tokens", "2,5,9", "--top", "2"]);
    assert!(ok && out.lines().count() == 3 && !err.contains("wrote"), "{out}{err}");
}

#[test]
fn a_software_adapter_defaults_to_the_cpu_unless_a_backend_is_named() {
    let args = ["generate", "-m", Q4, "-p", "w1", "--max-tokens", "2"];
    let (ok, _, forced) = run_env(&args, &[("MARKBASE_BACKEND", Some("vulkan"))], "");
    assert!(ok, "{forced}");
    assert!(forced.contains("gpu: "), "MARKBASE_BACKEND=vulkan must run on the GPU: {forced}");
    let (ok, _, err) = run_env(&args, &[("MARKBASE_BACKEND", None), ("WGPU_BACKEND", None)], "");
    assert!(ok, "{err}");
    if forced.contains("(vulkan, cpu,") {
        // the only Vulkan adapter is a software one
        assert!(err.contains("is a software GPU: running on the CPU reference executor"), "{err}");
        assert!(err.contains("cpu (reference"), "{err}");
    } else {
        assert!(err.contains("gpu: ") && !err.contains("software GPU"), "{err}");
    }
    let (ok, _, err) = run_env(&[&args[..], &["--backend", "vulkan"]].concat(), &[("MARKBASE_BACKEND", None)], "");
    assert!(ok && err.contains("gpu: ") && !err.contains("software GPU"), "{err}");
}

#[test]
fn gpu_runs_need_no_runtime_dir_from_the_environment() {
    let (ok, _, err) = run_env(&["generate", "-m", Q4, "--backend", "vulkan", "-p", "w1", "--max-tokens", "1"], &[("XDG_RUNTIME_DIR", None)], "");
    assert!(ok, "{err}");
    assert!(!err.contains("XDG_RUNTIME_DIR"), "{err}");
}

#[test]
fn dot_labels_break_lines_and_graph_token_counts_are_checked() {
    let (ok, out, err) = run(&["graph", "configs/gemma3-270m", "--format", "dot", "--tokens", "4"]);
    assert!(ok, "{err}");
    assert!(!out.contains("\\\\n"), "a label with a literal \\n");
    assert!(out.lines().filter(|l| l.contains("shape=box") && l.contains("\\n")).count() > 100, "{out}");
    fails_with(&["graph", "configs/gemma3-270m", "--tokens", "0"], "--tokens must be at least 1");
    fails_with(&["graph", "configs/gemma3-270m", "--tokens", "100000"], "exceeds the context of 4096");
}

#[test]
fn bench_refuses_what_it_cannot_do_and_says_so() {
    let tiny = ["bench", "--synthetic", "tiny-gemma3", "--prompt", "8", "--gen", "2"];
    fails_with(&[&tiny[..], &["--runs", "0"]].concat(), "--runs must be at least 1");
    // every backend failing is a failure; devices are named as on the command line
    let (ok, out, err) = run_env(&[&tiny[..], &["--runs", "1", "--backend", "vulkan"]].concat(), &[("VK_DRIVER_FILES", Some("/nonexistent/icd.json")), ("VK_ICD_FILENAMES", Some("/nonexistent/icd.json"))], "");
    assert!(!ok, "{out}{err}");
    assert!(out.contains("| vulkan | error: ") && !out.contains("Gpu("), "{out}");
    assert!(err.contains("no backend ran"), "{err}");
    // the CPU row: no NaN, no fraction of an unknown bandwidth, and no profile
    let (ok, out, err) = run(&[&tiny[..], &["--runs", "1", "--backend", "cpu", "--profile"]].concat());
    assert!(ok, "{err}");
    assert!(err.contains("the cpu row has no profile"), "{err}");
    let row = out.lines().find(|l| l.contains("| cpu |")).unwrap_or_else(|| panic!("{out}"));
    assert!(!row.contains("NaN") && !row.contains('%'), "{row}");
    let (ok, out, err) = run(&[&tiny[..], &["--runs", "1", "--backend", "cpu", "--bandwidth", "1e9"]].concat());
    assert!(ok && out.lines().any(|l| l.contains("| cpu |") && l.contains('%')), "{out}{err}");
}

/// `bench --batch`: a batch's decode step timed at each sequence count on the GPU, its profile
/// by op, and clear refusals.
#[test]
fn bench_batch_times_decode_steps_and_refuses_bad_counts() {
    let tiny = ["bench", "--synthetic", "tiny-gemma3", "--prompt", "8", "--gen", "2", "--runs", "1"];
    let (ok, out, err) = run(&[&tiny[..], &["--batch", "1,3", "--profile"]].concat());
    assert!(ok, "{out}{err}");
    // one sequence runs in a graph of 1 row, 3 in one of 4
    assert!(out.contains("| 1 | 1 |") && out.contains("| 3 | 4 |"), "{out}");
    assert!(out.contains("profile of a step of 3 sequences") && out.contains("attention_batched"), "{out}");
    let (ok, out, err) = run(&[&tiny[..], &["--batch", "2", "--json"]].concat());
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    assert!(ok && v["batch"][0]["sequences"] == 2 && v["batch"][0]["tok_s"].as_f64().is_some_and(|t| t > 0.0), "{out}");
    // the several-token GEMV by default; the f16 GEMM in parts with --batch-f16 (here its FMA twin)
    let kernels = |v: &serde_json::Value| v["batch"][0]["matmul_kernels"].as_array().map(|a| a.iter().filter_map(|k| k.as_str().map(String::from)).collect::<Vec<_>>()).unwrap_or_default();
    let k = kernels(&v);
    assert!(!k.is_empty() && k.iter().all(|k| k.starts_with("gemv")), "{k:?}");
    let (ok, out, err) = run_env(&[&tiny[..], &["--batch", "2", "--json", "--batch-f16"]].concat(), &[("MARKBASE_COOP", Some("fma"))], "");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    let k = kernels(&v);
    assert!(ok && k.iter().any(|k| k.starts_with("gemm_f16") && k.contains(" split")) && !k.iter().any(|k| k.starts_with("gemv")), "{k:?} {err}");
    fails_with(&[&tiny[..], &["--batch", "0"]].concat(), "--batch: 0 sequences");
    fails_with(&[&tiny[..], &["--batch", "65"]].concat(), "--batch: 65 sequences");
    fails_with(&[&tiny[..], &["--batch", "2", "--backend", "all"]].concat(), "one backend");
    fails_with(&[&tiny[..], &["--batch", "x"]].concat(), "invalid value");
}

#[test]
fn chat_keeps_the_conversation_cached() {
    let dir = fixture_copy("chat", |d| {
        let t = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}\
                 {% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
        std::fs::write(d.join("chat_template.jinja"), t).unwrap();
    });
    // the GPU pipelines decode steps: the steps still queued at a turn's end are read first
    for backend in ["cpu", "vulkan"] {
        let (ok, _, err) = run_env(
            &["chat", "-m", dir.to_str().unwrap(), "--backend", backend, "--max-tokens", "3", "--system", "w9 w8"],
            &[],
            "w1 w2\nw3\nw4 w5\n/exit\n",
        );
        assert!(ok, "{err}");
        let turns: Vec<&str> = err.lines().filter(|l| l.contains("new prompt tokens")).collect();
        assert_eq!(turns.len(), 3, "{err}");
        assert!(turns[0].contains("(0 cached)"), "{err}");
        for t in &turns[1..] {
            let cached: usize = t.split(" cached)").next().unwrap().rsplit('(').next().unwrap().parse().unwrap();
            assert!(cached > 0, "{backend}: a turn re-ran the conversation: {err}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--no-fuse` on graph, logits, generate and bench: the dump shows no fused node (and, with
/// a list, none of those rules), the logits stay those of the fused graphs within the
/// fixtures' bound, and an unknown rule is an error naming the rules.
#[test]
fn no_fuse_switches_rules_off_on_every_command() {
    let fused = run(&["graph", Q4, "--max-context", "64"]);
    assert!(fused.0 && fused.1.contains("[fused: kv_append]") && fused.1.contains("[fused: norm_matmul]"), "{}", fused.2);
    let none = run(&["graph", Q4, "--max-context", "64", "--no-fuse"]);
    assert!(none.0 && !none.1.contains("[fused:") && !none.1.contains("norm_matmul"), "{}", none.2);
    let some = run(&["graph", Q4, "--max-context", "64", "--no-fuse=kv_append,geglu"]);
    assert!(some.0 && !some.1.contains("[fused: kv_append]") && !some.1.contains("[fused: geglu]") && some.1.contains("[fused: norm_matmul]"));
    let json = run(&["graph", Q4, "--max-context", "64", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&json.1).unwrap();
    assert!(v["nodes"].as_array().unwrap().iter().any(|n| n["fused_by"] == "kv_append"));
    let e = fails_with(&["graph", Q4, "--no-fuse=norm_add,bogus"], "unknown fusion rule 'bogus'");
    assert!(e.contains("kv_append"), "{e}");

    let logits = |extra: &[&str]| {
        let npy = std::env::temp_dir().join(format!("markbase-fuse-{}-{}.npy", std::process::id(), extra.len()));
        let mut args = vec!["logits", "-m", Q4, "--backend", "cpu", "--tokens", "2,5,9,14", "--out", npy.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (ok, _, err) = run(&args);
        assert!(ok, "{err}");
        let b = std::fs::read(&npy).unwrap();
        let _ = std::fs::remove_file(&npy);
        let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
        b[10 + hlen..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>()
    };
    let (a, b) = (logits(&[]), logits(&["--no-fuse"]));
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(a.len() == 4 * 512 && d <= 1e-5 * scale, "fused and unfused logits differ by {d} (max {scale})");

    let (ok, out, err) = run(&["generate", "-m", Q4, "--backend", "cpu", "-p", "Hello", "--max-tokens", "3", "--no-fuse"]);
    assert!(ok && !out.is_empty(), "{err}");
    let (ok, _, err) = run(&["bench", "-m", Q4, "--backend", "cpu", "--prompt", "8", "--gen", "2", "--runs", "1", "--no-fuse=norm_add"]);
    assert!(ok, "{err}");
}

/// The default dump shows the phases the runtime runs: one for a decode step, two for a
/// prefill.
#[test]
fn graph_dumps_show_the_phases_that_run() {
    let (ok, out, err) = run(&["graph", Q4, "--max-context", "64"]);
    assert!(ok && out.lines().filter(|l| l.starts_with("# phase ")).count() == 1, "{out}{err}");
    let (ok, out, _) = run(&["graph", Q4, "--max-context", "64", "--tokens", "8"]);
    assert!(ok && out.lines().filter(|l| l.starts_with("# phase ")).count() == 2, "{out}");
    let (ok, out, _) = run(&["graph", Q4, "--max-context", "64", "--phases", "two"]);
    assert!(ok && out.lines().filter(|l| l.starts_with("# phase ")).count() == 2, "{out}");
}

/// A config value beyond what markbase takes names its field and the limit, once prefixed
/// with the file's path.
#[test]
fn oversized_config_values_name_the_field_and_the_limit() {
    for (field, value, want) in [
        ("num_hidden_layers", "1000000", "field `num_hidden_layers`: 1000000 exceeds the largest value markbase accepts, 256"),
        ("hidden_size", "1000000000000000", "field `hidden_size`: 1000000000000000 is beyond any model"),
        ("vocab_size", "-3", "field `vocab_size`: expected a non-negative integer, got -3"),
    ] {
        let dir = fixture_copy(&format!("oversized-{field}"), |d| {
            let p = d.join("config.json");
            let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            c[field] = serde_json::from_str(value).unwrap();
            std::fs::write(&p, c.to_string()).unwrap();
        });
        for args in [vec!["graph", dir.to_str().unwrap()], vec!["generate", "-m", dir.to_str().unwrap(), "--backend", "cpu", "-p", "hi"]] {
            let e = fails_with(&args, want);
            assert_eq!(e.matches("config.json").count(), 1, "{e}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

const VLM4: &str = "tests/fixtures/vlm/gemma4";
const VLM3: &str = "tests/fixtures/vlm/gemma3";

/// `generate --image` and `chat` with `--image` and `/image`: the tiny Gemma 4 vision
/// fixture's greedy continuation of its chat reference (an image, then `w17 w29 w40`), on the
/// CPU; Gemma 3 through its own template.
#[test]
fn generate_and_chat_with_images() {
    let sq = format!("{VLM4}/square.png");
    let want = "w149 w62 w331 w458";
    let (ok, out, err) = run(&["generate", "-m", VLM4, "--backend", "cpu", "--image", &sq, "-p", "w17 w29 w40", "--chat", "--max-tokens", "4"]);
    assert!(ok && out.contains(want), "{out}{err}");
    // the same turn in chat, its image added by /image; a missing file is reported and skipped
    let stdin = format!("/image {sq}\n/image no-such.png\nw17 w29 w40\n/exit\n");
    let (ok, out, err) = run_env(&["chat", "-m", VLM4, "--backend", "cpu", "--max-tokens", "4"], &[], &stdin);
    assert!(ok && out.contains(want), "{out}{err}");
    assert!(err.contains("error: no-such.png: cannot be read"), "{err}");
    // --image for the first turn, then a second turn reusing the cached prefix
    let stdin = "w17 w29 w40\nw5\n/exit\n";
    let (ok, out, err) = run_env(&["chat", "-m", VLM4, "--backend", "cpu", "--max-tokens", "4", "--image", &sq], &[], stdin);
    assert!(ok && out.contains(want) && err.contains("[8 new prompt tokens (78 cached)"), "{out}{err}");
    let (ok, out, err) = run(&["generate", "-m", VLM3, "--backend", "cpu", "--image", &format!("{VLM3}/wide.png"), "-p", "w17", "--chat", "--max-tokens", "2"]);
    assert!(ok && !out.trim().is_empty(), "{out}{err}");
}

/// Image errors: a model without a vision tower, unreadable and non-image files, more image
/// tokens than the context; each a one-line error before anything runs.
#[test]
fn image_errors_are_clear() {
    let sq = format!("{VLM3}/square.png");
    fails_with(&["generate", "-m", Q4, "--backend", "cpu", "--image", &sq, "-p", "w5"], "has no vision tower");
    fails_with(&["chat", "-m", Q4, "--backend", "cpu", "--image", &sq], "has no vision tower");
    fails_with(&["generate", "-m", VLM3, "--backend", "cpu", "--image", "no-such.png", "-p", "w5"], "no-such.png: cannot be read");
    fails_with(&["generate", "-m", VLM3, "--backend", "cpu", "--image", &format!("{VLM3}/config.json"), "-p", "w5"], "config.json");
    let e = fails_with(&["generate", "-m", VLM3, "--backend", "cpu", "--image", &sq, "--image", &sq, "-p", "w5", "--max-context", "32"], "more than the context of 32 tokens");
    assert!(e.contains("(32 of them the soft tokens of 2 images)"), "{e}");
    // /image in a chat with a text-only model
    let (ok, _, err) = run_env(&["chat", "-m", Q4, "--backend", "cpu"], &[], &format!("/image {sq}\n/exit\n"));
    assert!(ok && err.contains("error: ") && err.contains("has no vision tower"), "{err}");
}

const CLIP: &str = "tests/fixtures/audio/chirp_16k_s32_stereo.wav";

/// The token the reference's audio chat turn (`[image, w23 w31, audio]`) continues with.
fn audio_turn_next_token() -> String {
    let l = markbase::npy::read_f32(&root().join(VLM4).join("ref/audio_logits.npy")).unwrap();
    let v = l.shape[1];
    let last = &l.data[l.data.len() - v..];
    let id = last.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    format!("w{id}")
}

/// `generate --audio`, `chat` with `--audio` and `/audio`, `encode --audio` and `logits
/// --audio`: the tiny
/// Gemma 4 fixture's chat turn of the reference (the square image, `w23 w31`, the clip)
/// continues with the reference's next token.
#[test]
fn generate_chat_and_encode_with_audio() {
    let sq = format!("{VLM4}/square.png");
    let next = audio_turn_next_token();
    let (ok, out, err) = run(&["generate", "-m", VLM4, "--backend", "cpu", "--image", &sq, "--audio", CLIP, "-p", "w23 w31", "--chat", "--max-tokens", "1"]);
    assert!(ok && out.trim() == next, "{out}{err}");
    // the same turn in chat, the clip added by /audio; a missing file is reported and skipped
    let stdin = format!("/image {sq}\n/audio {CLIP}\n/audio no-such.wav\nw23 w31\n/exit\n");
    let (ok, out, err) = run_env(&["chat", "-m", VLM4, "--backend", "cpu", "--max-tokens", "1"], &[], &stdin);
    assert!(ok && out.trim() == next, "{out}{err}");
    assert!(err.contains("error: no-such.wav: cannot open"), "{err}");
    // --audio for the first turn
    let (ok, out, err) = run_env(&["chat", "-m", VLM4, "--backend", "cpu", "--max-tokens", "1", "--image", &sq, "--audio", CLIP], &[], "w23 w31\n/exit\n");
    assert!(ok && out.trim() == next, "{out}{err}");
    // encode: the clip's 6 soft tokens after the image's 64
    let npy = std::env::temp_dir().join(format!("markbase-cli-{}-audio-soft.npy", std::process::id()));
    let (ok, _, err) = run(&["encode", "-m", VLM4, "--backend", "cpu", "--image", &sq, "--audio", CLIP, "--out", npy.to_str().unwrap()]);
    assert!(ok && err.contains("soft tokens per clip [6]"), "{err}");
    let a = markbase::npy::read_f32(&npy).unwrap();
    assert_eq!(a.shape, [70, 64]);
    // logits of the reference's ids, the image's and the clip's runs filled
    let ids = markbase::npy::read_i32(&root().join(VLM4).join("ref/audio_chat_ids.npy")).unwrap().data;
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let (ok, _, err) = run(&["logits", "-m", VLM4, "--backend", "cpu", "--tokens", &ids.join(","), "--image", &sq, "--audio", CLIP, "--out", npy.to_str().unwrap()]);
    assert!(ok, "{err}");
    let got = markbase::npy::read_f32(&npy).unwrap().data;
    let want = markbase::npy::read_f32(&root().join(VLM4).join("ref/audio_logits.npy")).unwrap().data;
    let mx = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / mx;
    assert!(got.len() == want.len() && e <= 5e-4, "logits --audio: {e:.2e} of max |logit|");
    fails_with(&["logits", "-m", VLM4, "--backend", "cpu", "--tokens", "2,503,5", "--audio", CLIP, "--out", npy.to_str().unwrap()], "1 audio placeholders");
    let _ = std::fs::remove_file(&npy);
}

/// Audio errors: a missing file, a file that is not audio, a model without an audio tower, a
/// clip over 30 s; each a one-line error before any weight is loaded.
#[test]
fn audio_errors_are_clear() {
    fails_with(&["generate", "-m", VLM4, "--backend", "cpu", "--audio", "no-such.wav", "-p", "w5"], "no-such.wav: cannot open");
    fails_with(&["generate", "-m", VLM4, "--backend", "cpu", "--audio", &format!("{VLM4}/square.png"), "-p", "w5"], "square.png");
    fails_with(&["generate", "-m", VLM3, "--backend", "cpu", "--audio", CLIP, "-p", "w5"], "has no audio tower");
    fails_with(&["chat", "-m", Q4, "--backend", "cpu", "--audio", CLIP], "has no audio tower");
    fails_with(&["encode", "-m", VLM3, "--audio", CLIP, "--out", "never-written.npy"], "has no audio tower");
    // 31 s of silence at 1 kHz, 8-bit
    let long = std::env::temp_dir().join(format!("markbase-cli-{}-long.wav", std::process::id()));
    std::fs::write(&long, wav::wav_bytes(1, 1, 1_000, 8, 31_000, &[128; 31_000])).unwrap();
    let e = fails_with(&["generate", "-m", VLM4, "--backend", "cpu", "--audio", long.to_str().unwrap(), "-p", "w5"], "at most 30.00 s");
    assert!(e.contains("long.wav") && e.contains("31.00 s"), "{e}");
    let _ = std::fs::remove_file(&long);
    // /audio in a chat with a model without an audio tower
    let (ok, _, err) = run_env(&["chat", "-m", VLM3, "--backend", "cpu"], &[], &format!("/audio {CLIP}\n/exit\n"));
    assert!(ok && err.contains("error: ") && err.contains("has no audio tower"), "{err}");
}

/// Gemma 3n: `encode --audio` runs the audio tower alone (the text decoder is never built) and
/// writes the clip's 188 soft tokens, which match the library's; `generate` on a Gemma 3n
/// checkpoint is a clear error.
#[test]
fn gemma3n_encode_audio_and_generate_refused() {
    const TINY3N: &str = "tests/fixtures/audio_tower/gemma3n";
    let speech = "tests/fixtures/audio/speech_16k.wav";
    let npy = std::env::temp_dir().join(format!("markbase-cli-{}-3n-soft.npy", std::process::id()));
    let (ok, _, err) = run(&["encode", "-m", TINY3N, "--backend", "cpu", "--audio", speech, "--out", npy.to_str().unwrap()]);
    assert!(ok && err.contains("soft tokens per clip [188]"), "{err}");
    let a = markbase::npy::read_f32(&npy).unwrap();
    assert_eq!(a.shape, [188, 128]);
    let samples = markbase::audio::load(&root().join(speech), &Default::default()).unwrap();
    let mut enc = markbase::audio::encode::AudioEncoder::open(&root().join(TINY3N), markbase::model::DeviceKind::Cpu, false).unwrap();
    assert_eq!(enc.encode(&samples).unwrap().data, a.data);
    let _ = std::fs::remove_file(&npy);
    let e = fails_with(&["generate", "-m", "tests/fixtures/gemma3n-bf16", "--backend", "cpu", "-p", "w5"], "Gemma 3n text decoder is not supported yet");
    assert!(e.contains("encode --audio"), "{e}");
}
