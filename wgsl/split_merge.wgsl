// Attention's split merge for one (token, head) per workgroup, shared by attention.wgsl (MERGE:
// the head's last workgroup) and attn_combine.wgsl (a dispatch of its own):
// result[d] = sum_s o_s[d] w_s, w_s = e^(m_s - M) / sum_r l_r e^(m_r - M), M = max_s m_s,
// over nsplit <= WG splits whose partials (D values o_s, then m_s and l_s) start at `b`,
// D + 2 values apart; results from `ob` on.
//
// The including kernel defines split_part(i) (partial value i), split_out(i, v) (result i)
// and workgroup memory ps: array<f32, WG> (a split's weight per invocation); the reductions
// are common.wgsl's. Call from uniform control flow.

fn merge_splits(b: u32, ob: u32, D: u32, nsplit: u32, lid: u32) {
    let sb = b + min(lid, nsplit - 1u) * (D + 2u) + D;
    let ms = select(NEG_BIG, split_part(sb), lid < nsplit);
    let mx = wg_max(ms);
    let ws = select(0.0, exp(ms - mx), lid < nsplit);
    let ls = wg_sum(ws * split_part(sb + 1u));
    ps[lid] = ws / ls;
    workgroupBarrier();
    for (var d = lid; d < D; d += WG) {
        var a = 0.0;
        for (var s = 0u; s < nsplit; s++) {
            a = fma(split_part(b + s * (D + 2u) + d), ps[s], a);
        }
        split_out(ob + d, a);
    }
}
