//! The expert-grouped GEMM on f16 tiles (`gemm_coop.wgsl` with GROUPED, its activations' pass
//! over x's own rows) against the CPU: its FMA twin on every adapter with f16 (CI's software
//! rasterizer included), and the cooperative-matrix kernel where the adapter has them. Routings
//! that leave an expert without pairs, give one a single pair and one more pairs than a tile
//! holds; weight rows and K that leave partial tiles and steps; expert stacks in chunks; x per
//! token (shared by its pairs) and per pair; activations up to 1e6.
//!
//! Bounds as the dense f16 GEMM's (`tests/gemm_f16.rs`), per element of the sum over k of
//! |x[q, k]| |W_e[r, k]|: 4e-6 where both inputs are exact (hi + lo pairs, or weights exact in
//! f16), 6e-4 with the activations split and weights rounded, 1.2e-3 with one f16 each.
//! The tests FAIL (never skip) when no adapter is found.

#[path = "common/f16_gemm.rs"]
mod f16_gemm;
#[path = "common/kernel_data.rs"]
mod kernel_data;

use f16_gemm::{kernels, worst};
use kernel_data::*;
use markbase::cpu::ops as cpu;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{KernelOptions, KernelSpec, Kernels, MatMulDims, MatMulKernel};
use markbase::gpu::ops::gemm_f16::{self, CoopMode, Hilo};
use markbase::gpu::weights::{upload_weight, GpuFormat, GpuWeight};
use markbase::graph::quant::FloatType;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

/// Expert ids of `counts[e]` pairs for each expert e, in a random order.
fn routing(r: &mut StdRng, counts: &[usize]) -> Vec<u32> {
    let mut ids: Vec<u32> = counts.iter().enumerate().flat_map(|(e, &c)| std::iter::repeat_n(e as u32, c)).collect();
    ids.shuffle(r);
    ids
}

/// The variants checked for `fmt` over rows of `k`: the format's split with both tiles, both
/// inputs split with tiles of 64 tokens, no split with tiles of 128.
fn variants(fmt: GpuFormat, k: usize) -> Vec<(Hilo, u8, bool, bool)> {
    let split = gemm_f16::hilo(fmt, k);
    let center = split == Hilo::X && gemm_f16::center(fmt, k);
    let mut v = vec![];
    for c in [(split, 2, gemm_f16::vs(split), center), (split, 4, gemm_f16::vs(split), center), (Hilo::Both, 2, false, false), (Hilo::Off, 4, true, false)] {
        if !v.contains(&c) {
            v.push(c);
        }
    }
    v
}

/// The grouped f16 GEMM `mm` of `kk` over the stack `gw` for `t` tokens of `s` pairs grouped
/// by `groups`: its activations' pass over x's rows, then a dispatch per chunk. Returns the
/// pairs' rows (every one must be written: y starts as NaN).
#[allow(clippy::too_many_arguments)]
fn run_grouped(gpu: &Gpu, kk: &Kernels, mm: &MatMulKernel, gw: &GpuWeight, x: &[f32], groups: &[u32], (t, s): (usize, usize), x_bcast: bool) -> Vec<f32> {
    let (n, k) = (gw.rows_per_expert, gw.k);
    let xrows = if x_bcast { t } else { t * s };
    assert_eq!(x.len(), xrows * k);
    let xb = gpu.upload_f32("x", x);
    let gb = gpu.upload_u32("groups", groups);
    let y = gpu.upload_f32("y", &vec![f32::NAN; t * s * n]);
    let scales = gpu.storage("scales", (xrows * 4) as u64);
    let x16 = gpu.storage("x16", gemm_f16::x16_bytes(&mm.spec, xrows, k));
    let rk = kk.row_scale(mm, k).unwrap();
    let rp = gpu.uniform("rp", &mm.params(&MatMulDims::plain(gw, 0, xrows)));
    let rbg = rk.bind_buffers(&gpu.device, &[(0, &rp), (1, &xb), (5, &x16), (7, &scales)]);
    let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::gathered(gw, c, t, s, x_bcast)).collect();
    let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
    let bgs: Vec<wgpu::BindGroup> = (0..dims.len()).map(|c| mm.bind_group_f16(&gpu.device, &params[c], &x16, &y, &scales, Some(&gb), None, gw, c)).collect();
    run(gpu, |pass| {
        rk.dispatch(pass, &rbg, gemm_f16::row_scale_groups(xrows, 65535));
        for (c, d) in dims.iter().enumerate() {
            mm.dispatch(pass, &bgs[c], d);
        }
    });
    gpu.read_f32(&y, t * s * n).unwrap()
}

/// One case: a `[counts.len(), n, k]` stack of `fmt` in `nchunks` chunks, `t` tokens of `s` pairs
/// routed by `counts`, x per token (`x_bcast`) or per pair, its rows' largest |x| at
/// `amps[row % amps.len()]`. Returns the worst error seen (of sum|x||w|).
#[allow(clippy::too_many_arguments)]
fn case(gpu: &Gpu, ks: &[(&str, Kernels, bool)], r: &mut StdRng, fmt: GpuFormat, (n, k): (usize, usize), (t, s): (usize, usize), counts: &[usize], nchunks: usize, x_bcast: bool, amps: &[f32]) -> f32 {
    let ne = counts.len();
    let np = t * s;
    assert_eq!(counts.iter().sum::<usize>(), np);
    let wd = random_weight(r, fmt, &[ne, n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[ne, n, k], nchunks))).unwrap();
    assert_eq!(gw.chunks.len(), nchunks, "{}: chunk count", fmt.describe());
    let ids = routing(r, counts);
    let xrows = if x_bcast { t } else { np };
    let mut x = vec![0f32; xrows * k];
    for (i, row) in x.chunks_mut(k).enumerate() {
        let amp = amps[i % amps.len()];
        for v in row.iter_mut() {
            *v = r.gen_range(-amp..amp);
        }
        row[r.gen_range(0..k)] = amp;
    }
    let groups = cpu::moe_group(&ids, ne).unwrap();
    let mut want = vec![0f32; np * n];
    cpu::grouped_matmul(&x, x_bcast, &ids, s, &groups, &wref, n, k, &mut want).unwrap();
    let ax: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let aw: Vec<f32> = wref.iter().map(|v| v.abs()).collect();
    let mut mag = vec![0f32; np * n];
    cpu::grouped_matmul(&ax, x_bcast, &ids, s, &groups, &aw, n, k, &mut mag).unwrap();
    let mut worst_all = 0f32;
    for (label, kk, coop) in ks {
        for (hilo, mt, vs, center) in variants(fmt, k) {
            let spec = KernelSpec::GemmF16 { fmt, coop: *coop, m8: false, hilo, mt, nt: 2, vs, center, bk: 32, db: false, grouped: true, split: false };
            if gemm_f16::spec_smem_bytes(&spec) > gpu.limits().max_compute_workgroup_storage_size {
                continue;
            }
            let mm = kk.matmul_spec(spec).unwrap();
            let exact_w = center || gemm_f16::values_in_f16(fmt);
            let bound = f16_gemm::bound(hilo, exact_w);
            let got = run_grouped(gpu, kk, &mm, &gw, &x, &groups, (t, s), x_bcast);
            let what = format!(
                "{} {} pairs {counts:?} N={n} K={k} T={t} S={s} chunks={nchunks} bcast={x_bcast} max|x| {amps:?}",
                mm.kernel.name,
                fmt.describe()
            );
            let worst = worst(&got, &want, &mag);
            let i = worst.0;
            println!("[{label}] {what}: worst error {:.2e} of sum|x||w|", worst.1);
            assert!(worst.1 <= bound, "[{label}] {what}: pair {} (expert {}) row {}: gpu {} cpu {} (sum|x||w| {}), {:.2e} of it", i / n, ids[i / n], i % n, got[i], want[i], mag[i], worst.1);
            worst_all = worst_all.max(worst.1);
        }
    }
    worst_all
}

#[test]
fn grouped_gemm_f16_formats_awkward_routings() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    println!("adapter: {}", gpu.info.summary());
    let ks = kernels(&gpu);
    let mut r = rng("gemm_f16_grouped");
    let q4 = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let q8 = GpuFormat::Affine { bits: 8, group: 64, scale: FloatType::Bf16 };
    // experts without pairs (0, 5), with one (1), past a tile of 128 (2)
    let counts = [0, 1, 140, 30, 29, 0];
    let mut worst = 0f32;
    // 200 rows: a whole row tile and a partial one; K past the last step of 64
    worst = worst.max(case(&gpu, &ks, &mut r, q4, (200, 320), (100, 2), &counts, 1, true, &[1.0, 1e5]));
    worst = worst.max(case(&gpu, &ks, &mut r, q8, (70, 192), (100, 2), &counts, 3, false, &[2.0, 7e5, 1.0]));
    worst = worst.max(case(&gpu, &ks, &mut r, GpuFormat::Float(FloatType::Bf16), (131, 98), (50, 4), &counts, 2, true, &[0.5, 1e6]));
    worst = worst.max(case(&gpu, &ks, &mut r, GpuFormat::Mxfp4, (64, 160), (100, 2), &counts, 3, false, &[1e6, 40000.0, 65504.0, 1.0]));
    // a global scale per expert
    worst = worst.max(case(&gpu, &ks, &mut r, GpuFormat::Nvfp4 { global: true }, (37, 336), (40, 5), &[7, 0, 1, 72, 0, 120], 3, true, &[1.0, 3e5]));
    println!("worst error of all cases: {worst:.2e} of sum|x||w|");
}

/// A pair's result is the same bits however many pairs its expert has and wherever in its
/// expert's tiles it lands: tokens routed as before, after others that load the experts (one of
/// them from a single pair to past a tile of 128) and shift every pair's place in its list.
#[test]
fn grouped_gemm_f16_rows_independent_of_their_tiles() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let ks = kernels(&gpu);
    let mut r = rng("gemm_f16_grouped_rows");
    let q4 = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let (ne, n, k, s) = (4, 40, 192, 2);
    let gw = upload_weight(&gpu, &random_weight(&mut r, q4, &[ne, n, k]), Some(chunk_limit(q4, &[ne, n, k], 2))).unwrap();
    // 12 tokens: expert 1 takes one pair; 75 tokens in front of them, 140 of their pairs on expert 1
    let (t0, t1) = (12, 75);
    let ids0: Vec<u32> = (0..t0 * s).map(|q| if q == 5 { 1 } else { [0, 2, 3][q % 3] }).collect();
    let front: Vec<u32> = (0..t1 * s).map(|q| if q < 140 { 1 } else { (q % 4) as u32 }).collect();
    let ids1: Vec<u32> = front.iter().chain(&ids0).copied().collect();
    let x0 = randn(&mut r, t0 * k, 1.0);
    let x1: Vec<f32> = randn(&mut r, t1 * k, 1.0).into_iter().chain(x0.iter().copied()).collect();
    for (label, kk, _) in &ks {
        for mt in [2, 4] {
            let mm = kk.grouped_matmul_rows(q4, k, n, 1 << 20, ne).unwrap();
            let KernelSpec::GemmF16 { hilo, vs, center, coop, m8, .. } = mm.spec else { panic!("{}: not the f16 GEMM", mm.kernel.name) };
            let mm = kk.matmul_spec(KernelSpec::GemmF16 { fmt: q4, coop, m8, hilo, mt, nt: 2, vs, center, bk: 32, db: false, grouped: true, split: false }).unwrap();
            let y0 = run_grouped(&gpu, kk, &mm, &gw, &x0, &cpu::moe_group(&ids0, ne).unwrap(), (t0, s), true);
            let y1 = run_grouped(&gpu, kk, &mm, &gw, &x1, &cpu::moe_group(&ids1, ne).unwrap(), (t0 + t1, s), true);
            let tail = &y1[t1 * s * n..];
            let same = y0.iter().zip(tail).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "[{label}] {}: a pair's result depends on the other pairs of its expert", mm.kernel.name);
            println!("[{label}] {}: {} results bit-identical", mm.kernel.name, y0.len());
        }
    }
}

/// Where the grouped GEMM runs on f16 tiles: where the f16 GEMM is on and one expert's weight
/// is large enough for the pairs' work; the f32 one elsewhere.
#[test]
fn grouped_gemm_f16_selection() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let opts = |coop| KernelOptions { coop, ..KernelOptions::for_gpu(&gpu) };
    let fma = Kernels::new(&gpu, opts(CoopMode::Fma)).unwrap();
    let off = Kernels::new(&gpu, opts(CoopMode::Off)).unwrap();
    let q4 = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let min = gemm_f16::min_weight();
    // Gemma 4 26B-A4B's gate at 512 tokens of 8 pairs each
    let (n, k, pairs, e) = (704, 2816, 4096, 128);
    let mm = fma.grouped_matmul_rows(q4, k, n, pairs, e).unwrap();
    if gemm_f16::takes_f16(n, k, pairs) {
        assert!(matches!(mm.spec, KernelSpec::GemmF16 { grouped: true, fmt, .. } if fmt == q4), "{:?}", mm.spec);
        assert!(mm.kernel.name.starts_with("gemm_f16_grouped["), "{}", mm.kernel.name);
    }
    let mm = off.grouped_matmul_rows(q4, k, n, pairs, e).unwrap();
    assert!(matches!(mm.spec, KernelSpec::GroupedGemm { .. }), "coop off: {:?}", mm.spec);
    // a small stack stays on the f32 GEMM
    let mm = fma.grouped_matmul_rows(q4, 64, 37, 8, 4).unwrap();
    assert_eq!(matches!(mm.spec, KernelSpec::GemmF16 { .. }), 37 * 64 * 512 >= min * 512, "{:?}", mm.spec);
    // a bad row length is a typed error
    assert!(fma.grouped_matmul_rows(q4, 100, 37, 8, 4).is_err());
}

/// Grouped GEMM throughput: `cargo test --release --test gemm_f16_grouped -- --ignored
/// throughput --nocapture`. Gemma 4 26B-A4B's experts (128 of gate and up [704, 2816], down
/// [2816, 704]; affine 4-bit g64) for `MARKBASE_BENCH_T` tokens (default 512) of 8 pairs each,
/// routed uniformly: the f32 grouped GEMM and the f16 one (with its activations' pass, and
/// alone), median of `MARKBASE_BENCH_ITERS` passes; TFLOP/s of the pairs' work, 2 P N K.
/// `MARKBASE_BENCH_EXPERTS` takes fewer experts (a quick run on a slow adapter).
#[test]
#[ignore]
fn throughput() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    println!("adapter: {}", gpu.info.summary());
    let envu = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (t, s, ne) = (envu("MARKBASE_BENCH_T", 512), 8, envu("MARKBASE_BENCH_EXPERTS", 128));
    let iters = envu("MARKBASE_BENCH_ITERS", 5);
    let fmt = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let mut r = rng("gemm_f16_grouped_throughput");
    let coop = if gpu.info.coop_f16_16 { CoopMode::Tensor } else { CoopMode::Fma };
    let opts = |coop| KernelOptions { coop, ..KernelOptions::for_gpu(&gpu) };
    let kf16 = Kernels::new(&gpu, opts(coop)).unwrap();
    let kf32 = Kernels::new(&gpu, opts(CoopMode::Off)).unwrap();
    let np = t * s;
    let ids: Vec<u32> = (0..t).flat_map(|_| rand::seq::index::sample(&mut r, ne, s).into_iter().map(|e| e as u32).collect::<Vec<_>>()).collect();
    let gb = gpu.upload_u32("groups", &cpu::moe_group(&ids, ne).unwrap());
    for (n, k, x_bcast) in [(704, 2816, true), (2816, 704, false)] {
        let wd = random_weight(&mut r, fmt, &[ne, n, k]);
        let w = upload_weight(&gpu, &wd, None).unwrap();
        let xrows = if x_bcast { t } else { np };
        let x = gpu.upload_f32("x", &randn(&mut r, xrows * k, 1.0));
        let y = gpu.storage("y", (np * n * 4) as u64);
        let flop = 2.0 * (np * n * k) as f64;
        let d = MatMulDims::gathered(&w, 0, t, s, x_bcast);
        let mm = kf32.grouped_matmul_rows(fmt, k, n, np, ne).unwrap();
        let pb = gpu.uniform("p", &mm.params(&d));
        let bg = mm.bind_group(&gpu.device, &pb, &x, &y, Some(&gb), &w, 0);
        let sec = median_pass_seconds(&gpu, iters, |pass| mm.dispatch(pass, &bg, &d));
        println!("BENCH grouped T={t} S={s} E={ne} N={n} K={k} {}: {:.1} us, {:.1} TFLOP/s", mm.kernel.name, sec * 1e6, flop / sec / 1e12);
        let mm = kf16.grouped_matmul_rows(fmt, k, n, np, ne).unwrap();
        assert!(mm.is_f16(), "{}", mm.kernel.name);
        let scales = gpu.storage("scales", (xrows * 4) as u64);
        let x16 = gpu.storage("x16", gemm_f16::x16_bytes(&mm.spec, xrows, k));
        let rk = kf16.row_scale(&mm, k).unwrap();
        let pb = gpu.uniform("p", &mm.params(&d));
        let rp = gpu.uniform("rp", &mm.params(&MatMulDims::plain(&w, 0, xrows)));
        let rbg = rk.bind_buffers(&gpu.device, &[(0, &rp), (1, &x), (5, &x16), (7, &scales)]);
        let bg = mm.bind_group_f16(&gpu.device, &pb, &x16, &y, &scales, Some(&gb), None, &w, 0);
        let rg = gemm_f16::row_scale_groups(xrows, 65535);
        let both = median_pass_seconds(&gpu, iters, |pass| {
            rk.dispatch(pass, &rbg, rg);
            mm.dispatch(pass, &bg, &d);
        });
        let gemm = median_pass_seconds(&gpu, iters, |pass| mm.dispatch(pass, &bg, &d));
        println!(
            "BENCH grouped T={t} S={s} E={ne} N={n} K={k} {}: {:.1} us ({:.1} with the activations' pass), {:.1} TFLOP/s ({:.1})",
            mm.kernel.name,
            gemm * 1e6,
            both * 1e6,
            flop / gemm / 1e12,
            flop / both / 1e12
        );
    }
}
