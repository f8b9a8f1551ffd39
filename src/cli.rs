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
