//! Every kernel variant (with and without subgroups) parses, validates and
//! translates to MSL, SPIR-V and HLSL with naga — the offline check for the
//! backends CI cannot run (Metal, DX12).

#[path = "common/naga_smem.rs"]
mod naga_smem;

use markbase::gpu::kernels::KernelSpec;

/// f16 and cooperative matrices are always allowed: the kernels that use them run only where
/// the device has them (see `gemm_f16`).
fn capabilities(subgroups: bool) -> naga::valid::Capabilities {
    // (f16 in f32: `unpack2x16float`, part of every WebGPU-compliant adapter's downlevel flags)
    let mut c = naga::valid::Capabilities::SHADER_FLOAT16 | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32 | naga::valid::Capabilities::COOPERATIVE_MATRIX;
    if subgroups {
        c |= naga::valid::Capabilities::SUBGROUP | naga::valid::Capabilities::SUBGROUP_BARRIER;
    }
    c
}

fn translate(name: &str, wgsl: &str, subgroups: bool) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| format!("parse: {}", e.emit_to_string(wgsl)))?;
    let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities(subgroups));
    v.subgroup_stages(naga::valid::ShaderStages::COMPUTE);
    v.subgroup_operations(naga::valid::SubgroupOperationSet::all());
    let info = v.validate(&module).map_err(|e| format!("validate: {}", e.emit_to_string(wgsl)))?;

    // MSL 2.4 (subgroup reductions need 2.1+; simd_sum etc.)
    let msl_opts = naga::back::msl::Options { lang_version: (2, 4), fake_missing_bindings: true, ..Default::default() };
    let pipe = naga::back::msl::PipelineOptions::default();
    let (msl, _) = naga::back::msl::write_string(&module, &info, &msl_opts, &pipe).map_err(|e| format!("msl: {e:?}"))?;
    assert!(msl.contains("kernel"), "{name}: no kernel in MSL");

    // SPIR-V 1.3 (subgroup operations)
    let spv_opts = naga::back::spv::Options { lang_version: (1, 3), ..Default::default() };
    let words = naga::back::spv::write_vec(&module, &info, &spv_opts, None).map_err(|e| format!("spv: {e:?}"))?;
    assert_eq!(words[0], 0x0723_0203, "{name}: SPIR-V magic");

    // HLSL SM 6.2 (wave intrinsics); naga has no HLSL for cooperative matrices, and D3D12 never
    // gets the kernels that use them
    if wgsl.contains("enable wgpu_cooperative_matrix;") {
        return Ok(());
    }
    let hlsl_opts = naga::back::hlsl::Options {
        shader_model: naga::back::hlsl::ShaderModel::V6_2,
        fake_missing_bindings: true,
        ..Default::default()
    };
    let mut hlsl = String::new();
    let pipeline_opts = naga::back::hlsl::PipelineOptions::default();
    let mut w = naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_opts, &pipeline_opts);
    w.write(&module, &info, None).map_err(|e| format!("hlsl: {e:?}"))?;
    assert!(hlsl.contains("numthreads"), "{name}: no entry point in HLSL");
    Ok(())
}

#[test]
fn every_kernel_translates_to_msl_spirv_hlsl() {
    let mut failures = Vec::new();
    let mut n = 0;
    for spec in KernelSpec::all_variants() {
        let sgs: &[bool] = if spec.uses_subgroups() { &[false, true] } else { &[false] };
        for &sg in sgs {
            let name = format!("{}{}", spec.name(), if sg { "+sg" } else { "" });
            let text = spec.source(sg).text();
            n += 1;
            if let Err(e) = translate(&name, &text, sg) {
                failures.push(format!("{name}: {e}"));
            }
        }
    }
    println!("{n} kernel variants checked");
    assert!(failures.is_empty(), "{} of {n} variants failed:\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn subgroup_free_variants_need_no_subgroup_capability() {
    // The non-subgroup path must validate without the SUBGROUP capability.
    for spec in KernelSpec::all_variants() {
        let text = spec.source(false).text();
        let module = naga::front::wgsl::parse_str(&text).unwrap();
        let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities(false));
        v.validate(&module).unwrap_or_else(|e| panic!("{}: {}", spec.name(), e.emit_to_string(&text)));
    }
}

/// The f16 GEMM's Metal variant (8 x 8 cooperative matrices: Metal's simdgroup matrices have no
/// 16 x 16) translates to MSL with simdgroup matrices of 8 x 8 only, for every weight format and
/// split; the 16 x 16 variant is the one Vulkan runs.
#[test]
fn metal_gemm_uses_8x8_simdgroup_matrices() {
    let mut n = 0;
    for spec in KernelSpec::all_variants() {
        let KernelSpec::GemmF16 { coop: true, m8, .. } = spec else { continue };
        let wgsl = spec.source(false).text();
        let module = naga::front::wgsl::parse_str(&wgsl).unwrap_or_else(|e| panic!("{}: {}", spec.name(), e.emit_to_string(&wgsl)));
        let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities(false));
        let info = v.validate(&module).unwrap_or_else(|e| panic!("{}: {}", spec.name(), e.emit_to_string(&wgsl)));
        let opts = naga::back::msl::Options { lang_version: (2, 4), fake_missing_bindings: true, ..Default::default() };
        let (msl, _) = naga::back::msl::write_string(&module, &info, &opts, &naga::back::msl::PipelineOptions::default()).unwrap();
        let (has8, has16) = (msl.contains("simdgroup_float8x8") && msl.contains("simdgroup_half8x8"), msl.contains("16x16"));
        if m8 {
            assert!(has8 && !has16, "{}: the Metal variant must use 8 x 8 simdgroup matrices only", spec.name());
            assert!(msl.contains("simdgroup_multiply_accumulate"), "{}: no simdgroup product in MSL", spec.name());
            n += 1;
        } else {
            assert!(has16 && !has8, "{}: the Vulkan variant uses 16 x 16", spec.name());
        }
    }
    assert!(n > 0, "no Metal variant of the f16 GEMM");
    println!("{n} Metal variants checked");
}

/// `gemm_f16::spec_smem_bytes` is the f16 GEMM's workgroup memory exactly (the sum of the workgroup
/// variables its entry point uses: the backends write no others): it decides which variants an
/// adapter can run, and which staging the selection takes.
#[test]
fn gemm_f16_smem_bytes_match_the_shaders() {
    let mut n = 0;
    for spec in KernelSpec::all_variants() {
        let KernelSpec::GemmF16 { .. } = spec else { continue };
        let bytes = naga_smem::workgroup_bytes(&spec.name(), &spec.source(false).text(), capabilities(false));
        assert_eq!(markbase::gpu::ops::gemm_f16::spec_smem_bytes(&spec), bytes, "{}", spec.name());
        n += 1;
    }
    assert!(n > 0, "no f16 GEMM variant");
}
