// Attention over the KV slot ring (cpu::ops::attention): query t of head h sees
// absolute positions j in [lo, pos[t]] (lo = pos[t] + 1 - window with a window,
// else 0), stored at slot j % S; kv head = h / (nq / nkv). Online softmax in f32.
//
// One workgroup per (head, token, split). Keys of the query's range are cut into
// `nsplit` contiguous parts; each workgroup walks its part in tiles of WG keys (one
// key per invocation for the score, then every invocation accumulates its output
// dims d = lid + i*WG, i < DPT). With nsplit == 1 the result is written to out;
// otherwise (SPLIT) out receives per split [D unnormalized outputs, max, sum] and
// attn_combine.wgsl merges them.
//
// Prelude consts: WG, DPT (= ceil(D / WG)), QV4 (= ceil(D / 4) rounded for the q tile).
// Flags: SUBGROUP, SPLIT.
// Bindings: 0 params, 1 q [T, nq, D], 2 pos [T], 3 k [S, nkv, D], 4 v [S, nkv, D], 5 out.

struct Params {
    T: u32,
    nq: u32,
    nkv: u32,
    D: u32,
    S: u32,
    window: u32,   // 0: causal only
    nsplit: u32,
    _p0: u32,
    scale: f32,
    _p1: u32,
    _p2: u32,
    _p3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vc: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> qs: array<vec4<f32>, QV4>;
var<workgroup> ps: array<f32, WG>;
var<workgroup> slots: array<u32, WG>;
var<workgroup> wpos: u32;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
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
    let h = wid.x;
    let t = wid.y;
    let sp = wid.z;
    let D = p.D;
    let D4 = D / 4u;
    let kh = h / (p.nq / p.nkv);
    if lid == 0u {
        wpos = pos[t];
    }
    let pp = workgroupUniformLoad(&wpos);
    var lo = 0u;
    if p.window > 0u && pp + 1u > p.window {
        lo = pp + 1u - p.window;
    }
    let n = pp + 1u - lo;
    let chunk = (n + p.nsplit - 1u) / p.nsplit;
    let js = min(lo + sp * chunk, pp + 1u);
    let je = min(js + chunk, pp + 1u);

    let qb = (t * p.nq + h) * D4;
    for (var i = lid; i < D4; i += WG) {
        qs[i] = q[qb + i] * p.scale;
    }
    workgroupBarrier();

    var m = NEG_BIG;
    var l = 0.0;
    var o: array<f32, DPT>;
    for (var j0 = js; j0 < je; j0 += WG) {
        let j = j0 + lid;
        let valid = j < je;
        var s = NEG_BIG;
        if valid {
            let slot = j % p.S;
            slots[lid] = slot;
            let kb = (slot * p.nkv + kh) * D4;
            var a = vec4<f32>(0.0);
            for (var i = 0u; i < D4; i++) {
                a = fma(qs[i], kc[kb + i], a);
            }
            s = a.x + a.y + a.z + a.w;
        }
        let mn = max(m, wg_max(s));
        let pj = select(0.0, exp(s - mn), valid);
        ps[lid] = pj;
        let lt = wg_sum(pj);
        let alpha = exp(m - mn);
        l = l * alpha + lt;
        m = mn;
        let cnt = min(WG, je - j0);
        for (var i = 0u; i < DPT; i++) {
            o[i] *= alpha;
        }
        for (var kk = 0u; kk < cnt; kk++) {
            let w = ps[kk];
            let vb = (slots[kk] * p.nkv + kh) * D;
            for (var i = 0u; i < DPT; i++) {
                let d = lid + i * WG;
                if d < D {
                    o[i] = fma(w, vc[vb + d], o[i]);
                }
            }
        }
        workgroupBarrier();
    }
//#if SPLIT
    let ob = ((t * p.nq + h) * p.nsplit + sp) * (D + 2u);
    for (var i = 0u; i < DPT; i++) {
        let d = lid + i * WG;
        if d < D {
            out[ob + d] = o[i];
        }
    }
    if lid == 0u {
        out[ob + D] = m;
        out[ob + D + 1u] = l;
    }
//#else
    let ob = (t * p.nq + h) * D;
    for (var i = 0u; i < DPT; i++) {
        let d = lid + i * WG;
        if d < D {
            out[ob + d] = o[i] / l;
        }
    }
//#endif
}
