//! WGSL source assembly: a prelude of `const` declarations, then the shared
//! files and the kernel's file, filtered by a tiny line preprocessor.
//!
//! Preprocessor lines (the whole line, leading spaces allowed):
//! `//#if FLAG`, `//#if !FLAG`, `//#if A || B`, `//#if A && B`, `//#elif ...`,
//! `//#else`, `//#endif`. Flags are names set by the Rust side; nesting is allowed.
//! `//#repeat N VAR` ... `//#endrepeat` emits the enclosed lines N times (N a number or a
//! prelude const), with `$VAR` replaced by 0, 1, ... (textual unrolling: WGSL has no
//! unroll attribute, and naga's loop bounding keeps drivers from unrolling loops).

use std::collections::BTreeSet;

/// One specialization of a kernel: its WGSL files, prelude consts and flags.
#[derive(Clone, Debug, Default)]
pub struct Source {
    /// Files in order (contents).
    pub files: Vec<&'static str>,
    /// `const NAME: u32 = VALUE;` lines of the prelude.
    pub consts: Vec<(String, u32)>,
    pub flags: BTreeSet<String>,
}

impl Source {
    pub fn new(files: &[&'static str]) -> Self {
        Source { files: files.to_vec(), ..Default::default() }
    }
    pub fn c(mut self, name: &str, v: u32) -> Self {
        self.consts.push((name.to_string(), v));
        self
    }
    pub fn flag(mut self, name: &str, on: bool) -> Self {
        if on {
            self.flags.insert(name.to_string());
        }
        self
    }
    /// The assembled WGSL text. `enable` directives of any file move to the top (WGSL wants
    /// them before every declaration), each once.
    pub fn text(&self) -> String {
        let mut enables: Vec<String> = Vec::new();
        let mut body = String::new();
        for f in &self.files {
            for line in preprocess_with(f, &self.flags, &self.consts).lines() {
                if line.starts_with("enable ") {
                    if !enables.iter().any(|e| e == line) {
                        enables.push(line.to_string());
                    }
                    body.push('\n');
                } else {
                    body.push_str(line);
                    body.push('\n');
                }
            }
            body.push('\n');
        }
        let mut out = String::new();
        for e in &enables {
            out.push_str(e);
            out.push('\n');
        }
        for (n, v) in &self.consts {
            out.push_str(&format!("const {n}: u32 = {v}u;\n"));
        }
        out.push_str(&body);
        out
    }
}

fn eval(cond: &str, flags: &BTreeSet<String>) -> bool {
    let atom = |s: &str| {
        let s = s.trim();
        match s.strip_prefix('!') {
            Some(n) => !flags.contains(n.trim()),
            None => flags.contains(s),
        }
    };
    if cond.contains("||") {
        cond.split("||").any(atom)
    } else {
        cond.split("&&").all(atom)
    }
}

/// Applies the `//#if` lines. Panics on unbalanced directives (a bug in a .wgsl file,
/// caught by the naga target test).
pub fn preprocess(src: &str, flags: &BTreeSet<String>) -> String {
    preprocess_with(src, flags, &[])
}

/// [`preprocess`] with `//#repeat` counts resolved against `consts`: the conditions are applied
/// first, so a repeat in a branch left out may count by a const this kernel lacks.
pub fn preprocess_with(src: &str, flags: &BTreeSet<String>, consts: &[(String, u32)]) -> String {
    // Stack of (this branch active, some branch of this if already taken, parent active).
    let mut stack: Vec<(bool, bool, bool)> = Vec::new();
    let mut active = true;
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("//#if ") {
            let c = eval(rest, flags);
            stack.push((c, c, active));
            active = active && c;
            continue;
        }
        if let Some(rest) = t.strip_prefix("//#elif ") {
            let (_, taken, parent) = stack.last().copied().expect("#elif without #if");
            let c = !taken && eval(rest, flags);
            *stack.last_mut().unwrap() = (c, taken || c, parent);
            active = parent && c;
            continue;
        }
        if t.starts_with("//#else") {
            let (_, taken, parent) = stack.last().copied().expect("#else without #if");
            *stack.last_mut().unwrap() = (!taken, true, parent);
            active = parent && !taken;
            continue;
        }
        if t.starts_with("//#endif") {
            let (_, _, parent) = stack.pop().expect("#endif without #if");
            active = parent;
            continue;
        }
        if active {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(stack.is_empty(), "unterminated //#if");
    expand_repeats(&out, consts)
}

/// Expands `//#repeat N VAR` blocks (innermost last, so nested repeats see outer indices).
fn expand_repeats(src: &str, consts: &[(String, u32)]) -> String {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        if let Some(rest) = t.strip_prefix("//#repeat ") {
            let mut parts = rest.split_whitespace();
            let n = parts.next().expect("//#repeat N VAR");
            let var = parts.next().expect("//#repeat N VAR");
            let n: u32 = n.parse().unwrap_or_else(|_| {
                consts.iter().find(|(c, _)| c == n).unwrap_or_else(|| panic!("//#repeat: unknown count {n}")).1
            });
            // find the matching end
            let mut depth = 1;
            let mut j = i + 1;
            while depth > 0 {
                let tj = lines.get(j).expect("unterminated //#repeat").trim_start();
                if tj.starts_with("//#repeat ") {
                    depth += 1;
                } else if tj.starts_with("//#endrepeat") {
                    depth -= 1;
                }
                j += 1;
            }
            let body = lines[i + 1..j - 1].join("\n");
            let pat = format!("${var}");
            for k in 0..n {
                out.push_str(&expand_repeats(&body.replace(&pat, &k.to_string()), consts));
            }
            i = j;
            continue;
        }
        out.push_str(lines[i]);
        out.push('\n');
        i += 1;
    }
    out
}

/// How a binding is declared in the shader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindKind {
    Uniform,
    Read,
    ReadWrite,
}

/// Parses the WGSL with naga and lists its `@group(0)` bindings, sorted.
pub fn reflect_bindings(wgsl: &str) -> Result<Vec<(u32, BindKind)>, String> {
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| e.emit_to_string(wgsl))?;
    let mut out = Vec::new();
    for (_, g) in module.global_variables.iter() {
        let Some(b) = &g.binding else { continue };
        if b.group != 0 {
            return Err(format!("binding in group {}", b.group));
        }
        let kind = match g.space {
            naga::AddressSpace::Uniform => BindKind::Uniform,
            naga::AddressSpace::Storage { access } => {
                if access.contains(naga::StorageAccess::STORE) {
                    BindKind::ReadWrite
                } else {
                    BindKind::Read
                }
            }
            other => return Err(format!("unsupported address space {other:?}")),
        };
        out.push((b.binding, kind));
    }
    out.sort_by_key(|b| b.0);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preprocessor_nesting() {
        let src = "a\n//#if X\nb\n//#if !Y\nc\n//#else\nd\n//#endif\n//#elif Z\ne\n//#else\nf\n//#endif\ng\n";
        let f = |names: &[&str]| preprocess(src, &names.iter().map(|s| s.to_string()).collect());
        assert_eq!(f(&["X"]), "a\nb\nc\ng\n");
        assert_eq!(f(&["X", "Y"]), "a\nb\nd\ng\n");
        assert_eq!(f(&["Z"]), "a\ne\ng\n");
        assert_eq!(f(&[]), "a\nf\ng\n");
        assert_eq!(f(&["X", "Z"]), "a\nb\nc\ng\n");
    }

    #[test]
    fn repeat_expansion() {
        let src = "x\n//#repeat 2 i\na$i\n//#repeat N j\nb$i$j\n//#endrepeat\n//#endrepeat\ny\n";
        let out = preprocess_with(src, &BTreeSet::new(), &[("N".to_string(), 3)]);
        assert_eq!(out, "x\na0\nb00\nb01\nb02\na1\nb10\nb11\nb12\ny\n");
    }
}
