//! WGSL source assembly: a prelude of `const` declarations, then the shared
//! files and the kernel's file, filtered by a tiny line preprocessor.
//!
//! Preprocessor lines (the whole line, leading spaces allowed):
//! `//#if FLAG`, `//#if !FLAG`, `//#if A || B`, `//#if A && B`, `//#elif ...`,
//! `//#else`, `//#endif`. Flags are names set by the Rust side; nesting is allowed.

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
    /// The assembled WGSL text.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for (n, v) in &self.consts {
            out.push_str(&format!("const {n}: u32 = {v}u;\n"));
        }
        for f in &self.files {
            out.push_str(&preprocess(f, &self.flags));
            out.push('\n');
        }
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
}
