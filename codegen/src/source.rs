//! Spanned access to a TOML spec file: every value knows its file, line, column and key
//! path, so any later stage can report `specs/qwen3.toml:12:17: key `hparams.n_embd.type`: ...`.
//! Errors are collected (a spec with five mistakes reports five), not returned on the first.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// Where something was written: file, 1-based line and column, dotted key path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loc {
    pub file: Arc<PathBuf>,
    pub line: usize,
    pub col: usize,
    pub key: String,
}

impl Loc {
    /// Builds an error at this location.
    pub fn error(&self, message: impl Into<String>) -> SpecError {
        SpecError {
            loc: self.clone(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file.display(), self.line, self.col)?;
        if !self.key.is_empty() {
            write!(f, ": key `{}`", self.key)?;
        }
        Ok(())
    }
}

/// One problem in a spec file, with its location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    pub loc: Loc,
    pub message: String,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.loc, self.message)
    }
}

impl std::error::Error for SpecError {}

/// All problems found in one pass over a spec file (never empty when returned as an error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecErrors(pub Vec<SpecError>);

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for SpecErrors {}

/// The text of one spec file plus the line index used to turn byte offsets into lines.
pub struct SourceFile {
    file: Arc<PathBuf>,
    line_starts: Vec<usize>,
    errors: Vec<SpecError>,
}

impl SourceFile {
    pub fn new(path: &Path, text: &str) -> Self {
        let mut line_starts = vec![0];
        line_starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        SourceFile {
            file: Arc::new(path.to_path_buf()),
            line_starts,
            errors: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.file
    }

    pub fn loc(&self, span: &Range<usize>, key: &str) -> Loc {
        let line = self
            .line_starts
            .partition_point(|&s| s <= span.start)
            .max(1);
        let col = span.start - self.line_starts[line - 1] + 1;
        Loc {
            file: self.file.clone(),
            line,
            col,
            key: key.to_string(),
        }
    }

    pub fn push(&mut self, err: SpecError) {
        self.errors.push(err);
    }

    pub fn error(&mut self, span: &Range<usize>, key: &str, message: impl Into<String>) {
        let err = self.loc(span, key).error(message);
        self.errors.push(err);
    }

    pub fn has_errors(&self) -> bool {
        !self.errors.is_empty()
    }

    pub fn take_errors(&mut self) -> Vec<SpecError> {
        std::mem::take(&mut self.errors)
    }

    /// Parses the TOML syntax; a syntax error becomes one located error.
    pub fn parse<'i>(&mut self, text: &'i str) -> Option<Spanned<DeTable<'i>>> {
        match DeTable::parse(text) {
            Ok(t) => Some(t),
            Err(e) => {
                let span = e.span().unwrap_or(0..0);
                self.error(&span, "", format!("TOML syntax: {}", e.message().trim()));
                None
            }
        }
    }
}

pub type SpannedValue<'i> = Spanned<DeValue<'i>>;

/// A borrowed TOML value with its key path and span.
#[derive(Clone, Copy)]
pub struct Item<'a, 'i> {
    pub key: &'a str,
    pub value: &'a DeValue<'i>,
    pub span: &'a Range<usize>,
}

/// The entries of one table in document order, with their full key paths.
pub struct Table<'a, 'i> {
    pub path: String,
    pub span: Range<usize>,
    pub entries: Vec<(String, Range<usize>, &'a Spanned<DeValue<'i>>)>,
    used: Vec<bool>,
}

impl<'a, 'i> Table<'a, 'i> {
    pub fn new(path: &str, span: Range<usize>, table: &'a DeTable<'i>) -> Self {
        let mut entries: Vec<_> = table
            .iter()
            .map(|(k, v)| (k.get_ref().to_string(), k.span(), v))
            .collect();
        // DeTable is ordered by key; the spans give back the order the author wrote.
        entries.sort_by_key(|(_, span, _)| span.start);
        let used = vec![false; entries.len()];
        Table {
            path: path.to_string(),
            span,
            entries,
            used,
        }
    }

    pub fn child_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{}", self.path, quote_key(key))
        }
    }

    /// Looks up `key` and marks it used.
    pub fn get(&mut self, key: &str) -> Option<(String, &'a Spanned<DeValue<'i>>)> {
        let i = self.entries.iter().position(|(k, _, _)| k == key)?;
        self.used[i] = true;
        Some((self.child_path(key), self.entries[i].2))
    }

    /// All entries, marking them used (for tables whose keys are names chosen by the author).
    pub fn all(&mut self) -> Vec<(String, String, Range<usize>, &'a Spanned<DeValue<'i>>)> {
        self.used.iter_mut().for_each(|u| *u = true);
        self.entries
            .iter()
            .map(|(k, ks, v)| (k.clone(), self.child_path(k), ks.clone(), *v))
            .collect()
    }

    /// Reports every key that no `get` asked for.
    pub fn finish(self, src: &mut SourceFile, allowed: &[&str]) {
        for ((key, span, _), used) in self.entries.iter().zip(&self.used) {
            if !used {
                let path = self.child_path(key);
                src.error(
                    span,
                    &path,
                    format!("unknown key; expected one of: {}", allowed.join(", ")),
                );
            }
        }
    }

    pub fn str(&mut self, src: &mut SourceFile, key: &str) -> Option<Spanned<String>> {
        let (path, v) = self.get(key)?;
        match v.get_ref() {
            DeValue::String(s) => Some(Spanned::new(v.span(), s.to_string())),
            other => {
                src.error(
                    &v.span(),
                    &path,
                    format!("expected a string, found {}", other.type_str()),
                );
                None
            }
        }
    }

    pub fn req_str(&mut self, src: &mut SourceFile, key: &str) -> Option<Spanned<String>> {
        let got = self.str(src, key);
        if got.is_none() && !self.entries.iter().any(|(k, _, _)| k == key) {
            src.error(
                &self.span.clone(),
                &self.child_path(key),
                "missing required key",
            );
        }
        got
    }

    pub fn bool(&mut self, src: &mut SourceFile, key: &str) -> Option<Spanned<bool>> {
        let (path, v) = self.get(key)?;
        match v.get_ref() {
            DeValue::Boolean(b) => Some(Spanned::new(v.span(), *b)),
            other => {
                src.error(
                    &v.span(),
                    &path,
                    format!("expected true or false, found {}", other.type_str()),
                );
                None
            }
        }
    }

    pub fn int(&mut self, src: &mut SourceFile, key: &str) -> Option<Spanned<i64>> {
        let (path, v) = self.get(key)?;
        match as_int(v.get_ref()) {
            Some(i) => Some(Spanned::new(v.span(), i)),
            None => {
                src.error(
                    &v.span(),
                    &path,
                    format!("expected an integer, found {}", describe(v.get_ref())),
                );
                None
            }
        }
    }

    pub fn table(&mut self, src: &mut SourceFile, key: &str) -> Option<Table<'a, 'i>> {
        let (path, v) = self.get(key)?;
        match v.get_ref() {
            DeValue::Table(t) => Some(Table::new(&path, v.span(), t)),
            other => {
                src.error(
                    &v.span(),
                    &path,
                    format!("expected a table, found {}", other.type_str()),
                );
                None
            }
        }
    }

    pub fn array(
        &mut self,
        src: &mut SourceFile,
        key: &str,
    ) -> Option<(String, Range<usize>, &'a [SpannedValue<'i>])> {
        let (path, v) = self.get(key)?;
        match v.get_ref() {
            DeValue::Array(a) => Some((path, v.span(), &a[..])),
            other => {
                src.error(
                    &v.span(),
                    &path,
                    format!("expected an array, found {}", other.type_str()),
                );
                None
            }
        }
    }
}

/// A TOML integer as i64, when it is one and fits.
pub fn as_int(v: &DeValue<'_>) -> Option<i64> {
    match v {
        DeValue::Integer(i) => i64::from_str_radix(&i.as_str().replace('_', ""), i.radix()).ok(),
        _ => None,
    }
}

/// A TOML float (or integer) as f64.
pub fn as_float(v: &DeValue<'_>) -> Option<f64> {
    match v {
        DeValue::Float(f) => f.as_str().replace('_', "").parse().ok(),
        DeValue::Integer(_) => as_int(v).map(|i| i as f64),
        _ => None,
    }
}

/// A short description of a value for "expected X, found Y" messages.
pub fn describe(v: &DeValue<'_>) -> String {
    match v {
        DeValue::String(s) => format!("string \"{s}\""),
        DeValue::Integer(i) => format!("integer {}", i.as_str()),
        DeValue::Float(f) => format!("float {}", f.as_str()),
        DeValue::Boolean(b) => format!("boolean {b}"),
        other => other.type_str().to_string(),
    }
}

/// Quotes a key segment the way TOML would need it (`"blk.{i}.attn_q.weight"`).
pub fn quote_key(key: &str) -> String {
    if !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        key.to_string()
    } else {
        format!("\"{key}\"")
    }
}
