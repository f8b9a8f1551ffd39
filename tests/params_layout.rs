//! Every Rust params struct has the layout of the WGSL struct it is bound to: the same size,
//! the same members in the same order at the same offsets. Each kernel variant is assembled as
//! the runtime builds it and parsed with naga; its uniform bindings are compared with the
//! params structs the launchers write to them.
//!
//! Names are compared case-insensitively (the WGSL uses `T`, `K`, `D` where Rust has `t`, `k`,
//! `d`), a leading `_` marks a member a kernel leaves unread (`_norm_mode`: still `norm_mode`),
//! and padding (`_p0`, `_pad`, ...) is matched by its place only. The few members the WGSL
//! names differently are listed per struct in `ALIASES`.

use std::collections::{BTreeMap, BTreeSet};

use markbase::gpu::kernels::*;

/// A struct layout: name, size in bytes, (member, offset) in order.
#[derive(Clone, Debug)]
struct Layout {
    name: String,
    size: usize,
    fields: Vec<(String, usize)>,
}

fn rust<T: ParamsLayout>() -> Layout {
    Layout { name: T::NAME.into(), size: std::mem::size_of::<T>(), fields: T::fields().into_iter().map(|(n, o)| (n.into(), o)).collect() }
}

/// Rust field and WGSL member names that differ by more than case, per struct.
const ALIASES: &[(&str, &str, &str)] = &[
    ("MatMulParams", "experts", "e"),
    ("MoeGroupParams", "pairs", "p"),
    ("MoeGroupParams", "experts", "e"),
    ("RopeParams", "slots", "s"),
    ("KvWriteParams", "slots", "s"),
    ("AttentionParams", "slots", "s"),
];

fn is_padding(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("_p").map(|r| r.strip_prefix("ad").unwrap_or(r)) else {
        return false;
    };
    rest.chars().all(|c| c.is_ascii_digit())
}

/// The members that are not padding, named in one convention (lower case, no leading `_`,
/// aliases of `strukt` applied when `rust_side`).
fn members(l: &Layout, strukt: &str, rust_side: bool) -> Vec<(String, usize)> {
    l.fields
        .iter()
        .filter(|(n, _)| !is_padding(n))
        .map(|(n, o)| {
            let mut n = n.trim_start_matches('_').to_lowercase();
            if rust_side {
                if let Some(a) = ALIASES.iter().find(|a| a.0 == strukt && a.1 == n) {
                    n = a.2.to_string();
                }
            }
            (n, *o)
        })
        .collect()
}

/// `Err` with the differences when the layouts disagree.
fn compare(rust: &Layout, wgsl: &Layout) -> Result<(), String> {
    let r = members(rust, &rust.name, true);
    let w = members(wgsl, &rust.name, false);
    let mut errs = vec![];
    if rust.size != wgsl.size {
        errs.push(format!("size {} (Rust) vs {} (WGSL)", rust.size, wgsl.size));
    }
    if r != w {
        errs.push(format!("members\n  Rust {r:?}\n  WGSL {w:?}"));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(format!("{} vs WGSL {}: {}", rust.name, wgsl.name, errs.join("; ")))
    }
}

/// The uniform structs of a WGSL module by binding.
fn uniforms(wgsl: &str) -> Result<BTreeMap<u32, Layout>, String> {
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| e.emit_to_string(wgsl))?;
    let mut out = BTreeMap::new();
    for (_, var) in module.global_variables.iter() {
        if var.space != naga::AddressSpace::Uniform {
            continue;
        }
        let binding = var.binding.as_ref().ok_or("a uniform without a binding")?;
        let ty = &module.types[var.ty];
        let naga::TypeInner::Struct { members, span } = &ty.inner else {
            return Err(format!("uniform at binding {} is not a struct", binding.binding));
        };
        let fields = members.iter().map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize)).collect();
        out.insert(binding.binding, Layout { name: ty.name.clone().unwrap_or_default(), size: *span as usize, fields });
    }
    Ok(out)
}

/// The params struct each uniform binding of `spec` is written from.
fn params_of(spec: &KernelSpec) -> Vec<(u32, Layout)> {
    match spec {
        KernelSpec::Gemv { .. }
        | KernelSpec::GemvCat { .. }
        | KernelSpec::Gemm { .. }
        | KernelSpec::GroupedGemm { .. }
        | KernelSpec::GemmF16 { .. }
        | KernelSpec::RowScale { .. } => {
            vec![(0, rust::<MatMulParams>())]
        }
        KernelSpec::Embed { .. } => vec![(0, rust::<EmbedParams>())],
        KernelSpec::RmsNorm { .. } => vec![(0, rust::<RmsNormParams>())],
        KernelSpec::Rope { cache, chunk, .. } => {
            let mut v = vec![(0, rust::<RopeParams>())];
            if *cache && *chunk {
                v.push((5, rust::<KvChunkParams>()));
            }
            v
        }
        KernelSpec::KvWrite { chunk } => {
            let mut v = vec![(0, rust::<KvWriteParams>())];
            if *chunk {
                v.push((4, rust::<KvChunkParams>()));
            }
            v
        }
        KernelSpec::Attention { qrope, chunk, .. } => {
            let mut v = vec![(0, rust::<AttentionParams>())];
            if qrope.is_some() {
                v.push((6, rust::<RopeParams>()));
            }
            if *chunk {
                v.push((11, rust::<KvChunkParams>()));
            }
            v
        }
        KernelSpec::AttnCombine => vec![(0, rust::<AttentionParams>())],
        KernelSpec::GeGlu | KernelSpec::Binary { .. } | KernelSpec::Unary => vec![(0, rust::<ElementwiseParams>())],
        KernelSpec::TopK | KernelSpec::TopKSoftmax { .. } | KernelSpec::WeightedSum => vec![(0, rust::<RoutingParams>())],
        KernelSpec::MoeGroup => vec![(0, rust::<MoeGroupParams>())],
        KernelSpec::Copy => vec![(0, rust::<CopyParams>())],
        KernelSpec::Argmax { .. } | KernelSpec::Sample { .. } => vec![(0, rust::<ArgmaxParams>())],
        KernelSpec::Vision(_) | KernelSpec::VisionAttnF16 { .. } => vec![(0, rust::<VisionParams>())],
        KernelSpec::Audio(_) => vec![(0, rust::<AudioParams>())],
        KernelSpec::Batched { .. } => vec![(0, rust::<BatchedParams>())],
    }
}

/// Every params struct bound to a shader.
fn all_params() -> Vec<Layout> {
    vec![
        rust::<MatMulParams>(),
        rust::<EmbedParams>(),
        rust::<RmsNormParams>(),
        rust::<RopeParams>(),
        rust::<KvWriteParams>(),
        rust::<KvChunkParams>(),
        rust::<AttentionParams>(),
        rust::<ElementwiseParams>(),
        rust::<RoutingParams>(),
        rust::<MoeGroupParams>(),
        rust::<CopyParams>(),
        rust::<ArgmaxParams>(),
        rust::<VisionParams>(),
        rust::<AudioParams>(),
        rust::<BatchedParams>(),
    ]
}

#[test]
fn params_structs_match_their_wgsl_structs() {
    let mut failures = vec![];
    let mut checked = BTreeSet::new();
    let specs = KernelSpec::all_variants();
    for spec in &specs {
        for sg in [false, true] {
            let name = format!("{}{}", spec.name(), if sg { "+sg" } else { "" });
            let u = match uniforms(&spec.source(sg).text()) {
                Ok(u) => u,
                Err(e) => {
                    failures.push(format!("{name}: {e}"));
                    continue;
                }
            };
            let want = params_of(spec);
            let bound: Vec<u32> = u.keys().copied().collect();
            let listed: Vec<u32> = want.iter().map(|w| w.0).collect();
            if bound != listed {
                failures.push(format!("{name}: uniforms at bindings {bound:?}, params structs written to {listed:?}"));
                continue;
            }
            for (b, r) in want {
                if let Err(e) = compare(&r, &u[&b]) {
                    failures.push(format!("{name} binding {b}: {e}"));
                }
                checked.insert(r.name);
            }
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    let all: BTreeSet<String> = all_params().into_iter().map(|l| l.name).collect();
    assert_eq!(checked, all, "params structs not bound by any variant of all_variants()");
}

/// The comparison itself finds a reordered, an added and a removed member, on either side.
#[test]
fn layout_comparison_catches_changes() {
    let src = KernelSpec::RmsNorm { w: None, res: false, scalar: None, steps: 0 }.source(false).text();
    let base = uniforms(&src).unwrap().remove(&0).unwrap();
    let r = rust::<RmsNormParams>();
    compare(&r, &base).expect("the real layouts agree");

    let edit = |from: &str, to: &str| {
        assert!(src.contains(from), "rmsnorm.wgsl no longer has {from:?}");
        uniforms(&src.replacen(from, to, 1)).unwrap().remove(&0).unwrap()
    };
    // WGSL side: two f32/u32 members swapped, a member added, a member removed
    let swapped = edit("    eps: f32,\n    mode: u32,", "    mode: u32,\n    eps: f32,");
    assert!(compare(&r, &swapped).is_err(), "swapped WGSL members not caught");
    let added = edit("    mode: u32,", "    mode: u32,\n    extra: u32,");
    assert!(compare(&r, &added).is_err(), "added WGSL member not caught");
    let removed = edit("    mode: u32,", "");
    assert!(compare(&r, &removed).is_err(), "removed WGSL member not caught");

    // Rust side: the same changes to the field table
    let mut swapped = r.clone();
    swapped.fields.swap(2, 3);
    let (a, b) = (swapped.fields[2].1, swapped.fields[3].1);
    swapped.fields[2].1 = b;
    swapped.fields[3].1 = a;
    assert!(compare(&swapped, &base).is_err(), "swapped Rust fields not caught");
    let mut added = r.clone();
    added.fields.push(("extra".into(), 16));
    added.size = 20;
    assert!(compare(&added, &base).is_err(), "added Rust field not caught");
    let mut removed = r.clone();
    removed.fields.pop();
    assert!(compare(&removed, &base).is_err(), "removed Rust field not caught");

    // padding replaced by a member
    let cp = KernelSpec::Copy.source(false).text();
    let copy = uniforms(&cp.replacen("_p0: u32", "extra: u32", 1)).unwrap().remove(&0).unwrap();
    assert!(compare(&rust::<CopyParams>(), &copy).is_err(), "padding turned member not caught");
}
