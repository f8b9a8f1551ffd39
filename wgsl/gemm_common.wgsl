// What the tiled GEMMs share (gemm.wgsl, gemm_coop.wgsl and its row scales, row_scale.wgsl):
// the matmul params (MatMulParams; gemv.wgsl's members unread here), x at binding 1 (in vec4s
// with XVEC) and the loads of its elements.

struct Params {
    T: u32,
    K: u32,
    rows: u32,
    row_start: u32,
    ldy: u32,
    e_start: u32,
    e_count: u32,
    S: u32,
    x_bcast: u32,
    E: u32,          // GROUPED: experts of the whole stack (offsets before the pair list)
    _norm_mode: u32, // (gemv.wgsl's fused norm)
    _norm_eps: f32,
    _rows2: u32,     // (gemv.wgsl's concatenated weights)
    _rows3: u32,
    ksplit: u32,     // SPLIT: parts of K
    _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if XVEC
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
//#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
//#endif
// Elements 4q..4q+3 of K step k0 of x row xr (zeros past K or for an invalid row).
fn load_x4(xr: u32, k0: u32, q: u32, K: u32, ok: bool) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    let k = k0 + 4u * q;
    if ok && k < K {
//#if XVEC
        v = x[(xr * K + k) >> 2u];
//#else
        for (var j = 0u; j < 4u; j++) {
            if k + j < K {
                v[j] = x[xr * K + k + j];
            }
        }
//#endif
    }
    return v;
}

