// Elementwise ops over n f32 values (one source variant per op):
//   GEGLU:  out = gelu(a) * b                        (b: up, same length)
//   BINARY: out = a (+|*) b[i % nb]                  (params.op 0 add, 1 mul; b dtype BDT)
//   UNARY:  out = f(a), params.op 0 scale (a * f), 1 gelu, 2 softcap (f * tanh(a / f)),
//           3 relu (max(a, 0)), 4 silu (a / (1 + exp(-a)))
// tanh arguments are clamped to +-15 (cpu::ops).
//
// Prelude consts: WG, BDT (BINARY: 0 bf16, 1 f16, 2 f32). Flags: GEGLU | BINARY | UNARY.
// Bindings: 0 params, 1 a, 2 out, 3 b (GEGLU, BINARY).

struct Params {
    n: u32,
    nb: u32,
    op: u32,
    _p0: u32,
    f: f32,
    _p1: u32,
    _p2: u32,
    _p3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#if GEGLU
@group(0) @binding(3) var<storage, read> b: array<f32>;
//#endif
//#if BINARY
@group(0) @binding(3) var<storage, read> b: array<u32>;
//#endif


//#if BINARY
fn b_at(i: u32) -> f32 {
    return vec_el(b[word_of(i, BDT)], i, BDT);
}
//#endif

@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let stride = nwg.x * WG;
    for (var i = gid.x + gid.y * stride; i < p.n; i += stride * nwg.y) {
        let v = a[i];
        var r: f32;
//#if GEGLU
        r = gelu(v) * b[i];
//#endif
//#if BINARY
        let w = b_at(i % p.nb);
        if p.op == 0u {
            r = v + w;
        } else {
            r = v * w;
        }
//#endif
//#if UNARY
        switch p.op {
            case 0u: {
                r = v * p.f;
            }
            case 1u: {
                r = gelu(v);
            }
            case 3u: {
                r = max(v, 0.0);
            }
            case 4u: {
                r = v / (1.0 + exp(-v));
            }
            default: {
                r = p.f * tanh_c(v / p.f);
            }
        }
//#endif
        out[i] = r;
    }
}
