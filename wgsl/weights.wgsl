// Weight decoding: one generic path for every stored format, plus fast 4-bit and
// 8-bit code extraction (vec4 loads). A "row" is a row of the weight chunk bound
// here (for expert stacks: expert_in_chunk * N + n); K is the row length in elements.
//
// Prelude consts: WFMT (0 affine, 1 mxfp4, 2 mxfp8, 3 nvfp4, 4 float), WBITS,
// WGROUP, SDT (affine scale/bias dtype), FDT (float weight dtype); dtypes:
// 0 bf16, 1 f16, 2 f32 (16-bit values packed two per u32, little-endian).
// Flags: W_FLOAT | W_QUANT, W_AFFINE, W_NV, W_GLOBAL, W_VEC4 (fast 4/8-bit loads).
//
// Bindings: 8 packed weights (u32 words, or f32/bf16/f16 values), 9 scales
// (affine: SDT values; mx/nv: u8 bytes, four per word), 10 biases (affine),
// 11 nvfp4 global scale per expert (f32).

//#if W_VEC4
@group(0) @binding(8) var<storage, read> wq: array<vec4<u32>>;
//#else
@group(0) @binding(8) var<storage, read> wq: array<u32>;
//#endif
//#if W_QUANT
@group(0) @binding(9) var<storage, read> wsc: array<u32>;
//#endif
//#if W_AFFINE
@group(0) @binding(10) var<storage, read> wbi: array<u32>;
//#endif
//#if W_GLOBAL
@group(0) @binding(11) var<storage, read> wgs: array<f32>;
//#endif

// 32 decoded elements (8 x vec4); the value of element i is s * v[i] + b.
struct Blk {
    v: array<vec4<f32>, 8>,
    s: f32,
    b: f32,
}

// 8 decoded elements.
struct Oct {
    a: vec4<f32>,
    b: vec4<f32>,
}

fn wword(w: u32) -> u32 {
//#if W_VEC4
    return wq[w >> 2u][w & 3u];
//#else
    return wq[w];
//#endif
}

// E2M1 (fp4) codes -> values.
fn e2m1v(c: vec4<u32>) -> vec4<f32> {
    let m = c & vec4<u32>(7u);
    let big = bitcast<vec4<f32>>((((m >> vec4<u32>(1u)) + vec4<u32>(126u)) << vec4<u32>(23u)) | ((m & vec4<u32>(1u)) << vec4<u32>(22u)));
    let mag = select(vec4<f32>(m) * 0.5, big, m >= vec4<u32>(2u));
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(mag) | ((c & vec4<u32>(8u)) << vec4<u32>(28u)));
}

// E4M3FN (fp8) codes -> values (0x7f / 0xff are NaN).
fn e4m3v(c: vec4<u32>) -> vec4<f32> {
    let e = (c >> vec4<u32>(3u)) & vec4<u32>(15u);
    let m = c & vec4<u32>(7u);
    let norm = bitcast<vec4<f32>>(((e + vec4<u32>(120u)) << vec4<u32>(23u)) | (m << vec4<u32>(20u)));
    var mag = select(vec4<f32>(m) * 0.001953125, norm, e > vec4<u32>(0u));
    mag = select(mag, bitcast<vec4<f32>>(vec4<u32>(0x7fc00000u)), (c & vec4<u32>(0x7fu)) == vec4<u32>(0x7fu));
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(mag) | ((c & vec4<u32>(0x80u)) << vec4<u32>(24u)));
}

// Small unsigned integer codes -> f32 (exact: 2^23 + q minus 2^23).
fn u2f(c: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(c | vec4<u32>(0x4b000000u)) - vec4<f32>(8388608.0);
}

// Codes of a format -> values before the group scale (affine: q itself).
fn code_vals(c: vec4<u32>) -> vec4<f32> {
    if WFMT == 1u || WFMT == 3u {
        return e2m1v(c);
    } else if WFMT == 2u {
        return e4m3v(c);
    }
    return u2f(c);
}

// Group scale `g` (index into the chunk's scale array).
fn w_scale(g: u32) -> f32 {
//#if W_AFFINE
    if SDT == 2u {
        return bitcast<f32>(wsc[g]);
    }
    return f16x2_pick(wsc[g >> 1u], g, SDT);
//#elif W_QUANT
    let byte = (wsc[g >> 2u] >> ((g & 3u) * 8u)) & 0xffu;
    if WFMT == 3u {
        return e4m3v(vec4<u32>(byte)).x;
    }
    // E8M0: 2^(byte - 127)
    return select(bitcast<f32>(byte << 23u), bitcast<f32>(0x00400000u), byte == 0u);
//#else
    return 1.0;
//#endif
}

fn w_bias(g: u32) -> f32 {
//#if W_AFFINE
    if SDT == 2u {
        return bitcast<f32>(wbi[g]);
    }
    return f16x2_pick(wbi[g >> 1u], g, SDT);
//#else
    return 0.0;
//#endif
}

// nvfp4 per-expert factor global_scale[e] / (6 * 448); 1 for every other format.
fn w_global(e: u32) -> f32 {
//#if W_GLOBAL
    return wgs[e] * (1.0 / 2688.0);
//#else
    return 1.0;
//#endif
}

// Float weights: element `e` (flat index into the chunk).
fn wf_at(e: u32) -> f32 {
    if FDT == 2u {
        return bitcast<f32>(wword(e));
    }
    return f16x2_pick(wword(e >> 1u), e, FDT);
}

// Generic code extraction: the 8 codes of octet `o` (elements 8o..8o+7) of `row`.
// Each octet lies in a window of at most two words of the LSB-first bit stream.
fn oct_codes(row: u32, o: u32, K: u32) -> array<vec4<u32>, 2> {
    let rw = K * WBITS / 32u;
    let bit = o * 8u * WBITS;
    let w0 = row * rw + (bit >> 5u);
    let sh = bit & 31u;
    let lo = wword(w0);
    var hi = 0u;
    if sh + 8u * WBITS > 32u {
        hi = wword(w0 + 1u);
    }
    let mask = (1u << WBITS) - 1u;
    var q: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        let p = sh + i * WBITS;
        var v: u32;
        if p >= 32u {
            v = hi >> (p - 32u);
        } else if p + WBITS <= 32u {
            v = lo >> p;
        } else {
            v = (lo >> p) | (hi << (32u - p));
        }
        q[i] = v & mask;
    }
    return array<vec4<u32>, 2>(vec4<u32>(q[0], q[1], q[2], q[3]), vec4<u32>(q[4], q[5], q[6], q[7]));
}

// Codes of block `blk` (elements 32blk..32blk+31) of `row`; octets at or past K read as 0.
fn blk_codes(row: u32, blk: u32, K: u32) -> array<vec4<u32>, 8> {
    var c: array<vec4<u32>, 8>;
//#if W_FAST4
    // 4 bits: one vec4 of words per block; K % 32 == 0.
    let v = wq[row * (K >> 5u) + blk];
    for (var i = 0u; i < 4u; i++) {
        let w = vec4<u32>(v[i]);
        c[2u * i] = (w >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
        c[2u * i + 1u] = (w >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
    }
//#elif W_FAST8
    // 8 bits: two vec4 of words per block; K % 32 == 0.
    let base = row * (K >> 4u) + 2u * blk;
    let v0 = wq[base];
    let v1 = wq[base + 1u];
    for (var i = 0u; i < 4u; i++) {
        c[i] = (vec4<u32>(v0[i]) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u);
        c[4u + i] = (vec4<u32>(v1[i]) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u);
    }
//#else
    for (var j = 0u; j < 4u; j++) {
        let o = blk * 4u + j;
        if o * 8u < K {
            let q = oct_codes(row, o, K);
            c[2u * j] = q[0];
            c[2u * j + 1u] = q[1];
        }
    }
//#endif
    return c;
}

// Block `blk` of `row` in deferred form (value = s * v + b). Elements at or past K
// hold arbitrary finite values: callers mask the activations instead.
fn dq_blk(row: u32, blk: u32, K: u32) -> Blk {
    var r: Blk;
//#if W_FLOAT
    let e0 = row * K + blk * 32u;
    for (var i = 0u; i < 8u; i++) {
        var f = vec4<f32>(0.0);
        for (var j = 0u; j < 4u; j++) {
            if blk * 32u + 4u * i + j < K {
                f[j] = wf_at(e0 + 4u * i + j);
            }
        }
        r.v[i] = f;
    }
    r.s = 1.0;
    r.b = 0.0;
//#else
    let c = blk_codes(row, blk, K);
    for (var i = 0u; i < 8u; i++) {
        r.v[i] = code_vals(c[i]);
    }
    let G = K / WGROUP;
    if WGROUP >= 32u {
        let g = row * G + blk * 32u / WGROUP;
        r.s = w_scale(g);
        r.b = w_bias(g);
    } else {
        // nvfp4: two groups of 16 per block.
        let g = row * G + blk * 2u;
        let s0 = w_scale(g);
        var s1 = 0.0;
        if blk * 32u + 16u < K {
            s1 = w_scale(g + 1u);
        }
        for (var i = 0u; i < 4u; i++) {
            r.v[i] *= s0;
            r.v[4u + i] *= s1;
        }
        r.s = 1.0;
        r.b = 0.0;
    }
//#endif
    return r;
}

// Octet `o` of `row`, fully decoded (zeros at or past K).
fn dq_oct(row: u32, o: u32, K: u32) -> Oct {
    var r: Oct;
    r.a = vec4<f32>(0.0);
    r.b = vec4<f32>(0.0);
//#if W_FLOAT
    let e0 = row * K + o * 8u;
    for (var j = 0u; j < 4u; j++) {
        if o * 8u + j < K {
            r.a[j] = wf_at(e0 + j);
        }
        if o * 8u + 4u + j < K {
            r.b[j] = wf_at(e0 + 4u + j);
        }
    }
//#else
    if o * 8u < K {
        let c = oct_codes(row, o, K);
        let g = row * (K / WGROUP) + o * 8u / WGROUP;
        let s = w_scale(g);
        let b = w_bias(g);
        r.a = code_vals(c[0]) * s + b;
        r.b = code_vals(c[1]) * s + b;
    }
//#endif
    return r;
}
