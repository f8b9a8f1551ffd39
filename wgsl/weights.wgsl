// Weight decoding: one generic path for every stored format, plus fast 4-bit and
// 8-bit code extraction (vec4 loads). A "row" is a row of the weight chunk bound
// here (for expert stacks: expert_in_chunk * N + n); K is the row length in elements.
//
// Prelude consts: WFMT (0 affine, 1 mxfp4, 2 mxfp8, 3 nvfp4, 4 float), WBITS,
// WGROUP, SDT (affine scale/bias dtype), FDT (float weight dtype); dtypes:
// 0 bf16, 1 f16, 2 f32 (16-bit values packed two per u32, little-endian).
// Flags: W_FLOAT | W_QUANT, W_AFFINE, W_GLOBAL; fast paths (K % 32 == 0, binding 8 read
// as vec4<u32>: W_VEC4, or as vec2<u32>: W_VEC2, the GEMV's half blocks): W_FAST4 / W_FAST8
// (4/8-bit codes), W_FASTBF16, W_FASTF32.
//
// Bindings: 8 packed weights (u32 words, or f32/bf16/f16 values), 9 scales (affine: each
// group's scale and bias side by side, one word of two 16-bit values or two f32 words, so that
// one load brings both; mx/nv: u8 bytes, four per word), 11 nvfp4 global scale per expert (f32).

//#if W_VEC2
@group(0) @binding(8) var<storage, read> wq: array<vec2<u32>>;
//#elif W_VEC4
@group(0) @binding(8) var<storage, read> wq: array<vec4<u32>>;
//#else
@group(0) @binding(8) var<storage, read> wq: array<u32>;
//#endif
//#if W_QUANT
@group(0) @binding(9) var<storage, read> wsc: array<u32>;
//#endif
//#if W_GLOBAL
@group(0) @binding(11) var<storage, read> wgs: array<f32>;
//#endif

// 32 values or codes of a block, as 8 vec4 (no arrays: the hot paths stay in registers).
struct V8 {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
    v4: vec4<f32>,
    v5: vec4<f32>,
    v6: vec4<f32>,
    v7: vec4<f32>,
}

struct U8 {
    v0: vec4<u32>,
    v1: vec4<u32>,
    v2: vec4<u32>,
    v3: vec4<u32>,
    v4: vec4<u32>,
    v5: vec4<u32>,
    v6: vec4<u32>,
    v7: vec4<u32>,
}

// 32 decoded elements; the value of element i is s * v[i] + b.
struct Blk {
    v: V8,
    s: f32,
    b: f32,
}

// Half a block (GEMV HALF path): 16 decoded elements, value = s * v[i] + b.
struct H4 {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
}

struct HBlk {
    v: H4,
    s: f32,
    b: f32,
}

// 8 decoded elements.
struct Oct {
    a: vec4<f32>,
    b: vec4<f32>,
}

//#if W_VEC2
fn wq4(i: u32) -> vec4<u32> {
    return vec4<u32>(wq[2u * i], wq[2u * i + 1u]);
}
//#elif W_VEC4
fn wq4(i: u32) -> vec4<u32> {
    return wq[i];
}
//#endif

fn wword(w: u32) -> u32 {
//#if W_VEC2
    return wq[w >> 1u][w & 1u];
//#elif W_VEC4
    return wq[w >> 2u][w & 3u];
//#else
    return wq[w];
//#endif
}

// E2M1 (fp4) codes -> values. Magnitude m = 2..7 is 2^(m/2 - 1) (1 + (m & 1) / 2): its f32 bits
// are m << 22 plus the bits of 0.5 (exponent and mantissa bit side by side); m = 1 is 0.5 and
// m = 0 is 0, m times the bits of 0.5. The sign bit moves from bit 3 to bit 31.
fn e2m1v(c: vec4<u32>) -> vec4<f32> {
    let m = c & vec4<u32>(7u);
    let half = vec4<u32>(0x3f000000u);
    let mag = select((m << vec4<u32>(22u)) + half, m * half, m < vec4<u32>(2u));
    return bitcast<vec4<f32>>(mag | ((c & vec4<u32>(8u)) << vec4<u32>(28u)));
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

// The stored words of group `g`'s scale: affine (scale/bias word, f32 bias word), mx/nv (the
// word holding its byte); read once, decoded by scale_of / bias_of.
fn sc_words(g: u32) -> vec2<u32> {
//#if W_AFFINE
    if SDT == 2u {
        return vec2<u32>(wsc[2u * g], wsc[2u * g + 1u]);
    }
    return vec2<u32>(wsc[g], 0u);
//#elif W_QUANT
    return vec2<u32>(wsc[g >> 2u], 0u);
//#else
    return vec2<u32>(0u);
//#endif
}

// Group `g`'s scale from its words `v` (sc_words).
fn scale_of(v: vec2<u32>, g: u32) -> f32 {
//#if W_AFFINE
    if SDT == 2u {
        return bitcast<f32>(v.x);
    }
    return f16x2_pick(v.x, 0u, SDT);
//#elif W_QUANT
    let byte = (v.x >> ((g & 3u) * 8u)) & 0xffu;
    if WFMT == 3u {
        return e4m3v(vec4<u32>(byte)).x;
    }
    // E8M0: 2^(byte - 127)
    return select(bitcast<f32>(byte << 23u), bitcast<f32>(0x00400000u), byte == 0u);
//#else
    return 1.0;
//#endif
}

fn bias_of(v: vec2<u32>) -> f32 {
//#if W_AFFINE
    if SDT == 2u {
        return bitcast<f32>(v.y);
    }
    return f16x2_pick(v.x, 1u, SDT);
//#else
    return 0.0;
//#endif
}

// Group scale `g` (index into the chunk's scale array).
fn w_scale(g: u32) -> f32 {
    return scale_of(sc_words(g), g);
}

fn w_bias(g: u32) -> f32 {
    return bias_of(sc_words(g));
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
    return wf_val(wf_word(e), e);
}

// The word holding float element `e`, and element `e`'s value from that word.
fn wf_word(e: u32) -> u32 {
    return wword(select(e >> 1u, e, FDT == 2u));
}

fn wf_val(word: u32, e: u32) -> f32 {
    if FDT == 2u {
        return bitcast<f32>(word);
    }
    return f16x2_pick(word, e, FDT);
}

// Generic code extraction: the 8 codes of octet `o` (elements 8o..8o+7) of `row`.
// Each octet lies in a window of at most two words of the LSB-first bit stream.
fn oct_codes(row: u32, o: u32, K: u32) -> array<vec4<u32>, 2> {
    let w = oct_window(row, o, K);
    return oct_split(w.x, w.y, o);
}

// The window's words (the second 0 when the octet fits in the first).
fn oct_window(row: u32, o: u32, K: u32) -> vec2<u32> {
    let rw = K * WBITS / 32u;
    let bit = o * 8u * WBITS;
    let w0 = row * rw + (bit >> 5u);
    var hi = 0u;
    if (bit & 31u) + 8u * WBITS > 32u {
        hi = wword(w0 + 1u);
    }
    return vec2<u32>(wword(w0), hi);
}

// Octet `o`'s codes from its window (lo, hi).
fn oct_split(lo: u32, hi: u32, o: u32) -> array<vec4<u32>, 2> {
    // 4 and 8 bits: word-aligned octets
    if WBITS == 4u {
        let m = vec4<u32>(15u);
        return array<vec4<u32>, 2>((vec4<u32>(lo) >> vec4<u32>(0u, 4u, 8u, 12u)) & m, (vec4<u32>(lo) >> vec4<u32>(16u, 20u, 24u, 28u)) & m);
    }
    if WBITS == 8u {
        let sh8 = vec4<u32>(0u, 8u, 16u, 24u);
        return array<vec4<u32>, 2>((vec4<u32>(lo) >> sh8) & vec4<u32>(255u), (vec4<u32>(hi) >> sh8) & vec4<u32>(255u));
    }
    let sh = (o * 8u * WBITS) & 31u;
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
fn blk_codes(row: u32, blk: u32, K: u32) -> U8 {
    var c: U8;
//#if W_FAST4 || W_FAST8
    // 4 bits: one vec4 of words per block, an octet per word; 8 bits: two, an octet per pair of
    // words (oct_split's word-aligned paths); K % 32 == 0.
//#if W_FAST4
    let v = wq4(row * (K >> 5u) + blk);
    let q0 = oct_split(v.x, 0u, 0u);
    let q1 = oct_split(v.y, 0u, 0u);
    let q2 = oct_split(v.z, 0u, 0u);
    let q3 = oct_split(v.w, 0u, 0u);
//#else
    let base = row * (K >> 4u) + 2u * blk;
    let v0 = wq4(base);
    let v1 = wq4(base + 1u);
    let q0 = oct_split(v0.x, v0.y, 0u);
    let q1 = oct_split(v0.z, v0.w, 0u);
    let q2 = oct_split(v1.x, v1.y, 0u);
    let q3 = oct_split(v1.z, v1.w, 0u);
//#endif
    c.v0 = q0[0];
    c.v1 = q0[1];
    c.v2 = q1[0];
    c.v3 = q1[1];
    c.v4 = q2[0];
    c.v5 = q2[1];
    c.v6 = q3[0];
    c.v7 = q3[1];
//#else
    let o = blk * 4u;
    if o * 8u < K {
        let q = oct_codes(row, o, K);
        c.v0 = q[0];
        c.v1 = q[1];
    }
    if o * 8u + 8u < K {
        let q = oct_codes(row, o + 1u, K);
        c.v2 = q[0];
        c.v3 = q[1];
    }
    if o * 8u + 16u < K {
        let q = oct_codes(row, o + 2u, K);
        c.v4 = q[0];
        c.v5 = q[1];
    }
    if o * 8u + 24u < K {
        let q = oct_codes(row, o + 3u, K);
        c.v6 = q[0];
        c.v7 = q[1];
    }
//#endif
    return c;
}

// 4 float weights at elements e0 + 0..3 of the chunk (zeros at or past K within the row).
fn wf4(e0: u32, k0: u32, K: u32) -> vec4<f32> {
    var f = vec4<f32>(0.0);
    if k0 < K {
        f.x = wf_at(e0);
    }
    if k0 + 1u < K {
        f.y = wf_at(e0 + 1u);
    }
    if k0 + 2u < K {
        f.z = wf_at(e0 + 2u);
    }
    if k0 + 3u < K {
        f.w = wf_at(e0 + 3u);
    }
    return f;
}

// Four bf16 values packed in two words.
fn bf16x4(a: u32, b: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xffff0000u, b << 16u, b & 0xffff0000u));
}

// Block `blk` of `row` in deferred form (value = s * v + b). Elements at or past K
// hold arbitrary finite values: callers mask the activations instead.
fn dq_blk(row: u32, blk: u32, K: u32) -> Blk {
    var r: Blk;
//#if W_FASTF32
    // f32 weights, K % 32 == 0: eight vec4 loads
    let base = row * (K >> 2u) + 8u * blk;
//#repeat 8 i
    r.v.v$i = bitcast<vec4<f32>>(wq[base + $iu]);
//#endrepeat
    r.s = 1.0;
    r.b = 0.0;
//#elif W_FASTBF16
    // bf16 weights, K % 32 == 0: four vec4 loads; word k holds elements 2k (low) and 2k+1
    let base = row * (K >> 3u) + 4u * blk;
//#repeat 4 i
    let w$i = wq[base + $iu];
//#endrepeat
    r.v.v0 = bf16x4(w0.x, w0.y);
    r.v.v1 = bf16x4(w0.z, w0.w);
    r.v.v2 = bf16x4(w1.x, w1.y);
    r.v.v3 = bf16x4(w1.z, w1.w);
    r.v.v4 = bf16x4(w2.x, w2.y);
    r.v.v5 = bf16x4(w2.z, w2.w);
    r.v.v6 = bf16x4(w3.x, w3.y);
    r.v.v7 = bf16x4(w3.z, w3.w);
    r.s = 1.0;
    r.b = 0.0;
//#elif W_FLOAT
    let k0 = blk * 32u;
    let e0 = row * K + k0;
//#repeat 8 i
    r.v.v$i = wf4(e0 + 4u * $iu, k0 + 4u * $iu, K);
//#endrepeat
    r.s = 1.0;
    r.b = 0.0;
//#elif W_FAST4 && W_AFFINE
    // affine 4-bit: each nibble q becomes the f32 1 + q/16 with one shift and one
    // and-or (bits placed in the mantissa); value = s*q + b = 16s * (1 + q/16) + (b - 16s).
    let v = wq4(row * (K >> 5u) + blk);
    let sl = vec4<u32>(19u, 15u, 11u, 7u);
    let mk = vec4<u32>(0x00780000u);
    let one = vec4<u32>(0x3f800000u);
    r.v.v0 = bitcast<vec4<f32>>(((vec4<u32>(v.x) << sl) & mk) | one);
    r.v.v1 = bitcast<vec4<f32>>(((vec4<u32>(v.x >> 16u) << sl) & mk) | one);
    r.v.v2 = bitcast<vec4<f32>>(((vec4<u32>(v.y) << sl) & mk) | one);
    r.v.v3 = bitcast<vec4<f32>>(((vec4<u32>(v.y >> 16u) << sl) & mk) | one);
    r.v.v4 = bitcast<vec4<f32>>(((vec4<u32>(v.z) << sl) & mk) | one);
    r.v.v5 = bitcast<vec4<f32>>(((vec4<u32>(v.z >> 16u) << sl) & mk) | one);
    r.v.v6 = bitcast<vec4<f32>>(((vec4<u32>(v.w) << sl) & mk) | one);
    r.v.v7 = bitcast<vec4<f32>>(((vec4<u32>(v.w >> 16u) << sl) & mk) | one);
    let g = row * (K / WGROUP) + blk * 32u / WGROUP;
    let sc = w_scale(g);
    r.s = 16.0 * sc;
    r.b = w_bias(g) - 16.0 * sc;
//#else
    let c = blk_codes(row, blk, K);
//#repeat 8 i
    r.v.v$i = code_vals(c.v$i);
//#endrepeat
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
        r.v.v0 *= s0;
        r.v.v1 *= s0;
        r.v.v2 *= s0;
        r.v.v3 *= s0;
        r.v.v4 *= s1;
        r.v.v5 *= s1;
        r.v.v6 *= s1;
        r.v.v7 *= s1;
        r.s = 1.0;
        r.b = 0.0;
    }
//#endif
    return r;
}

//#if W_FAST4 && W_AFFINE && W_VEC2
// Half `h` of block `blk` of `row` (affine 4-bit): elements 16h .. 16h + 15 of the block,
// words 2h and 2h + 1 of its four, one 8-byte load (same decoding as dq_blk).
fn dq_half(row: u32, blk: u32, h: u32, K: u32) -> HBlk {
    var r: HBlk;
    let sl = vec4<u32>(19u, 15u, 11u, 7u);
    let mk = vec4<u32>(0x00780000u);
    let one = vec4<u32>(0x3f800000u);
    let w = wq[(row * (K >> 5u) + blk) * 2u + h];
    r.v.v0 = bitcast<vec4<f32>>(((vec4<u32>(w.x) << sl) & mk) | one);
    r.v.v1 = bitcast<vec4<f32>>(((vec4<u32>(w.x >> 16u) << sl) & mk) | one);
    r.v.v2 = bitcast<vec4<f32>>(((vec4<u32>(w.y) << sl) & mk) | one);
    r.v.v3 = bitcast<vec4<f32>>(((vec4<u32>(w.y >> 16u) << sl) & mk) | one);
    let g = row * (K / WGROUP) + blk * 32u / WGROUP;
    let sc = w_scale(g);
    r.s = 16.0 * sc;
    r.b = w_bias(g) - 16.0 * sc;
    return r;
}
//#endif

// An octet's stored words, loaded by oct_raw and decoded by oct_dec: a caller can issue the
// loads early and decode when the values are needed. Float weights: the word of each of the
// eight elements (a: 0..3, b: 4..7); quantized: a = (window lo, window hi, scale words).
struct ROct {
    a: vec4<u32>,
    b: vec4<u32>,
}

// The words of octet `o` of `row` (zeros at or past K).
fn oct_raw(row: u32, o: u32, K: u32) -> ROct {
    var r: ROct;
    r.a = vec4<u32>(0u);
    r.b = vec4<u32>(0u);
//#if W_FLOAT
    let e0 = row * K + o * 8u;
    for (var j = 0u; j < 4u; j++) {
        if o * 8u + j < K {
            r.a[j] = wf_word(e0 + j);
        }
        if o * 8u + 4u + j < K {
            r.b[j] = wf_word(e0 + 4u + j);
        }
    }
//#else
    if o * 8u < K {
        let w = oct_window(row, o, K);
        let sc = sc_words(row * (K / WGROUP) + o * 8u / WGROUP);
        r.a = vec4<u32>(w, sc);
    }
//#endif
    return r;
}

// Octet `o` of `row` decoded from its words `r` (oct_raw).
fn oct_dec(r: ROct, row: u32, o: u32, K: u32) -> Oct {
    var d: Oct;
//#if W_FLOAT
    let e0 = row * K + o * 8u;
    for (var j = 0u; j < 4u; j++) {
        d.a[j] = wf_val(r.a[j], e0 + j);
        d.b[j] = wf_val(r.b[j], e0 + 4u + j);
    }
//#else
    let c = oct_split(r.a.x, r.a.y, o);
    let g = row * (K / WGROUP) + o * 8u / WGROUP;
    let s = scale_of(r.a.zw, g);
    let b = bias_of(r.a.zw);
    d.a = code_vals(c[0]) * s + b;
    d.b = code_vals(c[1]) * s + b;
//#endif
    return d;
}

// Octet `o` of `row`, fully decoded (zeros at or past K).
fn dq_oct(row: u32, o: u32, K: u32) -> Oct {
    return oct_dec(oct_raw(row, o, K), row, o, K);
}
