//! The commands behind the CLI, as library functions returning their output.

use std::path::Path;

use markbase_graph::builder::{build_from_config, BuildOptions};
use markbase_graph::passes::{compile, PhasePolicy};
use markbase_graph::{dump, ModelConfig};

#[derive(Clone, Copy, Debug)]
pub enum DumpFormat {
    Text,
    Json,
    Dot,
}

/// Reads and parses `<dir>/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig, String> {
    let p = dir.join("config.json");
    let s = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    ModelConfig::from_json_str(&s).map_err(|e| format!("{}: {e}", p.display()))
}

/// `markbase graph`: the compiled graph of a model directory, dumped.
pub fn graph(dir: &Path, format: DumpFormat, tokens: usize, max_context: usize, policy: PhasePolicy) -> Result<String, String> {
    let cfg = read_config(dir)?;
    let opts = if tokens <= 1 {
        BuildOptions::decode(max_context, 512.min(max_context))
    } else {
        BuildOptions::prefill(tokens, max_context.max(tokens))
    };
    let g = build_from_config(&cfg, &opts).map_err(|e| e.to_string())?;
    let c = compile(g, policy).map_err(|e| e.to_string())?;
    Ok(match format {
        DumpFormat::Text => dump::to_text(&c),
        DumpFormat::Json => {
            let mut s = serde_json::to_string_pretty(&dump::to_json(&c)).map_err(|e| e.to_string())?;
            s.push('\n');
            s
        }
        DumpFormat::Dot => dump::to_dot(&c),
    })
}

use std::io::Write;

use crate::model::{DeviceKind, GenerateParams, Model, ModelOptions, SampleParams};
use crate::tokenizer::Message;

/// Parses a `--backend` value: `cpu` or a GPU backend name.
pub fn parse_device(s: Option<&str>) -> Result<DeviceKind, String> {
    match s {
        None => Ok(DeviceKind::Gpu(None)),
        Some("cpu") => Ok(DeviceKind::Cpu),
        Some(b) => b
            .parse::<crate::gpu::device::Backend>()
            .map(|b| DeviceKind::Gpu(Some(b)))
            .map_err(|_| format!("unknown backend {b:?} (vulkan, metal, dx12, gl, cpu)")),
    }
}

/// Loads a model with a progress bar on stderr.
pub fn load_model(dir: &Path, device: DeviceKind, max_context: usize, check_nan: bool) -> Result<Model, String> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let b2 = bar.clone();
    let progress = Box::new(move |done: u64, total: u64| {
        b2.set_length(total);
        b2.set_position(done);
    });
    let opts = ModelOptions { device, max_context, progress: Some(progress), check_nan, ..Default::default() };
    let m = Model::load(dir, opts);
    bar.finish_and_clear();
    Ok(m?)
}

/// Options shared by `generate` and `chat`.
#[derive(Clone, Debug)]
pub struct GenOptions {
    pub max_tokens: usize,
    pub sampling: SampleParams,
}

/// `markbase generate`: streams the continuation of `prompt` to stdout.
pub fn generate(m: &mut Model, prompt: &str, chat: bool, o: &GenOptions) -> Result<(), String> {
    let tk = m.tokenizer()?;
    let ids = if chat { tk.encode_chat(&[Message::user(prompt)])? } else { tk.encode(prompt, true)? };
    let params = GenerateParams { max_tokens: o.max_tokens, sampling: o.sampling, ..Default::default() };
    let t0 = std::time::Instant::now();
    let mut n = 0;
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "{}", if chat { "" } else { prompt });
    let mut first = None;
    for piece in m.generate(&ids, params)? {
        let p = piece?;
        first.get_or_insert_with(|| t0.elapsed());
        n += 1;
        let _ = write!(out, "{}", p.text);
        let _ = out.flush();
    }
    let _ = writeln!(out);
    let total = t0.elapsed().as_secs_f64();
    let ttft = first.map(|d| d.as_secs_f64()).unwrap_or(total);
    let rate = if n > 1 { (n - 1) as f64 / (total - ttft).max(1e-9) } else { 0.0 };
    eprintln!("[{} prompt tokens, {} generated; first token {:.2}s; {:.1} tok/s; {}]", ids.len(), n, ttft, rate, m.device());
    Ok(())
}

/// `markbase chat`: an interactive loop on stdin. The whole conversation is
/// re-rendered with the chat template each turn.
pub fn chat(m: &mut Model, o: &GenOptions) -> Result<(), String> {
    let mut msgs: Vec<Message> = vec![];
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            continue;
        }
        if line == "/exit" || line == "/quit" {
            return Ok(());
        }
        msgs.push(Message::user(line));
        let ids = m.tokenizer()?.encode_chat(&msgs)?;
        let params = GenerateParams { max_tokens: o.max_tokens, sampling: o.sampling, ..Default::default() };
        let mut reply = String::new();
        let mut out = std::io::stdout().lock();
        let r: Result<(), String> = (|| {
            for piece in m.generate(&ids, params)? {
                let p = piece?;
                reply.push_str(&p.text);
                let _ = write!(out, "{}", p.text);
                let _ = out.flush();
            }
            Ok(())
        })();
        let _ = writeln!(out);
        if let Err(e) = r {
            eprintln!("error: {e}");
            msgs.pop();
            continue;
        }
        msgs.push(Message::assistant(reply.trim()));
    }
}

/// Writes an f32 array as a `.npy` file (format 1.0, little-endian, C order).
pub fn write_npy(path: &Path, shape: &[usize], data: &[f32]) -> Result<(), String> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_s}, }}");
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses `2,818,5279`.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().map_err(|_| format!("bad token id {t:?}")))
        .collect()
}

/// `markbase logits`: f32 logits of every position of `tokens`, written as .npy.
pub fn logits(m: &mut Model, tokens: &[u32], out: &Path) -> Result<String, String> {
    if tokens.is_empty() {
        return Err("no tokens given".into());
    }
    let rows = m.logits(tokens)?;
    let v = m.config.vocab_size;
    write_npy(out, &[rows.len(), v], &rows.concat())?;
    Ok(format!("wrote {} x {} logits to {}", rows.len(), v, out.display()))
}

/// `markbase inspect`.
pub fn inspect(dir: &Path, json: bool) -> (String, bool) {
    let r = crate::inspect::inspect(dir);
    let s = if json { serde_json::to_string_pretty(&r.to_json()).unwrap_or_default() + "\n" } else { r.to_string() };
    (s, r.ok())
}

/// `markbase bench`.
#[allow(clippy::too_many_arguments)]
pub fn bench(
    model: Option<&Path>,
    synthetic: Option<&str>,
    backend: Option<&str>,
    prompt: usize,
    gen: usize,
    runs: usize,
    bandwidth: f64,
    profile: bool,
    json: bool,
) -> Result<String, String> {
    use crate::bench;
    let (name, cfg, weights) = bench::source(model, synthetic)?;
    let devices: Vec<DeviceKind> = match backend {
        Some("all") => {
            let mut v: Vec<DeviceKind> = crate::gpu::device::Backend::ALL
                .iter()
                .filter(|b| crate::gpu::device::Gpu::with_options(&crate::gpu::device::GpuOptions { backend: Some(**b), ..Default::default() }).is_ok())
                .map(|b| DeviceKind::Gpu(Some(*b)))
                .collect();
            v.push(DeviceKind::Cpu);
            v
        }
        b => vec![parse_device(b)?],
    };
    let o = bench::BenchOptions { prompt, gen, runs, bandwidth, profile };
    let mut rows = vec![];
    for d in devices {
        let r = bench::bench_one(&name, &cfg, weights.clone(), d, &o)
            .unwrap_or_else(|e| serde_json::json!({"model": name, "device": format!("{d:?}"), "error": e}));
        if !json {
            eprintln!("{}", serde_json::to_string(&r).unwrap_or_default());
        }
        rows.push(r);
    }
    Ok(if json { serde_json::to_string_pretty(&rows).unwrap_or_default() + "\n" } else { bench::table(&rows) })
}
