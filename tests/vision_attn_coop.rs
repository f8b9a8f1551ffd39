//! The vision towers' attention on f16 tiles (`vision_attn_coop.wgsl`) against the CPU
//! reference: its FMA twin on every adapter with f16 (CI's software rasterizer included), and
//! the cooperative-matrix kernel itself where the adapter has 16 x 16 x 16 f16 -> f32
//! cooperative matrices (whatever the selection's default), in three variants: both products on
//! cooperative matrices, S = Q K^T only, P V only (the other on the twin's FMA loop), each
//! case's errors on one line, so that one run tells which product is wrong. Query and key counts off the tiles (1 .. 257), head dims 13 .. 128
//! (padded to multiples of 16; without vec4 loads where D % 4 != 0), grouped kv heads, masks
//! (none, partial, a whole key tile, all but one key, every key), and activations far past
//! f16's range (queries 1e4 against keys 1e-4, values 1e5, huge scores).
//!
//! Errors are measured against the attention in f64, as max |gpu - exact| / max |exact| over a
//! case's outputs. Bound, with the default split (queries, keys, weights and values as hi + lo
//! f16 pairs: scores of about 22 significant bits): 2e-5 plus 4x the f32 CPU reference's own
//! error (large scores: an f32 dot product is off by about 2^-24 sqrt(D) of sum |q k|, the split's
//! by 2 to 3 times that); fully masked queries must give exact zeros. Every split's error is
//! printed (`--nocapture`), and the f32 CPU's and the f32 tiled kernel's on the same data.
//! The tests FAIL (never skip) when no adapter is found.

#[path = "common/f16_gemm.rs"]
mod f16_gemm;
#[path = "common/kernel_data.rs"]
mod kernel_data;
#[path = "common/naga_smem.rs"]
mod naga_smem;

use kernel_data::{rng, run};
use markbase::cpu::vision_ops::full_attention;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{KernelOptions, KernelSpec, Kernels, VisionKernel, VisionParams};
use markbase::gpu::ops::gemm_f16::CoopMode;
use markbase::gpu::ops::vision_coop;
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::Mutex;

/// Held while `MARKBASE_VISION_ATTN_COOP` (read when a cooperative-matrix kernel is built) is set
/// by a test, and by the tests that build those kernels' sources.
static PRODUCTS: Mutex<()> = Mutex::new(());

/// The cooperative-matrix variants: (label, `MARKBASE_VISION_ATTN_COOP`).
const COOP_VARIANTS: [(&str, &str); 3] = [("coop", "both"), ("coop qk", "qk"), ("coop pv", "pv")];

/// The default split's bound (of max|out|), besides 4x the f32 reference's error.
const BOUND: f32 = 2e-5;

/// Which keys are valid.
#[derive(Clone, Copy, Debug)]
enum Mask {
    None,
    /// Every 5th key masked.
    Fifth,
    /// Keys 5 .. 45 masked (a whole tile of 32 among them).
    Block,
    /// Only the last key valid.
    LastOnly,
    /// No key valid: zeros.
    All,
}

impl Mask {
    fn words(self, s: usize) -> Option<Vec<u32>> {
        let ok = |i: usize| match self {
            Mask::None => true,
            Mask::Fifth => i % 5 != 0,
            Mask::Block => !(5..45).contains(&i),
            Mask::LastOnly => i + 1 == s,
            Mask::All => false,
        };
        match self {
            Mask::None => None,
            _ => Some((0..s).map(|i| ok(i) as u32).collect()),
        }
    }
}

/// One case: `t` queries of `h` heads, `s` keys of `kvh` heads, head dim `d`; values drawn with
/// magnitudes `amp` (q, k, v), a few of them 8x larger.
#[derive(Clone, Copy, Debug)]
struct Case {
    t: usize,
    s: usize,
    h: usize,
    kvh: usize,
    d: usize,
    mask: Mask,
    amp: (f32, f32, f32),
    /// Positive queries and keys growing with their index: each tile's largest score passes the
    /// previous tiles' by far (every tile rescales).
    ramp: bool,
}

fn values(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // roughly normal (sum of uniforms), and an outlier now and then
            let u: f32 = (0..4).map(|_| r.gen_range(-1.0f32..1.0)).sum::<f32>() * 0.87;
            if r.gen_range(0..50) == 0 {
                8.0 * amp * u
            } else {
                amp * u
            }
        })
        .collect()
}

/// The data of a case: q, k, v, valid words, the CPU's output, the same in f64.
struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    valid: Option<Vec<u32>>,
    want: Vec<f32>,
    exact: Vec<f32>,
    scale: f32,
}

/// The attention in f64 (rounded to f32 at the end): the yardstick of the f32 CPU reference and
/// of the kernels (an f32 dot product of large scores is itself off by about 2^-24 sqrt(D) of
/// sum |q k|).
fn attention_f64(c: &Case, q: &[f32], k: &[f32], v: &[f32], valid: Option<&[u32]>, scale: f32) -> Vec<f32> {
    let (d, g) = (c.d, c.h / c.kvh);
    let mut out = vec![0f32; c.t * c.h * d];
    for t in 0..c.t {
        for h in 0..c.h {
            let qv = &q[(t * c.h + h) * d..][..d];
            let sc: Vec<Option<f64>> = (0..c.s)
                .map(|s| {
                    let kv = &k[(s * c.kvh + h / g) * d..][..d];
                    valid.is_none_or(|m| m[s] != 0).then(|| qv.iter().zip(kv).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64)
                })
                .collect();
            let mx = sc.iter().flatten().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let w: Vec<f64> = sc.iter().map(|x| x.map_or(0.0, |x| (x - mx).exp())).collect();
            let sum: f64 = w.iter().sum();
            for e in 0..d {
                let o: f64 = (0..c.s).map(|s| w[s] * v[(s * c.kvh + h / g) * d + e] as f64).sum();
                out[(t * c.h + h) * d + e] = (o / sum) as f32;
            }
        }
    }
    out
}

fn data(r: &mut StdRng, c: &Case) -> Data {
    let mut q = values(r, c.t * c.h * c.d, c.amp.0);
    let mut k = values(r, c.s * c.kvh * c.d, c.amp.1);
    if c.ramp {
        q.iter_mut().for_each(|x| *x = x.abs());
        for (i, x) in k.iter_mut().enumerate() {
            *x = x.abs() * (1.0 + (i / (c.kvh * c.d)) as f32 / 4.0);
        }
    }
    let v = values(r, c.s * c.kvh * c.d, c.amp.2);
    let valid = c.mask.words(c.s);
    let scale = 1.0 / (c.d as f32).sqrt();
    let mut want = vec![0f32; c.t * c.h * c.d];
    full_attention(&q, &k, &v, valid.as_deref(), c.h, c.kvh, c.d, scale, &mut want);
    let exact = attention_f64(c, &q, &k, &v, valid.as_deref(), scale);
    Data { q, k, v, valid, want, exact, scale }
}

/// Runs `spec` on a case's data (`groups` workgroups); the output.
fn run_spec(gpu: &Gpu, kernels: &Kernels, spec: KernelSpec, c: &Case, x: &Data, groups: [u32; 3]) -> Vec<f32> {
    let kernel = kernels.get(spec).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
    let p = VisionParams { n: (c.t * c.h) as u32, heads: c.h as u32, kv: c.kvh as u32, s: c.s as u32, d: c.d as u32, f: x.scale, ..Default::default() };
    let pb = gpu.uniform("p", &p);
    let (qb, kb, vb) = (gpu.upload_f32("q", &x.q), gpu.upload_f32("k", &x.k), gpu.upload_f32("v", &x.v));
    let n = c.t * c.h * c.d;
    let out = gpu.storage("out", (n * 4) as u64);
    gpu.queue.write_buffer(&out, 0, &vec![0xffu8; n * 4]);
    let mb = x.valid.as_ref().map(|m| gpu.upload_u32("valid", m));
    let mut binds = vec![(0, &pb), (1, &qb), (2, &out), (3, &kb), (4, &vb)];
    if let Some(m) = &mb {
        binds.push((5, m));
    }
    let bg = kernel.bind_buffers(&gpu.device, &binds);
    run(gpu, |pass| kernel.dispatch(pass, &bg, groups));
    gpu.read_f32(&out, n).unwrap()
}

/// The largest |got - want| over max|want| (non-finite: infinite), and whether every fully
/// masked output is exactly zero.
fn error(got: &[f32], want: &[f32]) -> f32 {
    let mag = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut worst = 0f32;
    for (g, w) in got.iter().zip(want) {
        let e = (g - w).abs();
        worst = worst.max(if e.is_finite() { e } else { f32::INFINITY });
    }
    if mag > 0.0 {
        worst / mag
    } else {
        worst
    }
}

fn cases() -> Vec<Case> {
    let mut v = vec![];
    let real = (1.0, 1.0, 1.0);
    // awkward key and query counts at SigLIP's head dim, masked and not
    for (t, s, mask) in [(1, 1, Mask::None), (17, 17, Mask::Fifth), (33, 33, Mask::None), (100, 100, Mask::Block), (257, 257, Mask::Fifth), (70, 33, Mask::None), (5, 257, Mask::LastOnly)] {
        v.push(Case { t, s, h: 2, kvh: 2, d: 72, mask, amp: real, ramp: false });
    }
    // head dims (13, 40: no vec4 loads / a partial block of 16), grouped kv heads
    for (d, h, kvh) in [(16, 2, 1), (64, 4, 2), (80, 3, 1), (128, 2, 2), (13, 3, 1), (40, 2, 2), (100, 2, 1)] {
        v.push(Case { t: 45, s: 77, h, kvh, d, mask: Mask::Fifth, amp: real, ramp: false });
    }
    // every key masked: zeros
    v.push(Case { t: 20, s: 40, h: 2, kvh: 1, d: 72, mask: Mask::All, amp: real, ramp: false });
    // peaked weights; queries and keys far past f16 (moderate scores); huge scores (one key);
    // values past f16; tiny values
    for amp in [(4.0, 4.0, 1.0), (1e4, 1e-4, 1.0), (3e-5, 3e4, 2.0), (1e3, 1e3, 1.0), (1.0, 1.0, 1e5), (1e-3, 1e3, 1e-3)] {
        v.push(Case { t: 66, s: 100, h: 2, kvh: 1, d: 72, mask: Mask::Fifth, amp, ramp: false });
    }
    // the running maximum moving by far at every tile (the accumulators' rescaling)
    v.push(Case { t: 40, s: 130, h: 2, kvh: 2, d: 72, mask: Mask::Fifth, amp: real, ramp: true });
    v.push(Case { t: 33, s: 100, h: 2, kvh: 1, d: 40, mask: Mask::None, amp: (0.3, 0.3, 1.0), ramp: true });
    v
}

/// The kernel sets: (label, kernels, coop, `MARKBASE_VISION_ATTN_COOP`): the twin, and where the
/// adapter has cooperative matrices the three variants of the cooperative-matrix kernel (a
/// pipeline cache each: the variant is read when a kernel is built).
fn kernel_sets(gpu: &Gpu) -> Vec<(&'static str, Kernels, bool, &'static str)> {
    let mut v = vec![];
    for (label, kernels, coop) in f16_gemm::kernels(gpu) {
        if !coop {
            v.push((label, kernels, false, "both"));
            continue;
        }
        for (label, products) in COOP_VARIANTS {
            let opts = KernelOptions { coop: CoopMode::Tensor, ..KernelOptions::for_gpu(gpu) };
            v.push((label, Kernels::new(gpu, opts).unwrap(), true, products));
        }
    }
    v
}

#[test]
fn vision_attention_f16_matches_the_cpu() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    println!("adapter: {}", gpu.info.summary());
    let mut r = rng("vision_attention_f16");
    let _products = PRODUCTS.lock().unwrap_or_else(|e| e.into_inner());
    let sets = kernel_sets(&gpu);
    let limit = gpu.limits().max_compute_workgroup_storage_size;
    let tiled = Kernels::new(&gpu, KernelOptions { coop: CoopMode::Off, ..KernelOptions::for_gpu(&gpu) }).unwrap();
    let maxg = gpu.limits().max_compute_workgroups_per_dimension;
    let mut failures = vec![];
    for c in cases() {
        let x = data(&mut r, &c);
        let mask = x.valid.is_some();
        let what = format!("T={} S={} H={}/{} D={} mask {:?} amp {:?}{}", c.t, c.s, c.h, c.kvh, c.d, c.mask, c.amp, if c.ramp { " ramp" } else { "" });
        let t0 = std::time::Instant::now();
        // the f32 tiled kernel on the same data, for comparison
        let dm = (c.d.div_ceil(4) * 4) as u32;
        let tgroups = [(c.t.div_ceil(32) * c.h) as u32, 1, 1];
        let tg = run_spec(&gpu, &tiled, KernelSpec::Vision(VisionKernel::Attention { mask, dm }), &c, &x, tgroups);
        let mut line = format!("{what}: vs f64: cpu f32 {:.1e}, tiled f32 {:.1e}", error(&x.want, &x.exact), error(&tg, &x.exact));
        for (label, kernels, coop, products) in &sets {
            std::env::set_var("MARKBASE_VISION_ATTN_COOP", products);
            // the twin as selected; the cooperative-matrix kernel whatever the default
            let spec = if *coop { vision_coop::shape_for(limit, true, c.d, mask) } else { vision_coop::spec_for(kernels, c.d, mask) };
            let spec = spec.unwrap_or_else(|| panic!("{label}: no f16 attention for D={}", c.d));
            let KernelSpec::VisionAttnF16 { coop: sc, d16, kt: kt0, v4, pf, .. } = spec else { panic!("{label}: {spec:?}") };
            assert_eq!((sc, d16 as usize, v4), (*coop, c.d.div_ceil(16), c.d % 4 == 0), "{label}: {spec:?}");
            let groups = vision_coop::groups(c.t, c.h, maxg);
            // the chosen tiles, the other tiles; with each split and the other placement of the
            // next tile's loads
            let other = if kt0 == 32 { 16 } else { 32 };
            // (every split at SigLIP's head dim only: each variant is a pipeline to build)
            let mut runs = vec![(kt0, true, true, pf), (other, true, true, pf)];
            if c.d == 72 {
                runs.extend([(kt0, true, false, pf), (kt0, false, true, pf), (kt0, false, false, pf), (kt0, true, true, !pf)]);
            }
            for (i, (kt, hp, hv, pf)) in runs.into_iter().enumerate() {
                if vision_coop::smem_bytes(d16, kt, hp) > limit {
                    continue;
                }
                let spec = KernelSpec::VisionAttnF16 { coop: *coop, mask, d16, kt, hilo_p: hp, hilo_v: hv, v4, pf };
                let got = run_spec(&gpu, kernels, spec, &c, &x, groups);
                let e = error(&got, &x.exact);
                line += &format!(", {label} k{kt} p{} v{}{} {e:.1e}", hp as u8, hv as u8, if pf { " pf" } else { "" });
                if i == 0 {
                    line += &format!(" (vs cpu {:.1e})", error(&got, &x.want));
                }
                if matches!(c.mask, Mask::All) && got.iter().any(|&g| g != 0.0) {
                    failures.push(format!("{what} [{label} k{kt} hilo p {hp} v {hv}]: a query without valid keys must give zeros"));
                }
                let bound = BOUND + 4.0 * error(&x.want, &x.exact);
                if hp && hv && e > bound {
                    failures.push(format!("{what} [{label} k{kt}]: error {e:.2e} of max|out| over {bound:.2e}"));
                }
            }
        }
        println!("{line} ({:.1} s)", t0.elapsed().as_secs_f64());
    }
    std::env::remove_var("MARKBASE_VISION_ATTN_COOP");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The f16 attention runs where the f16 GEMM's mode is the twin, or the tensor cores where
/// `MARKBASE_VISION_ATTN=coop` (or the default) asks for them, and the head dim fits; elsewhere the
/// f32 kernels.
#[test]
fn vision_attention_f16_selection() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let k = |coop| Kernels::new(&gpu, KernelOptions { coop, ..KernelOptions::for_gpu(&gpu) }).unwrap();
    let fma = k(CoopMode::Fma);
    let limit = gpu.limits().max_compute_workgroup_storage_size;
    for d in [1, 13, 64, 72, 80, 96, 112, 128] {
        let spec = vision_coop::spec_for(&fma, d, true).unwrap_or_else(|| panic!("no f16 attention for D={d}"));
        let KernelSpec::VisionAttnF16 { coop: false, mask: true, d16, kt, hilo_p, hilo_v: true, .. } = spec else { panic!("{spec:?}") };
        assert_eq!(d16 as usize, d.div_ceil(16));
        // tiles of 32 keys with the weights split where they fit, and always in 48 KiB
        assert_eq!((kt, hilo_p), if vision_coop::smem_bytes(d16, 32, true) <= limit { (32, true) } else { (16, true) }, "D={d}");
        assert!(vision_coop::smem_bytes(d16, 32, true) <= 48 << 10, "D={d}: over 48 KiB");
        assert!(vision_coop::smem_bytes(d16, 16, true) <= 32 << 10, "D={d}: over 32 KiB with tiles of 16 keys");
    }
    assert!(vision_coop::spec_for(&fma, 129, false).is_none(), "D=129 takes the f32 kernels");
    assert!(vision_coop::spec_for(&k(CoopMode::Off), 72, false).is_none(), "mode off takes the f32 kernels");
    assert!(vision_coop::spec_for(&k(CoopMode::Tensor8), 72, false).is_none(), "Metal's 8 x 8 takes the f32 kernels");
    // tensor cores: the cooperative-matrix kernel by default, the f32 tiled one where asked for
    let sel = std::env::var("MARKBASE_VISION_ATTN").unwrap_or_default();
    let want = sel == "coop" || (vision_coop::VISION_ATTN_COOP_DEFAULT && sel != "tiled" && sel != "f32");
    let spec = vision_coop::spec_for(&k(CoopMode::Tensor), 72, false);
    assert_eq!(spec.is_some(), want, "tensor cores with MARKBASE_VISION_ATTN={sel:?}: {spec:?}");
    if let Some(spec) = spec {
        assert!(matches!(spec, KernelSpec::VisionAttnF16 { coop: true, .. }), "{spec:?}");
    }
}

/// `vision_coop::smem_bytes` is the kernel's workgroup memory exactly (the workgroup variables
/// its entry point uses), so that the selection keeps under the adapter's limit.
#[test]
fn vision_attention_f16_smem_bytes_match_the_shader() {
    let mut n = 0;
    for spec in KernelSpec::all_variants() {
        let KernelSpec::VisionAttnF16 { d16, kt, hilo_p, .. } = spec else { continue };
        let caps = naga::valid::Capabilities::SHADER_FLOAT16 | naga::valid::Capabilities::COOPERATIVE_MATRIX;
        let bytes = naga_smem::workgroup_bytes(&spec.name(), &spec.source(false).text(), caps);
        assert_eq!(vision_coop::smem_bytes(d16, kt, hilo_p), bytes, "{}", spec.name());
        n += 1;
    }
    assert!(n > 0, "no f16 attention variant");
}

/// The cooperative-matrix variants translate to SPIR-V with cooperative-matrix products (Vulkan
/// runs them), as many per key tile as the split asks; the twin's have none. (Metal's 8 x 8
/// simdgroup matrices have no variant: there the f32 kernels run.)
#[test]
fn vision_attention_f16_spirv_uses_cooperative_matrices() {
    const OP_COOP_MUL_ADD: u32 = 4459; // OpCooperativeMatrixMulAddKHR
    let _products = PRODUCTS.lock().unwrap_or_else(|e| e.into_inner());
    let mut n = 0;
    // each variant (both products, S only, P V only), as MARKBASE_VISION_ATTN_COOP asks
    for (_, products) in COOP_VARIANTS {
        std::env::set_var("MARKBASE_VISION_ATTN_COOP", products);
        let (qk, pv) = vision_coop::coop_products();
        for spec in KernelSpec::all_variants() {
            let KernelSpec::VisionAttnF16 { coop, d16, kt, hilo_p, hilo_v, .. } = spec else { continue };
            if !coop && products != "both" {
                continue; // (the twin has no variants)
            }
            let wgsl = spec.source(false).text();
            let module = naga::front::wgsl::parse_str(&wgsl).unwrap_or_else(|e| panic!("{}: {}", spec.name(), e.emit_to_string(&wgsl)));
            let caps = naga::valid::Capabilities::SHADER_FLOAT16 | naga::valid::Capabilities::COOPERATIVE_MATRIX;
            let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps).validate(&module).unwrap();
            let opts = naga::back::spv::Options { lang_version: (1, 3), ..Default::default() };
            let words = naga::back::spv::write_vec(&module, &info, &opts, None).unwrap_or_else(|e| panic!("{}: {e:?}", spec.name()));
            let mut products = 0;
            let mut i = 5;
            while i < words.len() {
                let (len, op) = ((words[i] >> 16) as usize, words[i] & 0xffff);
                products += (op == OP_COOP_MUL_ADD) as usize;
                i += len.max(1);
            }
            // per tile: scores 3 x D16 x KB, weights times V (1 + hilo_p + hilo_v) x D16 x KB (those on
            // cooperative matrices: MARKBASE_VISION_ATTN_COOP)
            let per = 3 * qk as usize + (1 + hilo_p as usize + hilo_v as usize) * pv as usize;
            let want = if coop { per * d16 as usize * (kt as usize / 16) } else { 0 };
            assert_eq!(products, want, "{}: cooperative-matrix products in SPIR-V", spec.name());
            n += coop as usize;
        }
    }
    std::env::remove_var("MARKBASE_VISION_ATTN_COOP");
    assert!(n > 0, "no cooperative-matrix variant of the f16 attention");
}

/// The exponent of the power of two that brings a largest |value| `m` into [2^6, 2^7), as the
/// kernel finds it (`up_exp`).
fn up_exp(m: f32) -> i32 {
    let e = ((m.to_bits() >> 23) & 0xff) as i32 - 127;
    (6 - e).clamp(-126, 126)
}

/// Removes an environment variable when dropped (a failed assertion included).
struct EnvGuard(&'static str);

impl Drop for EnvGuard {
    fn drop(&mut self) {
        std::env::remove_var(self.0);
    }
}

/// The first key tile's scores as the products leave them (`MARKBASE_VISION_ATTN_DUMP=scores`:
/// each query row and each key scaled by its power of two, before the score factors), against
/// the same sums in f64, for the twin and each cooperative-matrix variant: where a variant's
/// products are wrong, this names the scores (row, key) that are, with a corner of both matrices.
/// Bound: 2e-6 of sum_d |q k| (the hi + lo split's three products: about 22 significant bits).
#[test]
fn vision_attention_f16_first_tile_scores() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let mut r = rng("vision_attention_f16_scores");
    let _products = PRODUCTS.lock().unwrap_or_else(|e| e.into_inner());
    let _dump = EnvGuard("MARKBASE_VISION_ATTN_DUMP");
    let limit = gpu.limits().max_compute_workgroup_storage_size;
    let maxg = gpu.limits().max_compute_workgroups_per_dimension;
    // whole query tiles: the dump through global memory stores all their rows
    let c = Case { t: 128, s: 40, h: 2, kvh: 1, d: 72, mask: Mask::None, amp: (3.0, 0.5, 1.0), ramp: false };
    let x = data(&mut r, &c);
    let d = c.d;
    let row_exp = |v: &[f32]| up_exp(v.iter().fold(0f32, |m, a| m.max(a.abs())));
    let mut failures = vec![];
    // each mode with its own pipeline caches (the mode is read when a kernel is built)
    let sets = ["scores", "global"].into_iter().flat_map(|mode| kernel_sets(&gpu).into_iter().map(move |k| (k, mode)));
    for ((label, kernels, coop, products), mode) in sets {
        std::env::set_var("MARKBASE_VISION_ATTN_COOP", products);
        std::env::set_var("MARKBASE_VISION_ATTN_DUMP", mode);
        let spec = vision_coop::shape_for(limit, coop, d, false).unwrap_or_else(|| panic!("{label}: no f16 attention for D={d}"));
        let KernelSpec::VisionAttnF16 { kt, .. } = spec else { unreachable!() };
        let kt = kt as usize;
        assert!(kernels.get(spec).unwrap().name.contains("dump_s"), "{label}: the diagnostic is built");
        let got = run_spec(&gpu, &kernels, spec, &c, &x, vision_coop::groups(c.t, c.h, maxg));
        let (mut worst, mut at) = (0f64, (0, 0, 0));
        let mut corner = String::new();
        for t in 0..c.t {
            for h in 0..c.h {
                let q = &x.q[(t * c.h + h) * d..][..d];
                let qs = 2f64.powi(row_exp(q));
                for j in 0..kt.min(c.s) {
                    let k = &x.k[j * c.kvh * d..][..d];
                    let ks = 2f64.powi(row_exp(k));
                    let (mut s, mut m) = (0f64, 0f64);
                    for e in 0..d {
                        let p = q[e] as f64 * qs * k[e] as f64 * ks;
                        s += p;
                        m += p.abs();
                    }
                    let g = got[(t * c.h + h) * d + j] as f64;
                    let err = if g.is_finite() { (g - s).abs() / m.max(1e-30) } else { f64::INFINITY };
                    if err > worst {
                        (worst, at) = (err, (t, h, j));
                    }
                    if t < 3 && h == 0 && j < 4 {
                        corner += &format!(" [{t},{j}] {g:.4} want {s:.4}");
                    }
                }
            }
        }
        println!("{label} {mode} ({}): first tile's scores, worst {worst:.2e} of sum|q k| at query {} head {} key {}; corner:{corner}", spec.name(), at.0, at.1, at.2);
        if worst > 2e-6 {
            failures.push(format!("{label} {mode}: scores off by {worst:.2e} of sum|q k| at query {} head {} key {}", at.0, at.1, at.2));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
