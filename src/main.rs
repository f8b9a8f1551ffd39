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
    /// Embedding + layers, then the head.
    Two,
    /// One phase per layer.
    PerLayer,
    /// The whole step in one phase (what decode steps run).
    One,
}

#[derive(Args, Clone)]
struct RunArgs {
    /// Model directory (MLX checkpoint).
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// vulkan | metal | dx12 | gl | cpu (default: MARKBASE_BACKEND, else the platform's best GPU).
    #[arg(long)]
    backend: Option<String>,
    /// KV-cache length.
    #[arg(long, default_value_t = 4096)]
    max_context: usize,
    /// Debug numerics: one submission per node, every output read back; stops at the
    /// first node producing NaN or Inf and names it (dump id, op, weights).
    #[arg(long)]
    check_nan: bool,
}

#[derive(Args, Clone)]
struct SampleArgs {
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
    temp: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
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
        #[arg(long, value_enum, default_value = "two")]
        phases: Phases,
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
        #[arg(short = 'p', long)]
        prompt: String,
        /// Wrap the prompt in the checkpoint's chat template.
        #[arg(long)]
        chat: bool,
        #[command(flatten)]
        sample: SampleArgs,
    },
    /// Interactive chat.
    Chat {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        sample: SampleArgs,
    },
    /// Benchmark prefill and decode on one or every backend.
    Bench {
        /// Model directory (MLX checkpoint).
        #[arg(short = 'm', long = "model")]
        model: Option<PathBuf>,
        /// A synthetic model in real shapes with random 4-bit weights (gemma3-270m, gemma3-1b,
        /// gemma3-12b, gemma4-e2b, gemma4-e4b, gemma4-26b-a4b, gemma4-31b).
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
        /// Bandwidth to report the fraction of, in bytes/s.
        #[arg(long, default_value_t = 4.3e12)]
        bandwidth: f64,
        /// Also a per-op GPU profile of one decode step.
        #[arg(long)]
        profile: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write the f32 logits of every position of a token sequence as .npy.
    Logits {
        #[command(flatten)]
        run: RunArgs,
        /// Comma-separated token ids.
        #[arg(long)]
        tokens: String,
        #[arg(long, default_value = "logits.npy")]
        out: PathBuf,
    },
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
fn out(s: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(s.as_bytes());
}

fn load(run: &RunArgs) -> Result<markbase::model::Model, String> {
    let dev = cli::parse_device(run.backend.as_deref())?;
    cli::load_model(&run.model, dev, run.max_context, run.check_nan)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Graph { model_dir, format, tokens, max_context, phases } => {
            let fmt = match format {
                DumpFormat::Text => cli::DumpFormat::Text,
                DumpFormat::Json => cli::DumpFormat::Json,
                DumpFormat::Dot => cli::DumpFormat::Dot,
            };
            let policy = match phases {
                Phases::Two => markbase::graph::PhasePolicy::EmbedLayersHead,
                Phases::PerLayer => markbase::graph::PhasePolicy::PerLayer,
                Phases::One => markbase::graph::PhasePolicy::Step,
            };
            cli::graph(&model_dir, fmt, tokens, max_context, policy).map(|s| out(&s))
        }
        Cmd::Inspect { model_dir, json } => {
            let (s, ok) = cli::inspect(&model_dir, json);
            out(&s);
            if ok {
                Ok(())
            } else {
                Err("the checkpoint has problems (listed above)".into())
            }
        }
        Cmd::Generate { run, prompt, chat, sample } => {
            load(&run).and_then(|mut m| cli::generate(&mut m, &prompt, chat, &sample.options()))
        }
        Cmd::Chat { run, sample } => load(&run).and_then(|mut m| cli::chat(&mut m, &sample.options())),
        Cmd::Bench { model, synthetic, prompt, gen, runs, backend, bandwidth, profile, json } => {
            cli::bench(model.as_deref(), synthetic.as_deref(), backend.as_deref(), prompt, gen, runs, bandwidth, profile, json)
                .map(|s| out(&s))
        }
        Cmd::Logits { run, tokens, out: path } => cli::parse_tokens(&tokens)
            .and_then(|t| load(&run).and_then(|mut m| cli::logits(&mut m, &t, &path)))
            .map(|s| eprintln!("{s}")),
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
