//! The commands behind the CLI, as library functions returning their output.

use std::path::Path;

use markbase_graph::builder::{build_from_config, BuildOptions};
use markbase_graph::passes::{compile, PhasePolicy};
use markbase_graph::{dump, FuseOptions, ModelConfig};

#[derive(Clone, Copy, Debug)]
pub enum DumpFormat {
    Text,
    Json,
    Dot,
}

/// Reads and parses `<dir>/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig, String> {
    crate::model::check_dir(dir)?;
    let p = dir.join("config.json");
    let s = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    ModelConfig::from_json_str(&s).map_err(|e| format!("{}: {e}", p.display()))
}

/// `markbase graph`: the compiled graph of a model directory, dumped.
pub fn graph(dir: &Path, format: DumpFormat, tokens: usize, max_context: usize, policy: PhasePolicy, fuse: &FuseOptions) -> Result<String, String> {
    if tokens == 0 {
        return Err("--tokens must be at least 1 (1 = a decode step, N > 1 = a prefill of N tokens)".into());
    }
    if max_context == 0 {
        return Err("--max-context must be at least 1 token".into());
    }
    if tokens > max_context {
        return Err(format!("--tokens {tokens} exceeds the context of {max_context} tokens (--max-context)"));
    }
    let cfg = read_config(dir)?;
    let mut opts = if tokens == 1 {
        BuildOptions::decode(max_context, 512.min(max_context))
    } else {
        BuildOptions::prefill(tokens, max_context)
    };
    opts.fuse = fuse.clone();
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

use crate::model::{DeviceKind, GenerateParams, Model, ModelOptions, SampleParams, StopReason};
use crate::tokenizer::{ContentPart, Message, PartsMessage};
use crate::vision::prompt::{Part, Prompt};
use crate::vision::{RgbImage, SoftTokens};

/// Parses a `--backend` value: `cpu` or a GPU backend name. Without one, the
/// environment's (`MARKBASE_BACKEND`, `WGPU_BACKEND`) is checked now, before anything is loaded.
pub fn parse_device(s: Option<&str>) -> Result<DeviceKind, String> {
    use crate::gpu::device::Backend;
    match s {
        None => match std::env::var("MARKBASE_BACKEND") {
            Ok(v) if v.trim() == "cpu" => Ok(DeviceKind::Cpu),
            _ => Backend::from_env().map(|_| DeviceKind::Gpu(None)).map_err(|e| format!("{e} (from the environment: MARKBASE_BACKEND or WGPU_BACKEND)")),
        },
        Some("cpu") => Ok(DeviceKind::Cpu),
        Some(b) => b
            .parse::<Backend>()
            .map(|b| DeviceKind::Gpu(Some(b)))
            .map_err(|_| format!("unknown backend {b:?} (vulkan, metal, dx12, gl, cpu)")),
    }
}

/// Whether neither `--backend` nor the environment names a backend: then a machine
/// whose only adapter is a software one runs on the CPU executor.
pub fn device_is_default(s: Option<&str>) -> bool {
    s.is_none() && ["MARKBASE_BACKEND", "WGPU_BACKEND"].iter().all(|v| std::env::var(v).map_or(true, |x| x.trim().is_empty()))
}

/// How `load_model` opens a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub device: DeviceKind,
    /// Use the CPU where the only adapter is a software GPU (see [`device_is_default`]).
    pub cpu_if_software_gpu: bool,
    /// `None`: the model's positions, at most 4096.
    pub max_context: Option<usize>,
    pub check_nan: bool,
    /// Refuse a checkpoint without `tokenizer.json` before loading it (text commands).
    pub need_tokenizer: bool,
    /// The fusion rules the graphs run.
    pub fuse: FuseOptions,
}

/// Loads a model with a progress bar on stderr: the weights read, then the stages.
pub fn load_model(dir: &Path, o: &LoadOptions) -> Result<Model, String> {
    if o.need_tokenizer && dir.join("config.json").is_file() && !dir.join("tokenizer.json").is_file() {
        return Err(format!("{}: no such file (generating text needs the checkpoint's tokenizer)", dir.join("tokenizer.json").display()));
    }
    let max_context = match o.max_context {
        Some(n) => n,
        None => read_config(dir).map(|c| c.max_position_embeddings.clamp(1, 4096)).unwrap_or(4096),
    };
    let t0 = std::time::Instant::now();
    // drawn from the first weight read on: what opening the device prints stays above it
    let bar = indicatif::ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::hidden());
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>15} {bar:30} {bytes}/{total_bytes} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("opening");
    let b2 = bar.clone();
    let progress = Box::new(move |done: u64, total: u64| {
        if b2.is_hidden() {
            b2.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        b2.set_length(total);
        b2.set_position(done);
    });
    let b3 = bar.clone();
    let stage = Box::new(move |s: &str| b3.set_message(s.to_string()));
    let opts = ModelOptions {
        device: o.device,
        max_context,
        progress: Some(progress),
        check_nan: o.check_nan,
        fuse: o.fuse.clone(),
        cpu_if_software_gpu: o.cpu_if_software_gpu,
        stage: Some(stage),
        ..Default::default()
    };
    let m = Model::load(dir, opts);
    let bytes = bar.length().unwrap_or(0);
    bar.finish_and_clear();
    let m = m?;
    if let Some(n) = m.notice() {
        eprintln!("note: {n}");
    }
    eprintln!("loaded {} of weights in {:.1}s on {}", crate::memory::human(bytes), t0.elapsed().as_secs_f64(), m.device());
    Ok(m)
}

/// Options shared by `generate` and `chat`.
#[derive(Clone, Debug)]
pub struct GenOptions {
    pub max_tokens: usize,
    pub sampling: SampleParams,
}

/// Where a prompt comes from: `-p TEXT`, `-p -` (stdin) or `-f FILE`.
pub fn read_prompt(text: Option<&str>, file: Option<&Path>) -> Result<String, String> {
    match (text, file) {
        (Some(_), Some(_)) => Err("give the prompt once: -p TEXT, -p - (stdin) or -f FILE".into()),
        (None, None) => Err("no prompt: give -p TEXT, -p - (stdin) or -f FILE".into()),
        (Some("-"), None) => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("reading the prompt from stdin: {e}"))?;
            Ok(s)
        }
        (Some(t), None) => Ok(t.to_string()),
        (None, Some(f)) => std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display())),
    }
}

/// Text as the CLI prints it: control characters other than newline and tab (ESC, CR,
/// backspace, BEL, the C1 range) are shown as escapes such as `\u{1b}`, so that a prompt or a
/// generated piece cannot move the cursor, recolour or clear the terminal.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return s.into();
    }
    s.chars()
        .map(|c| if c.is_control() && c != '\n' && c != '\t' { c.escape_unicode().to_string() } else { c.to_string() })
        .collect::<String>()
        .into()
}

/// A rate over an interval, or `n/a` where there is none.
fn rate(n: usize, seconds: f64) -> String {
    if n == 0 || seconds <= 0.0 {
        "n/a".into()
    } else {
        format!("{:.1} tok/s", n as f64 / seconds)
    }
}

/// Why a generation stopped, in words.
pub fn stop_words(why: Option<StopReason>, m: &Model, max_tokens: usize) -> String {
    match why {
        Some(StopReason::MaxTokens) => format!("max tokens ({max_tokens})"),
        Some(StopReason::Stop) => "end of text (a stop token)".into(),
        Some(StopReason::ContextFull) => format!("context full ({} tokens; raise --max-context)", m.max_context()),
        None => "error".into(),
    }
}

/// What one streamed generation did.
struct Streamed {
    n: usize,
    /// Time to the first token (prefill), and from it to the last (decode).
    first: f64,
    decode: f64,
    why: Option<StopReason>,
}

/// Streams a generation's text to stdout (and into `reply`).
fn stream(g: &mut crate::model::Generation<'_>, reply: &mut String) -> Result<Streamed, String> {
    let t0 = std::time::Instant::now();
    let mut out = std::io::stdout().lock();
    let (mut n, mut first, mut last) = (0, None, 0.0);
    for piece in g.by_ref() {
        let p = piece?;
        let now = t0.elapsed().as_secs_f64();
        first.get_or_insert(now);
        last = now;
        n += 1;
        reply.push_str(&p.text);
        let _ = write!(out, "{}", printable(&p.text));
        let _ = out.flush();
    }
    let _ = writeln!(out);
    let first = first.unwrap_or(t0.elapsed().as_secs_f64());
    Ok(Streamed { n, first, decode: last - first, why: g.stop_reason() })
}

/// Decodes image files (before any weight is loaded: a bad file is reported first), for the
/// model in `dir`, which must have a vision tower.
pub fn read_images(dir: &Path, paths: &[std::path::PathBuf]) -> Result<Vec<RgbImage>, String> {
    if paths.is_empty() {
        return Ok(vec![]);
    }
    let imgs = paths.iter().map(|p| crate::vision::load_image(p).map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
    let ck = crate::loader::Checkpoint::open(dir).map_err(|e| e.to_string())?;
    if ck.vision_config().map_err(|e| e.to_string())?.is_none() {
        return Err(format!("{} has no vision tower (no vision_config in config.json): it takes no images", dir.display()));
    }
    Ok(imgs)
}

/// `markbase generate`: streams the continuation of `prompt` (after `images`, before
/// `clips`) to stdout.
pub fn generate(m: &mut Model, prompt: &str, chat: bool, images: &[RgbImage], clips: &[Vec<f32>], o: &GenOptions) -> Result<(), String> {
    o.sampling.validate()?;
    let mut parts: Vec<Part> = images.iter().cloned().map(Part::Image).collect();
    parts.push(Part::Text(prompt.to_string()));
    parts.extend(clips.iter().cloned().map(Part::Audio));
    let p = if images.is_empty() && clips.is_empty() {
        let tk = m.tokenizer()?;
        let ids = if chat { tk.encode_chat(&[Message::user(prompt)])? } else { tk.encode(prompt, true)? };
        Prompt { ids, soft: vec![] }
    } else {
        m.prompt(&parts, chat)?
    };
    let ids = &p.ids;
    let params = GenerateParams { max_tokens: o.max_tokens, sampling: o.sampling, ..Default::default() };
    let t = std::time::Instant::now();
    m.prepare_with_images(ids, &p.soft, &o.sampling)?;
    let compile = t.elapsed().as_secs_f64();
    let mut g = m.generate_prompt(&p, params)?;
    {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{}", if chat { "".into() } else { printable(prompt) });
        let _ = out.flush();
    }
    let s = stream(&mut g, &mut String::new())?;
    drop(g);
    eprintln!("stopped: {}", stop_words(s.why, m, o.max_tokens));
    eprintln!(
        "[compile {compile:.2}s; {} prompt tokens, prefill {:.2}s ({}); {} generated, decode {}; {}]",
        ids.len(),
        s.first,
        rate(ids.len(), s.first),
        s.n,
        rate(s.n.saturating_sub(1), s.decode),
        crate::bench::short_device(&m.device())
    );
    Ok(())
}

/// `markbase chat`: an interactive loop on stdin. Each turn feeds only what the
/// conversation adds to the cached sequence (the template re-rendered, its common
/// prefix with the cached tokens kept). `images` and `clips` go with the first turn; `/image
/// PATH` and `/audio PATH` add one to the next turn (images come before the turn's text,
/// clips after it).
pub fn chat(m: &mut Model, o: &GenOptions, system: Option<&str>, images: Vec<RgbImage>, clips: Vec<Vec<f32>>) -> Result<(), String> {
    o.sampling.validate()?;
    m.tokenizer()?;
    let mut msgs: Vec<PartsMessage> = system.map(|s| vec![PartsMessage::text("system", s)]).unwrap_or_default();
    // the soft tokens of the conversation's images and clips, and those of the next turn
    let mut soft: Vec<SoftTokens> = vec![];
    let mut pending = images;
    let mut pending_clips = clips;
    let ph = m.engine().placeholders();
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
        if let Some(path) = line.strip_prefix("/image") {
            let path = Path::new(path.trim());
            match m.engine().vision_or_err().map_err(String::from).and_then(|_| crate::vision::load_image(path).map_err(|e| e.to_string())) {
                Ok(img) => {
                    pending.push(img);
                    eprintln!("[image {} added to the next turn]", path.display());
                }
                Err(e) => eprintln!("error: {e}"),
            }
            continue;
        }
        if let Some(path) = line.strip_prefix("/audio") {
            let path = std::path::PathBuf::from(path.trim());
            let read = || -> Result<Vec<Vec<f32>>, crate::Error> {
                m.engine().audio_or_err()?;
                let dir = m.engine().dir().ok_or_else(|| crate::Error::Input("this model was not loaded from a checkpoint".into()))?;
                crate::audio::encode::read_clips(dir, std::slice::from_ref(&path))
            };
            match read() {
                Ok(c) => {
                    pending_clips.extend(c);
                    eprintln!("[audio {} added to the next turn]", path.display());
                }
                Err(e) => eprintln!("error: {e}"),
            }
            continue;
        }
        let (turn_images, turn_clips) = (pending.len(), pending_clips.len());
        let new_soft = m.encode_images(&std::mem::take(&mut pending)).and_then(|mut s| {
            s.extend(m.encode_clips(&std::mem::take(&mut pending_clips))?);
            Ok(s)
        });
        let new_soft = match new_soft {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                continue;
            }
        };
        let mut content = vec![ContentPart::Image; turn_images];
        content.push(ContentPart::Text { text: line.to_string() });
        content.extend(vec![ContentPart::Audio; turn_clips]);
        msgs.push(PartsMessage::new("user", content));
        soft.extend(new_soft);
        let turn = (|| -> Result<(usize, usize, Prompt), String> {
            let p = m.chat_prompt(&msgs, soft.clone())?;
            let common = m.tokens().iter().zip(&p.ids).take_while(|(a, b)| a == b).count();
            // at least one token is fed: the step that samples the reply's first token
            let (keep, rest) = p.tail(common.min(p.ids.len().saturating_sub(1)), &ph);
            if keep > 0 && m.truncate(keep) {
                Ok((p.ids.len(), keep, rest))
            } else {
                m.reset();
                Ok((p.ids.len(), 0, p))
            }
        })();
        let params = GenerateParams { max_tokens: o.max_tokens, sampling: o.sampling, ..Default::default() };
        let mut reply = String::new();
        let (total, reused) = turn.as_ref().map_or((0, 0), |t| (t.0, t.1));
        let r = turn.and_then(|(_, _, rest)| {
            m.generate_after_with_images(&rest.ids, &rest.soft, params).map_err(String::from).and_then(|mut g| stream(&mut g, &mut reply))
        });
        match r {
            Ok(s) => {
                if s.why != Some(StopReason::Stop) {
                    eprintln!("stopped: {}", stop_words(s.why, m, o.max_tokens));
                }
                eprintln!(
                    "[{} new prompt tokens ({} cached), prefill {:.2}s; {} generated, decode {}]",
                    total - reused,
                    reused,
                    s.first,
                    s.n,
                    rate(s.n.saturating_sub(1), s.decode)
                );
                msgs.push(PartsMessage::text("assistant", reply.trim()));
            }
            Err(e) => {
                eprintln!("error: {e}");
                // the turn is dropped with its images and clips
                msgs.pop();
                soft.truncate(soft.len() - turn_images - turn_clips);
            }
        }
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

/// Parses `2,818,5279`; an empty entry (`2,,818`) is an error.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("no tokens given (--tokens 2,818,5279)".into());
    }
    s.split(',')
        .enumerate()
        .map(|(i, t)| match t.trim() {
            "" => Err(format!("empty token id at position {} of {s:?}", i + 1)),
            t => t.parse::<u32>().map_err(|_| format!("bad token id {t:?} in {s:?} (ids are integers >= 0)")),
        })
        .collect()
}

/// The output file of `logits`, opened before anything is computed; removed again
/// if nothing gets written and it did not exist before.
pub struct OutFile {
    path: std::path::PathBuf,
    created: bool,
    written: bool,
}

impl OutFile {
    pub fn check(path: &Path) -> Result<OutFile, String> {
        let existed = path.exists();
        if path.is_dir() {
            return Err(format!("{}: is a directory", path.display()));
        }
        std::fs::OpenOptions::new().append(true).create(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(OutFile { path: path.to_path_buf(), created: !existed, written: false })
    }

    /// Writes the f32 array `data` of `shape` (see [`write_npy`]) and keeps the file.
    pub fn write_f32(mut self, shape: &[usize], data: &[f32]) -> Result<(), String> {
        write_npy(&self.path, shape, data)?;
        self.written = true;
        Ok(())
    }
}

impl Drop for OutFile {
    fn drop(&mut self) {
        if self.created && !self.written {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// What `logits` reports: the array written (`out`), and/or the `top` largest logits of each row.
#[derive(Clone, Debug, Default)]
pub struct LogitsOptions {
    /// Only the last position.
    pub last: bool,
    /// Print the `top` largest ids and logits of each row.
    pub top: Option<usize>,
}

/// `markbase logits`: f32 logits of every (or the last) position of `tokens`, written as
/// .npy to `out` and/or printed as each row's top ids. Returns (stdout, stderr) text.
pub fn logits(m: &mut Model, tokens: &[u32], out: Option<OutFile>, o: &LogitsOptions) -> Result<(String, String), String> {
    if tokens.is_empty() {
        return Err("no tokens given".into());
    }
    let mut rows = m.logits(tokens)?;
    let first = if o.last { rows.len() - 1 } else { 0 };
    let rows = rows.split_off(first);
    let v = m.config.vocab_size;
    let mut text = String::new();
    if let Some(k) = o.top {
        for (i, r) in rows.iter().enumerate() {
            let mut idx: Vec<usize> = (0..r.len()).collect();
            idx.sort_by(|&a, &b| r[b].total_cmp(&r[a]).then(a.cmp(&b)));
            let top: Vec<String> = idx.iter().take(k).map(|&j| format!("{j}:{:.4}", r[j])).collect();
            text.push_str(&format!("{}\t{}\t{}\n", first + i, tokens[first + i], top.join(" ")));
        }
    }
    let mut note = String::new();
    if let Some(mut f) = out {
        write_npy(&f.path, &[rows.len(), v], &rows.concat())?;
        f.written = true;
        note = format!("wrote {} x {} logits to {}", rows.len(), v, f.path.display());
    }
    Ok((text, note))
}

/// `markbase inspect`.
pub fn inspect(dir: &Path, json: bool) -> Result<(String, bool), String> {
    crate::model::check_dir(dir)?;
    let r = crate::inspect::inspect(dir);
    let s = if json { serde_json::to_string_pretty(&r.to_json()).unwrap_or_default() + "\n" } else { r.to_string() };
    Ok((s, r.ok()))
}

/// A device as the command line names it (`vulkan`, `cpu`).
pub fn device_name(d: DeviceKind) -> String {
    match d {
        DeviceKind::Cpu => "cpu".into(),
        DeviceKind::Gpu(Some(b)) => b.name().into(),
        DeviceKind::Gpu(None) => "gpu".into(),
    }
}

/// `markbase bench`: each table row is printed as it finishes (JSON: the array at the
/// end). An error when no backend ran.
pub fn bench(model: Option<&Path>, synthetic: Option<&str>, backend: Option<&str>, o: crate::bench::BenchOptions, json: bool) -> Result<(), String> {
    use crate::bench;
    if o.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    if o.prompt == 0 || o.gen == 0 {
        return Err("--prompt and --gen must be at least 1 token".into());
    }
    if let Some(b) = o.bandwidth {
        if !(b.is_finite() && b > 0.0) {
            return Err(format!("--bandwidth must be a positive number of bytes/s, got {b}"));
        }
    }
    let devices: Vec<DeviceKind> = match backend {
        Some("all") => vec![],
        b => vec![parse_device(b)?],
    };
    if !o.batch.is_empty() {
        return bench_batch(model, synthetic, &devices, &o, json);
    }
    // the vision tower's image sizes are checked before any weight is made
    let vision_shape = match synthetic {
        Some(name) => crate::synthetic::vision_config(name)?,
        None => match model {
            Some(dir) => {
                crate::model::check_dir(dir)?;
                // a malformed vision config keeps the text bench running unless images are asked for
                match crate::loader::Checkpoint::open(dir).map_err(|e| e.to_string())?.vision_config() {
                    Ok(v) => v,
                    Err(e) if o.image_tokens.is_empty() => {
                        eprintln!("note: no image bench: {e}");
                        None
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            None => None,
        },
    };
    let image_tokens = match &vision_shape {
        Some(vc) => crate::bench_vision::image_tokens(vc, &o.image_tokens)?,
        None if !o.image_tokens.is_empty() => return Err("--image-tokens: this model has no vision tower".into()),
        None => vec![],
    };
    let (name, cfg, weights) = bench::source(model, synthetic)?;
    let vision = match vision_shape.map(|_| crate::bench_vision::source(model, synthetic)) {
        Some(Err(e)) if o.image_tokens.is_empty() => {
            eprintln!("note: no image bench: {e}");
            None
        }
        v => v.transpose()?.flatten(),
    };
    let devices = if devices.is_empty() {
        let mut v: Vec<DeviceKind> = crate::gpu::device::Backend::ALL
            .iter()
            .filter(|b| crate::gpu::device::Gpu::with_options(&crate::gpu::device::GpuOptions { backend: Some(**b), ..Default::default() }).is_ok())
            .map(|b| DeviceKind::Gpu(Some(*b)))
            .collect();
        v.push(DeviceKind::Cpu);
        v
    } else {
        devices
    };
    let mut stdout = std::io::stdout().lock();
    if !json {
        let _ = write!(stdout, "{}", bench::table_header());
        let _ = stdout.flush();
    }
    let mut rows = vec![];
    for d in devices {
        if o.profile && d == DeviceKind::Cpu {
            eprintln!("note: --profile times GPU dispatches; the cpu row has no profile");
        }
        let mut r = bench::bench_one(&name, &cfg, weights.clone(), d, &o)
            .unwrap_or_else(|e| serde_json::json!({"model": name, "device": device_name(d), "error": e}));
        if let (Some(v), None) = (&vision, r.get("error")) {
            match crate::bench_vision::bench_images(&cfg, weights.clone(), v, d, &image_tokens, o.runs, o.profile) {
                Ok(images) => r["image"] = serde_json::json!(images),
                Err(e) => {
                    eprintln!("{}: the image bench failed: {e}", device_name(d));
                    r["image_error"] = serde_json::json!(e);
                }
            }
        }
        if !json {
            let _ = write!(stdout, "{}", bench::table_row(&r));
            let _ = stdout.flush();
        }
        rows.push(r);
    }
    let _ = write!(stdout, "{}", if json { serde_json::to_string_pretty(&rows).unwrap_or_default() + "\n" } else { crate::bench_vision::table(&rows) + &bench::profile_tables(&rows) });
    let _ = stdout.flush();
    if rows.iter().all(|r| r.get("error").is_some()) {
        return Err(format!("no backend ran ({} failed)", rows.len()));
    }
    Ok(())
}

/// `markbase bench --batch`: a batch's decode step at each sequence count, on one backend.
fn bench_batch(model: Option<&Path>, synthetic: Option<&str>, devices: &[DeviceKind], o: &crate::bench::BenchOptions, json: bool) -> Result<(), String> {
    let &[device] = devices else { return Err("--batch runs on one backend, not all".into()) };
    if let Some(&b) = o.batch.iter().find(|&&b| b == 0 || (b > crate::batch::MAX_GPU_SLOTS && device != DeviceKind::Cpu)) {
        return Err(format!("--batch: {b} sequences (1 to {} on a GPU)", crate::batch::MAX_GPU_SLOTS));
    }
    let (name, cfg, weights) = crate::bench::source(model, synthetic)?;
    let rows = crate::bench_batch::bench_batch(&cfg, weights, device, &o.batch, o.prompt, o.gen, o.runs, o.profile)?;
    if json {
        println!("{}", serde_json::json!({"model": name, "device": device_name(device), "batch": rows}));
    } else {
        println!("{name} on {}: a batch's decode step", device_name(device));
        println!("| sequences | rows | ms per step | tok/s |");
        println!("|---:|---:|---:|---:|");
        for r in &rows {
            println!("| {} | {} | {:.2} | {:.1} |", r["sequences"], r["rows"], r["step_ms_median"].as_f64().unwrap_or(0.0), r["tok_s"].as_f64().unwrap_or(0.0));
        }
        if let Some(k) = rows.first().and_then(|r| r["matmul_kernels"].as_array()) {
            let k: Vec<&str> = k.iter().filter_map(|v| v.as_str()).collect();
            println!("\nmatmuls of a step: {}", k.join(", "));
        }
        if o.profile {
            for r in &rows {
                if let Some(ops) = r["gpu_profile_by_op"].as_array() {
                    println!("\nprofile of a step of {} sequences ({:.3} ms):", r["sequences"], r["gpu_profile_total_ms"].as_f64().unwrap_or(0.0));
                    for op in ops {
                        println!("  {:>9.3} ms  {:>4}x  {}", op["ms"].as_f64().unwrap_or(0.0), op["dispatches"], op["op"].as_str().unwrap_or(""));
                    }
                }
            }
        }
    }
    Ok(())
}
