// Half-split RoPE on heads head0..head0 + heads of x[T, x_heads, D] into out[T, heads, D]: pairs (i, i + D/2) for i < pairs rotate by
// angle pos[t] * inv_freq_i; the rest is copied.
//
// The angle is reduced exactly: the params carry, per pair, frac(inv_freq_i / 2pi)
// as a 64-bit fixed-point fraction of a turn (computed on the host from the f32
// inv_freq the CPU uses), so pos * inv_freq mod 1 turn is an integer product;
// sin/cos then use polynomials on [-pi/4, pi/4]. Accurate to ~2e-7 for any u32 position.
//
// NORM: x is first RMS-normed per head row (one workgroup per row): the q/k norms and
// their RoPE in one pass. CACHE (with NORM): out is a KV cache [S, heads, D]; row (t, h)
// goes to slot pos[t] % S (k's norm, RoPE and cache write in one pass). CHUNK (with CACHE): out is
// one chunk of a cache split across bindings (common.wgsl's KvChunk at binding 5): only the rows
// of its slots are computed and written.
//
// Prelude consts: WG, NDT (norm weight dtype: 0 bf16, 1 f16, 2 f32). Flags: NORM, HAS_NW, CACHE,
// CHUNK. Bindings: 0 params, 1 x, 2 pos (u32 [T]), 3 out, 4 norm weight (HAS_NW), 5 chunk (CHUNK).

struct Params {
    T: u32,
    heads: u32,
    D: u32,
    pairs: u32,
    norm_mode: u32,  // NORM: 0 no weight, 1 w, 2 1 + w
    norm_eps: f32,
    x_heads: u32,    // heads of a row of x
    head0: u32,      // first head of x read
    S: u32,          // CACHE: slots
    _p0: u32,
    _p1: u32,
    _p2: u32,
    // pair 2j: (lo, hi) = tab[j].xy, pair 2j+1: tab[j].zw
    tab: array<vec4<u32>, 128>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//#if HAS_NW
@group(0) @binding(4) var<storage, read> nw: array<u32>;
//#endif
//#if CHUNK
@group(0) @binding(5) var<uniform> kvc: KvChunk;
//#endif

// Rotates pair i of the row at b (position ps) from (a0, a1).
fn rotate(b: u32, i: u32, half: u32, ps: u32, a0: f32, a1: f32) {
    if i < p.pairs {
        let sc = sincos_turn(rope_turn(p.tab[i >> 1u], i, ps));
        out[b + i] = a0 * sc.y - a1 * sc.x;
        out[b + i + half] = a1 * sc.y + a0 * sc.x;
    } else {
        out[b + i] = a0;
        out[b + i + half] = a1;
    }
}

// Row of x holding output row `row` (token, head).
fn x_row(row: u32) -> u32 {
    return (row / p.heads) * p.x_heads + p.head0 + row % p.heads;
}

//#if NORM
fn norm_scale(i: u32) -> f32 {
//#if HAS_NW
    return nw_scale(nw[word_of(i, NDT)], i, NDT, p.norm_mode);
//#else
    return 1.0;
//#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    init_ids(lid, 0u, 0u, 1u);
    let half = p.D / 2u;
    for (var row = wid.y * nwg.x + wid.x; row < p.T * p.heads; row += nwg.x * nwg.y) {
        let ps = pos[row / p.heads];
//#if CHUNK
        // (uniform: the row is the workgroup's)
        let slot = ps % p.S;
        if slot < kvc.c0 || slot >= kvc.c0 + kvc.cn {
            continue;
        }
        let b = ((slot - kvc.c0) * p.heads + row % p.heads) * p.D;
//#elif CACHE
        let b = ((ps % p.S) * p.heads + row % p.heads) * p.D;
//#else
        let b = row * p.D;
//#endif
        let bx = x_row(row) * p.D;
        var ss = 0.0;
        for (var i = lid; i < p.D; i += WG) {
            let v = x[bx + i];
            ss = fma(v, v, ss);
        }
        let r = 1.0 / sqrt(wg_sum(ss) / f32(p.D) + p.norm_eps);
        for (var i = lid; i < half; i += WG) {
            rotate(b, i, half, ps, x[bx + i] * r * norm_scale(i), x[bx + i + half] * r * norm_scale(i + half));
        }
    }
}
//#else
@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let half = p.D / 2u;
    let total = p.T * p.heads * half;
    let stride = nwg.x * WG;
    for (var idx = gid.x + gid.y * stride; idx < total; idx += stride * nwg.y) {
        let i = idx % half;
        let th = idx / half;
        let b = th * p.D;
        let bx = x_row(th) * p.D;
        rotate(b, i, half, pos[th / p.heads], x[bx + i], x[bx + i + half]);
    }
}
//#endif
