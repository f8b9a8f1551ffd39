// What the tiled GEMMs share (gemm.wgsl, gemm_coop.wgsl and its activations' pass,
// row_scale.wgsl): the matmul params (MatMulParams; gemv.wgsl's members unread here), x at
// binding 1 (in vec4s with XVEC; with X16, gemm_coop.wgsl's f16 activations instead) and the
// loads of its elements.

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

// The f16 activations' padded shape: tokens to a multiple of 128 (any tile's), K to one of 64
// (any step's: 32 or 64).
fn t_pad(T: u32) -> u32 {
    return (T + 127u) & ~127u;
}

fn k_pad(K: u32) -> u32 {
    return (K + 63u) & ~63u;
}

//#if GROUPED
// Op::MoeGroup's value: E + 1 offsets, then the pair indices grouped by expert. The tiles of
// a grouped GEMM (BT tokens: the including file's) hold pairs of one expert each.
@group(0) @binding(3) var<storage, read> grp: array<u32>;

// The slot's tile: (expert, first position, end position, 1), or all 0 past the last tile.
var<workgroup> tile_sel: vec4<u32>;

// The tile of slot `slot`: the chunk's experts in order, ceil(count / BT) tiles each.
fn find_tile(slot: u32) -> vec4<u32> {
    var rem = slot;
    for (var e = p.e_start; e < p.e_start + p.e_count; e++) {
        let a = grp[e];
        let b = max(grp[e + 1u], a);
        let nt = (b - a + BT - 1u) / BT;
        if rem < nt {
            let o0 = a + rem * BT;
            return vec4<u32>(e, o0, min(b, o0 + BT), 1u);
        }
        rem -= nt;
    }
    return vec4<u32>(0u);
}

// The tile of slot `slot` for the whole workgroup (every invocation calls it, in uniform control
// flow), once the previous slot's reads of it are done.
fn slot_tile(lid: u32, slot: u32) -> vec4<u32> {
    workgroupBarrier();
    if lid == 0u {
        tile_sel = find_tile(slot);
    }
    return workgroupUniformLoad(&tile_sel);
}

// Pair index of position `o` of the grouped list.
fn pair_at(o: u32) -> u32 {
    return grp[p.E + 1u + o];
}
//#endif

//#if X16
// x / s as f16 (row_scale.wgsl): [TP][KP] hi parts, then (HILO_X) [TP][KP] lo parts
//#if XW
// (read 16 bytes at a time: eight f16)
@group(0) @binding(1) var<storage, read> x16: array<vec4<u32>>;
//#else
@group(0) @binding(1) var<storage, read> x16: array<vec4<f16>>;
//#endif
//#else
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
//#endif
