//! Tensor naming: tower tensors to ignore, the text-model prefix, and the
//! canonical names of Gemma 4 MoE expert stacks.

/// Prefixes of vision/audio tower tensors (mlx-vlm conversions, HF archives).
const TOWERS: [&str; 6] = ["vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.", "vision_embedder."];

/// Whether `name` belongs to a vision/audio tower (ignored by a text engine).
pub fn is_tower(name: &str) -> bool {
    // HF archives put the towers under `model.`; mlx-vlm at top level.
    let n = name.strip_prefix("model.").unwrap_or(name);
    TOWERS.iter().any(|t| n.starts_with(t))
}

/// Text-model prefixes, most specific first.
pub const KNOWN_PREFIXES: [&str; 3] = ["language_model.model.", "model.language_model.", "model."];

/// Detects the text-model prefix from the names of the tensors: the prefix of
/// `*embed_tokens.weight` (outside the towers). `preferred` (the model type's
/// default) wins when several candidates exist. Returns `None` if there is none.
pub fn detect_prefix<'a>(names: impl Iterator<Item = &'a str>, preferred: &str) -> Option<String> {
    let mut cands: Vec<String> = names
        .filter(|n| !is_tower(n))
        .filter_map(|n| n.strip_suffix("embed_tokens.weight"))
        .filter(|p| p.is_empty() || p.ends_with('.'))
        .map(str::to_string)
        .collect();
    cands.sort();
    cands.dedup();
    if cands.iter().any(|c| c == preferred) {
        return Some(preferred.to_string());
    }
    // Prefer the known layouts, then the shortest.
    cands.sort_by_key(|c| (KNOWN_PREFIXES.iter().position(|k| k == c).unwrap_or(usize::MAX), c.len()));
    cands.into_iter().next()
}

/// Which part of a stored tensor a canonical tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Whole,
    /// One half along axis -2 of a fused `gate_up_proj` `[E, 2*Im, C]`:
    /// `second == false` is the gate (first `Im` rows), `true` the up projection.
    Half { second: bool },
    /// The transpose of a stored 2-D float tensor (`[in, out]` projections read as `[out, in]`).
    Transposed,
}

/// Canonical name(s) of a stored tensor. MoE expert stacks are accepted as
/// `experts.switch_glu.{gate,up,down}_proj.*` (MLX), flat
/// `experts.{gate,up,down}_proj[.*]`, and Hugging Face's fused
/// `experts.gate_up_proj` + `experts.down_proj` (bare parameters); all map to
/// `experts.switch_glu.*`.
pub fn canonical(name: &str) -> Vec<(String, Part)> {
    let whole = |n: String| vec![(n, Part::Whole)];
    let Some((head, tail)) = name.split_once(".experts.") else {
        return whole(name.to_string());
    };
    if tail.starts_with("switch_glu.") {
        return whole(name.to_string());
    }
    let (proj, suffix) = match tail.split_once('.') {
        Some((p, s)) => (p, s),
        None => (tail, "weight"), // HF: bare parameter
    };
    let sw = |p: &str| format!("{head}.experts.switch_glu.{p}.{suffix}");
    match proj {
        "gate_proj" | "up_proj" | "down_proj" => whole(sw(proj)),
        "gate_up_proj" if suffix == "global_scale" => {
            vec![(sw("gate_proj"), Part::Whole), (sw("up_proj"), Part::Whole)]
        }
        "gate_up_proj" => vec![(sw("gate_proj"), Part::Half { second: false }), (sw("up_proj"), Part::Half { second: true })],
        _ => whole(name.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_names() {
        let p = "language_model.model.layers.0.experts.";
        assert_eq!(canonical(&format!("{p}switch_glu.up_proj.scales")), vec![(format!("{p}switch_glu.up_proj.scales"), Part::Whole)]);
        assert_eq!(canonical(&format!("{p}down_proj.weight")), vec![(format!("{p}switch_glu.down_proj.weight"), Part::Whole)]);
        assert_eq!(canonical(&format!("{p}down_proj")), vec![(format!("{p}switch_glu.down_proj.weight"), Part::Whole)]);
        let f = canonical(&format!("{p}gate_up_proj"));
        assert_eq!(f[0], (format!("{p}switch_glu.gate_proj.weight"), Part::Half { second: false }));
        assert_eq!(f[1], (format!("{p}switch_glu.up_proj.weight"), Part::Half { second: true }));
    }

    #[test]
    fn prefixes_and_towers() {
        let names = ["vision_tower.embed_tokens.weight", "language_model.model.embed_tokens.weight", "language_model.model.embed_tokens_per_layer.weight"];
        assert_eq!(detect_prefix(names.iter().copied(), "model.").as_deref(), Some("language_model.model."));
        assert!(is_tower("model.audio_tower.x.weight") && is_tower("embed_vision.embedding_projection.weight"));
        assert!(!is_tower("model.layers.0.mlp.up_proj.weight"));
    }
}
