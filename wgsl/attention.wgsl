// Attention over the KV slot ring (cpu::ops::attention): query t of head h sees
// absolute positions j in [lo, hi] (lo = pos[t] + 1 - window with a window, else 0;
// hi = pos[t], or max(pos[t], pos[T + t]) with attention bounds: an image span's tokens
// see the whole span), stored at slot j % S; kv head = h / (nq / nkv). Online softmax in f32.
//
// One workgroup per (head, token, split). Keys of the query's range are cut into
// `nsplit` contiguous parts; each workgroup walks its part in tiles of WG keys (one
// key per invocation for the score; then the values: invocation lid accumulates the vec4
// of dims lid % D4 over the tile's keys lid / D4, lid / D4 + WG / D4, .., four loads at a
// time, and the WG / D4 key lanes are summed at the end). With nsplit == 1 the result is
// written to out;
// otherwise (SPLIT) out receives per split [D unnormalized outputs, then max, sum and two
// unused values] (vec4s) and attn_combine.wgsl merges them.
//
// MERGE (with SPLIT): no combine dispatch. Each workgroup, its partials stored, fences them
// (storageBarrier: a device-scope release and acquire in SPIR-V) and counts itself in its
// head's counter; the one that brings it to nsplit merges the head's partials into fin
// (split_merge.wgsl, as the combine does) and zeroes the counter for the next dispatch.
//
// QROPE: q is first RMS-normed and rotated (rope.wgsl's NORM path, its params at binding 6):
// heads head0.. of a value with x_heads heads per row (a fused q/k/v projection), so q's
// norm and RoPE need no pass of their own.
//
// COOP (subgroups of at least 8): scores are computed by groups of eight invocations per key,
// each reading every eighth vec4 of the key's row, summed by shuffles: a subgroup's loads read
// whole lines (an invocation per key made each load touch as many rows as invocations).
//
// PREFETCH (with COOP): the first tile's first two passes of key rows are loaded at the start,
// before q's loads, norm and RoPE, and kept in registers (zeros past the split's keys and D4,
// as are qr's unused vec4s: their products vanish).
//
// APPEND (with QROPE, one token): the step's own key and value are heads k_head0.. and
// v_head0.. of q's row. The workgroups whose split holds the step's position pp norm (weight at
// binding 10) and rotate the key as q is and use it and the value row from there; the first
// query head of each kv head writes both at slot pp % S. No workgroup reads that slot from the
// caches, which are bound read_write; the older slots they read are not written.
//
// CHUNK (with SPLIT, without MERGE): k and v are one chunk of caches split across bindings
// (common.wgsl's KvChunk at binding 11), a dispatch per chunk. The chunk holds ring slots
// c0..c0 + cn counted from the ring lap of the query's first key lo (c0 < 2 S: a window's keys
// span two laps at most), i.e. positions ca..ca + cn, ca = lo - lo % S + c0; this dispatch takes
// those of [lo, pos[t]] (none, for most chunks of a short sequence), cut into the chunk's
// nsplit parts, written as splits split0.. of the p.nsplit partials the combine merges. Slot j
// is row j - ca of the chunk.
//
// Prelude consts: WG, DPT (= ceil(D / WG): sizes the q tile), QV4 (= ceil(D / 4) rounded
// for the q tile), QPL
// (= QV4 / 8: q vec4s per invocation with COOP), NDT (QROPE norm weight dtype).
// Flags: SUBGROUP, COOP, PREFETCH, SPLIT, MERGE, QROPE, HAS_NW, APPEND, CHUNK.
// Bindings: 0 params, 1 q [T, nq, D], 2 pos [T], 3 k [S, nkv, D], 4 v [S, nkv, D], 5 out,
// 6 rope params (QROPE), 7 norm weight (QROPE with a weight), 8 fin [T, nq, D] and 9 a
// counter per (t, head) (MERGE), 10 the key's norm weight (APPEND with HAS_NW), 11 the chunk
// (CHUNK).

struct Params {
    T: u32,
    nq: u32,
    nkv: u32,
    D: u32,
    S: u32,
    window: u32,   // 0: causal only
    nsplit: u32,
    spans: u32,    // 1: pos holds attention bounds [2, T], query t sees keys to pos[T + t]
    scale: f32,
    k_head0: u32,  // APPEND
    v_head0: u32,  // APPEND
    _p3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
//#if APPEND
@group(0) @binding(3) var<storage, read_write> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> vc: array<vec4<f32>>;
//#else
@group(0) @binding(3) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<f32>>;
//#endif
//#if SPLIT
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;
//#else
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
//#endif
//#if MERGE
@group(0) @binding(8) var<storage, read_write> fin: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read_write> done: array<atomic<u32>>;
var<workgroup> wlast: u32;

// split_merge.wgsl's accessors: the partials are this dispatch's out, the results fin
fn split_part(i: u32) -> vec4<f32> {
    return out[i];
}

fn split_out(i: u32, v: vec4<f32>) {
    fin[i] = v;
}
//#endif

//#if CHUNK
@group(0) @binding(11) var<uniform> kvc: KvChunk;

//#endif
var<workgroup> qs: array<vec4<f32>, QV4>;

//#if QROPE
// rope.wgsl's params
struct RopeParams {
    T: u32,
    heads: u32,
    D: u32,
    pairs: u32,
    norm_mode: u32,
    norm_eps: f32,
    x_heads: u32,
    head0: u32,
    S: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
    tab: array<vec4<u32>, 128>,
}

@group(0) @binding(6) var<uniform> rp: RopeParams;
//#if HAS_NW
@group(0) @binding(7) var<storage, read> nw: array<u32>;
//#endif
var<workgroup> qn: array<f32, QV4 * 4u>;

fn q_norm_scale(i: u32) -> f32 {
//#if HAS_NW
    return nw_scale(nw[word_of(i, NDT)], i, NDT, rp.norm_mode);
//#else
    return 1.0;
//#endif
}

// (sin, cos) of pair i's angle at position ps; (0, 1) past the rotated pairs.
fn pair_sincos(i: u32, ps: u32) -> vec2<f32> {
    if i < rp.pairs {
        return sincos_turn(rope_turn(rp.tab[i >> 1u], i, ps));
    }
    return vec2<f32>(0.0, 1.0);
}

// Pair (a0, a1) rotated by the angle of sc = (sin, cos).
fn rotate_pair(a0: f32, a1: f32, sc: vec2<f32>) -> vec2<f32> {
    return vec2<f32>(a0 * sc.y - a1 * sc.x, a1 * sc.y + a0 * sc.x);
}
//#endif
//#if APPEND && HAS_NW
@group(0) @binding(10) var<storage, read> kw: array<u32>;
//#endif
//#if APPEND
// the step's key (kcur, kn as qs, qn)
var<workgroup> kcur: array<vec4<f32>, QV4>;
var<workgroup> kn: array<f32, QV4 * 4u>;

fn k_norm_scale(i: u32) -> f32 {
//#if HAS_NW
    return nw_scale(kw[word_of(i, NDT)], i, NDT, rp.norm_mode);
//#else
    return 1.0;
//#endif
}
//#endif
var<workgroup> ps: array<f32, WG>;
var<workgroup> ov: array<vec4<f32>, WG>;
var<workgroup> slots: array<u32, WG>;
var<workgroup> wpos: u32;

//#if !SPLIT
// Four outputs from element i.
fn store4(i: u32, v: vec4<f32>) {
    out[i] = v.x;
    out[i + 1u] = v.y;
    out[i + 2u] = v.z;
    out[i + 3u] = v.w;
}
//#endif

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
    // the last key: the query's own position, or its image span's last (attention bounds)
    if lid == 0u && p.spans != 0u {
        wpos = max(pos[p.T + t], pp);
    }
    let hi = workgroupUniformLoad(&wpos);
    let n = hi + 1u - lo;
//#if CHUNK
    // the keys of [lo, hi] this chunk holds: r0..r1
    let ca = lo - lo % p.S + kvc.c0;
    let r0 = max(lo, ca);
    let r1 = max(r0, min(hi + 1u, ca + kvc.cn));
    let chunk = (r1 - r0 + kvc.nsplit - 1u) / kvc.nsplit;
    let js = min(r0 + sp * chunk, r1);
    let je = min(js + chunk, r1);
//#else
    let chunk = (n + p.nsplit - 1u) / p.nsplit;
    let js = min(lo + sp * chunk, hi + 1u);
    let je = min(js + chunk, hi + 1u);
//#endif
//#if APPEND
    // this split holds the step's key (uniform: pp from a uniform load)
    let has_cur = js <= pp && pp < je;
    let vb = (t * rp.x_heads + p.v_head0 + kh) * D4;
//#endif
//#if COOP
    // eight invocations per key
    let kg = lid >> 3u;
    let c8 = lid & 7u;
//#endif
//#if PREFETCH
    // the first tile's first two passes of key rows, loaded before q's norm and RoPE (they
    // depend on the positions alone): their memory round trip overlaps q's
    var kp0: array<vec4<f32>, QPL>;
    var kp1: array<vec4<f32>, QPL>;
    let ja = js + kg;
    let jb = ja + WG / 8u;
//#if CHUNK
    let kba = ((ja - ca) * p.nkv + kh) * D4;
    let kbb = ((jb - ca) * p.nkv + kh) * D4;
//#else
    let kba = ((ja % p.S) * p.nkv + kh) * D4;
    let kbb = ((jb % p.S) * p.nkv + kh) * D4;
//#endif
    for (var i = 0u; i < QPL; i++) {
        let e = c8 + 8u * i;
//#if APPEND
        // (not the step's slot, which this pass writes)
        if e < D4 && ja < je && ja != pp {
            kp0[i] = kc[kba + e];
        }
        if e < D4 && jb < je && jb != pp {
            kp1[i] = kc[kbb + e];
        }
//#else
        if e < D4 && ja < je {
            kp0[i] = kc[kba + e];
        }
        if e < D4 && jb < je {
            kp1[i] = kc[kbb + e];
        }
//#endif
    }
//#endif

//#if QROPE
    // rope(rms_norm(q row)) * scale
    let qb = (t * rp.x_heads + rp.head0 + h) * D4;
//#if APPEND
    // the step's key row, its loads issued with q's
    var ks = 0.0;
    if has_cur {
        let kb = (t * rp.x_heads + p.k_head0 + kh) * D4;
        for (var i = lid; i < D4; i += WG) {
            let v = q[kb + i];
            kcur[i] = v;
            ks += dot(v, v);
        }
    }
//#endif
    var ss = 0.0;
    for (var i = lid; i < D4; i += WG) {
        let v = q[qb + i];
        qs[i] = v;
        ss += dot(v, v);
    }
    let r = 1.0 / sqrt(wg_sum(ss) / f32(D) + rp.norm_eps);
//#if APPEND
    // the key normed and rotated along with q, into kcur
    var rk = 0.0;
    if has_cur {
        rk = 1.0 / sqrt(wg_sum(ks) / f32(D) + rp.norm_eps);
    }
//#endif
    for (var i = lid; i < D; i += WG) {
        qn[i] = qs[i >> 2u][i & 3u] * r * q_norm_scale(i);
//#if APPEND
        if has_cur {
            kn[i] = kcur[i >> 2u][i & 3u] * rk * k_norm_scale(i);
        }
//#endif
    }
    workgroupBarrier();
    let half = D / 2u;
    for (var i = lid; i < half; i += WG) {
        let sc = pair_sincos(i, pp);
        let b = rotate_pair(qn[i], qn[i + half], sc) * p.scale;
        qs[i >> 2u][i & 3u] = b.x;
        qs[(i + half) >> 2u][(i + half) & 3u] = b.y;
//#if APPEND
        if has_cur {
            let c = rotate_pair(kn[i], kn[i + half], sc);
            kcur[i >> 2u][i & 3u] = c.x;
            kcur[(i + half) >> 2u][(i + half) & 3u] = c.y;
        }
//#endif
    }
    workgroupBarrier();
//#if APPEND
    if has_cur && h % (p.nq / p.nkv) == 0u {
//#if CHUNK
        let cb = ((pp - ca) * p.nkv + kh) * D4;
//#else
        let cb = ((pp % p.S) * p.nkv + kh) * D4;
//#endif
        for (var i = lid; i < D4; i += WG) {
            kc[cb + i] = kcur[i];
            vc[cb + i] = q[vb + i];
        }
    }
//#endif
//#else
    let qb = (t * p.nq + h) * D4;
    for (var i = lid; i < D4; i += WG) {
        qs[i] = q[qb + i] * p.scale;
    }
    workgroupBarrier();
//#endif

    var m = NEG_BIG;
    var l = 0.0;
    // V: invocation lid owns dims 4dv..4dv + 3 of key lane vl (nvl lanes, D4 <= WG)
    let nvl = WG / D4;
    let dv = lid % D4;
    let vl = lid / D4;
    var o4 = vec4<f32>(0.0);
//#if COOP
    // invocation c of a group holds q's vec4s c, c + 8, ..
    var qr: array<vec4<f32>, QPL>;
    for (var i = 0u; i < QPL; i++) {
        let e = c8 + 8u * i;
        if e < D4 {
            qr[i] = qs[e];
        }
    }
//#endif
    for (var j0 = js; j0 < je; j0 += WG) {
        let j = j0 + lid;
        let valid = j < je;
        let cnt = min(WG, je - j0);
        var s = NEG_BIG;
//#if COOP
        // scores: a group of eight reads a key's row in whole 128-byte lines; WG / 8 keys per
        // pass, as many passes as the tile has keys (cnt is uniform)
        for (var k0 = 0u; k0 < cnt; k0 += WG / 8u) {
            let jk = j0 + k0 + kg;
            var a = vec4<f32>(0.0);
//#if APPEND
            if jk == pp && jk < je {
                // the step's key, from this pass
                for (var i = 0u; i < QPL; i++) {
                    let e = c8 + 8u * i;
                    if e < D4 {
                        a = fma(qr[i], kcur[e], a);
                    }
                }
            } else
//#endif
//#if PREFETCH
            if j0 == js && k0 == 0u {
                for (var i = 0u; i < QPL; i++) {
                    a = fma(qr[i], kp0[i], a);
                }
            } else if j0 == js && k0 == WG / 8u {
                for (var i = 0u; i < QPL; i++) {
                    a = fma(qr[i], kp1[i], a);
                }
            } else if jk < je {
//#else
            if jk < je {
//#endif
//#if CHUNK
                let kb = ((jk - ca) * p.nkv + kh) * D4;
//#else
                let kb = ((jk % p.S) * p.nkv + kh) * D4;
//#endif
                for (var i = 0u; i < QPL; i++) {
                    let e = c8 + 8u * i;
                    if e < D4 {
                        a = fma(qr[i], kc[kb + e], a);
                    }
                }
            }
            var t = (a.x + a.y) + (a.z + a.w);
            t += subgroupShuffleXor(t, 1u);
            t += subgroupShuffleXor(t, 2u);
            t += subgroupShuffleXor(t, 4u);
            if c8 == 0u {
                ps[k0 + kg] = t;
            }
        }
        workgroupBarrier();
        if valid {
//#if CHUNK
            slots[lid] = j - ca;
//#else
            slots[lid] = j % p.S;
//#endif
            s = ps[lid];
        }
        workgroupBarrier();
//#else
        if valid {
//#if CHUNK
            let slot = j - ca;
//#else
            let slot = j % p.S;
//#endif
            slots[lid] = slot;
            let kb = (slot * p.nkv + kh) * D4;
            var a = vec4<f32>(0.0);
//#if APPEND
            if j == pp {
                for (var i = 0u; i < D4; i++) {
                    a = fma(qs[i], kcur[i], a);
                }
            } else {
                for (var i = 0u; i < D4; i++) {
                    a = fma(qs[i], kc[kb + i], a);
                }
            }
//#else
            for (var i = 0u; i < D4; i++) {
                a = fma(qs[i], kc[kb + i], a);
            }
//#endif
            s = a.x + a.y + a.z + a.w;
        }
//#endif
        let mn = max(m, wg_max(s));
        let pj = select(0.0, exp(s - mn), valid);
        ps[lid] = pj;
        let lt = wg_sum(pj);
        let alpha = exp(m - mn);
        l = l * alpha + lt;
        m = mn;
        o4 *= alpha;
//#if APPEND
        // the step's key is the last of the split's last tile: its value from q's row
        let cur = has_cur && j0 + cnt == je;
        let vcnt = select(cnt, cnt - 1u, cur);
        if cur && vl == 0u {
            o4 = fma(vec4<f32>(ps[cnt - 1u]), q[vb + dv], o4);
        }
//#else
        let vcnt = cnt;
//#endif
        if vl < nvl {
            // lane vl takes keys vl, vl + nvl, ..: four per step, their loads issued together
            var kk = vl;
            for (; kk + 3u * nvl < vcnt; kk += 4u * nvl) {
                let k1 = kk + nvl;
                let k2 = k1 + nvl;
                let k3 = k2 + nvl;
                let v0 = vc[(slots[kk] * p.nkv + kh) * D4 + dv];
                let v1 = vc[(slots[k1] * p.nkv + kh) * D4 + dv];
                let v2 = vc[(slots[k2] * p.nkv + kh) * D4 + dv];
                let v3 = vc[(slots[k3] * p.nkv + kh) * D4 + dv];
                o4 = fma(vec4<f32>(ps[kk]), v0, o4);
                o4 = fma(vec4<f32>(ps[k1]), v1, o4);
                o4 = fma(vec4<f32>(ps[k2]), v2, o4);
                o4 = fma(vec4<f32>(ps[k3]), v3, o4);
            }
            for (; kk < vcnt; kk += nvl) {
                o4 = fma(vec4<f32>(ps[kk]), vc[(slots[kk] * p.nkv + kh) * D4 + dv], o4);
            }
        }
        workgroupBarrier();
    }
    // the key lanes' partial outputs summed: lane 0 holds dims 4dv..4dv + 3
    ov[lid] = o4;
    workgroupBarrier();
    if vl == 0u {
        for (var g = 1u; g < nvl; g++) {
            o4 += ov[g * D4 + dv];
        }
    }
//#if SPLIT
//#if CHUNK
    let ob = ((t * p.nq + h) * p.nsplit + kvc.split0 + sp) * (D4 + 1u);
//#else
    let ob = ((t * p.nq + h) * p.nsplit + sp) * (D4 + 1u);
//#endif
    if lid < D4 {
        out[ob + dv] = o4;
    }
    if lid == 0u {
        out[ob + D4] = vec4<f32>(m, l, 0.0, 0.0);
    }
//#if MERGE
    storageBarrier();
    let hc = t * p.nq + h;
    if lid == 0u {
        wlast = u32(atomicAdd(&done[hc], 1u) + 1u == p.nsplit);
    }
    if workgroupUniformLoad(&wlast) == 1u {
        storageBarrier();
        merge_splits(hc * p.nsplit * (D4 + 1u), hc * D4, D, p.nsplit, lid);
        if lid == 0u {
            atomicStore(&done[hc], 0u);
        }
    }
//#endif
//#else
    let ob = (t * p.nq + h) * D;
    if lid < D4 {
        store4(ob + 4u * dv, o4 / l);
    }
//#endif
}
