// Per-token scales of the f16 GEMM's activations (gemm_coop.wgsl): s[t] is the smallest power of
// two that brings max_k |x[t, k]| to at most 2^15, or 1 where it already is (or where x holds an
// Inf or NaN, which then reaches y as it would in f32). Powers of two keep x / s exact.
//
// One workgroup per token (a grid-stride loop over T). Bindings: 0 params (gemm.wgsl's: T, K),
// 1 x, 7 s.

// Params and x (binding 1): gemm_common.wgsl.
@group(0) @binding(7) var<storage, read_write> s: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    for (var t = wid.x; t < p.T; t += nwg.x) {
        var m = 0.0;
        for (var k = lid; k < p.K; k += 256u) {
            m = max(m, abs(x[t * p.K + k]));
        }
        red[lid] = m;
        workgroupBarrier();
        for (var h = 128u; h > 0u; h >>= 1u) {
            if lid < h {
                red[lid] = max(red[lid], red[lid + h]);
            }
            workgroupBarrier();
        }
        if lid == 0u {
            let mx = red[0];
            var sc = 1.0;
            if mx > 32768.0 && mx <= 3.4e38 {
                sc = exp2(ceil(log2(mx / 32768.0)));
                // log2's rounding: at most 2^15 after the division, whatever it gives
                if mx / sc > 32768.0 {
                    sc *= 2.0;
                }
            }
            s[t] = sc;
        }
        workgroupBarrier();
    }
}
