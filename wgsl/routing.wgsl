// MoE routing ops (one source variant per op):
//   TOPK:       ids[t, r] = index of the r-th largest logit of row t (ties: lower
//               index first; f32 total order like Rust's total_cmp). Each invocation
//               ranks one element against the whole row.
//   TOPK_SOFTMAX: w[t, r] = softmax over the selected logits, times scale[id] (HAS_SCALE).
//   WSUM:       out[t, d] = sum_s w[t, s] * x[t, s, d].
//
// Prelude consts: WG, SDT (scale dtype: 0 bf16, 1 f16, 2 f32).
// Bindings: TOPK: 0 params, 1 logits, 2 ids out.
//           TOPK_SOFTMAX: 0 params, 1 logits, 2 ids, 3 out, 4 scale (HAS_SCALE).
//           WSUM: 0 params, 1 x, 2 w, 3 out.

struct Params {
    T: u32,
    E: u32,   // experts (WSUM: S)
    k: u32,   // selected (WSUM: D)
    _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

//#if TOPK
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids_out: array<u32>;

fn tkey(v: f32) -> i32 {
    let i = bitcast<i32>(v);
    return i ^ i32(u32(i >> 31u) >> 1u);
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    let total = p.T * p.E;
    for (var idx = gid.x + gid.y * stride; idx < total; idx += stride * nwg.y) {
        let t = idx / p.E;
        let i = idx % p.E;
        let b = t * p.E;
        let ki = tkey(logits[b + i]);
        var rank = 0u;
        for (var j = 0u; j < p.E; j++) {
            let kj = tkey(logits[b + j]);
            if kj > ki || (kj == ki && j < i) {
                rank++;
            }
        }
        if rank < p.k {
            ids_out[t * p.k + rank] = i;
        }
    }
}
//#endif

//#if TOPK_SOFTMAX
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//#if HAS_SCALE
@group(0) @binding(4) var<storage, read> esc: array<u32>;
//#endif

fn scale_at(i: u32) -> f32 {
//#if HAS_SCALE
    if SDT == 2u {
        return bitcast<f32>(esc[i]);
    }
    return f16x2_pick(esc[i >> 1u], i, SDT);
//#else
    return 1.0;
//#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var t = gid.x + gid.y * stride; t < p.T; t += stride * nwg.y) {
        let lb = t * p.E;
        let ib = t * p.k;
        var mx = NEG_BIG;
        for (var r = 0u; r < p.k; r++) {
            mx = max(mx, logits[lb + ids[ib + r]]);
        }
        var sum = 0.0;
        for (var r = 0u; r < p.k; r++) {
            sum += exp(logits[lb + ids[ib + r]] - mx);
        }
        for (var r = 0u; r < p.k; r++) {
            let id = ids[ib + r];
            out[ib + r] = exp(logits[lb + id] - mx) / sum * scale_at(id);
        }
    }
}
//#endif

//#if WSUM
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let S = p.E;
    let D = p.k;
    let stride = nwg.x * WG;
    let total = p.T * D;
    for (var idx = gid.x + gid.y * stride; idx < total; idx += stride * nwg.y) {
        let t = idx / D;
        let d = idx % D;
        var acc = 0.0;
        for (var s = 0u; s < S; s++) {
            acc += w[t * S + s] * x[(t * S + s) * D + d];
        }
        out[idx] = acc;
    }
}
//#endif
