//! The `markbase` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use markbase::cli;
use markbase::model::SampleParams;

#[derive(Parser)]
#[command(name = "markbase", version, about = "Gemma inference on MLX checkpoints through wgpu")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum DumpFormat {
    Text,
    Json,
    Dot,
}

#[derive(Clone, Copy, ValueEnum)]
enum Phases {
    /// What the runtime runs: one phase for a decode step, two for a prefill.
    Auto,
    /// Embedding + layers, then the head (what prefills run).
    Two,
    /// One phase per layer.
    PerLayer,
    /// The whole step in one phase (what decode steps run).
    One,
}

#[derive(Args, Clone)]
struct FuseArgs {
    /// Turn fusion rules off, to bisect a numerical bug: all of them, or a comma-separated
    /// list (`--no-fuse=norm_add,geglu`) of norm_rope, norm_add, norm_matmul, kv_write,
    /// attention_rope, geglu, kv_append.
    #[arg(long, value_name = "RULES", num_args = 0..=1, require_equals = true, default_missing_value = "all")]
    no_fuse: Option<String>,
    /// Prefill GEMMs and the vision towers' attention in f32 on the shader cores, not in f16
    /// tiles on cooperative matrices (tensor cores) where the adapter has them (the same as
    /// MARKBASE_COOP=0).
    #[arg(long)]
    no_coop: bool,
    /// A batch's decode steps (`serve`, `bench --batch`) multiply on the f16 GEMM with K in parts
    /// (tensor cores) instead of the several-token GEMV: faster steps with many sequences,
    /// slower with few (the same as MARKBASE_ROW_GEMM=f16).
    #[arg(long)]
    batch_f16: bool,
}

impl FuseArgs {
    /// The fusion rules left on (all without the flag); `--no-coop` takes effect here, for the
    /// devices opened after it.
    fn options(&self) -> Result<markbase::graph::FuseOptions, String> {
        if self.no_coop {
            std::env::set_var("MARKBASE_COOP", "0");
        }
        if self.batch_f16 {
            std::env::set_var("MARKBASE_ROW_GEMM", "f16");
        }
        self.no_fuse.as_deref().map_or(Ok(markbase::graph::FuseOptions::all()), |rules| {
            markbase::graph::FuseOptions::without(rules).map_err(|e| format!("--no-fuse: {e}"))
        })
    }
}

#[derive(Args, Clone)]
struct RunArgs {
    /// Model directory (MLX checkpoint).
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// vulkan | metal | dx12 | gl | cpu (default: MARKBASE_BACKEND, else the platform's best GPU).
    #[arg(long)]
    backend: Option<String>,
    /// KV-cache length in tokens (default: the model's positions, at most 4096).
    #[arg(long)]
    max_context: Option<usize>,
    /// Debug numerics: one submission per node, every output read back; stops at the
    /// first node producing NaN or Inf and names it (dump id, op, weights).
    #[arg(long)]
    check_nan: bool,
    #[command(flatten)]
    fuse: FuseArgs,
}

#[derive(Args, Clone)]
struct SampleArgs {
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.0, allow_negative_numbers = true)]
    temp: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u32,
}

impl SampleArgs {
    fn options(&self) -> cli::GenOptions {
        cli::GenOptions {
            max_tokens: self.max_tokens,
            sampling: SampleParams {
                temperature: self.temp,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repetition_penalty,
                seed: self.seed,
            },
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the compiled op graph of a model directory (config.json, weights optional).
    Graph {
        model_dir: PathBuf,
        #[arg(long, value_enum, default_value = "text")]
        format: DumpFormat,
        /// Tokens per step: 1 = a decode step, N > 1 = a prefill of N tokens.
        #[arg(long, default_value_t = 1)]
        tokens: usize,
        /// KV-cache length of full-attention layers.
        #[arg(long, default_value_t = 4096)]
        max_context: usize,
        #[arg(long, value_enum, default_value = "auto")]
        phases: Phases,
        #[command(flatten)]
        fuse: FuseArgs,
    },
    /// Describe a checkpoint: family, layers, parameters, quantization, memory, problems.
    Inspect {
        model_dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Generate text from a prompt (streamed).
    Generate {
        #[command(flatten)]
        run: RunArgs,
        /// The prompt; `-` reads it from stdin.
        #[arg(short = 'p', long)]
        prompt: Option<String>,
        /// Read the prompt from a file.
        #[arg(short = 'f', long = "file")]
        file: Option<PathBuf>,
        /// Wrap the prompt in the checkpoint's chat template.
        #[arg(long)]
        chat: bool,
        /// An image (PNG, JPEG, WebP) before the prompt's text; repeatable, in order (a model
        /// with a vision tower).
        #[arg(long = "image")]
        images: Vec<PathBuf>,
        /// An audio clip (WAV, FLAC, MP3, OGG; at most 30 s) after the prompt's text;
        /// repeatable, in order (a model with an audio tower: Gemma 4 E2B/E4B).
        #[arg(long = "audio")]
        audio: Vec<PathBuf>,
        #[command(flatten)]
        sample: SampleArgs,
    },
    /// Interactive chat.
    Chat {
        #[command(flatten)]
        run: RunArgs,
        /// A system prompt before the first turn.
        #[arg(long)]
        system: Option<String>,
        /// An image for the first turn; repeatable (`/image PATH` adds one to the next turn).
        #[arg(long = "image")]
        images: Vec<PathBuf>,
        /// An audio clip for the first turn; repeatable (`/audio PATH` adds one to the next turn).
        #[arg(long = "audio")]
        audio: Vec<PathBuf>,
        #[command(flatten)]
        sample: SampleArgs,
    },
    /// Benchmark prefill and decode on one or every backend.
    Bench {
        /// Model directory (MLX checkpoint).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// A synthetic model in real shapes with random 4-bit weights (gemma3-270m, gemma3-1b,
        /// gemma3-4b, gemma3-12b, gemma4-e2b, gemma4-e4b, gemma4-26b-a4b, gemma4-31b; with a
        /// bf16 vision tower: gemma3-4b-vision, gemma4-e2b-vision).
        #[arg(long)]
        synthetic: Option<String>,
        #[arg(long, default_value_t = 512)]
        prompt: usize,
        #[arg(long, default_value_t = 128)]
        gen: usize,
        /// Timed runs (median reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// vulkan | metal | dx12 | gl | cpu | all.
        #[arg(long)]
        backend: Option<String>,
        /// Bandwidth to report the fraction of, in bytes/s (default: the adapter's, where known).
        #[arg(long)]
        bandwidth: Option<f64>,
        /// Also a per-op GPU profile of one decode step (GPU backends).
        #[arg(long)]
        profile: bool,
        #[arg(long)]
        json: bool,
        /// Models with a vision tower: also encode one image of each of these soft-token
        /// counts (Gemma 4's budgets; default 280,1120; SigLIP makes 256) and time the first
        /// token of it and 32 text tokens.
        #[arg(long = "image-tokens", value_delimiter = ',')]
        image_tokens: Vec<usize>,
        /// Instead: time the decode step of a batch of this many sequences (a row each, as
        /// `serve` runs them; comma-separated counts, each up to 64 on a GPU), after a prompt of
        /// up to 64 tokens each.
        #[arg(long = "batch", value_delimiter = ',')]
        batch: Vec<usize>,
        #[command(flatten)]
        fuse: FuseArgs,
    },
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(markbase::server::ServeArgs),
    /// Write the f32 logits of every position of a token sequence as .npy.
    Logits {
        #[command(flatten)]
        run: RunArgs,
        /// Comma-separated token ids.
        #[arg(long)]
        tokens: String,
        /// The .npy file to write (default: logits.npy, unless --top is given).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Only the last position.
        #[arg(long)]
        last: bool,
        /// Print the K largest ids and logits of each position (`position token id:logit ...`).
        #[arg(long, value_name = "K")]
        top: Option<usize>,
        /// An image whose soft tokens fill the next run of image placeholders in --tokens (which
        /// hold each image's run, in order, as the HF processor writes them); repeatable.
        #[arg(long = "image")]
        images: Vec<PathBuf>,
        /// An audio clip whose soft tokens fill the next run of audio placeholders in
        /// --tokens; repeatable.
        #[arg(long = "audio")]
        audio: Vec<PathBuf>,
    },
    /// Write the soft-token embeddings of images and audio clips (after the projector,
    /// `[N, D_text]` f32) as .npy.
    Encode {
        /// Model directory (MLX checkpoint with a vision or audio tower).
        #[arg(short = 'm', long = "model")]
        model: PathBuf,
        /// PNG, JPEG or WebP image; repeatable (the rows of each follow the previous ones).
        #[arg(long = "image", required_unless_present = "audio")]
        images: Vec<PathBuf>,
        /// WAV, FLAC, MP3 or OGG clip of at most 30 s; repeatable (its rows follow the images').
        #[arg(long = "audio")]
        audio: Vec<PathBuf>,
        /// The .npy file to write.
        #[arg(long)]
        out: PathBuf,
        /// Gemma 4: soft tokens per image (70, 140, 280, 560 or 1120; default: the checkpoint's).
        #[arg(long)]
        max_soft_tokens: Option<usize>,
        /// vulkan | metal | dx12 | gl | cpu (default: MARKBASE_BACKEND, else the platform's best GPU).
        #[arg(long)]
        backend: Option<String>,
        /// Check every value the GPU computes for NaN.
        #[arg(long)]
        check_nan: bool,
    },
    /// Write the log-mel features of an audio clip (what the audio tower takes) as .npy.
    Features {
        /// WAV, FLAC, MP3 or OGG file (any rate, mono or stereo).
        #[arg(long)]
        audio: PathBuf,
        /// The .npy file to write, [frames, mel bins] f32 (pieces of a split clip: OUT.1.npy, ...).
        #[arg(long)]
        out: PathBuf,
        /// Checkpoint whose processor config gives the settings (else --family's defaults).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// gemma4 | gemma3n, when no checkpoint is given.
        #[arg(long, default_value = "gemma4")]
        family: String,
        /// Clips over 30 s: refuse | split | truncate.
        #[arg(long, default_value = "refuse")]
        long: String,
    },
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
fn out(s: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(s.as_bytes());
}

fn load(run: &RunArgs, need_tokenizer: bool) -> Result<markbase::model::Model, String> {
    let device = cli::parse_device(run.backend.as_deref())?;
    let o = cli::LoadOptions {
        device,
        cpu_if_software_gpu: cli::device_is_default(run.backend.as_deref()),
        max_context: run.max_context,
        check_nan: run.check_nan,
        need_tokenizer,
        fuse: run.fuse.options()?,
    };
    cli::load_model(&run.model, &o)
}

/// Points `XDG_RUNTIME_DIR` at a private directory when it is unset or unusable (not
/// an absolute path to a directory of ours, closed to others), as GPU drivers expect.
#[cfg(unix)]
fn ensure_runtime_dir() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    let usable = |p: &std::path::Path| {
        p.is_absolute()
            && std::fs::metadata(p).is_ok_and(|m| m.is_dir() && uid.map_or(true, |u| m.uid() == u) && m.permissions().mode() & 0o077 == 0)
    };
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|v| usable(std::path::Path::new(&v))) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("markbase-runtime-{}", uid.unwrap_or(0)));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    if usable(&dir) {
        std::env::set_var("XDG_RUNTIME_DIR", &dir);
    }
}

#[cfg(not(unix))]
fn ensure_runtime_dir() {}

fn main() -> ExitCode {
    ensure_runtime_dir();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Graph { model_dir, format, tokens, max_context, phases, fuse } => {
            let fmt = match format {
                DumpFormat::Text => cli::DumpFormat::Text,
                DumpFormat::Json => cli::DumpFormat::Json,
                DumpFormat::Dot => cli::DumpFormat::Dot,
            };
            let policy = match phases {
                Phases::Auto if tokens == 1 => markbase::graph::PhasePolicy::Step,
                Phases::Auto | Phases::Two => markbase::graph::PhasePolicy::EmbedLayersHead,
                Phases::PerLayer => markbase::graph::PhasePolicy::PerLayer,
                Phases::One => markbase::graph::PhasePolicy::Step,
            };
            fuse.options().and_then(|f| cli::graph(&model_dir, fmt, tokens, max_context, policy, &f)).map(|s| out(&s))
        }
        Cmd::Inspect { model_dir, json } => cli::inspect(&model_dir, json).and_then(|(s, ok)| {
            out(&s);
            if ok {
                Ok(())
            } else {
                Err("the checkpoint has problems (listed above)".into())
            }
        }),
        Cmd::Generate { run, prompt, file, chat, images, audio, sample } => {
            let o = sample.options();
            o.sampling
                .validate()
                .and_then(|()| cli::read_prompt(prompt.as_deref(), file.as_deref()))
                .and_then(|text| Ok((text, cli::read_images(&run.model, &images)?, markbase::audio::encode::read_clips(&run.model, &audio)?)))
                .and_then(|(text, imgs, clips)| load(&run, true).and_then(|mut m| cli::generate(&mut m, &text, chat, &imgs, &clips, &o)))
        }
        Cmd::Chat { run, system, images, audio, sample } => {
            let o = sample.options();
            o.sampling
                .validate()
                .and_then(|()| Ok((cli::read_images(&run.model, &images)?, markbase::audio::encode::read_clips(&run.model, &audio)?)))
                .and_then(|(imgs, clips)| load(&run, true).and_then(|mut m| cli::chat(&mut m, &o, system.as_deref(), imgs, clips)))
        }
        Cmd::Bench { model, synthetic, prompt, gen, runs, backend, bandwidth, profile, json, image_tokens, batch, fuse } => fuse.options().and_then(|fuse| {
            let o = markbase::bench::BenchOptions { prompt, gen, runs, bandwidth, profile, fuse, image_tokens, batch };
            cli::bench(model.as_deref(), synthetic.as_deref(), backend.as_deref(), o, json)
        }),
        Cmd::Serve(args) => markbase::server::serve(args),
        Cmd::Logits { run, tokens, out: path, last, top, images, audio } if !images.is_empty() || !audio.is_empty() => (|| {
            let t = cli::parse_tokens(&tokens)?;
            if last || top.is_some() {
                return Err("with --image or --audio, logits writes every position's logits (no --last or --top)".to_string());
            }
            let file = cli::OutFile::check(path.as_deref().unwrap_or(std::path::Path::new("logits.npy")))?;
            let device = cli::parse_device(run.backend.as_deref())?;
            let (logits, vocab) = markbase::vision::encode::logits_with_soft(&run.model, &t, &images, &audio, device, run.check_nan)?;
            file.write_f32(&[t.len(), vocab], &logits)
        })(),
        Cmd::Logits { run, tokens, out: path, last, top, .. } => (|| {
            let t = cli::parse_tokens(&tokens)?;
            if top == Some(0) {
                return Err("--top must be at least 1".to_string());
            }
            let path = path.or_else(|| top.is_none().then(|| PathBuf::from("logits.npy")));
            let file = path.as_deref().map(cli::OutFile::check).transpose()?;
            let mut m = load(&run, false)?;
            let (text, note) = cli::logits(&mut m, &t, file, &cli::LogitsOptions { last, top })?;
            out(&text);
            if !note.is_empty() {
                eprintln!("{note}");
            }
            Ok(())
        })(),
        Cmd::Features { audio, out: path, model, family, long } => {
            markbase::audio::features_command(&audio, &path, model.as_deref(), &family, &long).map(|s| out(&s))
        }
        Cmd::Encode { model, images, audio, out: path, max_soft_tokens, backend, check_nan } => (|| {
            let file = cli::OutFile::check(&path)?;
            let device = cli::parse_device(backend.as_deref())?;
            let (mut rows, mut width) = (vec![], 0);
            if !images.is_empty() {
                let counts;
                (rows, width, counts) = markbase::vision::encode::encode_files(&model, &images, device, max_soft_tokens, check_nan)?;
                eprintln!("soft tokens per image {counts:?}");
            }
            if !audio.is_empty() {
                let (a, w, counts) = markbase::audio::encode::encode_files(&model, &audio, device, check_nan)?;
                eprintln!("soft tokens per clip {counts:?}");
                rows.extend(a);
                width = w;
            }
            let n = rows.len() / width.max(1);
            file.write_f32(&[n, width], &rows)?;
            eprintln!("{}: [{n}, {width}] f32", path.display());
            Ok(())
        })(),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", e.lines().next().unwrap_or("").trim());
            for l in e.lines().skip(1) {
                eprintln!("  {}", l.trim());
            }
            ExitCode::FAILURE
        }
    }
}
