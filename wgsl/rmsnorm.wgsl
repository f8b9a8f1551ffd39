// RMSNorm over rows of length D: out = x / sqrt(mean(x^2) + eps) * s, with
// s = w (mode 1), 1 + w (mode 2) or 1 (mode 0). One workgroup per row.
//
// RES: out = res + norm(x) (a post-norm and its residual add).
// SCALAR (with RES): out = (res + norm(x)) * s, s the one value of binding 5 (Gemma 4's layer scalar).
//
// REG (D <= NS * WG): the whole row in registers, NS values per invocation: x, the residual
// and the weight are all loaded before the reduction (one memory round trip for a lone row,
// which is latency-bound), and x is not read twice.
//
// Prelude consts: WG, NDT (weight dtype: 0 bf16, 1 f16, 2 f32), SDT (the scalar's dtype), NS
// (REG: values per invocation, a multiple of 8).
// Flags: SUBGROUP, HAS_W, RES, SCALAR, REG.
// Bindings: 0 params, 1 x, 2 out, 3 w (HAS_W; u32 words of NDT values), 4 res (RES),
// 5 s (SCALAR; u32 words of SDT values).

struct Params {
    rows: u32,
    D: u32,
    eps: f32,
    mode: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#if HAS_W
@group(0) @binding(3) var<storage, read> nw: array<u32>;
//#endif
//#if RES
@group(0) @binding(4) var<storage, read> res: array<f32>;
//#endif
//#if SCALAR
@group(0) @binding(5) var<storage, read> sw: array<u32>;
//#endif

fn norm_scale(i: u32) -> f32 {
//#if HAS_W
    return nw_scale(nw[word_of(i, NDT)], i, NDT, p.mode);
//#else
    return 1.0;
//#endif
}

// The residual's value i (RES).
fn res_at(i: u32) -> f32 {
//#if RES
    return res[i];
//#else
    return 0.0;
//#endif
}

// The scalar weight (1 without SCALAR).
fn row_scalar() -> f32 {
//#if SCALAR
    return nw_scale(sw[0], 0u, SDT, 1u);
//#else
    return 1.0;
//#endif
}

// An output from x's value v, the residual's rv, the weight scale w, the row's 1 / rms r and
// the scalar s.
fn finish(v: f32, rv: f32, w: f32, r: f32, s: f32) -> f32 {
//#if RES
    return (rv + v * r * w) * s;
//#else
    return v * r * w;
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
    let D = p.D;
    let s = row_scalar();
    // 8 elements per invocation and step, loaded before they are used (one memory
    // round trip per step, not per element: a lone row is latency-bound).
    for (var row = wid.y * nwg.x + wid.x; row < p.rows; row += nwg.x * nwg.y) {
        let b = row * D;
//#if REG
//#repeat NS j
        let i$j = lid + $ju * WG;
        let c$j = min(i$j, D - 1u);
        let v$j = select(0.0, x[b + c$j], i$j < D);
//#endrepeat
//#repeat NS j
        let r$j = res_at(b + c$j);
        let w$j = norm_scale(c$j);
//#endrepeat
        var ss = 0.0;
//#repeat NS j
        ss = fma(v$j, v$j, ss);
//#endrepeat
        let r = 1.0 / sqrt(wg_sum(ss) / f32(D) + p.eps);
//#repeat NS j
        if i$j < D {
            out[b + i$j] = finish(v$j, r$j, w$j, r, s);
        }
//#endrepeat
//#else
        var ss = 0.0;
        for (var i0 = lid; i0 < D; i0 += 8u * WG) {
//#repeat 8 j
            let i$j = i0 + $ju * WG;
            let v$j = select(0.0, x[b + min(i$j, D - 1u)], i$j < D);
//#endrepeat
            ss += ((v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)) + ((v4 * v4 + v5 * v5) + (v6 * v6 + v7 * v7));
        }
        let tot = wg_sum(ss);
        let r = 1.0 / sqrt(tot / f32(D) + p.eps);
        for (var i0 = lid; i0 < D; i0 += 8u * WG) {
//#repeat 8 j
            let i$j = i0 + $ju * WG;
            let c$j = min(i$j, D - 1u);
            let o$j = finish(x[b + c$j], res_at(b + c$j), norm_scale(c$j), r, s);
//#endrepeat
//#repeat 8 j
            if i$j < D {
                out[b + i$j] = o$j;
            }
//#endrepeat
        }
//#endif
    }
}
