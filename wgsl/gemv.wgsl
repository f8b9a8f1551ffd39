// GEMV for small T (decode): y[t, row_start + r] = sum_k x[t, k] * W[r, k].
//
// A workgroup owns R rows and TT tokens (GATHER: one (token, expert) pair).
// Each invocation walks 32-element blocks of K (stride WG), decodes each block
// of its R rows once, and reuses its activation block across the R rows; the
// per-invocation partial sums are then reduced over the workgroup (subgroupAdd
// + shared memory, or a shared-memory tree without subgroups).
//
// Prelude consts: WG, R, TT, RED_N (= R * TT * WG); weight consts (weights.wgsl).
// Flags: SUBGROUP, GATHER, XVEC (K % 32 == 0: unmasked vec4 activation loads), TT1.
// Bindings: 0 params, 1 x, 2 y, 3 ids (GATHER), 8.. weights.

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
    _p0: u32,
    _p1: u32,
    _p2: u32,
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

const RT: u32 = R * TT;
var<workgroup> red_g: array<f32, RED_N>;

// 32 activations of block `blk` of x row `xr` (zeros past K).
fn load_x(xr: u32, blk: u32, K: u32) -> array<vec4<f32>, 8> {
    var v: array<vec4<f32>, 8>;
//#if XVEC
    let b = xr * (K >> 2u) + blk * 8u;
    for (var i = 0u; i < 8u; i++) {
        v[i] = x[b + i];
    }
//#else
    let b = xr * K;
    let k0 = blk * 32u;
    for (var i = 0u; i < 8u; i++) {
        var f = vec4<f32>(0.0);
        for (var j = 0u; j < 4u; j++) {
            let k = k0 + 4u * i + j;
            if k < K {
                f[j] = x[b + k];
            }
        }
        v[i] = f;
    }
//#endif
    return v;
}

fn xsum(v: array<vec4<f32>, 8>) -> f32 {
    var s = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        s += v[i];
    }
    return s.x + s.y + s.z + s.w;
}

fn blk_dot(d: Blk, xv: array<vec4<f32>, 8>, xs: f32) -> f32 {
    var a = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        a = fma(d.v[i], xv[i], a);
    }
    let dv = a.x + a.y + a.z + a.w;
//#if W_AFFINE
    return d.s * dv + d.b * xs;
//#else
    return d.s * dv;
//#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
//#if SUBGROUP
    @builtin(subgroup_invocation_id) sgl: u32,
    @builtin(subgroup_id) sgi: u32,
    @builtin(num_subgroups) sgn: u32,
//#endif
) {
//#if SUBGROUP
    init_ids(lid, sgl, sgi, sgn);
//#else
    init_ids(lid, 0u, 0u, 1u);
//#endif
    let K = p.K;
    let nblk = (K + 31u) / 32u;
    let nrg = (p.rows + R - 1u) / R;
//#if GATHER
    let nty = p.T;
//#else
    let nty = (p.T + TT - 1u) / TT;
//#endif
    for (var ty = wid.y; ty < nty; ty += nwg.y) {
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
        for (var rg = wid.x; rg < nrg; rg += nwg.x) {
            let r0 = rg * R;
            var acc: array<f32, RT>;
            for (var blk = lid; blk < nb; blk += WG) {
//#if TT1
//#if GATHER
                let xr = select(ty, ty / p.S, p.x_bcast != 0u);
//#else
                let xr = t0;
//#endif
                let xv = load_x(xr, blk, K);
                let xs = xsum(xv);
//#endif
                for (var r = 0u; r < R; r++) {
                    let row = min(r0 + r, p.rows - 1u);
                    let d = dq_blk(wbase + row, blk, K);
//#if TT1
                    acc[r] += blk_dot(d, xv, xs);
//#else
                    for (var t = 0u; t < TT; t++) {
                        let xt = load_x(min(t0 + t, p.T - 1u), blk, K);
                        acc[r * TT + t] += blk_dot(d, xt, xsum(xt));
                    }
//#endif
                }
            }
            // Reduce the RT partial sums over the workgroup.
//#if SUBGROUP
            for (var i = 0u; i < RT; i++) {
                let s = subgroupAdd(acc[i]);
                if g_sg_lane == 0u {
                    red_g[g_sg_id * RT + i] = s;
                }
            }
            workgroupBarrier();
            var tot = 0.0;
            if lid < RT {
                for (var j = 0u; j < g_sg_n; j++) {
                    tot += red_g[j * RT + lid];
                }
            }
//#else
            for (var i = 0u; i < RT; i++) {
                red_g[i * WG + lid] = acc[i];
            }
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
            if lid < RT {
                let row = r0 + lid / TT;
                let tok = t0 + lid % TT;
                if in_chunk && row < p.rows && tok < p.T {
                    y[tok * p.ldy + p.row_start + row] = tot * gsc;
                }
            }
            workgroupBarrier();
        }
    }
}
