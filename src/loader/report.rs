//! Problems found while opening or checking a checkpoint, collected into one
//! [`Report`] grouped by decoder layer.

use std::fmt;
use std::path::PathBuf;

/// How bad a problem is: errors make loading fail, warnings do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// One problem.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Problem {
    pub severity: Severity,
    /// Decoder layer the problem belongs to (`None`: files, config, global tensors).
    pub layer: Option<usize>,
    /// What it is about: a tensor name relative to the text-model prefix (and to
    /// `layers.N.` for layer tensors), a file name, or `config.json`.
    pub subject: String,
    /// The full tensor name, when the problem is about a tensor.
    pub tensor: Option<String>,
    pub message: String,
}

impl Problem {
    pub fn error(subject: impl Into<String>, message: impl Into<String>) -> Self {
        Problem { severity: Severity::Error, layer: None, subject: subject.into(), tensor: None, message: message.into() }
    }
    pub fn warning(subject: impl Into<String>, message: impl Into<String>) -> Self {
        Problem { severity: Severity::Warning, ..Problem::error(subject, message) }
    }
    /// A problem about the tensor `full` (a full checkpoint name); `prefix` is the
    /// text-model prefix used to shorten it and to find its layer.
    pub fn tensor(severity: Severity, full: &str, prefix: &str, message: impl Into<String>) -> Self {
        let (layer, subject) = split_name(full, prefix);
        Problem { severity, layer, subject, tensor: Some(full.to_string()), message: message.into() }
    }
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// `language_model.model.layers.3.mlp.up_proj.weight` → `(Some(3), "mlp.up_proj.weight")`
/// (Gemma 3n's audio blocks are `conformer.N.`).
pub fn split_name(full: &str, prefix: &str) -> (Option<usize>, String) {
    let rel = full.strip_prefix(prefix).unwrap_or(full);
    if let Some(rest) = rel.strip_prefix("layers.").or_else(|| rel.strip_prefix("conformer.")) {
        if let Some((n, tail)) = rest.split_once('.') {
            if let Ok(i) = n.parse::<usize>() {
                return (Some(i), tail.to_string());
            }
        }
    }
    (None, rel.to_string())
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        match self.layer {
            Some(l) => write!(f, "{sev}: layer {l}: {} {}", self.subject, self.message),
            None => write!(f, "{sev}: {} {}", self.subject, self.message),
        }
    }
}

/// All problems of one checkpoint (possibly none).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Report {
    /// Checkpoint directory.
    pub dir: PathBuf,
    /// Text-model tensor prefix (names in problems are relative to it).
    pub prefix: String,
    pub problems: Vec<Problem>,
}

impl Report {
    pub fn new(dir: impl Into<PathBuf>, prefix: impl Into<String>) -> Self {
        Report { dir: dir.into(), prefix: prefix.into(), problems: vec![] }
    }
    pub fn push(&mut self, p: Problem) {
        if !self.problems.contains(&p) {
            self.problems.push(p);
        }
    }
    pub fn extend(&mut self, ps: impl IntoIterator<Item = Problem>) {
        for p in ps {
            self.push(p);
        }
    }
    pub fn errors(&self) -> impl Iterator<Item = &Problem> {
        self.problems.iter().filter(|p| p.severity == Severity::Error)
    }
    pub fn warnings(&self) -> impl Iterator<Item = &Problem> {
        self.problems.iter().filter(|p| p.severity == Severity::Warning)
    }
    pub fn has_errors(&self) -> bool {
        self.errors().next().is_some()
    }
    pub fn is_empty(&self) -> bool {
        self.problems.is_empty()
    }
    /// Problems sorted for display: file/config/global ones first, then by layer
    /// (stable: the order of discovery within a group is kept).
    pub fn sorted(&self) -> Vec<&Problem> {
        let mut v: Vec<&Problem> = self.problems.iter().collect();
        v.sort_by_key(|p| p.layer.map_or(0, |l| l + 1));
        v
    }
    /// Human-readable lines, one per problem, grouped by layer.
    pub fn lines(&self) -> Vec<String> {
        self.sorted().into_iter().map(|p| p.to_string()).collect()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ne = self.errors().count();
        let nw = self.warnings().count();
        let plural = |n: usize, w: &str| if n == 1 { format!("{n} {w}") } else { format!("{n} {w}s") };
        write!(f, "checkpoint {}: {}, {}", self.dir.display(), plural(ne, "error"), plural(nw, "warning"))?;
        if !self.prefix.is_empty() && !self.problems.is_empty() {
            write!(f, " (tensor names relative to `{}`)", self.prefix)?;
        }
        for l in self.lines() {
            write!(f, "\n  {l}")?;
        }
        Ok(())
    }
}
