//! A probe of the cooperative-matrix operations the f16 kernels use, each in a small kernel of its
//! own, against exact products (small integers over powers of two): row- and column-major loads
//! from f16 and vec4<f16> workgroup arrays at several strides, f32 stores at several row strides,
//! one and four subgroups, matrices loaded once and held across a loop while their memory is
//! overwritten (under register pressure), accumulators across iterations and through workgroup
//! memory, and divergent code before the products. A diagnostic for adapters with 16 x 16 x 16
//! f16 cooperative matrices (`cargo run --release --example coop_probe`; `PROBE_UNCHECKED=1`
//! builds the modules without bounds checks, `PROBE_SRC=NAME` prints one probe's WGSL). It
//! prints each probe's error and exits with 1 if any is wrong, 2 without such an adapter.

use markbase::gpu::device::Gpu;
use wgpu::util::DeviceExt;

#[derive(Clone, Copy, Debug)]
struct P {
    name: &'static str,
    groups: u32, // subgroups of 32 per workgroup
    sa: u32,     // A row stride (f16)
    sb: u32,     // B stride (f16)
    sc: u32,     // C row stride (f32)
    vec: bool,   // vec4<f16> workgroup arrays
    shared: bool, // A and B in one array (B behind A)
    hold: bool,  // A loaded once before the loop, its region overwritten after
    acc: bool,   // C accumulated across iterations (else stored per iteration)
    rt: bool,    // C round trip through workgroup memory each iteration (coopLoadT of C)
    brow: bool,  // B staged [k][n] and loaded row-major (else [n][k], column-major)
    nit: u32,
    ks: u32,     // 16-wide k steps
    press: u32,  // private floats kept live across the loop (register pressure)
    div: u8,     // before the products: 1 divergent code then a barrier, 2 also a subgroup barrier, 3 divergent code alone
}

fn src(p: &P) -> String {
    let wg = 32 * p.groups;
    let arows = 16 * p.groups;
    let asz = arows * p.sa;
    let bsz = 16 * p.ks * p.sb.max(16 * p.ks); // generous
    let (ta, tb) = if p.vec { ("vec4<f16>", 4) } else { ("f16", 1) };
    let _ = tb;
    let div = if p.vec { 4 } else { 1 };
    let overlap = p.shared && p.hold; // B staged over A's region after A is loaded
    let hs_len = if overlap { asz.max(bsz) } else if p.shared { asz + bsz } else { asz };
    let mut s = String::new();
    s += "enable f16;\nenable wgpu_cooperative_matrix;\n";
    s += "@group(0) @binding(0) var<storage, read> a_in: array<f32>;\n";
    s += "@group(0) @binding(1) var<storage, read> b_in: array<f32>;\n";
    s += "@group(0) @binding(2) var<storage, read_write> out: array<f32>;\n";
    s += &format!("var<workgroup> ha: array<{ta}, {}>;\n", hs_len / div);
    if !p.shared {
        s += &format!("var<workgroup> hb: array<{ta}, {}>;\n", bsz / div);
    }
    s += &format!("var<workgroup> ss: array<f32, {}>;\n", arows * p.sc);
    let bname = if p.shared { "ha" } else { "hb" };
    let boff = if p.shared && !overlap { asz } else { 0 };
    // element setters
    let set = |arr: &str, idx: &str, val: &str| -> String {
        if p.vec {
            format!("{arr}[({idx}) / 4u][({idx}) % 4u] = f16({val});\n")
        } else {
            format!("{arr}[{idx}] = f16({val});\n")
        }
    };
    let kk = 16 * p.ks;
    s += &format!("@compute @workgroup_size({wg})\nfn main(@builtin(local_invocation_index) lid: u32) {{\n");
    s += "    let g = lid / 32u;\n    let l = lid % 32u;\n";
    // stage A: rows arows x kk
    s += &format!("    for (var i = lid; i < {}u; i += {wg}u) {{\n        let m = i / {kk}u; let k = i % {kk}u;\n        ", arows * kk);
    s += &set("ha", &format!("m * {}u + k", p.sa), "a_in[m * {kk}u + k]".replace("{kk}", &kk.to_string()).as_str());
    s += "    }\n    workgroupBarrier();\n";
    let aload = |k: u32| format!("coopLoadT<coop_mat16x16<f16, A>>(&ha[(16u * g * {}u + {}u) / {div}u], {}u)", p.sa, 16 * k, p.sa / div);
    if p.hold {
        for k in 0..p.ks {
            s += &format!("    let a{k} = {};\n", aload(k));
        }
        s += "    workgroupBarrier();\n";
        // overwrite A's region with garbage
        s += &format!("    for (var i = lid; i < {}u; i += {wg}u) {{\n        ", asz);
        s += &set("ha", "i", "-777.0");
        s += "    }\n";
    }
    if p.press > 0 {
        s += &format!("    var pr: array<f32, {}>;\n    for (var q = 0u; q < {}u; q++) {{ pr[q] = a_in[(q * 13u + lid) % {}u]; }}\n", p.press, p.press, arows * kk);
    }
    if p.acc {
        s += "    var c = coop_mat16x16<f32, C>();\n";
    }
    s += &format!("    for (var it = 0u; it < {}u; it++) {{\n        workgroupBarrier();\n", p.nit);
    // stage B_it: b_in [it][n][k]
    s += &format!("        for (var i = lid; i < {}u; i += {wg}u) {{\n            let n = i / {kk}u; let k = i % {kk}u;\n            let val = b_in[it * {}u + i];\n            ", 16 * kk, 16 * kk);
    let bidx = if p.brow { format!("{boff}u + k * {}u + n", p.sb) } else { format!("{boff}u + n * {}u + k", p.sb) };
    s += &set(bname, &bidx, "val");
    s += "        }\n        workgroupBarrier();\n";
    if p.div > 0 {
        s += "        var z = 0.0;\n        for (var q = 0u; q < l % 7u; q++) { z += b_in[q]; }\n        if z == 12345.0 { out[0] = z; }\n";
        if p.div != 3 {
            s += "        workgroupBarrier();\n";
        }
        if p.div == 2 {
            s += "        subgroupBarrier();\n";
        }
    }
    if !p.acc {
        s += "        var c = coop_mat16x16<f32, C>();\n";
    }
    for k in 0..p.ks {
        let a = if p.hold { format!("a{k}") } else { aload(k) };
        let b = if p.brow {
            format!("coopLoadT<coop_mat16x16<f16, B>>(&{bname}[({boff}u + {}u * {}u) / {div}u], {}u)", 16 * k, p.sb, p.sb / div)
        } else {
            format!("coopLoad<coop_mat16x16<f16, B>>(&{bname}[({boff}u + {}u) / {div}u], {}u)", 16 * k, p.sb / div)
        };
        s += &format!("        {{\n            let av = {a};\n            let bv = {b};\n            c = coopMultiplyAdd(av, bv, c);\n        }}\n");
    }
    if p.rt {
        s += &format!("        coopStoreT(c, &ss[16u * g * {}u], {}u);\n        workgroupBarrier();\n", p.sc, p.sc);
        s += &format!("        for (var i = l; i < 256u; i += 32u) {{ ss[(16u * g + i / 16u) * {}u + i % 16u] *= 1.0; }}\n        workgroupBarrier();\n", p.sc);
        s += &format!("        c = coopLoadT<coop_mat16x16<f32, C>>(&ss[16u * g * {}u], {}u);\n", p.sc, p.sc);
    }
    if !p.acc {
        s += &format!("        workgroupBarrier();\n        coopStoreT(c, &ss[16u * g * {}u], {}u);\n        workgroupBarrier();\n", p.sc, p.sc);
        s += &format!("        for (var i = l; i < 256u; i += 32u) {{ out[(it * {arows}u + 16u * g + i / 16u) * 16u + i % 16u] = ss[(16u * g + i / 16u) * {}u + i % 16u]; }}\n", p.sc);
    }
    s += "    }\n";
    if p.press > 0 {
        s += &format!("    var zz = 0.0;\n    for (var q = 0u; q < {}u; q++) {{ zz += pr[q] * pr[(q + 1u) % {}u]; }}\n    if zz == 123456.0 {{ out[1] = zz; }}\n", p.press, p.press);
    }
    if p.acc {
        s += &format!("    workgroupBarrier();\n    coopStoreT(c, &ss[16u * g * {}u], {}u);\n    workgroupBarrier();\n", p.sc, p.sc);
        s += &format!("    for (var i = l; i < 256u; i += 32u) {{ out[(16u * g + i / 16u) * 16u + i % 16u] = ss[(16u * g + i / 16u) * {}u + i % 16u]; }}\n", p.sc);
    }
    s += "}\n";
    s
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

fn probe(gpu: &Gpu, p: &P) -> (f32, String) {
    let arows = 16 * p.groups as usize;
    let kk = 16 * p.ks as usize;
    let nit = p.nit as usize;
    let a: Vec<f32> = (0..arows * kk).map(|i| ((i * 7 + 3) % 17) as f32 / 8.0 - 1.0).collect();
    let b: Vec<f32> = (0..nit * 16 * kk).map(|i| ((i * 5 + 1) % 13) as f32 / 4.0 - 1.5).collect();
    let mut want = vec![0f32; if p.acc { arows * 16 } else { nit * arows * 16 }];
    for it in 0..nit {
        for m in 0..arows {
            for n in 0..16 {
                let mut acc = 0f32;
                for k in 0..kk {
                    acc += f16r(a[m * kk + k]) * f16r(b[it * 16 * kk + n * kk + k]);
                }
                if p.acc {
                    want[m * 16 + n] += acc;
                } else {
                    want[(it * arows + m) * 16 + n] = acc;
                }
            }
        }
    }
    let text = src(p);
    let dev = &gpu.device;
    let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
    let desc = wgpu::ShaderModuleDescriptor { label: Some(p.name), source: wgpu::ShaderSource::Wgsl(text.as_str().into()) };
    let module = if std::env::var("PROBE_UNCHECKED").is_ok() {
        unsafe { dev.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
    } else {
        dev.create_shader_module(desc)
    };
    let pipe = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(p.name),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return (f32::NAN, format!("compile error: {e}\n{text}"));
    }
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let ab = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(&a), usage });
    let bb = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(&b), usage });
    let ob = gpu.storage("out", (want.len() * 4) as u64);
    let bg = dev.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipe.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: ab.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: bb.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 2, resource: ob.as_entire_binding() },
        ],
    });
    let mut enc = dev.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    gpu.queue.submit([enc.finish()]);
    let got = gpu.read_f32(&ob, want.len()).unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut err = 0f32;
    let mut first = String::new();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let e = (g - w).abs() / scale;
        if !(e <= 1e-5) && first.is_empty() {
            first = format!("first bad at {i}: got {g} want {w}; got[0..8] {:?} want[0..8] {:?}", &got[..8], &want[..8]);
        }
        if e.is_nan() || e > err {
            err = if e.is_nan() { f32::INFINITY } else { e };
        }
    }
    (err, first)
}

fn probes() -> Vec<P> {
    let base = P { name: "base", groups: 1, sa: 16, sb: 16, sc: 16, vec: false, shared: false, hold: false, acc: false, rt: false, brow: false, nit: 1, ks: 1, div: 0, press: 0 };
    let mut ps = vec![base];

    ps.push(P { name: "vec", vec: true, ..base });
    ps.push(P { name: "vec sa24 sb24", vec: true, sa: 24, sb: 24, ..base });
    ps.push(P { name: "vec sa88 sb88 (LD 88)", vec: true, sa: 88, sb: 88, ..base });
    ps.push(P { name: "vec sb40 (LDP 40)", vec: true, sa: 40, sb: 40, ..base });
    ps.push(P { name: "sc36", sc: 36, ..base });
    ps.push(P { name: "vec sc36", vec: true, sc: 36, ..base });
    ps.push(P { name: "ks2", ks: 2, sa: 32, sb: 32, ..base });
    ps.push(P { name: "vec ks2 sa40", vec: true, ks: 2, sa: 40, sb: 40, ..base });
    ps.push(P { name: "4 groups", groups: 4, ..base });
    ps.push(P { name: "4 groups vec sa88 sc36", groups: 4, vec: true, sa: 88, sb: 88, sc: 36, ..base });
    ps.push(P { name: "nit3", nit: 3, ..base });
    ps.push(P { name: "nit3 4g vec", nit: 3, groups: 4, vec: true, ..base });
    ps.push(P { name: "shared", shared: true, ..base });
    ps.push(P { name: "shared vec 4g", shared: true, vec: true, groups: 4, ..base });
    ps.push(P { name: "hold", hold: true, ..base });
    ps.push(P { name: "hold vec 4g nit3", hold: true, vec: true, groups: 4, nit: 3, ..base });
    ps.push(P { name: "hold ks2 vec 4g nit3 sa88", hold: true, vec: true, groups: 4, nit: 3, ks: 2, sa: 88, sb: 88, ..base });
    ps.push(P { name: "hold overlap vec 4g nit3 sa88", hold: true, shared: true, vec: true, groups: 4, nit: 3, sa: 88, sb: 88, ..base });
    ps.push(P { name: "hold overlap ks2 vec 4g nit3 sa88 sc36", hold: true, shared: true, vec: true, groups: 4, nit: 3, ks: 2, sa: 88, sb: 88, sc: 36, ..base });
    ps.push(P { name: "acc nit3", acc: true, nit: 3, ..base });
    ps.push(P { name: "acc vec 4g nit3", acc: true, vec: true, groups: 4, nit: 3, ..base });
    ps.push(P { name: "rt nit3", rt: true, nit: 3, ..base });
    ps.push(P { name: "acc rt nit3", acc: true, rt: true, nit: 3, ..base });
    ps.push(P { name: "acc rt 4g sc36 nit3", acc: true, rt: true, groups: 4, sc: 36, nit: 3, ..base });
    ps.push(P { name: "brow", brow: true, ..base });
    ps.push(P { name: "brow vec sb88", brow: true, vec: true, sa: 88, sb: 88, ..base });
    ps.push(P { name: "brow vec 4g sb40 acc nit3", brow: true, vec: true, groups: 4, sa: 40, sb: 40, acc: true, nit: 3, ..base });
    ps.push(P { name: "hold overlap ks5 vec 4g nit3 sa88", hold: true, shared: true, vec: true, groups: 4, nit: 3, ks: 5, sa: 88, sb: 88, ..base });
    ps.push(P { name: "hold overlap ks5 vec 4g nit3 sa88 press64", hold: true, shared: true, vec: true, groups: 4, nit: 3, ks: 5, sa: 88, sb: 88, press: 64, ..base });
    ps.push(P { name: "hold overlap ks5 vec 4g nit3 sa88 press160", hold: true, shared: true, vec: true, groups: 4, nit: 3, ks: 5, sa: 88, sb: 88, press: 160, ..base });
    ps.push(P { name: "hold ks5 vec 4g nit3 sa88 press160", hold: true, vec: true, groups: 4, nit: 3, ks: 5, sa: 88, sb: 88, press: 160, ..base });
    ps.push(P { name: "ks5 vec 4g nit3 sa88 press160", vec: true, groups: 4, nit: 3, ks: 5, sa: 88, sb: 88, press: 160, ..base });
    for div in 1..4u8 {
        let n: &'static str = ["", "div bar", "div bar sgb", "div"][div as usize];
        ps.push(P { name: n, div, ..base });
        let n: &'static str = ["", "div bar acc 4g nit3 vec", "div bar sgb acc 4g nit3 vec", "div acc 4g nit3 vec"][div as usize];
        ps.push(P { name: n, div, acc: true, groups: 4, nit: 3, vec: true, ..base });
    }
    ps
}

/// Every probe's WGSL passes naga's validation.
fn validate() {
    for p in probes() {
        let text = src(&p);
        let module = naga::front::wgsl::parse_str(&text).unwrap_or_else(|e| panic!("{}: {}\n{text}", p.name, e.emit_to_string(&text)));
        let caps = naga::valid::Capabilities::SHADER_FLOAT16 | naga::valid::Capabilities::COOPERATIVE_MATRIX | naga::valid::Capabilities::SUBGROUP_BARRIER | naga::valid::Capabilities::SUBGROUP;
        { let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps); v.subgroup_stages(naga::valid::ShaderStages::COMPUTE); v.subgroup_operations(naga::valid::SubgroupOperationSet::all()); v.validate(&module) }.unwrap_or_else(|e| panic!("{}: {e:?}\n{text}", p.name));
    }
}

fn main() {
    validate();
    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("no adapter: {e}");
            std::process::exit(2);
        }
    };
    println!("{}", gpu.info.summary());
    if !gpu.info.coop_f16_16 {
        eprintln!("the adapter has no 16 x 16 x 16 f16 cooperative matrices");
        std::process::exit(2);
    }
    let ps = probes();
    let mut bad = vec![];
    for p in &ps {
        let (err, first) = probe(&gpu, p);
        println!("{:40} err {err:.3e} {first}", p.name);
        if !(err <= 1e-5) {
            bad.push(p.name);
        }
    }
    if let Ok(name) = std::env::var("PROBE_SRC") {
        if let Some(p) = ps.iter().find(|p| p.name == name) {
            println!("{}", src(p));
        }
    }
    if !bad.is_empty() {
        eprintln!("wrong: {bad:?}");
        std::process::exit(1);
    }
}
