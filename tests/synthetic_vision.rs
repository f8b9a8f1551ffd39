//! The synthetic vision shapes of `bench` against the real configs (Gemma 3 4B's SigLIP
//! So400m/14, Gemma 4 E2B's ViT), their parameter counts and the encode FLOPs the bench counts.

use markbase::bench_vision::tower_flops;
use markbase::vision::processor::tower_grid as grid;
use markbase::graph::builder::WeightResolver;
use markbase::graph::tower::{build_gemma4_tower, build_siglip_tower};
use markbase::graph::vision::{tower_params, TowerKind, VisionConfig};
use markbase::graph::{FloatType, WeightFormat};

struct Bf16;

impl WeightResolver for Bf16 {
    fn format(&self, _: &str, _: &[usize], _: bool) -> WeightFormat {
        WeightFormat::Float { dtype: FloatType::Bf16 }
    }
}

fn vision(name: &str) -> VisionConfig {
    markbase::synthetic::vision_config(name).unwrap().unwrap_or_else(|| panic!("{name} has no tower"))
}

fn params(vc: &VisionConfig) -> f64 {
    tower_params(vc).iter().map(|p| p.shape.iter().product::<usize>() as f64).sum()
}

#[test]
fn gemma3_4b_vision_is_siglip_so400m_at_896() {
    let vc = vision("gemma3-4b-vision");
    let text = markbase::synthetic::config("gemma3-4b-vision").unwrap();
    assert_eq!((text.hidden_size, text.num_layers, text.intermediate[0], text.num_heads, text.num_kv_heads, text.head_dim), (2560, 34, 10240, 8, 4, 256));
    assert_eq!((text.sliding_window, text.vocab_size), (1024, 262208));
    let got = (vc.kind, vc.hidden, vc.intermediate, vc.layers, vc.heads, vc.head_dim, vc.patch, vc.image_size, vc.pool, vc.tokens_per_image, vc.text_hidden);
    assert_eq!(got, (TowerKind::Siglip, 1152, 4304, 27, 16, 72, 14, 896, 4, 256, 2560));
    assert_eq!((vc.image_token, vc.boi_token, vc.eoi_token, vc.eps), (262144, 255999, 256000, 1e-6));
    assert_eq!(grid(&vc, 256).unwrap(), (64, 64));
    // about 417 M parameters, about 5.4 TFLOP an image
    let p = params(&vc);
    assert!((p / 417e6 - 1.0).abs() < 0.02, "{p}");
    let f = tower_flops(&build_siglip_tower(&vc, &Bf16).unwrap());
    assert!((f / 5.4e12 - 1.0).abs() < 0.02, "{f}");
}

#[test]
fn gemma4_e2b_vision_is_the_16_layer_vit() {
    let vc = vision("gemma4-e2b-vision");
    assert_eq!(markbase::synthetic::config("gemma4-e2b-vision").unwrap().hidden_size, 1536);
    let got = (vc.kind, vc.hidden, vc.intermediate, vc.layers, vc.heads, vc.head_dim, vc.patch, vc.pool, vc.position_table, vc.text_hidden);
    assert_eq!(got, (TowerKind::Gemma4Vit, 768, 3072, 16, 12, 64, 16, 3, 10240, 1536));
    assert!(vc.clipped && !vc.standardize && vc.rope_theta == 100.0 && vc.eps == 1e-6 && vc.default_tokens == 280);
    assert_eq!((vc.image_token, vc.boi_token, vc.eoi_token), (258880, 255999, 258882));
    // the budgets' grids: every patch pools into a soft token
    assert_eq!(grid(&vc, 280).unwrap(), (42, 60));
    assert_eq!(grid(&vc, 1120).unwrap(), (96, 105));
    // about 167 M parameters; about 1.0 TFLOP for a square image of 2,304 patches
    let p = params(&vc);
    assert!((p / 167e6 - 1.0).abs() < 0.02, "{p}");
    let f = tower_flops(&build_gemma4_tower(&vc, &Bf16, 48, 48).unwrap());
    assert!((f / 1.0e12 - 1.0).abs() < 0.05, "{f}");
}

/// The full-size towers' memory on a GPU: weights (bf16) and the buffers of one encode at the
/// largest input the bench runs, far under an 80 GB card beside the 4-bit text model.
#[test]
fn full_size_towers_fit_a_gpu() {
    for (name, tokens, most) in [("gemma3-4b-vision", 256, 4u64 << 30), ("gemma4-e2b-vision", 1120, 4 << 30)] {
        let vc = vision(name);
        let (rows, cols) = grid(&vc, tokens).unwrap();
        let g = match vc.kind {
            TowerKind::Siglip => build_siglip_tower(&vc, &Bf16).unwrap(),
            TowerKind::Gemma4Vit => build_gemma4_tower(&vc, &Bf16, rows, cols).unwrap(),
        };
        let weights: u64 = tower_params(&vc).iter().map(|p| 2 * p.shape.iter().product::<usize>() as u64).sum();
        let n = markbase::memory::TowerNeeds::of(name, g, weights).unwrap();
        eprintln!("{name}: weights {}, buffers {} (largest {})", markbase::memory::human(n.weight_bytes), markbase::memory::human(n.pool_bytes), markbase::memory::human(n.largest_pool));
        assert!(n.bytes() < most, "{name}: {n:?}");
    }
}
