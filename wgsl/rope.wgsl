// Half-split RoPE on x[T, heads, D]: pairs (i, i + D/2) for i < pairs rotate by
// angle pos[t] * inv_freq_i; the rest is copied.
//
// The angle is reduced exactly: the params carry, per pair, frac(inv_freq_i / 2pi)
// as a 64-bit fixed-point fraction of a turn (computed on the host from the f32
// inv_freq the CPU uses), so pos * inv_freq mod 1 turn is an integer product;
// sin/cos then use polynomials on [-pi/4, pi/4]. Accurate to ~2e-7 for any u32 position.
//
// Prelude consts: WG. Bindings: 0 params, 1 x, 2 pos (u32 [T]), 3 out.

struct Params {
    T: u32,
    heads: u32,
    D: u32,
    pairs: u32,
    // pair 2j: (lo, hi) = tab[j].xy, pair 2j+1: tab[j].zw
    tab: array<vec4<u32>, 128>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

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
        let t = th / p.heads;
        let b = th * p.D;
        let a0 = x[b + i];
        let a1 = x[b + i + half];
        if i < p.pairs {
            let v = p.tab[i >> 1u];
            let odd = (i & 1u) == 1u;
            let lo = select(v.x, v.z, odd);
            let hi = select(v.y, v.w, odd);
            let ps = pos[t];
            let sc = sincos_turn(ps * hi + mulhi(ps, lo));
            out[b + i] = a0 * sc.y - a1 * sc.x;
            out[b + i + half] = a1 * sc.y + a0 * sc.x;
        } else {
            out[b + i] = a0;
            out[b + i + half] = a1;
        }
    }
}
