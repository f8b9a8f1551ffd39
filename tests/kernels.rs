//! Every WGSL kernel against its CPU lowering (`markbase::cpu::ops`; weights
//! decoded by `markbase::quant`), on random inputs of a fixed seed (printed;
//! `MARKBASE_TEST_SEED=<n>` runs another). Both the subgroup and the
//! subgroup-free variants run where the adapter has subgroups.
//!
//! Tolerance unless stated: max |gpu - cpu| <= 1e-4 * max|cpu| + 1e-5.
//! The tests FAIL (never skip) when no adapter is found.

use std::sync::OnceLock;

use markbase::cpu::ops as cpu;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::*;
use markbase::gpu::weights::{upload_weight, GpuFormat, GpuWeight};
use markbase::graph::ops::{BinaryOp, HeadRange, NormScale, UnaryOp};
use markbase::graph::quant::FloatType;
use markbase::weights::RawTensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "common/kernel_data.rs"]
mod kernel_data;
use kernel_data::*;

struct Env {
    gpu: Gpu,
    /// (label, kernels): subgroup-free always, plus the subgroup variant when available.
    variants: Vec<(&'static str, Kernels)>,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
        println!("adapter: {}", gpu.info.summary());
        let mut variants = vec![("plain", Kernels::new(&gpu, KernelOptions { subgroups: false, checks: ShaderChecks::All, half_blocks: true, merge_splits: false, coop: markbase::gpu::ops::gemm_f16::CoopMode::Off }).unwrap())];
        if gpu.info.subgroups && gpu.info.subgroup_min_size >= 8 {
            variants.push(("subgroup", Kernels::new(&gpu, KernelOptions { subgroups: true, checks: ShaderChecks::All, half_blocks: true, merge_splits: false, coop: markbase::gpu::ops::gemm_f16::CoopMode::Off }).unwrap()));
        } else {
            println!("adapter has no subgroups (of 8 invocations or more): only the subgroup-free path runs");
        }
        Env { gpu, variants }
    })
}

// ------------------------------------------------------------------ weights

fn formats_for_tests() -> Vec<GpuFormat> {
    all_formats()
}

/// Row length valid for `fmt` and not a multiple of the 64/32-wide tiles where the format allows.
fn test_k(fmt: GpuFormat) -> usize {
    match fmt {
        GpuFormat::Float(_) => 45,
        GpuFormat::Affine { group: 128, .. } => 384,
        GpuFormat::Nvfp4 { .. } => 336,
        _ => 320,
    }
}

// ------------------------------------------------------------------ matmul

fn matmul_case(r: &mut StdRng, fmt: GpuFormat, n: usize, k: usize, ts: &[usize], nchunks: usize) {
    let e = env();
    let gpu = &e.gpu;
    let wd = random_weight(r, fmt, &[n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw: GpuWeight = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[n, k], nchunks))).unwrap();
    assert_eq!(gw.chunks.len(), nchunks.min(n), "{}: chunk count", fmt.describe());
    for &t in ts {
        let x = randn(r, t * k, 1.0);
        let mut want = vec![0f32; t * n];
        cpu::matmul(&x, &wref, k, n, &mut want);
        let xb = gpu.upload_f32("x", &x);
        let mut kernels: Vec<(String, MatMulKernel)> = Vec::new();
        for (label, ks) in &e.variants {
            let mm = ks.matmul(fmt, k, t, false).unwrap();
            // the one-token GEMV also with two blocks per step, and with whole blocks where it
            // takes half blocks (as on CPU adapters)
            if let KernelSpec::Gemv { fmt, wg, rows, tt: 1, gather, xvec, bp2, norm, dual, half, several } = mm.spec {
                let other = KernelSpec::Gemv { fmt, wg, rows, tt: 1, gather, xvec, bp2: !bp2, norm, dual, half, several };
                kernels.push((format!("{label} bp2={}", !bp2), ks.matmul_spec(other).unwrap()));
                if mm.kernel.name.contains(" half") {
                    let whole = KernelSpec::Gemv { fmt, wg, rows, tt: 1, gather, xvec, bp2, norm, dual, half: false, several };
                    kernels.push((format!("{label} whole blocks"), ks.matmul_spec(whole).unwrap()));
                }
            }
            // the GEMM with both tile widths, split over K, and with scalar activation loads where
            // it takes vec4s
            if let KernelSpec::Gemm { fmt, wide, split, xvec } = mm.spec {
                let spec = |wide, split, xvec| ks.matmul_spec(KernelSpec::Gemm { fmt, wide, split, xvec }).unwrap();
                kernels.push((format!("{label} wide={}", !wide), spec(!wide, false, xvec)));
                if !split {
                    kernels.push((format!("{label} split"), spec(false, true, xvec)));
                }
                if xvec {
                    kernels.push((format!("{label} scalar x"), spec(wide, split, false)));
                }
            }
            kernels.push((label.to_string(), mm));
        }
        for (label, mm) in &kernels {
            // a split GEMM: its own choice of parts, and 3 parts (the last one empty where K is
            // short), each run twice with y cleared between: the second run fails if the first
            // left a tile's counter set
            let splits: &[usize] = if mm.is_split() { &[0, 3] } else { &[0] };
            for &ksplit in splits {
                let y = gpu.storage("y", (t * n * 4) as u64);
                let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims { ksplit, ..MatMulDims::plain(&gw, c, t) }).collect();
                let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
                let bgs: Vec<wgpu::BindGroup> = (0..gw.chunks.len())
                    .map(|c| {
                        if mm.is_split() {
                            let (pb, cb) = mm.split_scratch_bytes(&dims[c]);
                            mm.bind_group_split(&gpu.device, &params[c], &xb, &y, &gpu.storage("part", pb), &gpu.storage("done", cb), &gw, c)
                        } else {
                            mm.bind_group(&gpu.device, &params[c], &xb, &y, None, &gw, c)
                        }
                    })
                    .collect();
                let rounds = if mm.is_split() { 2 } else { 1 };
                for round in 0..rounds {
                    gpu.queue.write_buffer(&y, 0, &vec![0u8; t * n * 4]);
                    run(gpu, |pass| {
                        for (c, d) in dims.iter().enumerate() {
                            mm.dispatch(pass, &bgs[c], d);
                        }
                    });
                    let got = gpu.read_f32(&y, t * n).unwrap();
                    let path = if mm.is_gemv() { "gemv" } else { "gemm" };
                    let parts = mm.ksplit(&dims[0]);
                    check(&format!("matmul {} {path} [{label}] N={n} K={k} T={t} chunks={} parts={parts} round {round}", fmt.describe(), gw.chunks.len()), &got, &want);
                }
            }
        }
    }
}

#[test]
fn matmul_every_format_gemv_and_gemm_chunked() {
    let mut r = rng("matmul");
    for fmt in formats_for_tests() {
        let k = test_k(fmt);
        matmul_case(&mut r, fmt, 37, k, &[1, 3, 17], 3);
    }
}

#[test]
fn matmul_unchunked_larger_tiles() {
    let mut r = rng("matmul_large");
    // Several GEMM tiles in both directions, and a GEMV with many row groups.
    // (K % 32 == 0 takes the vectorized float paths, K = 100 the masked ones)
    for (fmt, k) in [
        (GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 }, 256),
        (GpuFormat::Affine { bits: 8, group: 32, scale: FloatType::Bf16 }, 256),
        (GpuFormat::Float(FloatType::Bf16), 100),
        (GpuFormat::Float(FloatType::Bf16), 96),
        (GpuFormat::Float(FloatType::F32), 128),
    ] {
        matmul_case(&mut r, fmt, 131, k, &[1, 2, 70], 1);
    }
}

#[test]
fn gather_matmul_decode_and_prefill() {
    let mut r = rng("gather_matmul");
    let e = env();
    let gpu = &e.gpu;
    let (ne, n, k, s) = (5usize, 37usize, 320usize, 2usize);
    for fmt in [
        GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 },
        GpuFormat::Affine { bits: 3, group: 32, scale: FloatType::Bf16 },
        GpuFormat::Mxfp4,
        GpuFormat::Nvfp4 { global: true },
        GpuFormat::Float(FloatType::Bf16),
    ] {
        let wd = random_weight(&mut r, fmt, &[ne, n, k]);
        let wref = markbase::quant::dequantize(&wd).unwrap();
        let gw = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[ne, n, k], 3))).unwrap();
        assert_eq!(gw.chunks.len(), 3);
        for t in [1usize, 3] {
            for x_bcast in [false, true] {
                let ids: Vec<u32> = (0..t * s).map(|_| r.gen_range(0..ne as u32)).collect();
                let x = randn(&mut r, if x_bcast { t * k } else { t * s * k }, 1.0);
                let mut want = vec![0f32; t * s * n];
                for p in 0..t * s {
                    let xr = if x_bcast { &x[(p / s) * k..(p / s + 1) * k] } else { &x[p * k..(p + 1) * k] };
                    let ex = ids[p] as usize;
                    cpu::matmul(xr, &wref[ex * n * k..(ex + 1) * n * k], k, n, &mut want[p * n..(p + 1) * n]);
                }
                let xb = gpu.upload_f32("x", &x);
                let idb = gpu.upload_u32("ids", &ids);
                for (label, ks) in &e.variants {
                    let mm = ks.matmul(fmt, k, t * s, true).unwrap();
                    let y = gpu.storage("y", (t * s * n * 4) as u64);
                    let dims: Vec<MatMulDims> = (0..3).map(|c| MatMulDims::gathered(&gw, c, t, s, x_bcast)).collect();
                    let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
                    let bgs: Vec<wgpu::BindGroup> = (0..3).map(|c| mm.bind_group(&gpu.device, &params[c], &xb, &y, Some(&idb), &gw, c)).collect();
                    run(gpu, |pass| {
                        for (c, d) in dims.iter().enumerate() {
                            mm.dispatch(pass, &bgs[c], d);
                        }
                    });
                    let got = gpu.read_f32(&y, t * s * n).unwrap();
                    check(&format!("gather {} [{label}] T={t} S={s} bcast={x_bcast}", fmt.describe()), &got, &want);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ expert grouping, grouped GEMM

/// `t * s` expert ids in `0..e`. `uniform`: any expert; `sparse`: only experts `i % 3 == 1`
/// (expert 0 and many others get no pair); `skewed`: expert `e / 2` takes about 85%.
fn routing(r: &mut StdRng, kind: &str, t: usize, s: usize, e: usize) -> Vec<u32> {
    let e = e as u32;
    (0..t * s)
        .map(|_| match kind {
            "sparse" if e > 1 => 3 * r.gen_range(0..(e + 1) / 3) + 1,
            "skewed" if r.gen_bool(0.85) => e / 2,
            _ => r.gen_range(0..e),
        })
        .collect()
}

/// Groups `ids` on the GPU (`Op::MoeGroup`), checks the grouping against the CPU's, and
/// returns its buffer.
fn gpu_group(label: &str, ks: &Kernels, ids: &[u32], experts: usize) -> wgpu::Buffer {
    let gpu = &env().gpu;
    let mg = ks.moe_group().unwrap();
    let idb = gpu.upload_u32("ids", ids);
    let p = gpu.uniform("p", &mg.params(ids.len(), experts));
    let n = experts + 1 + ids.len();
    // filled with a marker: every word must be written
    let out = gpu.upload_u32("groups", &vec![0xdead_beef; n]);
    let bg = mg.bind_group(&gpu.device, &p, &idb, &out);
    run(gpu, |pass| mg.dispatch(pass, &bg));
    let want = cpu::moe_group(ids, experts).unwrap();
    let got = gpu.read_u32(&out, n).unwrap();
    if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
        panic!("moe_group [{label}] P={} E={experts}: word {i}: gpu {} cpu {}", ids.len(), got[i], want[i]);
    }
    out
}

#[test]
fn moe_group_is_the_cpus_stable_grouping() {
    let mut r = rng("moe_group");
    let e = env();
    // P = T*S from 2 to 4800 (several tiles of ids), E from 1 to 300 (more experts than invocations)
    for (t, s, ne) in [(13usize, 3usize, 7usize), (1, 2, 5), (300, 8, 128), (600, 8, 128), (5, 4, 300), (700, 2, 3), (9, 1, 1)] {
        for kind in ["uniform", "sparse", "skewed"] {
            let ids = routing(&mut r, kind, t, s, ne);
            for (label, ks) in &e.variants {
                gpu_group(&format!("{label} {kind} T={t} S={s}"), ks, &ids, ne);
            }
        }
    }
    // the CPU grouping: offsets, then the pairs of each expert in increasing order
    let g = cpu::moe_group(&[2, 0, 2, 2, 0, 3], 4).unwrap();
    assert_eq!(g, vec![0, 2, 2, 5, 6, 1, 4, 0, 2, 3, 5]);
    assert!(cpu::moe_group(&[0, 4], 4).is_err());
}

/// One grouped-GEMM case: `ids` routed pairs of `t` tokens, `s` per token, over a random
/// `[ne, n, k]` stack in `nchunks` chunks; every kernel variant against the CPU, with the
/// grouping computed on the GPU in the same pass.
#[allow(clippy::too_many_arguments)]
fn grouped_case(r: &mut StdRng, fmt: GpuFormat, (ne, n, k): (usize, usize, usize), t: usize, s: usize, kind: &str, nchunks: usize, x_bcast: bool) {
    let e = env();
    let gpu = &e.gpu;
    let wd = random_weight(r, fmt, &[ne, n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[ne, n, k], nchunks))).unwrap();
    assert_eq!(gw.chunks.len(), nchunks, "{}: chunk count", fmt.describe());
    let np = t * s;
    let ids = routing(r, kind, t, s, ne);
    let x = randn(r, if x_bcast { t * k } else { np * k }, 1.0);
    let mut want = vec![0f32; np * n];
    for p in 0..np {
        let xr = if x_bcast { &x[(p / s) * k..(p / s + 1) * k] } else { &x[p * k..(p + 1) * k] };
        let ex = ids[p] as usize;
        cpu::matmul(xr, &wref[ex * n * k..(ex + 1) * n * k], k, n, &mut want[p * n..(p + 1) * n]);
    }
    // the CPU lowering computes the same rows (same dot order per row)
    let groups = cpu::moe_group(&ids, ne).unwrap();
    let mut cpu_grouped = vec![0f32; np * n];
    cpu::grouped_matmul(&x, x_bcast, &ids, s, &groups, &wref, n, k, &mut cpu_grouped).unwrap();
    assert_eq!(cpu_grouped, want, "cpu grouped_matmul {}", fmt.describe());
    let xb = gpu.upload_f32("x", &x);
    let what = format!("grouped {} {kind} E={ne} N={n} K={k} T={t} S={s} chunks={nchunks} bcast={x_bcast}", fmt.describe());
    for (label, ks) in &e.variants {
        let gb = gpu_group(&format!("{label} {what}"), ks, &ids, ne);
        let mm = ks.grouped_matmul(fmt, k).unwrap();
        assert!(mm.kernel.name.starts_with("gemm_grouped"), "{}", mm.kernel.name);
        // NaN everywhere first: every row must be written
        let y = gpu.upload_f32("y", &vec![f32::NAN; np * n]);
        let dims: Vec<MatMulDims> = (0..nchunks).map(|c| MatMulDims::gathered(&gw, c, t, s, x_bcast)).collect();
        let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
        let bgs: Vec<wgpu::BindGroup> = (0..nchunks).map(|c| mm.bind_group(&gpu.device, &params[c], &xb, &y, Some(&gb), &gw, c)).collect();
        run(gpu, |pass| {
            for (c, d) in dims.iter().enumerate() {
                mm.dispatch(pass, &bgs[c], d);
            }
        });
        check(&format!("{what} [{label}]"), &gpu.read_f32(&y, np * n).unwrap(), &want);
    }
}

#[test]
fn grouped_matmul_every_format_odd_shapes_chunked() {
    let mut r = rng("grouped_matmul");
    let kinds = ["uniform", "sparse", "skewed"];
    for (i, fmt) in formats_for_tests().into_iter().enumerate() {
        // K = 96 (three 32-steps, not a multiple of the 64-wide tiles) where the group allows
        let k = match fmt {
            GpuFormat::Affine { group: 128, .. } => 384,
            GpuFormat::Affine { group: 64, .. } => 192,
            GpuFormat::Float(FloatType::F16) => 45,
            _ => 96,
        };
        for (j, (nchunks, x_bcast)) in [(1, true), (3, false), (3, true)].into_iter().enumerate() {
            grouped_case(&mut r, fmt, (7, 37, k), 13, 3, kinds[(i + j) % 3], nchunks, x_bcast);
        }
    }
}

#[test]
fn grouped_matmul_several_tiles_per_expert() {
    let mut r = rng("grouped_matmul_tiles");
    // one expert with ~250 pairs (4 tiles, the last partial), N over three row tiles
    for fmt in
        [GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 }, GpuFormat::Nvfp4 { global: true }, GpuFormat::Float(FloatType::Bf16)]
    {
        grouped_case(&mut r, fmt, (6, 130, 128), 150, 2, "skewed", 2, false);
        grouped_case(&mut r, fmt, (6, 130, 128), 150, 2, "uniform", 1, true);
    }
}

// ------------------------------------------------------------------ embedding

#[test]
fn embedding_gather_chunked_with_clamp() {
    let mut r = rng("embed");
    let e = env();
    let gpu = &e.gpu;
    let v = 50usize;
    for fmt in [
        GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 },
        GpuFormat::Affine { bits: 6, group: 64, scale: FloatType::Bf16 },
        GpuFormat::Affine { bits: 3, group: 32, scale: FloatType::F16 },
        GpuFormat::Mxfp8,
        GpuFormat::Nvfp4 { global: false },
        GpuFormat::Float(FloatType::Bf16),
        GpuFormat::Float(FloatType::F32),
    ] {
        let d = test_k(fmt);
        let wd = random_weight(&mut r, fmt, &[v, d]);
        let wref = markbase::quant::dequantize(&wd).unwrap();
        let gw = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[v, d], 3))).unwrap();
        let t = 9usize;
        let mut ids: Vec<u32> = (0..t).map(|_| r.gen_range(0..v as u32)).collect();
        ids[0] = v as u32 - 1;
        for clamp in [None, Some(40u32)] {
            if clamp.is_some() {
                ids[1] = 45; // >= clamp: reads row 0
            }
            let scale = r.gen_range(0.5f32..3.0);
            let mut want = vec![0f32; t * d];
            for (i, &id) in ids.iter().enumerate() {
                let row = match clamp {
                    Some(c) if id >= c => 0,
                    _ => id as usize,
                };
                for j in 0..d {
                    want[i * d + j] = wref[row * d + j] * scale;
                }
            }
            let idb = gpu.upload_u32("ids", &ids);
            let out = gpu.storage("out", (t * d * 4) as u64);
            let ek = e.variants[0].1.embed(fmt).unwrap();
            let params: Vec<wgpu::Buffer> = (0..gw.chunks.len()).map(|c| gpu.uniform("p", &ek.params(&gw, c, t, scale, clamp))).collect();
            let bgs: Vec<wgpu::BindGroup> = (0..gw.chunks.len()).map(|c| ek.bind_group(&gpu.device, &params[c], &idb, &out, &gw, c)).collect();
            run(gpu, |pass| {
                for bg in &bgs {
                    ek.dispatch(pass, bg, t, d);
                }
            });
            let got = gpu.read_f32(&out, t * d).unwrap();
            check_tol(&format!("embed {} clamp={clamp:?}", fmt.describe()), &got, &want, 1e-6, 1e-7);
        }
    }
}

// ------------------------------------------------------------------ norms, rope, kv, attention

#[test]
fn rms_norm_all_scales() {
    let mut r = rng("rms_norm");
    let e = env();
    let gpu = &e.gpu;
    // rows held in registers (one and two steps of 8 values per invocation), and a row
    // longer than that (the looping kernel: d > 16 x 256)
    for (rows, d) in [(5usize, 300usize), (3, 3840), (2, 4500)] {
        let x = randn(&mut r, rows * d, 2.0);
        let xb = gpu.upload_f32("x", &x);
        for (scale, wt) in [
            (NormScale::None, None),
            (NormScale::W, Some(FloatType::Bf16)),
            (NormScale::OnePlusW, Some(FloatType::Bf16)),
            (NormScale::W, Some(FloatType::F32)),
            (NormScale::OnePlusW, Some(FloatType::F16)),
        ] {
            let w = randn(&mut r, d, 1.0);
            let wt_ = wt.map(|t| float_tensor(t, &[d], &w));
            let wf = wt_.as_ref().map(|t| t.to_f32());
            let mut want = vec![0f32; rows * d];
            cpu::rms_norm(&x, wf.as_deref(), d, 1e-6, scale, &mut want);
            let wb = wt_.as_ref().map(|t| gpu.upload("w", &t.bytes));
            // with a residual: res + norm(x)
            let res = randn(&mut r, rows * d, 3.0);
            let resb = gpu.upload_f32("res", &res);
            let want_res: Vec<f32> = want.iter().zip(&res).map(|(a, b)| a + b).collect();
            // and that sum times a scalar weight (stored as the norm weight is, f32 without one)
            let sdt = wt.unwrap_or(FloatType::F32);
            let st = float_tensor(sdt, &[1], &[-0.37]);
            let s = st.to_f32()[0];
            let sb = gpu.upload("s", &st.bytes);
            let want_scaled: Vec<f32> = want_res.iter().map(|v| v * s).collect();
            for (label, ks) in &e.variants {
                for (what, want, with_res, scaled) in
                    [("rms_norm", &want, false, false), ("rms_norm_add", &want_res, true, false), ("rms_norm_add scaled", &want_scaled, true, true)]
                {
                    let k = if scaled { ks.rms_norm_add_scaled(wt, sdt, d) } else { ks.rms_norm(wt, with_res, d) }.unwrap();
                    let p = gpu.uniform("p", &k.params(rows, d, 1e-6, scale));
                    let out = gpu.storage("out", (rows * d * 4) as u64);
                    let bg = k.bind_group(&gpu.device, &p, &xb, &out, wb.as_ref(), with_res.then_some(&resb), scaled.then_some(&sb));
                    run(gpu, |pass| k.dispatch(pass, &bg, rows));
                    check(&format!("{what} {scale:?} {wt:?} [{label}] D={d}"), &gpu.read_f32(&out, rows * d).unwrap(), want);
                }
            }
        }
    }
}

/// The one-token GEMV with the RMSNorm of x fused in front, against norm-then-matmul on
/// the CPU: the norm only touches x, so a few formats (unmasked and masked K, the common
/// 4-bit path, a float and an fp4 one), chunked weights, one and two blocks per step.
#[test]
fn norm_matmul_formats() {
    let mut r = rng("norm_matmul");
    let e = env();
    let gpu = &e.gpu;
    let fmts =
        [GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 }, GpuFormat::Float(FloatType::Bf16), GpuFormat::Nvfp4 { global: false }];
    for (fmt_i, fmt) in fmts.into_iter().enumerate() {
        let (n, k) = (37, test_k(fmt));
        let wd = random_weight(&mut r, fmt, &[n, k]);
        let wref = markbase::quant::dequantize(&wd).unwrap();
        let gw: GpuWeight = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[n, k], 3))).unwrap();
        // a second weight of the same shape (the up projection of the fused GeGLU)
        let wd2 = random_weight(&mut r, fmt, &[n, k]);
        let wref2 = markbase::quant::dequantize(&wd2).unwrap();
        let gw2: GpuWeight = upload_weight(gpu, &wd2, Some(chunk_limit(fmt, &[n, k], 3))).unwrap();
        // single-chunk weights of 37 and 13 rows for the concatenating GEMV
        let wd3 = random_weight(&mut r, fmt, &[13, k]);
        let wref3 = markbase::quant::dequantize(&wd3).unwrap();
        let c3: GpuWeight = upload_weight(gpu, &wd3, None).unwrap();
        let (c1, c2): (GpuWeight, GpuWeight) = (upload_weight(gpu, &wd, None).unwrap(), upload_weight(gpu, &wd2, None).unwrap());
        for (norm_i, (scale, nt)) in
            [(NormScale::OnePlusW, Some(FloatType::Bf16)), (NormScale::W, Some(FloatType::F32)), (NormScale::None, None)].into_iter().enumerate()
        {
            let x = randn(&mut r, k, 4.0);
            let nwv = randn(&mut r, k, 1.0);
            let nwt = nt.map(|t| float_tensor(t, &[k], &nwv));
            let nwf = nwt.as_ref().map(|t| t.to_f32());
            let mut xn = vec![0f32; k];
            cpu::rms_norm(&x, nwf.as_deref(), k, 1e-6, scale, &mut xn);
            let mut want = vec![0f32; n];
            cpu::matmul(&xn, &wref, k, n, &mut want);
            let xb = gpu.upload_f32("x", &x);
            let nwb = nwt.as_ref().map(|t| gpu.upload("nw", &t.bytes));
            for (label, ks) in &e.variants {
                let mm = ks.norm_matmul(fmt, k, nt).unwrap();
                let KernelSpec::Gemv { fmt: f, wg, rows, tt, gather, xvec, bp2, norm, dual, half, several } = mm.spec else { panic!("not a GEMV") };
                assert_eq!(norm, Some(nt));
                let other = ks.matmul_spec(KernelSpec::Gemv { fmt: f, wg, rows, tt, gather, xvec, bp2: !bp2, norm, dual, half, several }).unwrap();
                let mut runs = vec![("", mm), (" other bp2", other)];
                // whole blocks too where it takes half blocks (as on CPU adapters)
                if runs[0].1.kernel.name.contains(" half") {
                    runs.push((" whole blocks", ks.matmul_spec(KernelSpec::Gemv { fmt: f, wg, rows, tt, gather, xvec, bp2, norm, dual, half: false, several }).unwrap()));
                }
                for (v, mm) in &runs {
                    let y = gpu.storage("y", (n * 4) as u64);
                    let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::plain(&gw, c, 1).with_norm(scale, 1e-6)).collect();
                    let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
                    let bgs: Vec<wgpu::BindGroup> =
                        (0..gw.chunks.len()).map(|c| mm.bind_group_norm(&gpu.device, &params[c], &xb, &y, nwb.as_ref(), &gw, None, c)).collect();
                    run(gpu, |pass| {
                        for (c, d) in dims.iter().enumerate() {
                            mm.dispatch(pass, &bgs[c], d);
                        }
                    });
                    check(&format!("norm_matmul {} {scale:?} [{label}{v}] N={n} K={k}", fmt.describe()), &gpu.read_f32(&y, n).unwrap(), &want);
                }
                // gelu(gate) * up, both weights in one dispatch per chunk
                let mut up = vec![0f32; n];
                cpu::matmul(&xn, &wref2, k, n, &mut up);
                let want_gu: Vec<f32> = want.iter().zip(&up).map(|(&g, &u)| cpu::gelu(g) * u).collect();
                // as for narrow, middling and wide weights: 2, 4 and 8 rows of each per workgroup
                let mut runs: Vec<MatMulKernel> = Vec::new();
                for rows_for in [n, GEMV_DUAL_NARROW_N, GEMV_DUAL_WIDE_N] {
                    let mm = ks.norm_geglu(fmt, k, rows_for, nt).unwrap();
                    if !runs.iter().any(|r| r.spec == mm.spec) {
                        runs.push(mm);
                    }
                }
                for mm in &runs {
                    let y = gpu.storage("y", (n * 4) as u64);
                    let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::plain(&gw, c, 1).with_norm(scale, 1e-6)).collect();
                    let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
                    let bgs: Vec<wgpu::BindGroup> =
                        (0..gw.chunks.len()).map(|c| mm.bind_group_norm(&gpu.device, &params[c], &xb, &y, nwb.as_ref(), &gw, Some(&gw2), c)).collect();
                    run(gpu, |pass| {
                        for (c, d) in dims.iter().enumerate() {
                            mm.dispatch(pass, &bgs[c], d);
                        }
                    });
                    check(&format!("norm_geglu {} {scale:?} [{label}] {}", fmt.describe(), mm.kernel.name), &gpu.read_f32(&y, n).unwrap(), &want_gu);
                }
                // q, k and v: two or three weights (row counts not multiples of a row group), one
                // dispatch, outputs side by side
                // (one norm convention per format: each is a separate, slow to build, kernel)
                let sets = if norm_i == fmt_i % 3 { vec![vec![(&c1, &wref), (&c2, &wref2), (&c3, &wref3)], vec![(&c3, &wref3), (&c1, &wref)]] } else { vec![] };
                for set in sets {
                    let ws: Vec<&GpuWeight> = set.iter().map(|p| p.0).collect();
                    let ncat: usize = ws.iter().map(|w| w.rows).sum();
                    let mut want_cat = Vec::new();
                    for (w, wr) in &set {
                        let mut part = vec![0f32; w.rows];
                        cpu::matmul(&xn, wr, k, w.rows, &mut part);
                        want_cat.extend(part);
                    }
                    let mm = ks.norm_matmul_cat(&ws, nt).unwrap().expect("one dispatch for single-chunk weights of one format");
                    // these few rows take 2 per workgroup; more rows in all would take 4
                    let KernelSpec::GemvCat { fmt: f, wg, rows, xvec, norm, n: nc, half } = mm.spec else { panic!("not a q/k/v GEMV") };
                    let four = ks.matmul_spec(KernelSpec::GemvCat { fmt: f, wg, rows: 4, xvec, norm, n: nc, half }).unwrap();
                    let runs = if rows != 4 { vec![mm, four] } else { vec![mm] };
                    for mm in &runs {
                        let y = gpu.storage("y", (ncat * 4) as u64);
                        let d = MatMulDims::cat(&ws).with_norm(scale, 1e-6);
                        let params = gpu.uniform("p", &mm.params(&d));
                        let bg = mm.bind_group_cat(&gpu.device, &params, &xb, &y, nwb.as_ref(), &ws);
                        run(gpu, |pass| mm.dispatch(pass, &bg, &d));
                        check(
                            &format!("norm_matmul cat{} {} {scale:?} [{label}] K={k} {}", ws.len(), fmt.describe(), mm.kernel.name),
                            &gpu.read_f32(&y, ncat).unwrap(),
                            &want_cat,
                        );
                    }
                }
            }
        }
    }
}

/// The one-token GEMV over rows longer than one pass of its workgroup (K = 4,672: 146 blocks,
/// 292 half blocks against at most 256 invocations, so the last pass is partial), plain (8 and,
/// as for a weight of few long rows, 4 rows per workgroup) and with the norm fused in front.
#[test]
fn gemv_long_rows() {
    let mut r = rng("gemv_long_rows");
    let fmt = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let (n, k) = (37usize, 4672usize);
    matmul_case(&mut r, fmt, n, k, &[1], 1);
    let e = env();
    let gpu = &e.gpu;
    let wd = random_weight(&mut r, fmt, &[n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw = upload_weight(gpu, &wd, None).unwrap();
    let x = randn(&mut r, k, 2.0);
    let nwt = float_tensor(FloatType::Bf16, &[k], &randn(&mut r, k, 1.0));
    let mut xn = vec![0f32; k];
    cpu::rms_norm(&x, Some(&nwt.to_f32()), k, 1e-6, NormScale::OnePlusW, &mut xn);
    let mut want = vec![0f32; n];
    cpu::matmul(&xn, &wref, k, n, &mut want);
    let (xb, nwb) = (gpu.upload_f32("x", &x), gpu.upload("nw", &nwt.bytes));
    let mut want_plain = vec![0f32; n];
    cpu::matmul(&x, &wref, k, n, &mut want_plain);
    for (label, ks) in &e.variants {
        // few rows of this length: 4 rows per workgroup
        let mm = ks.matmul_rows(fmt, k, n, 1, false).unwrap();
        assert!(mm.kernel.name.contains(" r4 "), "{}", mm.kernel.name);
        let y = gpu.storage("y", (n * 4) as u64);
        let d = MatMulDims::plain(&gw, 0, 1);
        let pb = gpu.uniform("p", &mm.params(&d));
        let bg = mm.bind_group(&gpu.device, &pb, &xb, &y, None, &gw, 0);
        run(gpu, |pass| mm.dispatch(pass, &bg, &d));
        check(&format!("matmul K={k} [{label}] {}", mm.kernel.name), &gpu.read_f32(&y, n).unwrap(), &want_plain);
        let mm = ks.norm_matmul(fmt, k, Some(FloatType::Bf16)).unwrap();
        let y = gpu.storage("y", (n * 4) as u64);
        let d = MatMulDims::plain(&gw, 0, 1).with_norm(NormScale::OnePlusW, 1e-6);
        let pb = gpu.uniform("p", &mm.params(&d));
        let bg = mm.bind_group_norm(&gpu.device, &pb, &xb, &y, Some(&nwb), &gw, None, 0);
        run(gpu, |pass| mm.dispatch(pass, &bg, &d));
        check(&format!("norm_matmul K={k} [{label}] {}", mm.kernel.name), &gpu.read_f32(&y, n).unwrap(), &want);
    }
}

#[test]
fn rope_matches_cpu_up_to_32k() {
    let mut r = rng("rope");
    let e = env();
    let gpu = &e.gpu;
    // pairs 0: a norm alone (Gemma 4's v norm, written to its cache)
    for (theta, factor, d, pairs) in [(10_000f32, 1f32, 64usize, 32usize), (1_000_000.0, 8.0, 128, 48), (10_000.0, 1.0, 512, 256), (1.0, 1.0, 32, 0)] {
        let (t, heads) = (6usize, 3usize);
        let mut pos: Vec<u32> = (0..t).map(|_| r.gen_range(0..32768)).collect();
        pos[0] = 0;
        pos[1] = 32767;
        let x = randn(&mut r, t * heads * d, 1.0);
        let (xb, pb) = (gpu.upload_f32("x", &x), gpu.upload_u32("pos", &pos));
        // plain, and behind a per-head RMSNorm (no weight, w, 1 + w)
        for norm in
            [None, Some((NormScale::None, None)), Some((NormScale::W, Some(FloatType::Bf16))), Some((NormScale::OnePlusW, Some(FloatType::F32)))]
        {
            let nwv = randn(&mut r, d, 1.0);
            let nwt = norm.and_then(|(_, t)| t).map(|t| float_tensor(t, &[d], &nwv));
            let mut xin = x.clone();
            if let Some((scale, _)) = norm {
                let nwf = nwt.as_ref().map(|t| t.to_f32());
                cpu::rms_norm(&x, nwf.as_deref(), d, 1e-6, scale, &mut xin);
            }
            let mut want = vec![0f32; x.len()];
            cpu::rope(&xin, &pos, heads, d, theta, factor, pairs, &mut want);
            for (label, ks) in &e.variants {
                let k = ks.rope(norm.map(|(_, t)| t)).unwrap();
                let p = gpu.uniform("p", &k.params(t, heads, d, theta, factor, pairs).with_norm(norm.map(|(s, _)| (s, 1e-6))));
                let nwb = nwt.as_ref().map(|t| gpu.upload("nw", &t.bytes));
                let out = gpu.storage("out", (x.len() * 4) as u64);
                let bg = k.bind_group(&gpu.device, &p, &xb, &pb, &out, nwb.as_ref());
                run(gpu, |pass| k.dispatch(pass, &bg, t, heads, d));
                check_tol(
                    &format!("rope theta={theta} factor={factor} d={d} pairs={pairs} norm={:?} [{label}]", norm.map(|n| n.0)),
                    &gpu.read_f32(&out, x.len()).unwrap(),
                    &want,
                    1e-5,
                    1e-6,
                );
                // normed heads 1..3 written to the slots of a cache (k's norm, RoPE and write)
                if let Some((scale, nt)) = norm {
                    let (h0, hc, slots) = (1usize, 2usize, 8usize);
                    let cpos: Vec<u32> = (0..t as u32).map(|i| 32760 + i).collect();
                    let sel = cpu::head_range(&xin, &[t, heads, d], Some(HeadRange { start: h0, count: hc }));
                    let mut rows = vec![0f32; sel.len()];
                    cpu::rope(&sel, &cpos, hc, d, theta, factor, pairs, &mut rows);
                    let mut want_c = vec![0f32; slots * hc * d];
                    cpu::kv_write(&rows, &cpos, hc * d, &mut want_c);
                    let k = ks.rope_to_cache(nt).unwrap();
                    let p = gpu.uniform(
                        "p",
                        &k.params(t, hc, d, theta, factor, pairs).with_norm(Some((scale, 1e-6))).with_heads(heads, h0).with_slots(slots),
                    );
                    let cache = gpu.upload_f32("cache", &vec![0f32; slots * hc * d]);
                    let cpb = gpu.upload_u32("pos", &cpos);
                    let bg = k.bind_group(&gpu.device, &p, &xb, &cpb, &cache, nwb.as_ref());
                    run(gpu, |pass| k.dispatch(pass, &bg, t, hc, d));
                    check_tol(
                        &format!("norm_rope to cache d={d} pairs={pairs} norm={scale:?} [{label}]"),
                        &gpu.read_f32(&cache, want_c.len()).unwrap(),
                        &want_c,
                        1e-5,
                        1e-6,
                    );
                }
            }
        }
    }
}

#[test]
fn kv_write_ring() {
    let mut r = rng("kv_write");
    let e = env();
    let gpu = &e.gpu;
    let (t, nkv, d, slots) = (3usize, 2usize, 8usize, 5usize);
    let row = nkv * d;
    let base = r.gen_range(0..100u32);
    let pos: Vec<u32> = (0..t as u32).map(|i| base + i).collect();
    let x = randn(&mut r, t * row, 1.0);
    let mut cache = randn(&mut r, slots * row, 1.0);
    let cb = gpu.upload_f32("cache", &cache);
    cpu::kv_write(&x, &pos, row, &mut cache);
    let k = e.variants[0].1.kv_write().unwrap();
    let p = gpu.uniform("p", &k.params(t, row, slots));
    let (xb, pb) = (gpu.upload_f32("x", &x), gpu.upload_u32("pos", &pos));
    let bg = k.bind_group(&gpu.device, &p, &xb, &pb, &cb);
    run(gpu, |pass| k.dispatch(pass, &bg, t, row));
    assert_eq!(gpu.read_f32(&cb, slots * row).unwrap(), cache);
}

#[allow(clippy::too_many_arguments)]
fn attention_case(r: &mut StdRng, t: usize, nq: usize, nkv: usize, d: usize, slots: usize, window: Option<usize>, pos0: u32, nsplit: usize) {
    let e = env();
    let gpu = &e.gpu;
    let pos: Vec<u32> = (0..t as u32).map(|i| pos0 + i).collect();
    let q = randn(r, t * nq * d, 1.0);
    let kc = randn(r, slots * nkv * d, 1.0);
    let vc = randn(r, slots * nkv * d, 1.0);
    let scale = 1.0 / (d as f32).sqrt() * 2.0;
    let mut want = vec![0f32; q.len()];
    cpu::attention(&q, &pos, &pos, &kc, &vc, nq, nkv, d, scale, window, &mut want);
    let (qb, pb, kb, vb) = (gpu.upload_f32("q", &q), gpu.upload_u32("pos", &pos), gpu.upload_f32("k", &kc), gpu.upload_f32("v", &vc));
    // split partials merged by a combine dispatch, then by each head's last workgroup (twice:
    // the merging workgroup leaves its counter at zero for the next dispatch)
    let merges: &[bool] = if nsplit > 1 { &[false, true] } else { &[false] };
    for (label, ks) in &e.variants {
        for &merge in merges {
            let k = ks.attention_full(d, nsplit, None, merge, false).unwrap();
            let p = gpu.uniform("p", &k.params(t, nq, nkv, d, slots, scale, window));
            let sc = k.scratch(gpu, "attention", t, nq, d);
            for rep in 0..1 + merge as usize {
                let out = gpu.storage("out", (q.len() * 4) as u64);
                let bg = k.bind_groups(&gpu.device, &p, &qb, &pb, &kb, &vb, &out, sc.as_ref(), &[]);
                run(gpu, |pass| k.dispatch(pass, &bg, t, nq));
                check(
                    &format!("attention [{label}] T={t} nq={nq} nkv={nkv} D={d} S={slots} window={window:?} pos0={pos0} split={nsplit} merge={merge} run {rep}"),
                    &gpu.read_f32(&out, q.len()).unwrap(),
                    &want,
                );
            }
        }
    }
    // the queries' norm (bf16 weight, 1 + w) and RoPE done by the attention pass, from heads
    // 1..1 + nq of a value with nq + 2 heads
    let (xh, h0, pairs, theta) = (nq + 2, 1, d / 4, 10_000f32);
    let x = randn(r, t * xh * d, 3.0);
    let nwv = randn(r, d, 0.5);
    let nwt = float_tensor(FloatType::Bf16, &[d], &nwv);
    let mut xn = vec![0f32; x.len()];
    cpu::rms_norm(&x, Some(&nwt.to_f32()), d, 1e-6, NormScale::OnePlusW, &mut xn);
    let sel = cpu::head_range(&xn, &[t, xh, d], Some(HeadRange { start: h0, count: nq }));
    let mut qr = vec![0f32; sel.len()];
    cpu::rope(&sel, &pos, nq, d, theta, 1.0, pairs, &mut qr);
    let mut want = vec![0f32; qr.len()];
    cpu::attention(&qr, &pos, &pos, &kc, &vc, nq, nkv, d, scale, window, &mut want);
    let (xb, nwb) = (gpu.upload_f32("x", &x), gpu.upload("nw", &nwt.bytes));
    let rp = RopeParams::new(t, nq, d, theta, 1.0, pairs).with_norm(Some((NormScale::OnePlusW, 1e-6))).with_heads(xh, h0);
    let rpb = gpu.uniform("rope", &rp);
    for (label, ks) in &e.variants {
        for &merge in merges {
            let k = ks.attention_full(d, nsplit, Some(Some(FloatType::Bf16)), merge, false).unwrap();
            let p = gpu.uniform("p", &k.params(t, nq, nkv, d, slots, scale, window));
            let out = gpu.storage("out", (want.len() * 4) as u64);
            let sc = k.scratch(gpu, "attention", t, nq, d);
            let bg = k.bind_groups(&gpu.device, &p, &xb, &pb, &kb, &vb, &out, sc.as_ref(), &[(6, &rpb), (7, &nwb)]);
            run(gpu, |pass| k.dispatch(pass, &bg, t, nq));
            check(
                &format!("norm_rope_attention [{label}] T={t} nq={nq} nkv={nkv} D={d} S={slots} window={window:?} pos0={pos0} split={nsplit} merge={merge}"),
                &gpu.read_f32(&out, want.len()).unwrap(),
                &want,
            );
        }
    }
    if t == 1 {
        attention_append_case(r, &pos, (nq, nkv, d, slots), window, nsplit, (&kc, &vc));
    }
}

/// One token's attention appending its own key and value: heads 1.. of x are the queries, the
/// nkv after them the key (normed with a bf16 weight of its own and rotated), the nkv after
/// those the value; the caches hold other rows at the token's slot, which the pass must
/// overwrite and must not read.
fn attention_append_case(r: &mut StdRng, pos: &[u32], (nq, nkv, d, slots): (usize, usize, usize, usize), window: Option<usize>, nsplit: usize, (kc, vc): (&[f32], &[f32])) {
    let e = env();
    let gpu = &e.gpu;
    let (xh, pairs, theta, scale) = (1 + nq + 2 * nkv, d / 4, 10_000f32, 0.5);
    let (k0, v0) = (1 + nq, 1 + nq + nkv);
    let x = randn(r, xh * d, 3.0);
    let (qw, kw) = (float_tensor(FloatType::Bf16, &[d], &randn(r, d, 0.5)), float_tensor(FloatType::Bf16, &[d], &randn(r, d, 0.5)));
    let roped = |w: &RawTensor, h0: usize, count: usize| {
        let mut xn = vec![0f32; x.len()];
        cpu::rms_norm(&x, Some(&w.to_f32()), d, 1e-6, NormScale::OnePlusW, &mut xn);
        let sel = cpu::head_range(&xn, &[1, xh, d], Some(HeadRange { start: h0, count }));
        let mut out = vec![0f32; sel.len()];
        cpu::rope(&sel, pos, count, d, theta, 1.0, pairs, &mut out);
        out
    };
    let (q, k) = (roped(&qw, 1, nq), roped(&kw, k0, nkv));
    let v = cpu::head_range(&x, &[1, xh, d], Some(HeadRange { start: v0, count: nkv }));
    let (mut want_k, mut want_v) = (kc.to_vec(), vc.to_vec());
    cpu::kv_write(&k, pos, nkv * d, &mut want_k);
    cpu::kv_write(&v, pos, nkv * d, &mut want_v);
    let mut want = vec![0f32; nq * d];
    cpu::attention(&q, pos, pos, &want_k, &want_v, nq, nkv, d, scale, window, &mut want);
    let (xb, pb, qwb, kwb) = (gpu.upload_f32("x", &x), gpu.upload_u32("pos", pos), gpu.upload("qw", &qw.bytes), gpu.upload("kw", &kw.bytes));
    let rp = RopeParams::new(1, nq, d, theta, 1.0, pairs).with_norm(Some((NormScale::OnePlusW, 1e-6))).with_heads(xh, 1);
    let rpb = gpu.uniform("rope", &rp);
    let merges: &[bool] = if nsplit > 1 { &[false, true] } else { &[false] };
    for (label, ks) in &e.variants {
        for &merge in merges {
            let k = ks.attention_full(d, nsplit, Some(Some(FloatType::Bf16)), merge, true).unwrap();
            let p = gpu.uniform("p", &k.params(1, nq, nkv, d, slots, scale, window).with_append(k0, v0));
            let (kb, vb) = (gpu.upload_f32("k", kc), gpu.upload_f32("v", vc));
            let out = gpu.storage("out", (want.len() * 4) as u64);
            let sc = k.scratch(gpu, "attention", 1, nq, d);
            let bg = k.bind_groups(&gpu.device, &p, &xb, &pb, &kb, &vb, &out, sc.as_ref(), &[(6, &rpb), (7, &qwb), (10, &kwb)]);
            run(gpu, |pass| k.dispatch(pass, &bg, 1, nq));
            let case = format!("[{label}] nq={nq} nkv={nkv} D={d} S={slots} window={window:?} pos={} split={nsplit} merge={merge}", pos[0]);
            check(&format!("appending attention {case}"), &gpu.read_f32(&out, want.len()).unwrap(), &want);
            check(&format!("appended keys {case}"), &gpu.read_f32(&kb, want_k.len()).unwrap(), &want_k);
            check(&format!("appended values {case}"), &gpu.read_f32(&vb, want_v.len()).unwrap(), &want_v);
        }
    }
}

#[test]
fn attention_decode_prefill_window_split() {
    let mut r = rng("attention");
    // decode, causal, more keys than one tile
    attention_case(&mut r, 1, 4, 2, 64, 300, None, 290, 1);
    // decode, sliding window over a wrapped ring
    attention_case(&mut r, 1, 4, 1, 48, 64, Some(40), 1000, 1);
    // decode, split over workgroups, head dim 256
    attention_case(&mut r, 1, 2, 2, 256, 400, None, 399, 3);
    // decode, more splits than keys (empty splits)
    attention_case(&mut r, 1, 2, 1, 16, 8, None, 2, 5);
    // decode, head dim 512 and 13 splits: the merge's one split lane takes them in two rounds
    // of eight loads, the second partial; a sliding window over a wrapped ring
    attention_case(&mut r, 1, 2, 1, 512, 300, Some(250), 700, 13);
    // prefill, causal from 0, GQA 3:1, head dim 512
    attention_case(&mut r, 5, 3, 1, 512, 16, None, 0, 1);
    // prefill continuing at position 37 with a window of 20
    attention_case(&mut r, 7, 2, 2, 32, 64, Some(20), 37, 1);
}

// ------------------------------------------------------------------ elementwise

#[test]
fn elementwise_geglu_binary_unary() {
    let mut r = rng("elementwise");
    let e = env();
    let gpu = &e.gpu;
    let ks = &e.variants[0].1;
    let n = 3 * 257;
    let mut a = randn(&mut r, n, 4.0);
    a[0] = 80.0; // tanh argument clamp
    a[1] = -80.0;
    let b = randn(&mut r, n, 2.0);
    let (ab, bb) = (gpu.upload_f32("a", &a), gpu.upload_f32("b", &b));
    let out = gpu.storage("out", (n * 4) as u64);

    // GeGLU
    let k = ks.geglu().unwrap();
    let p = gpu.uniform("p", &ElementwiseParams::geglu(n));
    let bg = k.bind_group(&gpu.device, &p, &ab, &out, Some(&bb));
    run(gpu, |pass| k.dispatch(pass, &bg, n));
    let mut want = vec![0f32; n];
    cpu::geglu(&a, &b, &mut want);
    check("geglu", &gpu.read_f32(&out, n).unwrap(), &want);

    // Binary with broadcast: b over the last dim (257), and a single element; f32 and bf16 b
    for f in [BinaryOp::Add, BinaryOp::Mul] {
        for nb in [257usize, 1] {
            for bt in [FloatType::F32, FloatType::Bf16] {
                let bv = randn(&mut r, nb, 2.0);
                let braw = float_tensor(bt, &[nb], &bv);
                let bvals = braw.to_f32();
                let bbuf = gpu.upload("b", &braw.bytes);
                let k = ks.binary(bt).unwrap();
                let p = gpu.uniform("p", &ElementwiseParams::binary(f, n, nb));
                let bg = k.bind_group(&gpu.device, &p, &ab, &out, Some(&bbuf));
                run(gpu, |pass| k.dispatch(pass, &bg, n));
                let mut want = vec![0f32; n];
                cpu::binary(f, &a, &bvals, &mut want);
                check(&format!("binary {f:?} nb={nb} {bt:?}"), &gpu.read_f32(&out, n).unwrap(), &want);
            }
        }
    }

    // Unary
    for f in [UnaryOp::Scale { factor: 0.37 }, UnaryOp::Gelu, UnaryOp::Softcap { cap: 3.0 }] {
        let k = ks.unary().unwrap();
        let p = gpu.uniform("p", &ElementwiseParams::unary(f, n));
        let bg = k.bind_group(&gpu.device, &p, &ab, &out, None);
        run(gpu, |pass| k.dispatch(pass, &bg, n));
        let mut want = vec![0f32; n];
        cpu::unary(f, &a, &mut want);
        check(&format!("unary {f:?}"), &gpu.read_f32(&out, n).unwrap(), &want);
    }
}

// ------------------------------------------------------------------ routing

#[test]
fn top_k_softmax_weighted_sum() {
    let mut r = rng("routing");
    let e = env();
    let gpu = &e.gpu;
    let ks = &e.variants[0].1;
    let (t, ne, k) = (4usize, 37usize, 5usize);
    let mut logits = randn(&mut r, t * ne, 3.0);
    // ties: equal values must come out lower index first
    logits[3] = 2.5;
    logits[9] = 2.5;
    logits[20] = 2.5;
    logits[ne + 1] = -0.0;
    logits[ne + 2] = 0.0;
    let lb = gpu.upload_f32("logits", &logits);

    let tk = ks.top_k().unwrap();
    let p = gpu.uniform("p", &tk.params(t, ne, k));
    let idb = gpu.storage("ids", (t * k * 4) as u64);
    let bg = tk.bind_group(&gpu.device, &[(0, &p), (1, &lb), (2, &idb)]);
    run(gpu, |pass| tk.dispatch(pass, &bg, t * ne));
    let mut want_ids = vec![0u32; t * k];
    cpu::top_k(&logits, ne, k, &mut want_ids);
    let ids = gpu.read_u32(&idb, t * k).unwrap();
    assert_eq!(ids, want_ids, "top_k");

    for st in [None, Some(FloatType::Bf16), Some(FloatType::F32)] {
        let sv = randn(&mut r, ne, 2.0);
        let sraw = st.map(|s| float_tensor(s, &[ne], &sv));
        let svals = sraw.as_ref().map(|s| s.to_f32());
        let sbuf = sraw.as_ref().map(|s| gpu.upload("scale", &s.bytes));
        let ts = ks.top_k_softmax(st).unwrap();
        let p = gpu.uniform("p", &ts.params(t, ne, k));
        let out = gpu.storage("w", (t * k * 4) as u64);
        let mut bufs = vec![(0, &p), (1, &lb), (2, &idb), (3, &out)];
        if let Some(s) = &sbuf {
            bufs.push((4, s));
        }
        let bg = ts.bind_group(&gpu.device, &bufs);
        run(gpu, |pass| ts.dispatch(pass, &bg, t));
        let mut want = vec![0f32; t * k];
        cpu::top_k_softmax(&logits, ne, &want_ids, k, svals.as_deref(), &mut want);
        check(&format!("top_k_softmax scale={st:?}"), &gpu.read_f32(&out, t * k).unwrap(), &want);
    }

    let (s, d) = (4usize, 37usize);
    let x = randn(&mut r, t * s * d, 1.0);
    let w = randn(&mut r, t * s, 1.0);
    let ws = ks.weighted_sum().unwrap();
    let p = gpu.uniform("p", &ws.params(t, s, d));
    let (xb, wb) = (gpu.upload_f32("x", &x), gpu.upload_f32("w", &w));
    let out = gpu.storage("out", (t * d * 4) as u64);
    let bg = ws.bind_group(&gpu.device, &[(0, &p), (1, &xb), (2, &wb), (3, &out)]);
    run(gpu, |pass| ws.dispatch(pass, &bg, t * d));
    let mut want = vec![0f32; t * d];
    cpu::weighted_sum(&x, &w, s, d, &mut want);
    check("weighted_sum", &gpu.read_f32(&out, t * d).unwrap(), &want);
}

// ------------------------------------------------------------------ copy, argmax

#[test]
fn slice() {
    let mut r = rng("copy");
    let e = env();
    let gpu = &e.gpu;
    let ck = e.variants[0].1.copy().unwrap();
    let shape = [3usize, 7, 5];
    let x = randn(&mut r, 105, 1.0);
    let xb = gpu.upload_f32("x", &x);
    for axis in 0..3 {
        let start = 1;
        let len = shape[axis] - 2;
        let cp = CopyParams::slice(&shape, axis, start, len);
        let n = cp.elements();
        let p = gpu.uniform("p", &cp);
        let out = gpu.storage("out", (n * 4) as u64);
        let bg = ck.bind_group(&gpu.device, &p, &xb, &out);
        run(gpu, |pass| ck.dispatch(pass, &bg, &cp));
        let mut want = vec![0f32; n];
        cpu::slice(&x, &shape, axis, start, len, &mut want);
        assert_eq!(gpu.read_f32(&out, n).unwrap(), want, "slice axis {axis}");
    }
}

#[test]
fn argmax_large_vocab() {
    let mut r = rng("argmax");
    let e = env();
    let gpu = &e.gpu;
    let ak = e.variants[0].1.argmax().unwrap();
    for (t, v) in [(2usize, 262_144usize), (1, 37), (3, 100_003)] {
        let mut l = randn(&mut r, t * v, 10.0);
        // a tie for the max in the last row: the lower index wins
        let i1 = r.gen_range(0..v / 2);
        let i2 = r.gen_range(v / 2..v);
        l[(t - 1) * v + i1] = 50.0;
        l[(t - 1) * v + i2] = 50.0;
        let want = cpu::argmax(&l[(t - 1) * v..]);
        assert_eq!(want as usize, i1);
        let lb = gpu.upload_f32("l", &l);
        let p = gpu.uniform("p", &ArgmaxParams::last_row(t, v));
        let out = gpu.storage("out", 4);
        let bg = ak.bind_group(&gpu.device, &p, &lb, &out);
        run(gpu, |pass| ak.dispatch(pass, &bg));
        assert_eq!(gpu.read_u32(&out, 1).unwrap()[0], want, "argmax T={t} V={v}");
    }
}

// ------------------------------------------------------------------ device

#[test]
fn adapter_info_and_backend_parsing() {
    use markbase::gpu::device::Backend;
    let e = env();
    assert!(!e.gpu.info.name.is_empty());
    assert!(e.gpu.info.limits.max_storage_buffer_binding_size >= 128 << 20);
    for (s, b) in [("vulkan", Backend::Vulkan), ("VK", Backend::Vulkan), ("metal", Backend::Metal), ("dx12", Backend::Dx12), ("gl", Backend::Gl)] {
        assert_eq!(s.parse::<Backend>().unwrap(), b);
    }
    assert!("cuda".parse::<Backend>().is_err());
    // readback of an odd-sized upload (padded to 4 bytes)
    let b = e.gpu.upload("odd", &[1, 2, 3, 4, 5]);
    assert_eq!(e.gpu.readback(&b, 5).unwrap(), vec![1, 2, 3, 4, 5]);
}

// ------------------------------------------------------------------ sampling

/// `cpu::ops::sample`'s inverse-CDF stage over the same distribution, measuring how far (relative to the
/// kept mass) the uniform draw `u` lies from the CDF interval of token `g`: 0 when `g` is
/// the CPU's own pick. `None` when `g` is not kept.
fn cdf_distance(logits: &[f32], params: &[u32; 8], recent: &[u32], g: u32) -> Option<f64> {
    let d = match cpu::sample_distribution(logits, params, recent) {
        cpu::SampleDistribution::Greedy(t) => return Some(if t == g { 0.0 } else { f64::INFINITY }),
        cpu::SampleDistribution::Kept(d) => d,
    };
    let kept = d.kept_mass();
    let u = cpu::uniform(params[5], params[6]) as f64 * kept;
    let mut acc = 0f64;
    for (i, &v) in d.z.iter().enumerate() {
        if v >= d.threshold {
            let lo = acc;
            acc += d.weight(v);
            if i as u32 == g {
                return Some(if u < lo {
                    (lo - u) / kept
                } else if u >= acc {
                    (u - acc) / kept
                } else {
                    0.0
                });
            }
        }
    }
    None
}

#[test]
fn sample_matches_cpu() {
    use markbase::cpu::ops::SampleParams;
    let mut r = rng("sample");
    let e = env();
    let gpu = &e.gpu;
    let base = SampleParams::default();
    let cases = [
        SampleParams { temperature: 0.0, ..base },
        SampleParams { temperature: 0.0, repetition_penalty: 1.5, ..base },
        SampleParams { temperature: 1.0, ..base },
        SampleParams { temperature: 0.7, top_k: 5, ..base },
        SampleParams { temperature: 1.3, top_p: 0.9, ..base },
        SampleParams { temperature: 1.0, min_p: 0.05, ..base },
        SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.01, repetition_penalty: 1.3, ..base },
        // a top-k set spanning several chunks of the sampler
        SampleParams { temperature: 1.0, top_k: 3000, top_p: 0.5, repetition_penalty: 0.8, ..base },
    ];
    for (t, v) in [(2usize, 1000usize), (1, 262_144), (1, 5000)] {
        // V=1000: a flat distribution (many tokens in play), less than one chunk of the
        // sampler; V=262144: logits spread like a language model's (most mass on a few
        // thousand tokens); V=5000: a partial last chunk. Duplicates near the top
        // exercise ties in top-k / top-p. (On a flat 262144-token distribution the f32 GPU
        // and the f64 CPU may pick adjacent tokens when u falls within ~1e-7 of a boundary.)
        let amp = if v > 1000 { 6.0 } else { 2.0 };
        let mut l = randn(&mut r, t * v, amp);
        l[(t - 1) * v + 7] = amp - 0.01;
        l[(t - 1) * v + 11] = amp - 0.01;
        let recent: Vec<u32> = (0..64).map(|i| if i % 3 == 0 { 7 } else { r.gen_range(0..v as u32) }).collect();
        let lb = gpu.upload_f32("l", &l);
        let rb = gpu.upload_u32("recent", &recent);
        let p = gpu.uniform("p", &ArgmaxParams::last_row(t, v));
        let sampler = markbase::gpu::sample::Sampler::new(gpu, &e.variants[0].1, v).unwrap();
        let mut picks = std::collections::BTreeSet::new();
        let mut mismatches = 0;
        for sp in cases {
            for step in 0..3u32 {
                let sp = SampleParams { seed: r.gen(), ..sp };
                let n_recent = if sp.repetition_penalty != 1.0 { 50 } else { 0 };
                let words = sp.words(step, n_recent);
                let want = cpu::sample(&l[(t - 1) * v..], &words, &recent);
                let wb = gpu.upload_u32("words", &words);
                let out = gpu.storage("out", 4);
                let ds = sampler.dispatches(&gpu.device, &p, &lb, &wb, &rb, &out);
                run(gpu, |pass| markbase::gpu::sample::Sampler::record(pass, &ds));
                let got = gpu.read_u32(&out, 1).unwrap()[0];
                let row = &l[(t - 1) * v..];
                // the replica agrees with the CPU on its own pick
                assert_eq!(cdf_distance(row, &words, &recent, want), Some(0.0), "replica of cpu::sample");
                if got != want {
                    // f32 (GPU) vs f64 (CPU) masses: adjacent picks within 1e-6 of the kept mass
                    let dist = cdf_distance(row, &words, &recent, got);
                    println!("sample V={v} {sp:?} step {step}: gpu {got} cpu {want}, distance {dist:?}");
                    assert!(dist.is_some_and(|d| d <= 1e-6), "sample V={v} {sp:?} step {step}: gpu {got} cpu {want}, distance {dist:?}");
                    mismatches += 1;
                }
                picks.insert(got);
            }
        }
        // the draws are not all the same token (the comparison is not vacuous)
        assert!(picks.len() >= 5, "V={v}: only {} distinct tokens drawn", picks.len());
        assert!(mismatches <= 2, "V={v}: {mismatches} boundary mismatches");
    }
}

// ------------------------------------------------------------------ benchmark (ignored)

/// Decode GEMV bandwidth: `cargo test --release --test kernels -- --ignored gemv_bandwidth --nocapture`.
/// Streams `MARKBASE_BENCH_LAYERS` distinct weights of `[N, K]` (default 32 x [15360, 3840],
/// affine 4-bit g64: larger than any L2) through one compute pass, timed with timestamp
/// queries when the adapter has them (else wall clock), median of `MARKBASE_BENCH_ITERS`.
#[test]
#[ignore]
fn gemv_bandwidth() {
    let e = env();
    let gpu = &e.gpu;
    let envu = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (n, k) = (envu("MARKBASE_BENCH_N", 15360), envu("MARKBASE_BENCH_K", 3840));
    let layers = envu("MARKBASE_BENCH_LAYERS", 32);
    let iters = envu("MARKBASE_BENCH_ITERS", 20);
    let t = envu("MARKBASE_BENCH_T", 1);
    let mut r = StdRng::seed_from_u64(1);
    let fmts: Vec<GpuFormat> = match std::env::var("MARKBASE_BENCH_FMT").as_deref() {
        Ok("all") => vec![
            GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 },
            GpuFormat::Affine { bits: 8, group: 64, scale: FloatType::Bf16 },
            GpuFormat::Affine { bits: 6, group: 64, scale: FloatType::Bf16 },
            GpuFormat::Mxfp4,
            GpuFormat::Float(FloatType::Bf16),
        ],
        _ => vec![GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 }],
    };
    println!("adapter: {}", gpu.info.summary());
    for fmt in fmts {
        // one random weight, uploaded `layers` times (distinct buffers)
        let wd = random_weight(&mut r, fmt, &[n, k]);
        let ws: Vec<GpuWeight> = (0..layers).map(|_| upload_weight(gpu, &wd, None).unwrap()).collect();
        let (a, b, c) = fmt.row_bytes(k);
        let bytes_per_layer = (n * (a + b + c)) as f64;
        let x = gpu.upload_f32("x", &randn(&mut r, t * k, 1.0));
        let y = gpu.storage("y", (t * n * 4) as u64);
        let checks = match std::env::var("MARKBASE_BENCH_CHECKS").as_deref() {
            Ok("compare") => vec![ShaderChecks::All, ShaderChecks::BoundsOnly, ShaderChecks::None],
            _ => vec![ShaderChecks::from_env()],
        };
        let mut kss = Vec::new();
        for &c in &checks {
            for sg in [false, true] {
                if !sg || gpu.info.subgroups {
                    let label = format!("{}{c:?}", if sg { "subgroup " } else { "plain " });
                    kss.push((label, Kernels::new(gpu, KernelOptions { subgroups: sg, checks: c, half_blocks: true, merge_splits: false, coop: markbase::gpu::ops::gemm_f16::CoopMode::Off }).unwrap()));
                }
            }
        }
        // MARKBASE_BENCH_KIND=norm: RMSNorm fused in front (bf16 norm weight, `norm_matmul`);
        // geglu: two weights per layer in one dual GEMV (`norm_geglu`); plain otherwise
        let kind = std::env::var("MARKBASE_BENCH_KIND").unwrap_or_default();
        let nw = gpu.upload("nw", &bf16_bytes(&randn(&mut r, k, 1.0)));
        for (label, ks) in &kss {
            let mm = match kind.as_str() {
                "norm" => ks.norm_matmul(fmt, k, Some(FloatType::Bf16)).unwrap(),
                "geglu" => ks.norm_geglu(fmt, k, n, Some(FloatType::Bf16)).unwrap(),
                _ => ks.matmul(fmt, k, t, false).unwrap(),
            };
            let d = MatMulDims::plain(&ws[0], 0, t);
            let d = if kind.is_empty() { d } else { d.with_norm(NormScale::OnePlusW, 1e-6) };
            let pb = gpu.uniform("p", &mm.params(&d));
            // MARKBASE_BENCH_DISTINCT_Y=1: one output per layer (independent dispatches, no
            // barriers between them) instead of one shared output (dependent, like a model)
            let distinct = std::env::var("MARKBASE_BENCH_DISTINCT_Y").is_ok_and(|v| v == "1");
            let ys: Vec<wgpu::Buffer> = if distinct { (0..layers).map(|_| gpu.storage("y", (t * n * 4) as u64)).collect() } else { vec![] };
            let bgs: Vec<wgpu::BindGroup> = ws
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let y = if distinct { &ys[i] } else { &y };
                    match kind.as_str() {
                        "norm" => mm.bind_group_norm(&gpu.device, &pb, &x, y, Some(&nw), w, None, 0),
                        "geglu" => mm.bind_group_norm(&gpu.device, &pb, &x, y, Some(&nw), w, Some(&ws[(i + 1) % layers]), 0),
                        _ => mm.bind_group(&gpu.device, &pb, &x, y, None, w, 0),
                    }
                })
                .collect();
            let med = median_pass_seconds(gpu, iters, |pass| {
                for bg in &bgs {
                    mm.dispatch(pass, bg, &d);
                }
            });
            let per = med / layers as f64;
            let bytes_per_layer = if kind == "geglu" { 2.0 * bytes_per_layer } else { bytes_per_layer };
            println!(
                "BENCH gemv {} [{label}] {} T={t} N={n} K={k}: {:.1} us/layer, {:.0} GB/s (median of {iters}, {layers} layers, {:.1} MB each, {})",
                fmt.describe(),
                mm.kernel.name,
                per * 1e6,
                bytes_per_layer / per / 1e9,
                bytes_per_layer / 1e6,
                if gpu.info.timestamps { "timestamps" } else { "wall clock" }
            );
        }
    }
}

/// Prefill expert matmul, gathered GEMV (one expert weight read per pair) against the
/// grouping plus grouped GEMM (one read per expert):
/// `cargo test --release --test kernels -- --ignored grouped_vs_gathered --nocapture`.
/// Shapes `MARKBASE_BENCH_{E,N,K,S,T}` (default Gemma 4 26B-A4B's gate projection, 256
/// tokens), affine 4-bit g64, random routing; wall clock, median of `MARKBASE_BENCH_ITERS`.
#[test]
#[ignore]
fn grouped_vs_gathered_bench() {
    let e = env();
    let gpu = &e.gpu;
    let envu = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (ne, n, k) = (envu("MARKBASE_BENCH_E", 128), envu("MARKBASE_BENCH_N", 704), envu("MARKBASE_BENCH_K", 2816));
    let (s, t, iters) = (envu("MARKBASE_BENCH_S", 8), envu("MARKBASE_BENCH_T", 256), envu("MARKBASE_BENCH_ITERS", 5));
    let fmt = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let mut r = StdRng::seed_from_u64(1);
    let wd = random_weight(&mut r, fmt, &[ne, n, k]);
    let gw = upload_weight(gpu, &wd, None).unwrap();
    let np = t * s;
    let ids = routing(&mut r, "uniform", t, s, ne);
    let xb = gpu.upload_f32("x", &randn(&mut r, t * k, 1.0));
    let idb = gpu.upload_u32("ids", &ids);
    let groups = gpu.storage("groups", ((ne + 1 + np) * 4) as u64);
    let y = gpu.storage("y", (np * n * 4) as u64);
    let ks = &e.variants.last().unwrap().1;
    let time = |f: &dyn Fn(&mut wgpu::ComputePass<'_>)| {
        let mut v: Vec<f64> = (0..iters + 1)
            .map(|_| {
                let t0 = std::time::Instant::now();
                run(gpu, f);
                t0.elapsed().as_secs_f64()
            })
            .skip(1)
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::gathered(&gw, c, t, s, true)).collect();
    let gather = ks.matmul(fmt, k, np, true).unwrap();
    let gp: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &gather.params(d))).collect();
    let gbg: Vec<wgpu::BindGroup> = (0..dims.len()).map(|c| gather.bind_group(&gpu.device, &gp[c], &xb, &y, Some(&idb), &gw, c)).collect();
    let gathered = time(&|pass| {
        for (c, d) in dims.iter().enumerate() {
            gather.dispatch(pass, &gbg[c], d);
        }
    });
    let mg = ks.moe_group().unwrap();
    let mgp = gpu.uniform("p", &mg.params(np, ne));
    let mgbg = mg.bind_group(&gpu.device, &mgp, &idb, &groups);
    let gm = ks.grouped_matmul(fmt, k).unwrap();
    let qp: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &gm.params(d))).collect();
    let qbg: Vec<wgpu::BindGroup> = (0..dims.len()).map(|c| gm.bind_group(&gpu.device, &qp[c], &xb, &y, Some(&groups), &gw, c)).collect();
    let group_only = time(&|pass| mg.dispatch(pass, &mgbg));
    let grouped = time(&|pass| {
        mg.dispatch(pass, &mgbg);
        for (c, d) in dims.iter().enumerate() {
            gm.dispatch(pass, &qbg[c], d);
        }
    });
    println!(
        "BENCH experts E={ne} N={n} K={k} S={s} T={t} {}: gathered GEMV {:.2} ms, grouping {:.2} ms + grouped GEMM = {:.2} ms ({:.1}x)",
        fmt.describe(),
        gathered * 1e3,
        group_only * 1e3,
        grouped * 1e3,
        gathered / grouped
    );
}

/// The memory path without a GEMV: `cargo test --release --test kernels -- --ignored
/// stream_bandwidth --nocapture`. `MARKBASE_BENCH_LAYERS` (32) dispatches, each reading its own
/// buffer of `MARKBASE_BENCH_MB` (33; 0: no reads, the cost of a dispatch and its barrier alone)
/// as vec4 words, `MARKBASE_BENCH_UNROLL` (4) words per invocation, workgroups of
/// `MARKBASE_BENCH_WG` (256); one output shared by all (dependent: a barrier between
/// dispatches) or, with `MARKBASE_BENCH_DISTINCT_Y=1`, one each. Timestamps, median of 20.
#[test]
#[ignore]
fn stream_bandwidth() {
    let gpu = &env().gpu;
    let envu = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let mb = envu("MARKBASE_BENCH_MB", 33);
    let layers = envu("MARKBASE_BENCH_LAYERS", 32);
    let unroll = envu("MARKBASE_BENCH_UNROLL", 4);
    let wg = envu("MARKBASE_BENCH_WG", 256);
    let distinct = std::env::var("MARKBASE_BENCH_DISTINCT_Y").is_ok_and(|v| v == "1");
    let words = (mb << 20) / 16;
    let src = format!(
        "@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;\n\
         @group(0) @binding(1) var<storage, read_write> y: array<u32>;\n\
         const WG: u32 = {wg}u;\nconst U: u32 = {unroll}u;\nconst N: u32 = {words}u;\n\
         @compute @workgroup_size(WG)\n\
         fn main(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) g: vec3<u32>) {{\n\
           let base = g.x * WG * U + l;\n\
           var a = vec4<u32>(0u);\n\
           for (var i = 0u; i < U; i++) {{ let j = base + i * WG; if j < N {{ a ^= w[j]; }} }}\n\
           let s = (a.x ^ a.y) ^ (a.z ^ a.w);\n\
           if l == 0u || s == 0x9e3779b9u {{ y[g.x] = s; }}\n\
         }}\n"
    );
    let module = gpu.device.create_shader_module(wgpu::ShaderModuleDescriptor { label: Some("stream"), source: wgpu::ShaderSource::Wgsl(src.into()) });
    let pipe = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("stream"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let groups = words.div_ceil(wg * unroll).max(1);
    let ws: Vec<wgpu::Buffer> = (0..layers).map(|_| gpu.storage("w", (words.max(1) * 16) as u64)).collect();
    let ys: Vec<wgpu::Buffer> = (0..if distinct { layers } else { 1 }).map(|_| gpu.storage("y", (groups * 4) as u64)).collect();
    let bgl = pipe.get_bind_group_layout(0);
    let bgs: Vec<wgpu::BindGroup> = ws
        .iter()
        .enumerate()
        .map(|(i, w)| {
            gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &bgl,
                entries: &[
                    wgpu::BindGroupEntry { binding: 0, resource: w.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 1, resource: ys[if distinct { i } else { 0 }].as_entire_binding() },
                ],
            })
        })
        .collect();
    assert!(gpu.info.timestamps, "stream_bandwidth needs timestamp queries");
    let med = median_pass_seconds(gpu, 20, |pass| {
        pass.set_pipeline(&pipe);
        for bg in &bgs {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(groups as u32, 1, 1);
        }
    });
    let per = med / layers as f64;
    println!(
        "BENCH stream {mb} MB wg={wg} unroll={unroll} groups={groups} {}: {:.2} us/dispatch, {:.0} GB/s",
        if distinct { "independent" } else { "dependent" },
        per * 1e6,
        (words * 16) as f64 / per / 1e9
    );
}

/// Sampler time per step over 262,144 logits: `cargo test --release --test kernels -- --ignored
/// sample_bench --nocapture`. Median of 20 passes timed with timestamp queries.
#[test]
#[ignore]
fn sample_bench() {
    use markbase::cpu::ops::SampleParams;
    use markbase::gpu::sample::Sampler;
    let e = env();
    let gpu = &e.gpu;
    assert!(gpu.info.timestamps, "sample_bench needs timestamp queries");
    let mut r = rng("sample_bench");
    let v = 262_144;
    let l = randn(&mut r, v, 6.0);
    let recent: Vec<u32> = (0..64).map(|_| r.gen_range(0..v as u32)).collect();
    let lb = gpu.upload_f32("l", &l);
    let rb = gpu.upload_u32("recent", &recent);
    let p = gpu.uniform("p", &ArgmaxParams::last_row(1, v));
    let out = gpu.storage("out", 4);
    let sampler = Sampler::new(gpu, &e.variants[0].1, v).unwrap();
    let base = SampleParams::default();
    let cases = [
        ("greedy", base),
        ("t0.7 top_p0.9", SampleParams { temperature: 0.7, top_p: 0.9, seed: 1, ..base }),
        ("t0.8 k40 p0.95 pen1.3", SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.01, repetition_penalty: 1.3, seed: 1 }),
        ("t1.0 (no filters)", SampleParams { temperature: 1.0, seed: 1, ..base }),
    ];
    for (name, sp) in cases {
        let n_recent = if sp.repetition_penalty != 1.0 { 64 } else { 0 };
        let wb = gpu.upload_u32("words", &sp.words(0, n_recent));
        let ds = sampler.dispatches(&gpu.device, &p, &lb, &wb, &rb, &out);
        let med = median_pass_seconds(gpu, 20, |pass| Sampler::record(pass, &ds));
        let got = gpu.read_u32(&out, 1).unwrap()[0];
        let want = cpu::sample(&l, &sp.words(0, n_recent), &recent);
        println!("sample V={v} {name}: {:.1} us per step ({} dispatches), token {got} (cpu {want})", med * 1e6, ds.len());
    }
}
