//! Workgroup memory of a kernel as naga sees it: the sum of the workgroup variables its entry
//! point uses (the backends write no others), to check the selection's own count against.

/// The bytes of workgroup memory `wgsl`'s first entry point uses, parsed and validated with
/// `caps` (`name` labels a failure). Each of those variables must be a whole number of 16 bytes:
/// an H100 stored cooperative matrices one element early into a workgroup array that followed a
/// lone u32 (the vision attention's flag), so the kernels keep every variable that size.
pub fn workgroup_bytes(name: &str, wgsl: &str, caps: naga::valid::Capabilities) -> u32 {
    let module = naga::front::wgsl::parse_str(wgsl).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(wgsl)));
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(wgsl)));
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).unwrap();
    let used = info.get_entry_point(0);
    let vars: Vec<(String, u32)> = module
        .global_variables
        .iter()
        .filter(|&(h, v)| v.space == naga::AddressSpace::WorkGroup && !used[h].is_empty())
        .map(|(_, v)| (v.name.clone().unwrap_or_default(), layouter[v.ty].size))
        .collect();
    let odd: Vec<_> = vars.iter().filter(|(_, b)| b % 16 != 0).collect();
    assert!(odd.is_empty(), "{name}: workgroup variables not a multiple of 16 bytes: {odd:?}");
    vars.iter().map(|(_, b)| b).sum()
}
