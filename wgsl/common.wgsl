// Shared helpers: invocation ids kept in private vars, workgroup reductions (subgroup
// path and shared-memory tree path), 16-bit float decoding, a 32x32 -> high-32 multiply.
//
// Needs from the prelude: const WG (workgroup size, a power of two).
// Flag SUBGROUP selects the subgroup path; every kernel entry point calls
// `init_ids(...)` first.

var<private> g_lid: u32;
var<private> g_sg_lane: u32;
var<private> g_sg_id: u32;
var<private> g_sg_n: u32;

// One f32 per invocation (tree path), or per subgroup (subgroup path).
var<workgroup> red_f: array<f32, WG>;

const NEG_BIG: f32 = -3.0e38;

//#if CHUNK
// One chunk of a KV cache split across storage bindings (src/gpu/kv.rs): slots c0..c0 + cn of
// the cache, bound as rows 0..cn. Attention also takes the splits split0..split0 + nsplit of
// the partials (and c0 counts from the ring lap of the query's first key: below 2 S).
struct KvChunk {
    c0: u32,
    cn: u32,
    split0: u32,
    nsplit: u32,
}

//#endif
fn init_ids(lid: u32, sg_lane: u32, sg_id: u32, sg_n: u32) {
    g_lid = lid;
    g_sg_lane = sg_lane;
    g_sg_id = sg_id;
    g_sg_n = sg_n;
}

// Sum of `v` over the workgroup, returned to every invocation. Call from uniform control flow.
fn wg_sum(v: f32) -> f32 {
//#if SUBGROUP
    let s = subgroupAdd(v);
    if g_sg_lane == 0u {
        red_f[g_sg_id] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    for (var i = 0u; i < g_sg_n; i++) {
        t += red_f[i];
    }
    workgroupBarrier();
    return t;
//#else
    red_f[g_lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if g_lid < s {
            red_f[g_lid] += red_f[g_lid + s];
        }
        workgroupBarrier();
    }
    let t = red_f[0];
    workgroupBarrier();
    return t;
//#endif
}

// Max of `v` over the workgroup, returned to every invocation. Call from uniform control flow.
fn wg_max(v: f32) -> f32 {
//#if SUBGROUP
    let s = subgroupMax(v);
    if g_sg_lane == 0u {
        red_f[g_sg_id] = s;
    }
    workgroupBarrier();
    var t = NEG_BIG;
    for (var i = 0u; i < g_sg_n; i++) {
        t = max(t, red_f[i]);
    }
    workgroupBarrier();
    return t;
//#else
    red_f[g_lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if g_lid < s {
            red_f[g_lid] = max(red_f[g_lid], red_f[g_lid + s]);
        }
        workgroupBarrier();
    }
    let t = red_f[0];
    workgroupBarrier();
    return t;
//#endif
}

// IEEE half (low 16 bits of h) -> f32, with integer ops only (unpack2x16float needs
// a capability some GL adapters lack).
fn f16_bits_to_f32(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if e == 0u {
        return bitcast<f32>(s | bitcast<u32>(f32(m) * 5.9604644775390625e-8));
    }
    if e == 31u {
        return bitcast<f32>(s | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

// Element `i` (i's parity picks the half) of a word holding two 16-bit floats;
// dt: 0 = bf16, 1 = f16.
fn f16x2_pick(word: u32, i: u32, dt: u32) -> f32 {
    let h = select(word & 0xffffu, word >> 16u, (i & 1u) == 1u);
    if dt == 0u {
        return bitcast<f32>(h << 16u);
    }
    return f16_bits_to_f32(h);
}

// Element i of a float vector stored as dtype dt (0 bf16, 1 f16, 2 f32) from its word.
fn vec_el(word: u32, i: u32, dt: u32) -> f32 {
    if dt == 2u {
        return bitcast<f32>(word);
    }
    return f16x2_pick(word, i, dt);
}

// Word of a float vector of dtype `dt` holding element i.
fn word_of(i: u32, dt: u32) -> u32 {
    return select(i >> 1u, i, dt == 2u);
}

// The scale an RMSNorm applies from its weight value w: mode 2 `1 + w`, 1 `w`, 0 none (1).
fn norm_w_scale(w: f32, mode: u32) -> f32 {
    if mode == 2u {
        return 1.0 + w;
    }
    if mode == 1u {
        return w;
    }
    return 1.0;
}

// The scale of norm weight element i (`word`: its `word_of`) under `mode` (see norm_w_scale).
fn nw_scale(word: u32, i: u32, dt: u32, mode: u32) -> f32 {
    return norm_w_scale(vec_el(word, i, dt), mode);
}

// tanh with the argument clamped to [-15, 15] (as the CPU reference).
fn tanh_c(v: f32) -> f32 {
    return tanh(clamp(v, -15.0, 15.0));
}

// GELU, tanh approximation.
fn gelu(v: f32) -> f32 {
    let u = 0.7978845608028654 * (v + 0.044715 * v * v * v);
    return 0.5 * v * (1.0 + tanh_c(u));
}

// High 32 bits of the 64-bit product a * b.
fn mulhi(a: u32, b: u32) -> u32 {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
}

// (sin, cos) of `turn` (a u32 fraction of a full turn).
fn sincos_turn(u: u32) -> vec2<f32> {
    let uu = u + 0x20000000u;
    let q = uu >> 30u;
    let rem = i32(uu & 0x3fffffffu) - 0x20000000;
    let a = f32(rem) * 1.4629180792671596e-9;   // 2 pi / 2^32
    let z = a * a;
    let s = a + a * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    if q == 0u {
        return vec2<f32>(s, c);
    } else if q == 1u {
        return vec2<f32>(c, -s);
    } else if q == 2u {
        return vec2<f32>(-s, -c);
    }
    return vec2<f32>(-c, s);
}

// RoPE angle of pair i at position ps as a fraction of a turn, from its params table entry
// (pair 2j: (lo, hi) = entry.xy, pair 2j+1: entry.zw; the 64-bit fraction of a turn per position).
fn rope_turn(v: vec4<u32>, i: u32, ps: u32) -> u32 {
    let odd = (i & 1u) == 1u;
    let lo = select(v.x, v.z, odd);
    let hi = select(v.y, v.w, odd);
    return ps * hi + mulhi(ps, lo);
}
