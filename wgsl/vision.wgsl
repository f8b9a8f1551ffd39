// The vision towers' ops (one source variant per op):
//   CLAMP:  out = min(max(x, lo), hi), scalar bounds lo, hi (dtypes LDT, HDT)
//   ROPE2D: 2-D RoPE of x[rows = T * heads, D]: channel half 0 turns with px[t], half 1 with
//           py[t]; pairs (i, i + D/4) inside each half; angle = pos / ts[i] (host timescales)
//   POOL:   mean of k x k blocks of the row-major grid (cols wide) of D-wide rows
//   LNORM:  LayerNorm of each D-wide row (one workgroup per row), weight (WDT), bias (BDT)
//   SCATTER: out row t = rows[src[t] - 1] where 0 < src[t] <= s (the rows' count), else x's
//   ATTN:   bidirectional attention, one workgroup per (query, head): keys in tiles of WG
//           with an online softmax, so a tile's scores are all that is ever held; keys whose
//           valid word is 0 (MASK) are skipped
//
// Prelude consts: WG, LDT/HDT/WDT/BDT (0 bf16, 1 f16, 2 f32); DM, DJ, QT, KT (ATTN with
// TILED: the head dim rounded up to 4, a quarter of it, queries and keys per tile). Flags: one op flag; HAS_B (LNORM), MASK and
// TILED (ATTN).
// Bindings: 0 params, 1 x (ATTN: q), 2 out, then CLAMP 3 lo 4 hi; ROPE2D 3 px 4 py; LNORM 3 w
// 4 b; ATTN 3 k 4 v 5 valid; SCATTER 3 rows 4 src.

struct Params {
    n: u32,     // values (CLAMP, POOL), rows (ROPE2D, LNORM, ATTN: T * heads)
    heads: u32, // ROPE2D, ATTN: heads of x / q
    kv: u32,    // ATTN: kv heads
    s: u32,     // ATTN: keys
    d: u32,     // row width
    cols: u32,  // POOL: grid columns
    k: u32,     // POOL: block side
    _p0: u32,
    f: f32,     // ATTN: scale; LNORM: eps; POOL: 1 / k²
    _p1: u32,
    _p2: u32,
    _p3: u32,
    ts: array<vec4<f32>, 64>, // ROPE2D timescales
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#if CLAMP
@group(0) @binding(3) var<storage, read> lo: array<u32>;
@group(0) @binding(4) var<storage, read> hi: array<u32>;
//#endif
//#if ROPE2D
@group(0) @binding(3) var<storage, read> px: array<u32>;
@group(0) @binding(4) var<storage, read> py: array<u32>;
//#endif
//#if LNORM
@group(0) @binding(3) var<storage, read> w: array<u32>;
//#if HAS_B
@group(0) @binding(4) var<storage, read> bias: array<u32>;
//#endif
//#endif
//#if SCATTER
@group(0) @binding(3) var<storage, read> rows: array<f32>;
@group(0) @binding(4) var<storage, read> src: array<u32>;
//#endif
//#if ATTN
@group(0) @binding(3) var<storage, read> kk: array<f32>;
@group(0) @binding(4) var<storage, read> vv: array<f32>;
//#if MASK
@group(0) @binding(5) var<storage, read> valid: array<u32>;
//#endif
//#endif

//#if CLAMP
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let a = vec_el(lo[0], 0u, LDT);
    let b = vec_el(hi[0], 0u, HDT);
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        out[i] = min(max(x[i], a), b);
    }
}
//#endif

//#if ROPE2D
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let half = p.d / 2u;
    let q = p.d / 4u;
    let stride = nwg.x * WG;
    // one invocation per (row, half, pair)
    for (var idx = gid.x + gid.y * stride; idx < p.n * half; idx += stride * nwg.y) {
        let row = idx / half;
        let axis = (idx % half) / q;
        let i = idx % q;
        let t = row / p.heads;
        var pos = px[t];
        if axis == 1u {
            pos = py[t];
        }
        let ang = f32(pos) / p.ts[i >> 2u][i & 3u];
        let sn = sin(ang);
        let cs = cos(ang);
        let b = row * p.d + axis * half;
        let a0 = x[b + i];
        let a1 = x[b + i + q];
        out[b + i] = a0 * cs - a1 * sn;
        out[b + i + q] = a1 * cs + a0 * sn;
    }
}
//#endif

//#if POOL
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let oc = p.cols / p.k;
    let stride = nwg.x * WG;
    for (var idx = gid.x + gid.y * stride; idx < p.n; idx += stride * nwg.y) {
        let o = idx / p.d;
        let ch = idx % p.d;
        let r0 = (o / oc) * p.k;
        let c0 = (o % oc) * p.k;
        var acc = 0.0;
        for (var r = r0; r < r0 + p.k; r++) {
            for (var c = c0; c < c0 + p.k; c++) {
                acc += x[(r * p.cols + c) * p.d + ch];
            }
        }
        out[idx] = acc * p.f;
    }
}
//#endif

//#if LNORM
@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    init_ids(lid, 0u, 0u, 1u);
    for (var row = wid.y * nwg.x + wid.x; row < p.n; row += nwg.x * nwg.y) {
        let b = row * p.d;
        var s = 0.0;
        for (var i = lid; i < p.d; i += WG) {
            s += x[b + i];
        }
        let mean = wg_sum(s) / f32(p.d);
        var v = 0.0;
        for (var i = lid; i < p.d; i += WG) {
            let c = x[b + i] - mean;
            v += c * c;
        }
        let r = 1.0 / sqrt(wg_sum(v) / f32(p.d) + p.f);
        for (var i = lid; i < p.d; i += WG) {
            var y = (x[b + i] - mean) * r * vec_el(w[word_of(i, WDT)], i, WDT);
//#if HAS_B
            y += vec_el(bias[word_of(i, BDT)], i, BDT);
//#endif
            out[b + i] = y;
        }
    }
}
//#endif

//#if SCATTER
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        let r = src[i / p.d];
        if r > 0u && r <= p.s {
            out[i] = rows[(r - 1u) * p.d + i % p.d];
        } else {
            out[i] = x[i];
        }
    }
}
//#endif

//#if ATTN
//#if TILED
// TILED: a workgroup takes QT queries of one head and walks the keys in tiles of KT: the
// queries, one tile of keys and one of values are held in workgroup memory (DM floats a row:
// the head dim, rounded up to 4), so each key and value is read once per QT queries instead of
// once per query. Invocation lid computes the scores of query lid / 4 with keys 4 (lid % 4) ..
// + 3 of the tile, and the output dims lid % 4 + 4 j of the same query; the row's online
// softmax (running max, sum, correction) is kept by invocations 0 .. QT - 1.
// (QT = WG / 4 and KT = 16 come from the prelude: each query has 4 invocations, each taking 4
// keys of the tile.)
var<workgroup> qt_s: array<f32, QT * DM>;
var<workgroup> kt_s: array<f32, KT * DM>;
var<workgroup> vt_s: array<f32, KT * DM>;
var<workgroup> sc_s: array<f32, QT * KT>;
var<workgroup> m_s: array<f32, QT>;
var<workgroup> l_s: array<f32, QT>;
var<workgroup> c_s: array<f32, QT>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let group = p.heads / p.kv;
    let d = p.d;
    let nt = p.n / p.heads;
    let ntiles = (nt + QT - 1u) / QT * p.heads;
    let qi = lid / 4u;
    let part = lid % 4u;
    for (var wt = wid.y * nwg.x + wid.x; wt < ntiles; wt += nwg.x * nwg.y) {
        let h = wt % p.heads;
        let t0 = (wt / p.heads) * QT;
        let kh = h / group;
        for (var idx = lid; idx < QT * d; idx += WG) {
            let t = t0 + idx / d;
            var q = 0.0;
            if t < nt {
                q = x[(t * p.heads + h) * d + idx % d];
            }
            qt_s[(idx / d) * DM + idx % d] = q;
        }
        if lid < QT {
            m_s[lid] = NEG_BIG;
            l_s[lid] = 0.0;
        }
        var acc: array<f32, DJ>;
        for (var j = 0u; j < DJ; j++) {
            acc[j] = 0.0;
        }
        for (var s0 = 0u; s0 < p.s; s0 += KT) {
            workgroupBarrier();
            for (var idx = lid; idx < KT * d; idx += WG) {
                let s = s0 + idx / d;
                var kv_k = 0.0;
                var kv_v = 0.0;
                if s < p.s {
                    let b = (s * p.kv + kh) * d + idx % d;
                    kv_k = kk[b];
                    kv_v = vv[b];
                }
                kt_s[(idx / d) * DM + idx % d] = kv_k;
                vt_s[(idx / d) * DM + idx % d] = kv_v;
            }
            workgroupBarrier();
            // scores of query qi with keys 4 part .. 4 part + 3
            for (var jj = 0u; jj < 4u; jj++) {
                let j = part * 4u + jj;
                let s = s0 + j;
                var ok = s < p.s;
//#if MASK
                if ok {
                    ok = valid[s] != 0u;
                }
//#endif
                var score = NEG_BIG;
                if ok {
                    var dot = 0.0;
                    for (var c = 0u; c < d; c++) {
                        dot += qt_s[qi * DM + c] * kt_s[j * DM + c];
                    }
                    score = dot * p.f;
                }
                sc_s[qi * KT + j] = score;
            }
            workgroupBarrier();
            if lid < QT {
                let m_old = m_s[lid];
                var mx = m_old;
                for (var j = 0u; j < KT; j++) {
                    mx = max(mx, sc_s[lid * KT + j]);
                }
                var sum = 0.0;
                for (var j = 0u; j < KT; j++) {
                    let sv = sc_s[lid * KT + j];
                    var pr = 0.0;
                    if sv > NEG_BIG {
                        pr = exp(sv - mx);
                    }
                    sc_s[lid * KT + j] = pr;
                    sum += pr;
                }
                var corr = 0.0;
                if m_old > NEG_BIG {
                    corr = exp(m_old - mx);
                }
                l_s[lid] = l_s[lid] * corr + sum;
                m_s[lid] = mx;
                c_s[lid] = corr;
            }
            workgroupBarrier();
            let corr = c_s[qi];
            let n = min(KT, p.s - s0);
            for (var j = 0u; j < DJ; j++) {
                let dd = part + 4u * j;
                if dd < d {
                    var a = acc[j] * corr;
                    for (var u = 0u; u < n; u++) {
                        a += sc_s[qi * KT + u] * vt_s[u * DM + dd];
                    }
                    acc[j] = a;
                }
            }
        }
        workgroupBarrier();
        let t = t0 + qi;
        let l = l_s[qi];
        if t < nt {
            for (var j = 0u; j < DJ; j++) {
                let dd = part + 4u * j;
                if dd < d {
                    var o = 0.0;
                    if l > 0.0 {
                        o = acc[j] / l;
                    }
                    out[(t * p.heads + h) * d + dd] = o;
                }
            }
        }
        // the next tile's queries and row state overwrite what this one read
        workgroupBarrier();
    }
}
//#else
var<workgroup> qs: array<f32, 256>;
var<workgroup> pt: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    init_ids(lid, 0u, 0u, 1u);
    let group = p.heads / p.kv;
    for (var row = wid.y * nwg.x + wid.x; row < p.n; row += nwg.x * nwg.y) {
        let kh = (row % p.heads) / group;
        for (var i = lid; i < p.d; i += WG) {
            qs[i] = x[row * p.d + i];
        }
        workgroupBarrier();
        var m = NEG_BIG;
        var l = 0.0;
        var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
        for (var s0 = 0u; s0 < p.s; s0 += WG) {
            let s = s0 + lid;
            var score = NEG_BIG;
            var ok = s < p.s;
//#if MASK
            if ok {
                ok = valid[s] != 0u;
            }
//#endif
            if ok {
                let kb = (s * p.kv + kh) * p.d;
                var dot = 0.0;
                for (var i = 0u; i < p.d; i++) {
                    dot += qs[i] * kk[kb + i];
                }
                score = dot * p.f;
            }
            // no branch on the reduced values (barriers stay in uniform control flow): with
            // every key so far masked, the weights and the correction are 0
            let m_new = max(m, wg_max(score));
            var pr = 0.0;
            if score > NEG_BIG {
                pr = exp(score - m_new);
            }
            var corr = 0.0;
            if m > NEG_BIG {
                corr = exp(m - m_new);
            }
            l = l * corr + wg_sum(pr);
            pt[lid] = pr;
            workgroupBarrier();
            let n = min(WG, p.s - s0);
            for (var j = 0u; j < 4u; j++) {
                let dd = lid + j * WG;
                if dd < p.d {
                    var a = acc[j] * corr;
                    for (var u = 0u; u < n; u++) {
                        a += pt[u] * vv[((s0 + u) * p.kv + kh) * p.d + dd];
                    }
                    acc[j] = a;
                }
            }
            workgroupBarrier();
            m = m_new;
        }
        for (var j = 0u; j < 4u; j++) {
            let dd = lid + j * WG;
            if dd < p.d {
                var o = 0.0;
                if l > 0.0 {
                    o = acc[j] / l;
                }
                out[row * p.d + dd] = o;
            }
        }
        workgroupBarrier();
    }
}
//#endif
//#endif
