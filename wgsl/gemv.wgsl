// GEMV for small T (decode): y[t, row_start + r] = sum_k x[t, k] * W[r, k].
//
// A workgroup owns R rows and TT tokens (GATHER: one (token, expert) pair).
// Each invocation walks 32-element blocks of K (stride WG), decodes each block
// of its R rows once, and reuses its activation block across the R rows; the
// per-invocation partial sums are then reduced over the workgroup (subgroupAdd
// + shared memory, or a shared-memory tree without subgroups).
//
// PRENORM (one token): y = W rms_norm(x). The workgroup reads all of x anyway: each
// invocation sums the squares of its blocks and scales them by the norm weight; the
// row sums are multiplied by 1 / rms at the end.
//
// DUAL (one token, one block per step): two weights of the same shape and format (a GeGLU's
// gate and up), the same R rows of each; y = gelu(gate row) * up row.
//
// CAT (one token, one block per step, after PRENORM): two or three weights of one format and K
// (a q/k/v projection), their outputs side by side: workgroups walk the row groups of the first
// (p.rows rows), then of the second (p.rows2), then of the third (p.rows3, CAT3), a weight per
// workgroup. Bindings of the third weight: 16.. (renamed with a `_v` suffix).
//
// Prelude consts: WG, R, TT, RS (reduction slots per invocation: R * TT, twice that with
// DUAL), RS2 .. RS16 (RS / 2 .. RS / 16), RED_N (= RS * WG), NDT (norm weight dtype: 0 bf16,
// 1 f16, 2 f32); weight consts (weights.wgsl).
// HALF (affine 4-bit, XVEC, not DUAL; several tokens: not GATHER): two invocations per block, invocation h
// taking elements 16h..16h+15: words 2h and 2h + 1 of the block's four (one 8-byte load per
// row, weights read as vec2<u32>: W_VEC2) and vec4s 4h..4h+3 of x. An invocation owning a whole
// block (128 contiguous bytes of x) makes each vec4 activation load of a subgroup touch 32
// lines; half blocks touch 16. Alternate runs of four elements instead (vec4s 2i + h, so that
// a pair's loads read whole 32-byte sectors) need the block's whole 16-byte word in both
// invocations, and measured slower.
//
// XRED (SUBGROUP, one token, RS a power of two up to 16, subgroups of RS to WG invocations,
// else a subgroupAdd per row): the RS sums are reduced across a subgroup in log2(RS) levels, each
// lane handing half of its values to the lane across one bit of its index and keeping the sum of
// the other half, then summing one value over the bits left: RS - 1 shuffles in all, plus
// log2(subgroup / RS), where a subgroupAdd per sum costs RS * log2(subgroup).
//
// Flags: SUBGROUP, GATHER, XVEC (K % 32 == 0: unmasked vec4 activation loads), TT1, TOKX
// (several tokens, not GATHER: token groups along the grid's x, row groups along y),
// BP2 (one token: two blocks per invocation and step), PRENORM, HAS_NW, DUAL, CAT, CAT3, HALF,
// XRED.
// Bindings: 0 params, 1 x, 2 y, 3 ids (GATHER), 4 norm weight (HAS_NW), 8.. weights,
// 12.. the second weight (DUAL; the same decoding, renamed with a `_u` suffix).

struct Params {
    T: u32,          // tokens (GATHER: pairs T*S)
    K: u32,
    rows: u32,       // rows of this chunk (GATHER: N, rows per expert)
    row_start: u32,  // first output column of this chunk
    ldy: u32,        // row stride of y (N of the whole weight)
    e_start: u32,    // GATHER: first expert held by this chunk
    e_count: u32,    // GATHER: experts held by this chunk
    S: u32,          // GATHER: experts per token
    x_bcast: u32,    // GATHER: 1 when x is [T, K] (shared by the S pairs of a token)
    E: u32,          // experts of the stack (read by the grouped GEMM only)
    norm_mode: u32,  // PRENORM: 0 no weight, 1 w, 2 1 + w
    norm_eps: f32,   // PRENORM
    rows2: u32,      // CAT: rows of the second weight
    rows3: u32,      // CAT3: rows of the third weight
    _ksplit: u32,    // (gemm.wgsl's split GEMM)
    _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if XVEC
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
//#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
//#endif
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
//#if GATHER
@group(0) @binding(3) var<storage, read> ids: array<u32>;
//#endif
//#if HAS_NW && XVEC
@group(0) @binding(4) var<storage, read> nw: array<vec4<u32>>;
//#elif HAS_NW
@group(0) @binding(4) var<storage, read> nw: array<u32>;
//#endif

const RT: u32 = R * TT;
var<workgroup> red_g: array<f32, RED_N>;

// 32 activations of block `blk` of x row `xr` (zeros past K).
fn load_x(xr: u32, blk: u32, K: u32) -> V8 {
    var v: V8;
//#if XVEC
    let b = xr * (K >> 2u) + blk * 8u;
//#repeat 8 i
    v.v$i = x[b + $iu];
//#endrepeat
//#else
    let b = xr * K;
    let k0 = blk * 32u;
//#repeat 8 i
    v.v$i = xs4(b, k0 + 4u * $iu, K);
//#endrepeat
//#endif
    return v;
}

//#if !XVEC
fn xs4(b: u32, k: u32, K: u32) -> vec4<f32> {
    var f = vec4<f32>(0.0);
    if k < K {
        f.x = x[b + k];
    }
    if k + 1u < K {
        f.y = x[b + k + 1u];
    }
    if k + 2u < K {
        f.z = x[b + k + 2u];
    }
    if k + 3u < K {
        f.w = x[b + k + 3u];
    }
    return f;
}
//#endif

//#if PRENORM && HAS_NW && XVEC
// Four 16-bit norm weights (NDT) packed in two words.
fn h16x4(a: u32, b: u32) -> vec4<f32> {
    if NDT == 0u {
        return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xffff0000u, b << 16u, b & 0xffff0000u));
    }
    return vec4<f32>(f16_bits_to_f32(a & 0xffffu), f16_bits_to_f32(a >> 16u), f16_bits_to_f32(b & 0xffffu), f16_bits_to_f32(b >> 16u));
}

fn nscale_v4(w: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(norm_w_scale(w.x, p.norm_mode), norm_w_scale(w.y, p.norm_mode), norm_w_scale(w.z, p.norm_mode), norm_w_scale(w.w, p.norm_mode));
}

// Norm scales of elements 4j .. 4j + 3.
fn nw4(j: u32) -> vec4<f32> {
    if NDT == 2u {
        return nscale_v4(bitcast<vec4<f32>>(nw[j]));
    }
    let w = nw[j >> 1u];
    let h = select(w.xy, w.zw, (j & 1u) == 1u);
    return nscale_v4(h16x4(h.x, h.y));
}

// Block `blk` of x times the norm weight (K % 32 == 0: the weights' block in vec4 loads).
fn norm_x(v: V8, blk: u32) -> V8 {
    var w: V8;
    if NDT == 2u {
//#repeat 8 i
        w.v$i = bitcast<vec4<f32>>(nw[blk * 8u + $iu]);
//#endrepeat
    } else {
//#repeat 4 j
        let n$j = nw[blk * 4u + $ju];
//#endrepeat
        w.v0 = h16x4(n0.x, n0.y);
        w.v1 = h16x4(n0.z, n0.w);
        w.v2 = h16x4(n1.x, n1.y);
        w.v3 = h16x4(n1.z, n1.w);
        w.v4 = h16x4(n2.x, n2.y);
        w.v5 = h16x4(n2.z, n2.w);
        w.v6 = h16x4(n3.x, n3.y);
        w.v7 = h16x4(n3.z, n3.w);
    }
    var o: V8;
//#repeat 8 i
    o.v$i = v.v$i * nscale_v4(w.v$i);
//#endrepeat
    return o;
}
//#elif PRENORM
// Norm scale of element k (1 past K and without a weight).
fn nscale1(k: u32) -> f32 {
//#if HAS_NW
    if k >= p.K {
        return 1.0;
    }
    return nw_scale(nw[word_of(k, NDT)], k, NDT, p.norm_mode);
//#else
    return 1.0;
//#endif
}

fn nscale4(k: u32) -> vec4<f32> {
    return vec4<f32>(nscale1(k), nscale1(k + 1u), nscale1(k + 2u), nscale1(k + 3u));
}

fn nw4(j: u32) -> vec4<f32> {
    return nscale4(4u * j);
}

// Block `blk` of x times the norm weight.
fn norm_x(v: V8, blk: u32) -> V8 {
    let k = blk * 32u;
    var o: V8;
//#repeat 8 i
    o.v$i = v.v$i * nscale4(k + 4u * $iu);
//#endrepeat
    return o;
}
//#endif

//#if PRENORM
fn sumsq(v: V8) -> f32 {
    let s = ((v.v0 * v.v0 + v.v1 * v.v1) + (v.v2 * v.v2 + v.v3 * v.v3)) + ((v.v4 * v.v4 + v.v5 * v.v5) + (v.v6 * v.v6 + v.v7 * v.v7));
    return (s.x + s.y) + (s.z + s.w);
}
//#endif

fn xsum(v: V8) -> f32 {
    let s = ((v.v0 + v.v1) + (v.v2 + v.v3)) + ((v.v4 + v.v5) + (v.v6 + v.v7));
    return (s.x + s.y) + (s.z + s.w);
}

fn blk_dot(d: Blk, xv: V8, xs: f32) -> f32 {
    var a = d.v.v0 * xv.v0;
    a = fma(d.v.v1, xv.v1, a);
    a = fma(d.v.v2, xv.v2, a);
    a = fma(d.v.v3, xv.v3, a);
    a = fma(d.v.v4, xv.v4, a);
    a = fma(d.v.v5, xv.v5, a);
    a = fma(d.v.v6, xv.v6, a);
    a = fma(d.v.v7, xv.v7, a);
    let dv = (a.x + a.y) + (a.z + a.w);
//#if W_AFFINE
    return d.s * dv + d.b * xs;
//#else
    return d.s * dv;
//#endif
}

//#if HALF
// Half `h` of block `blk` of x row `xr`: vec4s 4h..4h+3 of the block (K % 32 == 0).
fn load_xh(xr: u32, blk: u32, h: u32, K: u32) -> H4 {
    var v: H4;
    let b = xr * (K >> 2u) + blk * 8u + 4u * h;
//#repeat 4 i
    v.v$i = x[b + $iu];
//#endrepeat
    return v;
}

fn xsum_h(v: H4) -> f32 {
    let s = (v.v0 + v.v1) + (v.v2 + v.v3);
    return (s.x + s.y) + (s.z + s.w);
}

fn blk_dot_h(d: HBlk, xv: H4, xs: f32) -> f32 {
    var a = d.v.v0 * xv.v0;
    a = fma(d.v.v1, xv.v1, a);
    a = fma(d.v.v2, xv.v2, a);
    a = fma(d.v.v3, xv.v3, a);
    return d.s * ((a.x + a.y) + (a.z + a.w)) + d.b * xs;
}

//#if PRENORM
fn sumsq_h(v: H4) -> f32 {
    let s = (v.v0 * v.v0 + v.v1 * v.v1) + (v.v2 * v.v2 + v.v3 * v.v3);
    return (s.x + s.y) + (s.z + s.w);
}

// The half block times the norm weight: vec4 j of x takes the norm scales of elements 4j..4j+3.
fn norm_xh(v: H4, blk: u32, h: u32) -> H4 {
    var o: H4;
//#repeat 4 i
    o.v$i = v.v$i * nw4(blk * 8u + 4u * h + $iu);
//#endrepeat
    return o;
}
//#endif
//#endif


@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
//#if SUBGROUP
    @builtin(subgroup_invocation_id) sgl: u32,
    @builtin(subgroup_id) sgi: u32,
    @builtin(num_subgroups) sgn: u32,
    @builtin(subgroup_size) sgs: u32,
//#endif
) {
//#if SUBGROUP
    init_ids(lid, sgl, sgi, sgn);
//#else
    init_ids(lid, 0u, 0u, 1u);
//#endif
    let K = p.K;
    let nblk = (K + 31u) / 32u;
//#if CAT
    let ng1 = (p.rows + R - 1u) / R;
    let ng12 = ng1 + (p.rows2 + R - 1u) / R;
//#if CAT3
    let nrg = ng12 + (p.rows3 + R - 1u) / R;
//#else
    let nrg = ng12;
//#endif
//#else
    let nrg = (p.rows + R - 1u) / R;
//#endif
//#if GATHER
    let nty = p.T;
//#else
    let nty = (p.T + TT - 1u) / TT;
//#endif
//#if TOKX
    // several tokens, not gathered: a row group's token groups are neighbouring workgroups
    // (along x), so that they read its weights at about the same time
    let gt0 = wid.x;
    let gtn = nwg.x;
    let gr0 = wid.y;
    let grn = nwg.y;
//#else
    let gt0 = wid.y;
    let gtn = nwg.y;
    let gr0 = wid.x;
    let grn = nwg.x;
//#endif
    for (var ty = gt0; ty < nty; ty += gtn) {
//#if GATHER
        let e = ids[ty];
        let in_chunk = e >= p.e_start && e < p.e_start + p.e_count;
        let el = select(0u, e - p.e_start, in_chunk);
        let wbase = el * p.rows;
        let gsc = w_global(select(0u, e, in_chunk));
        let nb = select(0u, nblk, in_chunk);
        let t0 = ty;
//#else
        let in_chunk = true;
        let wbase = 0u;
        let gsc = w_global(0u);
        let nb = nblk;
        let t0 = ty * TT;
//#endif
        for (var rg = gr0; rg < nrg; rg += grn) {
//#if CAT
            // the weight of this row group, its rows and its first output column
            let sec = select(select(2u, 1u, rg < ng12), 0u, rg < ng1);
            let r0 = (rg - select(select(ng12, ng1, sec == 1u), 0u, sec == 0u)) * R;
            let nrows = select(select(p.rows3, p.rows2, sec == 1u), p.rows, sec == 0u);
            let ycol = p.row_start + select(select(p.rows + p.rows2, p.rows, sec == 1u), 0u, sec == 0u);
//#else
            let r0 = rg * R;
            let nrows = p.rows;
            let ycol = p.row_start;
//#endif
//#if TT1
            // one token: R scalar accumulators, everything unrolled
//#repeat R r
            var acc$r = 0.0;
//#endrepeat
//#if DUAL
//#repeat R r
            var accu$r = 0.0;
//#endrepeat
//#endif
//#if GATHER
            let xr = select(ty, ty / p.S, p.x_bcast != 0u);
//#else
            let xr = t0;
//#endif
//#if PRENORM
            var ss = 0.0;
//#endif
//#if BP2
            // two consecutive blocks per step (more bytes in flight per invocation); an odd
            // last block re-reads its pair's first block and discards it
            for (var b2 = lid; 2u * b2 < nb; b2 += WG) {
                let blk = 2u * b2;
                let has1 = blk + 1u < nb;
                let blk1 = select(blk, blk + 1u, has1);
                var xv = load_x(xr, blk, K);
                var xv1 = load_x(xr, blk1, K);
//#if PRENORM
                ss += sumsq(xv) + select(0.0, sumsq(xv1), has1);
                xv = norm_x(xv, blk);
                xv1 = norm_x(xv1, blk1);
//#endif
                let xs = xsum(xv);
                let xs1 = xsum(xv1);
//#repeat R r
                let row$r = wbase + min(r0 + $ru, p.rows - 1u);
                acc$r += blk_dot(dq_blk(row$r, blk, K), xv, xs) + select(0.0, blk_dot(dq_blk(row$r, blk1, K), xv1, xs1), has1);
//#endrepeat
            }
//#else
//#if HALF
            for (var hb = lid; hb < 2u * nb; hb += WG) {
                let blk = hb >> 1u;
                let h = hb & 1u;
                var xv = load_xh(xr, blk, h, K);
//#if PRENORM
                ss += sumsq_h(xv);
                xv = norm_xh(xv, blk, h);
//#endif
                let xs = xsum_h(xv);
//#if CAT
                if sec == 0u {
//#repeat R r
                    acc$r += blk_dot_h(dq_half(min(r0 + $ru, nrows - 1u), blk, h, K), xv, xs);
//#endrepeat
                } else if sec == 1u {
//#repeat R r
                    acc$r += blk_dot_h(dq_half_u(min(r0 + $ru, nrows - 1u), blk, h, K), xv, xs);
//#endrepeat
                } else {
//#if CAT3
//#repeat R r
                    acc$r += blk_dot_h(dq_half_v(min(r0 + $ru, nrows - 1u), blk, h, K), xv, xs);
//#endrepeat
//#endif
                }
//#else
//#repeat R r
                acc$r += blk_dot_h(dq_half(wbase + min(r0 + $ru, nrows - 1u), blk, h, K), xv, xs);
//#endrepeat
//#endif
//#if DUAL
//#repeat R r
                accu$r += blk_dot_h(dq_half_u(min(r0 + $ru, p.rows - 1u), blk, h, K), xv, xs);
//#endrepeat
//#endif
            }
//#else
            for (var blk = lid; blk < nb; blk += WG) {
                var xv = load_x(xr, blk, K);
//#if PRENORM
                ss += sumsq(xv);
                xv = norm_x(xv, blk);
//#endif
                let xs = xsum(xv);
//#if CAT
                if sec == 0u {
//#repeat R r
                    acc$r += blk_dot(dq_blk(min(r0 + $ru, nrows - 1u), blk, K), xv, xs);
//#endrepeat
                } else if sec == 1u {
//#repeat R r
                    acc$r += blk_dot(dq_blk_u(min(r0 + $ru, nrows - 1u), blk, K), xv, xs);
//#endrepeat
                } else {
//#if CAT3
//#repeat R r
                    acc$r += blk_dot(dq_blk_v(min(r0 + $ru, nrows - 1u), blk, K), xv, xs);
//#endrepeat
//#endif
                }
//#else
//#repeat R r
                acc$r += blk_dot(dq_blk(wbase + min(r0 + $ru, nrows - 1u), blk, K), xv, xs);
//#endrepeat
//#endif
//#if DUAL
//#repeat R r
                accu$r += blk_dot(dq_blk_u(min(r0 + $ru, p.rows - 1u), blk, K), xv, xs);
//#endrepeat
//#endif
            }
//#endif
//#endif
//#if PRENORM
            let rn = 1.0 / sqrt(wg_sum(ss) / f32(K) + p.norm_eps);
//#repeat R r
            acc$r *= rn;
//#endrepeat
//#if DUAL
//#repeat R r
            accu$r *= rn;
//#endrepeat
//#endif
//#endif
//#if SUBGROUP
            // the workgroup's sums per subgroup in red_g, then one invocation per sum adds them
//#if XRED
            // (subgroups no larger than the workgroup: every lane a shuffle reads is active)
            let xred = sgs >= RS && sgs <= WG;
            if xred {
                // transposed reduction: each level halves the values a lane holds, keeping the
                // half its lane bit selects and trading the other with the lane across that bit;
                // after log2(RS) levels a lane holds one row, summed over the bits left
                var v: array<f32, RS>;
//#repeat R r
                v[$ru] = acc$r;
//#endrepeat
//#if DUAL
//#repeat R r
                v[R + $ru] = accu$r;
//#endrepeat
//#endif
                let m1 = sgs / 2u;
                let h1 = (g_sg_lane & m1) != 0u;
                let h2 = (g_sg_lane & (m1 / 2u)) != 0u;
                let h3 = (g_sg_lane & (m1 / 4u)) != 0u;
                let h4 = (g_sg_lane & (m1 / 8u)) != 0u;
//#repeat RS2 j
                v[$ju] = select(v[$ju], v[$ju + RS2], h1) + subgroupShuffleXor(select(v[$ju + RS2], v[$ju], h1), m1);
//#endrepeat
//#repeat RS4 j
                v[$ju] = select(v[$ju], v[$ju + RS4], h2) + subgroupShuffleXor(select(v[$ju + RS4], v[$ju], h2), m1 / 2u);
//#endrepeat
//#repeat RS8 j
                v[$ju] = select(v[$ju], v[$ju + RS8], h3) + subgroupShuffleXor(select(v[$ju + RS8], v[$ju], h3), m1 / 4u);
//#endrepeat
//#repeat RS16 j
                v[$ju] = select(v[$ju], v[$ju + RS16], h4) + subgroupShuffleXor(select(v[$ju + RS16], v[$ju], h4), m1 / 8u);
//#endrepeat
                var sx = v[0];
                for (var m = sgs / (2u * RS); m > 0u; m >>= 1u) {
                    sx += subgroupShuffleXor(sx, m);
                }
                let row = select(0u, RS / 2u, h1) + select(0u, RS / 4u, h2) + select(0u, RS / 8u, h3) + select(0u, RS / 16u, h4);
                if (g_sg_lane & (sgs / RS - 1u)) == 0u {
                    red_g[g_sg_id * RS + row] = sx;
                }
            }
//#else
            let xred = false;
//#endif
            if !xred {
//#repeat R r
                let s$r = subgroupAdd(acc$r);
//#endrepeat
//#if DUAL
//#repeat R r
                let su$r = subgroupAdd(accu$r);
//#endrepeat
//#endif
                if g_sg_lane == 0u {
//#repeat R r
                    red_g[g_sg_id * RS + $ru] = s$r;
//#endrepeat
//#if DUAL
//#repeat R r
                    red_g[g_sg_id * RS + R + $ru] = su$r;
//#endrepeat
//#endif
                }
            }
            workgroupBarrier();
            var tot = 0.0;
            if lid < RS {
                for (var j = 0u; j < g_sg_n; j++) {
                    tot += red_g[j * RS + lid];
                }
            }
//#else
//#repeat R r
            red_g[$ru * WG + lid] = acc$r;
//#endrepeat
//#if DUAL
//#repeat R r
            red_g[(R + $ru) * WG + lid] = accu$r;
//#endrepeat
//#endif
            workgroupBarrier();
            for (var s = WG / 2u; s > 0u; s >>= 1u) {
                if lid < s {
                    for (var i = 0u; i < RS; i++) {
                        red_g[i * WG + lid] += red_g[i * WG + lid + s];
                    }
                }
                workgroupBarrier();
            }
            var tot = 0.0;
            if lid < RS {
                tot = red_g[lid * WG];
            }
//#endif
//#if DUAL
            // gate and up totals side by side, then y = gelu(gate) * up
            workgroupBarrier();
            if lid < RS {
                red_g[lid] = tot;
            }
            workgroupBarrier();
            if lid < R {
                tot = gelu(red_g[lid] * gsc) * red_g[R + lid] * w_global_u(0u);
            }
//#endif
//#else
            // several tokens: R x TT scalar sums, everything unrolled. Each step holds its block
            // of every token's activations (loaded once) and decodes each row's block once,
            // multiplying it with every token's; a sum's arithmetic is that of its (row, token)
            // alone, whatever R and TT are.
//#repeat R r
//#repeat TT t
            var acc$r_$t = 0.0;
//#endrepeat
//#endrepeat
//#if HALF
            // half blocks (as one token's): a step holds 16 activations of each token
            for (var hb = lid; hb < 2u * nb; hb += WG) {
                let blk = hb >> 1u;
                let h = hb & 1u;
//#repeat TT t
                let xv$t = load_xh(min(t0 + $tu, p.T - 1u), blk, h, K);
                let xs$t = xsum_h(xv$t);
//#endrepeat
//#repeat R r
                let d$r = dq_half(wbase + min(r0 + $ru, p.rows - 1u), blk, h, K);
//#repeat TT t
                acc$r_$t += blk_dot_h(d$r, xv$t, xs$t);
//#endrepeat
//#endrepeat
            }
//#else
            for (var blk = lid; blk < nb; blk += WG) {
//#repeat TT t
                let xv$t = load_x(min(t0 + $tu, p.T - 1u), blk, K);
                let xs$t = xsum(xv$t);
//#endrepeat
//#repeat R r
                let d$r = dq_blk(wbase + min(r0 + $ru, p.rows - 1u), blk, K);
//#repeat TT t
                acc$r_$t += blk_dot(d$r, xv$t, xs$t);
//#endrepeat
//#endrepeat
            }
//#endif
//#if SUBGROUP
//#repeat R r
//#repeat TT t
            let s$r_$t = subgroupAdd(acc$r_$t);
//#endrepeat
//#endrepeat
            if g_sg_lane == 0u {
//#repeat R r
//#repeat TT t
                red_g[g_sg_id * RT + $ru * TT + $tu] = s$r_$t;
//#endrepeat
//#endrepeat
            }
            workgroupBarrier();
            var tot = 0.0;
            if lid < RT {
                for (var j = 0u; j < g_sg_n; j++) {
                    tot += red_g[j * RT + lid];
                }
            }
//#else
//#repeat R r
//#repeat TT t
            red_g[($ru * TT + $tu) * WG + lid] = acc$r_$t;
//#endrepeat
//#endrepeat
            workgroupBarrier();
            for (var s = WG / 2u; s > 0u; s >>= 1u) {
                if lid < s {
                    for (var i = 0u; i < RT; i++) {
                        red_g[i * WG + lid] += red_g[i * WG + lid + s];
                    }
                }
                workgroupBarrier();
            }
            var tot = 0.0;
            if lid < RT {
                tot = red_g[lid * WG];
            }
//#endif
//#endif
            if lid < RT {
                let row = r0 + lid / TT;
                let tok = t0 + lid % TT;
                if in_chunk && row < nrows && tok < p.T {
//#if DUAL
                    y[tok * p.ldy + ycol + row] = tot;
//#else
                    y[tok * p.ldy + ycol + row] = tot * gsc;
//#endif
                }
            }
            workgroupBarrier();
        }
    }
}
