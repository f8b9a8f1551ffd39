// hi4: the f16 kernels' hi + lo splits (the f16 GEMM's staging and activations' pass, the vision
// attention's staging).

// f32 values rounded to 11 significant bits (f16's), as f32: by their bits, so that no compiler
// can fold a round trip through f16 away (one did: the lo parts came out zero).
fn hi4(v: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>((bitcast<vec4<u32>>(v) + vec4<u32>(0x1000u)) & vec4<u32>(0xffffe000u));
}
