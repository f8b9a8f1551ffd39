// Prefill GEMM on f16 tiles: y[t, row_start + r] = s[t] * sum_k (x[t, k] / s[t]) * W[r, k].
//
// COOP: the products run on cooperative matrices (tensor cores): 16x16x16, f16 inputs, f32
// accumulators. Without COOP, the twin: the same tiling, staging, scaling and epilogue, with a
// plain FMA loop in place of coopMultiplyAdd (each invocation holds the elements of the 16x16
// results that a subgroup of 32 would), so that adapters without cooperative matrices (and CI's
// software rasterizer) run and check everything but the products themselves.
//
// A workgroup of 256 invocations (8 groups of 32, a subgroup each under COOP) computes a tile of
// 64 tokens x 128 rows; group g takes tokens 32 (g / 4) .. + 32 and rows 32 (g % 4) .. + 32 as
// 2 x 2 results of 16 x 16. K advances 16 at a time through two workgroup-memory buffers: while
// the products of one step run, the next step's weight words and activations are in flight; they
// are decoded, scaled to f16 and stored into the other buffer after the products (one barrier per
// step, as gemm.wgsl).
//
// HILO: each f32 value v is staged as two f16, hi (v rounded to 11 significant bits) and
// lo = f16(v - hi), and each product
// as hi*hi + hi*lo + lo*hi (three products instead of one): about 22 bits of each input instead
// of 11, so that a whole model's logits stay within 1e-3 of f32's (one f16 rounding per input
// moves a small model's logits by up to 8e-3 of their largest).
//
// Scaling: s[t] (binding 7, written by row_scale.wgsl) is a power of two that brings the token's
// largest |x| to at most 2^15, so that x / s fits f16 (max 65504) exactly up to f16 rounding;
// Gemma's activations reach 1e5 and more. Weights are decoded to f16 (|W| far below 65504).
// Accumulation and the epilogue (times s[t] and the weight's global scale) are f32.
//
// Bindings: 0 params (gemm.wgsl's), 1 x, 2 y, 7 row scales, 8.. weights.
enable f16;
//#if COOP
enable wgpu_cooperative_matrix;
//#endif

// Params, x (binding 1) and load_x4: gemm_common.wgsl.
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(7) var<storage, read> rs: array<f32>;

const BT: u32 = 64u;   // tokens per tile
const BN: u32 = 128u;  // rows per tile
const BK: u32 = 16u;   // K per step
// f16 elements per staged row (COOP: padded by 8, so that rows start on distinct banks)
const LDS: u32 = BK + PAD;
const XS: u32 = BT * LDS;  // one activation buffer: [token][k]
const WS: u32 = BN * LDS;  // one weight buffer: [row][k]

var<workgroup> xs: array<f16, 2u * XS>;
var<workgroup> ws: array<f16, 2u * WS>;
//#if HILO
var<workgroup> xl: array<f16, 2u * XS>;
var<workgroup> wl: array<f16, 2u * WS>;
//#endif
// each group's 16 x 16 result on its way out: [token][row]
var<workgroup> cs: array<f32, 2048u>;

// Writes group g's result staged in cs (16 tokens from t0, 16 rows from r0) to y; lane l holds
// token l / 2, rows 8 (l % 2) .. + 8.
fn write_out(g: u32, l: u32, t0: u32, r0: u32, gsc: f32) {
    let i = l / 2u;
    let t = t0 + i;
    if t < p.T {
        let sc = rs[t] * gsc;
        for (var j = 0u; j < 8u; j++) {
            let c = 8u * (l % 2u) + j;
            let r = r0 + c;
            if r < p.rows {
                y[t * p.ldy + p.row_start + r] = cs[g * 256u + i * 16u + c] * sc;
            }
        }
    }
}

// f32 values rounded to 11 significant bits (f16's), as f32: by their bits, so that no compiler
// can fold a round trip through f16 away (one did: the lo parts came out zero).
fn hi4(v: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>((bitcast<vec4<u32>>(v) + vec4<u32>(0x1000u)) & vec4<u32>(0xffffe000u));
}

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let K = p.K;
    let g = lid / 32u;      // group: a subgroup under COOP
    let l = lid % 32u;      // lane in the group
    let gt = 32u * (g / 4u);  // the group's first token in the tile
    let gn = 32u * (g % 4u);  // its first row
    // activation loader: token lt, elements 4lq..4lq+3 of the step
    let lt = lid / 4u;
    let lq = lid % 4u;
    // weight loader: row lr, octet lo of the step's two
    let lr = lid / 2u;
    let lo = lid % 2u;
    let nsteps = (K + BK - 1u) / BK;
    let ntt = (p.T + BT - 1u) / BT;
    let nrt = (p.rows + BN - 1u) / BN;
    let gsc = w_global(0u);
    for (var ty = wid.y; ty < ntt; ty += nwg.y) {
        let t0 = ty * BT;
        let lvalid = t0 + lt < p.T;
        let xr = t0 + lt;
        var inv = 1.0;
        if lvalid {
            inv = 1.0 / rs[xr];
        }
        for (var rx = wid.x; rx < nrt; rx += nwg.x) {
            let r0 = rx * BN;
            let wr = r0 + lr;
            let wload = wr < p.rows;
            var rw = ROct(vec4<u32>(0u), vec4<u32>(0u));
            if wload {
                rw = oct_raw(wr, lo, K);
            }
            var rx4 = load_x4(xr, 0u, lq, K, lvalid);
//#if COOP
            var c00 = coop_mat16x16<f32, C>();
            var c01 = coop_mat16x16<f32, C>();
            var c10 = coop_mat16x16<f32, C>();
            var c11 = coop_mat16x16<f32, C>();
//#else
            // results (a, b): token gt + 16a + l / 2, rows gn + 16b + 8 (l % 2) + j at 8 (2a + b) + j
            var acc: array<f32, 32>;
            for (var j = 0u; j < 32u; j++) {
                acc[j] = 0.0;
            }
//#endif
            // the previous tile's last reads of the buffers are done
            workgroupBarrier();
            for (var s = 0u; s < nsteps; s++) {
                let cur = s & 1u;
                // store step s (loaded during step s - 1's products)
                {
                    let xb = cur * XS + lt * LDS + 4u * lq;
                    let xv = rx4 * inv;
                    let d = oct_dec(rw, wr, s * 2u + lo, K);
                    let wb = cur * WS + lr * LDS + 8u * lo;
//#if HILO
                    let xh = hi4(xv);
                    let wha = hi4(d.a);
                    let whb = hi4(d.b);
                    let xlo = vec4<f16>(xv - xh);
                    let wla = vec4<f16>(d.a - wha);
                    let wlb = vec4<f16>(d.b - whb);
                    for (var j = 0u; j < 4u; j++) {
                        xl[xb + j] = xlo[j];
                        wl[wb + j] = wla[j];
                        wl[wb + 4u + j] = wlb[j];
                    }
//#else
                    let xh = xv;
                    let wha = d.a;
                    let whb = d.b;
//#endif
                    for (var j = 0u; j < 4u; j++) {
                        xs[xb + j] = f16(xh[j]);
                        ws[wb + j] = f16(wha[j]);
                        ws[wb + 4u + j] = f16(whb[j]);
                    }
                }
                workgroupBarrier();
                // issue step s + 1's loads, then multiply step s
                if s + 1u < nsteps {
                    if wload {
                        rw = oct_raw(wr, (s + 1u) * 2u + lo, K);
                    }
                    rx4 = load_x4(xr, (s + 1u) * BK, lq, K, lvalid);
                }
//#if COOP
                {
                    let lda = LDS;
                    let ia0 = cur * XS + gt * LDS;
                    let ia1 = ia0 + 16u * LDS;
                    let ib0 = cur * WS + gn * LDS;
                    let ib1 = ib0 + 16u * LDS;
                    let a0 = coopLoadT<coop_mat16x16<f16, A>>(&xs[ia0], lda);
                    let a1 = coopLoadT<coop_mat16x16<f16, A>>(&xs[ia1], lda);
                    let b0 = coopLoad<coop_mat16x16<f16, B>>(&ws[ib0], lda);
                    let b1 = coopLoad<coop_mat16x16<f16, B>>(&ws[ib1], lda);
                    c00 = coopMultiplyAdd(a0, b0, c00);
                    c01 = coopMultiplyAdd(a0, b1, c01);
                    c10 = coopMultiplyAdd(a1, b0, c10);
                    c11 = coopMultiplyAdd(a1, b1, c11);
//#if HILO
                    let al0 = coopLoadT<coop_mat16x16<f16, A>>(&xl[ia0], lda);
                    let al1 = coopLoadT<coop_mat16x16<f16, A>>(&xl[ia1], lda);
                    let bl0 = coopLoad<coop_mat16x16<f16, B>>(&wl[ib0], lda);
                    let bl1 = coopLoad<coop_mat16x16<f16, B>>(&wl[ib1], lda);
                    c00 = coopMultiplyAdd(a0, bl0, c00);
                    c01 = coopMultiplyAdd(a0, bl1, c01);
                    c10 = coopMultiplyAdd(a1, bl0, c10);
                    c11 = coopMultiplyAdd(a1, bl1, c11);
                    c00 = coopMultiplyAdd(al0, b0, c00);
                    c01 = coopMultiplyAdd(al0, b1, c01);
                    c10 = coopMultiplyAdd(al1, b0, c10);
                    c11 = coopMultiplyAdd(al1, b1, c11);
//#endif
                }
//#else
                for (var k = 0u; k < BK; k++) {
                    for (var a = 0u; a < 2u; a++) {
                        let ix = cur * XS + (gt + 16u * a + l / 2u) * LDS + k;
                        let xa = f32(xs[ix]);
//#if HILO
                        let xla = f32(xl[ix]);
//#endif
                        for (var b = 0u; b < 2u; b++) {
                            let wb = cur * WS + (gn + 16u * b + 8u * (l % 2u)) * LDS + k;
                            for (var j = 0u; j < 8u; j++) {
                                let q = 8u * (2u * a + b) + j;
                                let wh = f32(ws[wb + j * LDS]);
                                acc[q] = fma(xa, wh, acc[q]);
//#if HILO
                                acc[q] = fma(xa, f32(wl[wb + j * LDS]), acc[q]);
                                acc[q] = fma(xla, wh, acc[q]);
//#endif
                            }
                        }
                    }
                }
//#endif
            }
            // epilogue: each result through the group's 16 x 16 of cs
            for (var a = 0u; a < 2u; a++) {
                for (var b = 0u; b < 2u; b++) {
                    let io = g * 256u;
//#if COOP
                    let st = 16u;
                    if a == 0u && b == 0u {
                        coopStoreT(c00, &cs[io], st);
                    } else if a == 0u {
                        coopStoreT(c01, &cs[io], st);
                    } else if b == 0u {
                        coopStoreT(c10, &cs[io], st);
                    } else {
                        coopStoreT(c11, &cs[io], st);
                    }
//#else
                    for (var j = 0u; j < 8u; j++) {
                        cs[io + (l / 2u) * 16u + 8u * (l % 2u) + j] = acc[8u * (2u * a + b) + j];
                    }
//#endif
                    workgroupBarrier();
                    write_out(g, l, t0 + gt + 16u * a, r0 + gn + 16u * b, gsc);
                    workgroupBarrier();
                }
            }
        }
    }
}
