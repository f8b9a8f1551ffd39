// The audio towers' ops (one source variant per op), f32 activations and accumulation:
//   CONV2D:  dense 2-D convolution of x[h, w, c] by wt[o, kh, kw, c] (dtype WDT), `pad` zeros
//            left and right, `pad_top` above (those below implied by ho), `stride` both ways,
//            into out[ho, wo, o]; one invocation per output
//   CGN_SUM, CGN_SQ, CGN: Gemma 3n's cumulative group norm of x[h, row] (row = F C, channel
//            last) by wt[c] (WDT), one workgroup per row in three passes: CGN_SUM writes each
//            row's sum to out[t] (the row statistics buffer), CGN_SQ each row's squared
//            deviations from its running mean (the sum of rows 0..t over (t + 1) row) to
//            out[h + t], CGN normalises row t by that mean and the running sum of the
//            squared deviations (stats: the statistics buffer)
//   MASK:    out = x, rows (row values each) whose valid word is 0 set to zero
//   STRIDED: rows 0, stride, 2 stride, .. of x (row words each; f32 or u32 alike)
//   GLU:     out[r, i] = a / (1 + exp(-b)), a = x[r, i], b = x[r, row + i] (row = C)
//   DWCONV:  causal depthwise conv of x[T, C] by wt[C, K] (WDT): out[t, c] = sum_j
//            wt[c, j] x[t - (K - 1) + j, c], zeros before row 0
//   ATTN:    the local audio attention, one workgroup per (query, head): q scaled by
//            D^-1/2 / ln 2 softplus(per_dim_scale) (PDT), keys by key_scale; query t
//            sees keys s = t - dist, 0 <= dist < window, whose valid word is not 0; logit
//            q . (k_s ks + R[dist]) soft-capped at cap; R: [window, heads D] (the relative
//            position embeddings, a matmul before this dispatch)
//
// Prelude consts: WG, WDT (CONV2D, CGN, DWCONV), PDT (ATTN) (0 bf16, 1 f16, 2 f32). Flags: one op
// flag.
// Bindings: 0 params, 1 x (ATTN: q), 2 out, then CONV2D 3 wt; CGN 3 wt 4 stats; MASK 3 valid; DWCONV 3 wt; ATTN
// 3 k 4 v 5 valid 6 per_dim_scale 7 R.

struct Params {
    n: u32,      // output values (ATTN: queries x heads)
    row: u32,    // MASK, STRIDED, CGN: values per row; GLU, DWCONV: channels; ATTN: head dim D
    stride: u32, // CONV2D, STRIDED
    pad: u32,    // CONV2D
    h: u32,      // CONV2D input rows; CGN rows
    w: u32,      // CONV2D input columns
    c: u32,      // CONV2D input channels; CGN channels
    o: u32,      // CONV2D output channels
    kh: u32,     // CONV2D kernel rows
    kw: u32,     // CONV2D kernel columns; DWCONV kernel K
    ho: u32,     // CONV2D output rows
    wo: u32,     // CONV2D output columns
    heads: u32,  // ATTN
    window: u32, // ATTN
    cap: f32,    // ATTN logit soft cap
    key_scale: f32, // ATTN
    pad_top: u32, // CONV2D rows of zeros above
    eps: f32,    // CGN
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if STRIDED
@group(0) @binding(1) var<storage, read> xw: array<u32>;
@group(0) @binding(2) var<storage, read_write> outw: array<u32>;
//#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#endif
//#if CONV2D || DWCONV || CGN
@group(0) @binding(3) var<storage, read> wt: array<u32>;
//#endif
//#if CGN
@group(0) @binding(4) var<storage, read> stats: array<f32>;
//#endif
//#if MASK
@group(0) @binding(3) var<storage, read> valid: array<u32>;
//#endif
//#if ATTN
@group(0) @binding(3) var<storage, read> kk: array<f32>;
@group(0) @binding(4) var<storage, read> vv: array<f32>;
@group(0) @binding(5) var<storage, read> valid: array<u32>;
@group(0) @binding(6) var<storage, read> pds: array<u32>;
@group(0) @binding(7) var<storage, read> rel: array<f32>;
//#endif

//#if CONV2D || DWCONV || CGN
fn wt_at(i: u32) -> f32 {
    return vec_el(wt[word_of(i, WDT)], i, WDT);
}
//#endif

//#if CONV2D
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var idx = gid.x + gid.y * stride; idx < p.n; idx += stride * nwg.y) {
        let oc = idx % p.o;
        let pix = idx / p.o;
        let tx = pix % p.wo;
        let ty = pix / p.wo;
        var acc = 0.0;
        for (var i = 0u; i < p.kh; i++) {
            let yy = ty * p.stride + i;
            if yy < p.pad_top || yy - p.pad_top >= p.h {
                continue;
            }
            for (var j = 0u; j < p.kw; j++) {
                let xx = tx * p.stride + j;
                if xx < p.pad || xx - p.pad >= p.w {
                    continue;
                }
                let src = ((yy - p.pad_top) * p.w + xx - p.pad) * p.c;
                let kb = ((oc * p.kh + i) * p.kw + j) * p.c;
                var s = 0.0;
                for (var ci = 0u; ci < p.c; ci++) {
                    s += wt_at(kb + ci) * x[src + ci];
                }
                acc += s;
            }
        }
        out[idx] = acc;
    }
}
//#endif

//#if CGN_SUM || CGN_SQ || CGN
// Value i of the row statistics (CGN_SQ: its own output buffer).
fn stat(i: u32) -> f32 {
//#if CGN
    return stats[i];
//#else
    return out[i];
//#endif
}

// The sum of rows 0..=t of the statistics from base on (the running sum of a per-row one).
fn prefix(base: u32, t: u32) -> f32 {
    var s = 0.0;
    for (var j = g_lid; j <= t; j += WG) {
        s += stat(base + j);
    }
    return wg_sum(s);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    init_ids(lid, 0u, 0u, 1u);
    for (var t = wid.y * nwg.x + wid.x; t < p.h; t += nwg.x * nwg.y) {
        let base = t * p.row;
        let n = f32(t + 1u) * f32(p.row);
//#if CGN_SUM
        var s = 0.0;
        for (var i = lid; i < p.row; i += WG) {
            s += x[base + i];
        }
        let total = wg_sum(s);
        if lid == 0u {
            out[t] = total;
        }
//#else
        let mean = prefix(0u, t) / n;
//#if CGN_SQ
        var s2 = 0.0;
        for (var i = lid; i < p.row; i += WG) {
            let d = x[base + i] - mean;
            s2 += d * d;
        }
        let total = wg_sum(s2);
        if lid == 0u {
            out[p.h + t] = total;
        }
//#else
        let inv = 1.0 / sqrt(prefix(p.h, t) / n + p.eps);
        for (var i = lid; i < p.row; i += WG) {
            out[base + i] = (x[base + i] - mean) * inv * wt_at(i % p.c);
        }
//#endif
//#endif
    }
}
//#endif

//#if MASK
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        out[i] = select(0.0, x[i], valid[i / p.row] != 0u);
    }
}
//#endif

//#if STRIDED
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        outw[i] = xw[(i / p.row) * p.stride * p.row + i % p.row];
    }
}
//#endif

//#if GLU
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        let b = (i / p.row) * 2u * p.row + i % p.row;
        out[i] = x[b] / (1.0 + exp(-x[b + p.row]));
    }
}
//#endif

//#if DWCONV
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        let t = i / p.row;
        let ch = i % p.row;
        var s = 0.0;
        for (var j = 0u; j < p.kw; j++) {
            if t + j >= p.kw - 1u {
                s += wt_at(ch * p.kw + j) * x[(t + j + 1u - p.kw) * p.row + ch];
            }
        }
        out[i] = s;
    }
}
//#endif

//#if ATTN
const LN2: f32 = 0.6931471805599453;

// ln(1 + e^v), accurate for small e^v (log1p by the (1 + y) - 1 correction).
fn softplus(v: f32) -> f32 {
    if v > 20.0 {
        return v;
    }
    let y = exp(v);
    let u = 1.0 + y;
    if u == 1.0 {
        return y;
    }
    return log(u) * (y / (u - 1.0));
}

var<workgroup> qs: array<f32, 256>;
var<workgroup> lg: array<f32, 256>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let d = p.row;
    let hd = p.heads * d;
    for (var row = wid.y * nwg.x + wid.x; row < p.n; row += nwg.x * nwg.y) {
        let t = row / p.heads;
        let h = row % p.heads;
        for (var i = lid; i < d; i += WG) {
            qs[i] = x[row * d + i] * (inverseSqrt(f32(d)) / LN2 * softplus(vec_el(pds[word_of(i, PDT)], i, PDT)));
        }
        workgroupBarrier();
        // one invocation per key: its soft-capped logit, NEG_BIG where it is not seen
        for (var dist = lid; dist < p.window; dist += WG) {
            var l = NEG_BIG;
            if dist <= t {
                let s = t - dist;
                if valid[s] != 0u {
                    let kb = s * hd + h * d;
                    let rb = dist * hd + h * d;
                    var dot = 0.0;
                    for (var i = 0u; i < d; i++) {
                        dot += qs[i] * (kk[kb + i] * p.key_scale + rel[rb + i]);
                    }
                    l = tanh_c(dot / p.cap) * p.cap;
                }
            }
            lg[dist] = l;
        }
        workgroupBarrier();
        var m = NEG_BIG;
        for (var j = 0u; j < p.window; j++) {
            m = max(m, lg[j]);
        }
        var sum = 0.0;
        for (var j = 0u; j < p.window; j++) {
            if lg[j] > NEG_BIG {
                sum += exp(lg[j] - m);
            }
        }
        for (var dd = lid; dd < d; dd += WG) {
            var acc = 0.0;
            for (var j = 0u; j < p.window; j++) {
                if lg[j] > NEG_BIG {
                    acc += exp(lg[j] - m) * vv[(t - j) * hd + h * d + dd];
                }
            }
            var o = 0.0;
            if sum > 0.0 {
                o = acc / sum;
            }
            out[row * d + dd] = o;
        }
        workgroupBarrier();
    }
}
//#endif
