//! The `markbase` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use markbase::cli;

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
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
fn out(s: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(s.as_bytes());
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
            };
            cli::graph(&model_dir, fmt, tokens, max_context, policy).map(|s| out(&s))
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
