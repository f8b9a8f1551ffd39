//! The prefill GEMM on f16 tiles (`gemm_coop.wgsl` with its row scales) against the CPU: its FMA
//! twin on every adapter with f16 (CI's software rasterizer included), and the cooperative-matrix
//! kernel itself where the adapter has cooperative matrices (16 x 16 x 16, f16 -> f32). Every
//! weight format, shapes that leave partial tiles in every direction, weights in chunks, and
//! activations up to 1e6 (far past f16's 65504: the row scales keep them finite).
//!
//! Bound (one f16 per input): |gpu - cpu| <= 1.2e-3 x sum_k |x[t, k]| |W[r, k]| per element, with the CPU's products
//! in f32. Rounding x / s and W to f16 costs each product at most 2 x 2^-11 of its magnitude
//! (4.9e-4 each), so this is about the worst case (the FMA twin on lavapipe: 1.7e-4 at most); a
//! wrong element, tile or scale lands far above it. With each input as a hi + lo pair of f16
//! (the default), 4e-6 of the same sum (observed: 8.5e-7 at most).
//! The tests FAIL (never skip) when no adapter is found.

#[path = "common/f16_gemm.rs"]
mod f16_gemm;
#[path = "common/kernel_data.rs"]
mod kernel_data;

use f16_gemm::{kernels, worst};
use kernel_data::*;
use markbase::cpu::ops as cpu;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{all_formats, KernelOptions, KernelSpec, Kernels, MatMulDims};
use markbase::gpu::ops::gemm_f16::{self, CoopMode, Hilo};
use markbase::gpu::weights::{upload_weight, GpuFormat};
use markbase::graph::quant::FloatType;
use rand::rngs::StdRng;
use rand::Rng;

/// The kernel variants checked: (split, results per subgroup along the tokens and along the rows, vec4 buffers,
/// centred affine weights, K per step, double buffers); those whose workgroup memory exceeds the
/// adapter's are left out, and the centred ones where the format has no centring.
const VARIANTS: [(Hilo, u8, u8, bool, bool, u8, bool); 16] = [
    (Hilo::Both, 2, 2, false, false, 32, false),
    (Hilo::X, 4, 2, false, false, 32, false),
    (Hilo::Off, 4, 2, true, false, 32, false),
    (Hilo::Both, 2, 2, true, false, 32, false),
    (Hilo::X, 2, 2, true, true, 32, false),
    (Hilo::X, 4, 2, true, true, 32, false),
    (Hilo::X, 2, 2, true, true, 64, false),
    (Hilo::X, 2, 2, true, true, 32, true),
    (Hilo::Off, 2, 2, true, false, 64, true),
    (Hilo::Both, 2, 2, false, false, 64, false),
    (Hilo::Off, 2, 2, true, false, 32, true),
    (Hilo::Off, 4, 2, true, false, 64, false),
    (Hilo::Off, 4, 2, false, false, 32, true),
    (Hilo::X, 2, 4, true, true, 32, false),
    (Hilo::Off, 2, 4, true, false, 32, false),
    (Hilo::X, 4, 4, true, true, 32, false),
];

/// One case: W `[n, k]` of `fmt` in about `nchunks` chunks, `t` tokens whose rows have their
/// largest |x| at `amps[t % amps.len()]`.
fn case(gpu: &Gpu, ks: &[(&str, Kernels, bool)], r: &mut StdRng, fmt: GpuFormat, n: usize, k: usize, t: usize, nchunks: usize, amps: &[f32]) {
    let wd = random_weight(r, fmt, &[n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[n, k], nchunks))).unwrap();
    let mut x = vec![0f32; t * k];
    for (i, row) in x.chunks_mut(k).enumerate() {
        let amp = amps[i % amps.len()];
        for v in row.iter_mut() {
            *v = r.gen_range(-amp..amp);
        }
        row[r.gen_range(0..k)] = amp;
    }
    let mut want = vec![0f32; t * n];
    cpu::matmul(&x, &wref, k, n, &mut want);
    let ax: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let aw: Vec<f32> = wref.iter().map(|v| v.abs()).collect();
    let mut mag = vec![0f32; t * n];
    cpu::matmul(&ax, &aw, k, n, &mut mag);
    let xb = gpu.upload_f32("x", &x);
    for (label, kk, coop) in ks {
        let chosen = kk.matmul_rows(fmt, k, n, t, false).unwrap();
        if gemm_f16::takes_f16(n, k, t) {
            assert!(
                matches!(chosen.spec, KernelSpec::GemmF16 { fmt: f, coop: c, hilo: h, .. } if f == fmt && c == *coop && h == gemm_f16::hilo(fmt, k)),
                "{label}: the f16 GEMM is chosen, not {:?}",
                chosen.spec
            );
        } else {
            assert!(matches!(chosen.spec, KernelSpec::Gemm { .. }), "{label}: a small weight takes the f32 GEMM, not {:?}", chosen.spec);
        }
        // the variants, and the chosen kernel where it cuts K into parts (few tiles)
        let mut specs: Vec<KernelSpec> = VARIANTS
            .iter()
            .filter(|&&(hilo, mt, nt, _, center, bk, db)| gemm_f16::smem_bytes(*coop, hilo, mt, nt, bk, db) <= gpu.limits().max_compute_workgroup_storage_size && (!center || gemm_f16::center(fmt, k)))
            .map(|&(hilo, mt, nt, vs, center, bk, db)| KernelSpec::GemmF16 { fmt, coop: *coop, m8: false, hilo, mt, nt, vs, center, bk, db, grouped: false, split: false })
            .collect();
        if matches!(chosen.spec, KernelSpec::GemmF16 { split: true, .. }) {
            specs.push(chosen.spec);
        }
        for spec in specs {
            let KernelSpec::GemmF16 { hilo, mt, nt, vs, center, bk, db, split, .. } = spec else { unreachable!() };
            let mm = kk.matmul_spec(spec).unwrap();
            // centred weights are exact in f16: the activations' split alone bounds the error
            let exact_w = center || gemm_f16::values_in_f16(fmt);
            let bound = f16_gemm::bound(hilo, exact_w);
            let y = gpu.storage("y", (t * n * 4) as u64);
            gpu.queue.write_buffer(&y, 0, &vec![0xffu8; t * n * 4]);
            let scales = gpu.storage("scales", (t * 4) as u64);
            let x16 = gpu.storage("x16", gemm_f16::x16_bytes(&mm.spec, t, k));
            let rk = kk.row_scale(&mm, k).unwrap();
            let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::plain(&gw, c, t)).collect();
            let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
            let rbg = rk.bind_buffers(&gpu.device, &[(0, &params[0]), (1, &xb), (5, &x16), (7, &scales)]);
            let (pbytes, cbytes) = dims.iter().map(|d| mm.split_scratch_bytes(d)).fold((4, 4), |a, b| (a.0.max(b.0), a.1.max(b.1)));
            let (part, done) = (gpu.storage("part", pbytes), gpu.storage("done", cbytes));
            let scratch = split.then_some((&part, &done));
            let bgs: Vec<wgpu::BindGroup> = (0..gw.chunks.len()).map(|c| mm.bind_group_f16(&gpu.device, &params[c], &x16, &y, &scales, None, scratch, &gw, c)).collect();
            run(gpu, |pass| {
                rk.dispatch(pass, &rbg, gemm_f16::row_scale_groups(t, 65535));
                for (c, d) in dims.iter().enumerate() {
                    mm.dispatch(pass, &bgs[c], d);
                }
            });
            let got = gpu.read_f32(&y, t * n).unwrap();
            let what = format!("gemm_f16 {} [{label} {hilo:?} mt={mt} nt={nt} vs={vs} centred={center} bk={bk} db={db} parts={:?}] N={n} K={k} T={t} chunks={} max|x| {amps:?}", fmt.describe(), dims.iter().map(|d| mm.ksplit(d)).collect::<Vec<_>>(), gw.chunks.len());
            let worst = worst(&got, &want, &mag);
            let i = worst.0;
            println!("{what}: worst error {:.2e} of sum|x||w|", worst.1);
            assert!(worst.1 <= bound, "{what}: at token {} row {}: gpu {} cpu {} (sum|x||w| {}), {:.2e} of it", i / n, i % n, got[i], want[i], mag[i], worst.1);
        }
    }
}

#[test]
fn gemm_f16_every_format_partial_tiles_chunked() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    println!("adapter: {}", gpu.info.summary());
    let ks = kernels(&gpu);
    let mut r = rng("gemm_f16");
    for fmt in all_formats() {
        let k = match fmt {
            GpuFormat::Float(_) => 45,
            GpuFormat::Affine { group: 128, .. } => 384,
            GpuFormat::Nvfp4 { .. } => 336,
            _ => 320,
        };
        case(&gpu, &ks, &mut r, fmt, 37, k, 17, 3, &[1.0]);
    }
}

#[test]
fn gemm_f16_several_tiles_and_huge_activations() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let ks = kernels(&gpu);
    let mut r = rng("gemm_f16_tiles");
    let q4 = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    // two row tiles and three token tiles, the last ones partial; vec4 and scalar activations
    case(&gpu, &ks, &mut r, q4, 200, 256, 130, 1, &[1.0, 3.0]);
    case(&gpu, &ks, &mut r, GpuFormat::Float(FloatType::Bf16), 131, 98, 70, 1, &[0.5]);
    // centred groups of 32 with K = 352: a step of 64 holds the last weight columns and the
    // centring's first ones
    case(&gpu, &ks, &mut r, GpuFormat::Affine { bits: 4, group: 32, scale: FloatType::Bf16 }, 70, 352, 33, 1, &[1.0]);
    // Gemma's activations: rows at 1e5 and 1e6 beside ordinary ones (an unscaled f16 tile
    // would hold Inf)
    case(&gpu, &ks, &mut r, q4, 130, 512, 40, 2, &[2.0, 1e5, 7e5, 1e6]);
    case(&gpu, &ks, &mut r, GpuFormat::Mxfp4, 64, 256, 9, 1, &[1e6, 40000.0, 65504.0]);
    // a weight as large as the f16 GEMM's threshold: chosen where it is on
    case(&gpu, &ks, &mut r, q4, 2048, 2048, 9, 1, &[1.0]);
}

/// Prefill GEMM throughput: `cargo test --release --test gemm_f16 -- --ignored throughput --nocapture`.
/// Gemma 3 12B's prefill shapes (`[N, K]` of q, k/v, o, gate/up, down; affine 4-bit g64) at
/// `MARKBASE_BENCH_T` tokens (default 512; `MARKBASE_BENCH_SHAPES` picks shapes): the f32 GEMM
/// and every f16 variant that fits the
/// adapter (`MARKBASE_BENCH_VARIANTS`: `hilo:mt:vs[:flag...]` items, e.g. `both:2:0,x:4:1:c`,
/// `x:2:1:c:k64:db`; flags in any order: `c` centred weights, `k64` steps of 64, `db` double
/// buffers, `n4` tiles of 256 rows), each GEMM
/// with its activations' pass, timed as one pass of `MARKBASE_BENCH_LAYERS` dispatch pairs
/// (timestamps where the adapter has them), median of `MARKBASE_BENCH_ITERS`; TFLOP/s of
/// 2 T N K.
#[test]
#[ignore]
fn throughput() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    println!("adapter: {}", gpu.info.summary());
    let envu = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let t = envu("MARKBASE_BENCH_T", 512);
    let layers = envu("MARKBASE_BENCH_LAYERS", 8);
    let iters = envu("MARKBASE_BENCH_ITERS", 5);
    let variants: Vec<(Hilo, u8, u8, bool, bool, u8, bool)> = match std::env::var("MARKBASE_BENCH_VARIANTS") {
        Ok(v) => v
            .split(',')
            .map(|s| {
                let f: Vec<&str> = s.split(':').collect();
                let h = match f[0] {
                    "both" => Hilo::Both,
                    "x" => Hilo::X,
                    _ => Hilo::Off,
                };
                let flag = |n: &str| f.iter().skip(3).any(|&x| x == n);
                (h, f[1].parse().unwrap(), if flag("n4") { 4 } else { 2 }, f[2] == "1", flag("c"), if flag("k64") { 64 } else { 32 }, flag("db"))
            })
            .collect(),
        Err(_) => vec![
            (Hilo::Both, 2, 2, false, false, 32, false),
            (Hilo::Off, 4, 2, false, false, 32, false),
            (Hilo::Off, 4, 2, true, false, 32, false),
            (Hilo::X, 4, 2, true, false, 32, false),
            (Hilo::X, 2, 2, true, false, 32, false),
            (Hilo::X, 4, 2, true, true, 32, false),
            (Hilo::X, 2, 2, true, true, 32, false),
            (Hilo::X, 2, 2, true, true, 64, false),
            (Hilo::X, 2, 2, true, true, 32, true),
            (Hilo::Off, 4, 2, true, false, 64, false),
            (Hilo::Off, 4, 2, true, false, 32, true),
            (Hilo::Off, 2, 2, true, false, 64, false),
        ],
    };
    let fmt = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let mut r = rng("gemm_f16_throughput");
    let coop = if gpu.info.coop_f16_16 { CoopMode::Tensor } else { CoopMode::Fma };
    let opts = |coop| KernelOptions { coop, ..KernelOptions::for_gpu(&gpu) };
    let kf16 = Kernels::new(&gpu, opts(coop)).unwrap();
    let kf32 = Kernels::new(&gpu, opts(CoopMode::Off)).unwrap();
    // `MARKBASE_BENCH_SHAPES`: some of them, as `NxK` items (e.g. `15360x3840,3840x15360`)
    let only = std::env::var("MARKBASE_BENCH_SHAPES").ok();
    for (n, k) in [(4096, 3840), (2048, 3840), (3840, 4096), (15360, 3840), (3840, 15360)] {
        if only.as_ref().is_some_and(|o| !o.split(',').any(|x| x == format!("{n}x{k}"))) {
            continue;
        }
        let wd = random_weight(&mut r, fmt, &[n, k]);
        let ws: Vec<_> = (0..layers).map(|_| upload_weight(&gpu, &wd, None).unwrap()).collect();
        let x = gpu.upload_f32("x", &randn(&mut r, t * k, 1.0));
        let y = gpu.storage("y", (t * n * 4) as u64);
        let flop = 2.0 * (t * n * k) as f64;
        // the f32 GEMM
        let mm = kf32.matmul_rows(fmt, k, n, t, false).unwrap();
        let d = MatMulDims::plain(&ws[0], 0, t);
        let pb = gpu.uniform("p", &mm.params(&d));
        let bgs: Vec<_> = ws.iter().map(|w| mm.bind_group(&gpu.device, &pb, &x, &y, None, w, 0)).collect();
        let sec = median_pass_seconds(&gpu, iters, |pass| bgs.iter().for_each(|bg| mm.dispatch(pass, bg, &d))) / layers as f64;
        println!("BENCH gemm T={t} N={n} K={k} {}: {:.1} us, {:.1} TFLOP/s", mm.kernel.name, sec * 1e6, flop / sec / 1e12);
        for &(hilo, mt, nt, vs, center, bk, db) in &variants {
            if gemm_f16::smem_bytes(coop == CoopMode::Tensor, hilo, mt, nt, bk, db) > gpu.limits().max_compute_workgroup_storage_size {
                continue;
            }
            let mm = kf16.matmul_spec(KernelSpec::GemmF16 { fmt, coop: coop == CoopMode::Tensor, m8: false, hilo, mt, nt, vs, center, bk, db, grouped: false, split: false }).unwrap();
            let scales = gpu.storage("scales", (t * 4) as u64);
            let x16 = gpu.storage("x16", gemm_f16::x16_bytes(&mm.spec, t, k));
            let rk = kf16.row_scale(&mm, k).unwrap();
            let pb = gpu.uniform("p", &mm.params(&d));
            let rbg = rk.bind_buffers(&gpu.device, &[(0, &pb), (1, &x), (5, &x16), (7, &scales)]);
            let bgs: Vec<_> = ws.iter().map(|w| mm.bind_group_f16(&gpu.device, &pb, &x16, &y, &scales, None, None, w, 0)).collect();
            let rg = gemm_f16::row_scale_groups(t, 65535);
            let both = median_pass_seconds(&gpu, iters, |pass| {
                for bg in &bgs {
                    rk.dispatch(pass, &rbg, rg);
                    mm.dispatch(pass, bg, &d);
                }
            }) / layers as f64;
            let gemm = median_pass_seconds(&gpu, iters, |pass| bgs.iter().for_each(|bg| mm.dispatch(pass, bg, &d))) / layers as f64;
            println!(
                "BENCH gemm T={t} N={n} K={k} {}: {:.1} us ({:.1} with the activations' pass), {:.1} TFLOP/s ({:.1})",
                mm.kernel.name,
                gemm * 1e6,
                both * 1e6,
                flop / gemm / 1e12,
                flop / both / 1e12
            );
        }
    }
}

/// The default tile: 64 tokens x 256 rows for weights of up to 8 bits where the grid keeps 96
/// tiles, 128 x 128 for bf16 weights (the same bytes per product either way) and for grids too
/// small (`MARKBASE_COOP_NT` and `_MT` unset).
#[test]
fn gemm_f16_tile_shape_defaults() {
    if std::env::var("MARKBASE_COOP_NT").is_ok() || std::env::var("MARKBASE_COOP_MT").is_ok() {
        return;
    }
    let q4 = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let bf16 = GpuFormat::Float(FloatType::Bf16);
    let smem = 48 << 10;
    assert_eq!(gemm_f16::tile_shape(q4, true, Hilo::X, 15360, 512, smem), (2, 4));
    assert_eq!(gemm_f16::tile_shape(q4, true, Hilo::X, 3840, 512, smem), (2, 4));
    assert_eq!(gemm_f16::tile_shape(bf16, true, Hilo::X, 15360, 512, smem), (4, 2));
    // 8 x 8 tiles of 256 rows: too few, and 16 x 4 of 128 rows too
    assert_eq!(gemm_f16::tile_shape(q4, true, Hilo::X, 2048, 512, smem), (2, 2));
    // both inputs split: 50 KiB with 256 rows
    assert_eq!(gemm_f16::tile_shape(q4, true, Hilo::Both, 15360, 512, smem).1, 2);
}
