//! Workgroup memory of a kernel as naga sees it: the sum of the workgroup variables its entry
//! point uses (the backends write no others), to check the selection's own count against.

/// The bytes of workgroup memory `wgsl`'s first entry point uses, parsed and validated with
/// `caps` (`name` labels a failure).
pub fn workgroup_bytes(name: &str, wgsl: &str, caps: naga::valid::Capabilities) -> u32 {
    let module = naga::front::wgsl::parse_str(wgsl).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(wgsl)));
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(wgsl)));
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).unwrap();
    let used = info.get_entry_point(0);
    module
        .global_variables
        .iter()
        .filter(|&(h, v)| v.space == naga::AddressSpace::WorkGroup && !used[h].is_empty())
        .map(|(_, v)| layouter[v.ty].size)
        .sum()
}
