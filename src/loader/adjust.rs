//! Corrections of `config.json` from the tensors actually present: Gemma 4 MoE
//! detection (router / expert stacks) and the vocabulary size.

use markbase_graph::{Family, ModelConfig};

use super::report::{Problem, Severity};

/// The config after looking at the tensors.
#[derive(Clone, Debug)]
pub struct Adjusted {
    pub config: ModelConfig,
    /// Disagreements between config and tensors.
    pub problems: Vec<Problem>,
    /// What was inferred (for `inspect`), e.g. "num_experts = 8 (from the expert tensors)".
    pub notes: Vec<String>,
}

/// Adjusts `cfg` to the checkpoint. `shape_of(name)` gives the stored shape of a
/// tensor by its canonical full name (expert stacks under `experts.switch_glu.*`).
///
/// * MoE is detected from `layers.N.router.proj` even when the config lacks
///   `enable_moe_block`.
/// * `num_experts` / `moe_intermediate_size` are inferred from the 3-D expert
///   stacks (`[E, Im, H]` gate/up) and the router (`[E, H]`) when the config lacks
///   them, and cross-checked when it has them (a mismatch is an error).
/// * `vocab_size` follows the rows of `embed_tokens` (mlx-lm's wrappers copy a
///   top-level default into the text config; the tensor is the truth).
pub fn adjust_config(cfg: &ModelConfig, prefix: &str, shape_of: &dyn Fn(&str) -> Option<Vec<usize>>) -> Adjusted {
    let mut c = cfg.clone();
    let mut problems = vec![];
    let mut notes = vec![];
    let err = |subject: &str, m: String| Problem { severity: Severity::Error, layer: None, subject: subject.to_string(), tensor: None, message: m };

    // Vocabulary from the embedding (quantized or not, rows are dim 0).
    if let Some(s) = shape_of(&format!("{prefix}embed_tokens.weight")) {
        if s.len() == 2 && s[0] != c.vocab_size && s[0] > 0 {
            problems.push(Problem {
                severity: Severity::Warning,
                ..err("config.json:", format!("vocab_size is {} but embed_tokens has {} rows; using {}", c.vocab_size, s[0], s[0]))
            });
            c.vocab_size = s[0];
        }
    }

    if c.family != Family::Gemma4 {
        return Adjusted { config: c, problems, notes };
    }
    let lp = |i: usize, rel: &str| format!("{prefix}layers.{i}.{rel}");
    let mut router_layers = vec![];
    // (what, layer, E) and (what, layer, Im) observations.
    let mut experts: Vec<(String, usize, usize)> = vec![];
    let mut inter: Vec<(String, usize, usize)> = vec![];
    for i in 0..c.num_layers {
        if let Some(s) = shape_of(&lp(i, "router.proj.weight")) {
            router_layers.push(i);
            if s.len() == 2 {
                experts.push(("router.proj".into(), i, s[0]));
            }
        }
        if let Some(s) = shape_of(&lp(i, "router.per_expert_scale")) {
            if s.len() == 1 {
                experts.push(("router.per_expert_scale".into(), i, s[0]));
            }
        }
        for p in ["gate_proj", "up_proj", "down_proj"] {
            if let Some(s) = shape_of(&lp(i, &format!("experts.switch_glu.{p}.weight"))) {
                if s.len() == 3 {
                    experts.push((format!("experts.switch_glu.{p}"), i, s[0]));
                    if p != "down_proj" {
                        inter.push((format!("experts.switch_glu.{p}"), i, s[1]));
                    }
                }
            }
        }
    }
    if router_layers.is_empty() && experts.is_empty() {
        return Adjusted { config: c, problems, notes };
    }
    if !c.enable_moe_block {
        c.enable_moe_block = true;
        notes.push(format!("enable_moe_block = true (router.proj found in {} layers)", router_layers.len()));
    }
    // Experts: all tensors must agree, and with the config if it says.
    let (e_val, e_problems) = agree("number of experts", &experts, c.num_experts, "num_experts");
    problems.extend(e_problems);
    if c.num_experts.is_none() {
        if let Some(e) = e_val {
            c.num_experts = Some(e);
            notes.push(format!("num_experts = {e} (from the expert tensors)"));
        }
    }
    let (i_val, i_problems) = agree("moe intermediate size", &inter, c.moe_intermediate_size, "moe_intermediate_size");
    problems.extend(i_problems);
    if c.moe_intermediate_size.is_none() {
        if let Some(i) = i_val {
            c.moe_intermediate_size = Some(i);
            notes.push(format!("moe_intermediate_size = {i} (from the expert tensors)"));
        }
    }
    if c.top_k_experts.is_none() {
        problems.push(err("config.json:", "top_k_experts is missing (MoE checkpoint; it cannot be inferred from the tensors)".into()));
    } else if let (Some(k), Some(e)) = (c.top_k_experts, c.num_experts) {
        if k == 0 || k > e {
            problems.push(err("config.json:", format!("top_k_experts = {k} is not in 1..={e}")));
        }
    }
    Adjusted { config: c, problems, notes }
}

/// The value all observations agree on; problems for those that do not and for a
/// config value that differs.
fn agree(what: &str, obs: &[(String, usize, usize)], cfg: Option<usize>, field: &str) -> (Option<usize>, Vec<Problem>) {
    let mut problems = vec![];
    // Majority value of the tensors.
    let mut counts: Vec<(usize, usize)> = vec![];
    for &(_, _, v) in obs {
        match counts.iter_mut().find(|(x, _)| *x == v) {
            Some(c) => c.1 += 1,
            None => counts.push((v, 1)),
        }
    }
    counts.sort_by_key(|&(v, n)| (std::cmp::Reverse(n), v));
    let majority = counts.first().map(|&(v, _)| v);
    let reference = cfg.or(majority);
    if let Some(r) = reference {
        for (name, layer, v) in obs {
            if *v != r {
                let src = if cfg.is_some() { format!("config {field} = {r}") } else { format!("{r} in most tensors") };
                problems.push(Problem {
                    severity: Severity::Error,
                    layer: Some(*layer),
                    subject: name.clone(),
                    tensor: None,
                    message: format!("implies {what} {v}, but {src}"),
                });
            }
        }
    }
    (majority, problems)
}
