// Attention's split merge for one (token, head) per workgroup, shared by attention.wgsl (MERGE:
// the head's last workgroup) and attn_combine.wgsl (a dispatch of its own):
// result[d] = sum_s o_s[d] w_s, w_s = e^(m_s - M) / sum_r l_r e^(m_r - M), M = max_s m_s,
// over nsplit <= WG splits. Partials in vec4s: split s's D values o_s from vec4 b + s (D4 + 1),
// then (m_s, l_s, -, -); results from vec4 ob on.
//
// The weighted sum: invocation lid owns the vec4 of dims lid % D4 of split lane lid / D4
// (WG / D4 lanes, D4 <= WG); a lane takes splits lane, lane + lanes, .., eight loads issued
// before their products (a loop of one load and one product per split runs a memory round
// trip per few splits), then the lanes' sums meet in workgroup memory.
//
// The including kernel defines split_part(i) (partial vec4 i), split_out(i, v) (result vec4 i)
// and workgroup memory ps: array<f32, WG> (a split's weight per invocation) and ov:
// array<vec4<f32>, WG>; the reductions are common.wgsl's. Call from uniform control flow.

fn merge_splits(b: u32, ob: u32, D: u32, nsplit: u32, lid: u32) {
    let D4 = D / 4u;
    let st = D4 + 1u;
    let ml = split_part(b + min(lid, nsplit - 1u) * st + D4);
    let ms = select(NEG_BIG, ml.x, lid < nsplit);
    let mx = wg_max(ms);
    let ws = select(0.0, exp(ms - mx), lid < nsplit);
    let ls = wg_sum(ws * ml.y);
    ps[lid] = ws / ls;
    workgroupBarrier();
    let nl = WG / D4;
    let dv = lid % D4;
    let sl = lid / D4;
    var a = vec4<f32>(0.0);
    if sl < nl {
        for (var s0 = sl; s0 < nsplit; s0 += 8u * nl) {
//#repeat 8 i
            let s$i = s0 + $iu * nl;
            var v$i = vec4<f32>(0.0);
            if s$i < nsplit {
                v$i = split_part(b + s$i * st + dv);
            }
//#endrepeat
//#repeat 8 i
            if s$i < nsplit {
                a = fma(vec4<f32>(ps[s$i]), v$i, a);
            }
//#endrepeat
        }
    }
    ov[lid] = a;
    workgroupBarrier();
    if sl == 0u {
        for (var g = 1u; g < nl; g++) {
            a += ov[g * D4 + dv];
        }
        split_out(ob + dv, a);
    }
}
