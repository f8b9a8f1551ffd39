// The f16 GEMM's activations (gemm_coop.wgsl): per-token scales and x / s in f16.
//
// s[t] is the smallest power of two that brings max_k |x[t, k]| to at most 2^15, or 1 where it
// already is (or where x holds an Inf or NaN, which then reaches y as it would in f32). Powers of
// two keep x / s exact. x16 then holds x / s rounded to f16 (hi), and with HILO_X the rest,
// f16(x / s - hi) (lo), in rows padded to t_pad(T) tokens and k_pad(K) elements (64s) with zeros, so
// that the GEMM's tiles load them without bounds.
//
// One workgroup per token (a grid-stride loop over the padded tokens). Bindings: 0 params
// (gemm.wgsl's: T, K), 1 x, 5 x16, 7 s.
enable f16;

// Params, x (binding 1), t_pad, k_pad: gemm_common.wgsl. hi4: f16_split.wgsl.
@group(0) @binding(5) var<storage, read_write> x16: array<vec4<f16>>;
@group(0) @binding(7) var<storage, read_write> s: array<f32>;

var<workgroup> red: array<f32, 256>;
//#if AUG
// The token's group sums of x / s, divided by the group size GS (so that they fit f16 as x / s
// does), for a centring GEMM (gemm_coop.wgsl's CENTER): columns K + 2g and K + 2g + 1 both hold
// group g's.
const MAXG: u32 = 1024u;
var<workgroup> gsum: array<f32, MAXG>;
//#endif

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tp = t_pad(p.T);
//#if AUG
    let G = min(p.K / GS, MAXG);
    let ka = p.K + 2u * G;
//#else
    let ka = p.K;
//#endif
    let kq = k_pad(ka) / 4u;
    for (var t = wid.x; t < tp; t += nwg.x) {
        let valid = t < p.T;
        var m = 0.0;
        for (var q = lid; q < kq; q += 256u) {
            let v = abs(load_x4(t, 0u, q, p.K, valid));
            m = max(m, max(max(v.x, v.y), max(v.z, v.w)));
        }
        red[lid] = m;
        workgroupBarrier();
        for (var h = 128u; h > 0u; h >>= 1u) {
            if lid < h {
                red[lid] = max(red[lid], red[lid + h]);
            }
            workgroupBarrier();
        }
        let mx = red[0];
        var sc = 1.0;
        if mx > 32768.0 && mx <= 3.4e38 {
            sc = exp2(ceil(log2(mx / 32768.0)));
            // log2's rounding: at most 2^15 after the division, whatever it gives
            if mx / sc > 32768.0 {
                sc *= 2.0;
            }
        }
        if lid == 0u && valid {
            s[t] = sc;
        }
        let inv = 1.0 / sc;
//#if AUG
        for (var g = lid; g < G; g += 256u) {
            var acc = vec4<f32>(0.0);
            for (var q = 0u; q < GS / 4u; q++) {
                acc += load_x4(t, g * GS, q, p.K, valid);
            }
            gsum[g] = (acc.x + acc.y + acc.z + acc.w) * inv / f32(GS);
        }
        workgroupBarrier();
//#endif
        for (var q = lid; q < kq; q += 256u) {
            var v = load_x4(t, 0u, q, p.K, valid) * inv;
//#if AUG
            for (var e = 0u; e < 4u; e++) {
                let c = 4u * q + e;
                if c >= p.K && c < ka {
                    v[e] = gsum[(c - p.K) / 2u];
                }
            }
//#endif
            let h = hi4(v);
            x16[t * kq + q] = vec4<f16>(h);
//#if HILO_X
            x16[(tp + t) * kq + q] = vec4<f16>(v - h);
//#endif
        }
        // every invocation has read red[0]
        workgroupBarrier();
    }
}
