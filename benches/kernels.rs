//! Kernel benchmarks (criterion): the quantized GEMV (decode) and GEMM (prefill) per
//! MLX quantization mode, and decode attention. Sizes from the environment
//! (`MARKBASE_BENCH_N`, `MARKBASE_BENCH_K`, `MARKBASE_BENCH_CTX`); the defaults are
//! small enough for a software rasterizer. Run: `cargo bench --bench kernels`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{attention_splits, Kernels, MatMulDims};
use markbase::gpu::weights::upload_weight;
use markbase::graph::ir::WeightParam;
use markbase::graph::quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
use markbase::synthetic::random_weight;

fn env(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn submit_wait(gpu: &Gpu, f: impl FnOnce(&mut wgpu::ComputePass<'_>)) {
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        f(&mut pass);
    }
    gpu.queue.submit([enc.finish()]);
    gpu.wait().unwrap();
}

fn matmul(c: &mut Criterion) {
    let gpu = Gpu::new().expect("a GPU adapter");
    let kernels = Kernels::for_gpu(&gpu).unwrap();
    let (n, k) = (env("MARKBASE_BENCH_N", 1024), env("MARKBASE_BENCH_K", 1024));
    let q = |mode, bits, group_size| WeightFormat::Quantized { spec: QuantSpec { mode, bits, group_size }, global_scale: false };
    let formats = [
        ("affine4g64", q(QuantMode::Affine, 4, 64)),
        ("affine8g64", q(QuantMode::Affine, 8, 64)),
        ("affine3g32", q(QuantMode::Affine, 3, 32)),
        ("mxfp4", q(QuantMode::Mxfp4, 4, 32)),
        ("mxfp8", q(QuantMode::Mxfp8, 8, 32)),
        ("nvfp4", q(QuantMode::Nvfp4, 4, 16)),
        ("bf16", WeightFormat::Float { dtype: FloatType::Bf16 }),
    ];
    let mut g = c.benchmark_group(format!("matmul_{n}x{k}"));
    g.sample_size(10);
    for (name, format) in formats {
        let p = WeightParam { name: name.into(), shape: vec![n, k], format, module: true };
        let wd = random_weight(&p, 7, false);
        let bytes = wd.weight.bytes.len() + wd.scales.as_ref().map_or(0, |s| s.bytes.len()) + wd.biases.as_ref().map_or(0, |s| s.bytes.len());
        let w = upload_weight(&gpu, &wd, None).unwrap();
        for t in [1usize, 64] {
            let mk = kernels.matmul(w.format, k, t, false).unwrap();
            let x = gpu.upload_f32("x", &vec![0.5f32; t * k]);
            let y = gpu.storage("y", (t * n * 4) as u64);
            let groups: Vec<_> = (0..w.chunks.len())
                .map(|ci| {
                    let d = MatMulDims::plain(&w, ci, t);
                    let pb = gpu.uniform("p", &mk.params(&d));
                    (mk.bind_group(&gpu.device, &pb, &x, &y, None, &w, ci), d, pb)
                })
                .collect();
            g.throughput(Throughput::Bytes(bytes as u64));
            let label = if t == 1 { "gemv" } else { "gemm_t64" };
            g.bench_function(format!("{label}/{name}"), |b| {
                b.iter(|| {
                    submit_wait(&gpu, |pass| {
                        for (bg, d, _) in &groups {
                            mk.dispatch(pass, bg, d);
                        }
                    })
                })
            });
        }
    }
    g.finish();
}

fn attention(c: &mut Criterion) {
    let gpu = Gpu::new().expect("a GPU adapter");
    let kernels = Kernels::for_gpu(&gpu).unwrap();
    let ctx = env("MARKBASE_BENCH_CTX", 1024);
    let (nq, nkv, d) = (8usize, 4usize, 256usize);
    let mut g = c.benchmark_group(format!("attention_decode_ctx{ctx}"));
    g.sample_size(10);
    let ak = kernels.attention(d, attention_splits(ctx, nq, 1)).unwrap();
    let q = gpu.upload_f32("q", &vec![0.1f32; nq * d]);
    let pos = gpu.upload_u32("pos", &[(ctx - 1) as u32]);
    let kc = gpu.upload_f32("k", &vec![0.01f32; ctx * nkv * d]);
    let vc = gpu.upload_f32("v", &vec![0.02f32; ctx * nkv * d]);
    let out = gpu.storage("out", (nq * d * 4) as u64);
    let sc = ak.scratch(&gpu, "attention", 1, nq, d);
    let pb = gpu.uniform("p", &ak.params(1, nq, nkv, d, ctx, 1.0, None));
    let bg = ak.bind_groups(&gpu.device, &pb, &q, &pos, &kc, &vc, &out, sc.as_ref(), &[]);
    g.throughput(Throughput::Bytes((2 * ctx * nkv * d * 4) as u64));
    g.bench_function("gqa8x4_d256", |b| b.iter(|| submit_wait(&gpu, |pass| ak.dispatch(pass, &bg, 1, nq))));
    g.finish();
}

criterion_group!(benches, matmul, attention);
criterion_main!(benches);
