//! The one error type of this crate. Every message names what was being read (key, array
//! element, tensor) and, for structural problems, the byte offset where it starts.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// An error reading, querying or writing a GGUF file.
///
/// `Display` gives `"<file>: byte 0x<offset>: <message>"`, leaving out the parts that are
/// unknown (a buffer parsed from memory has no file name; a missing key has no offset).
#[derive(Debug)]
pub struct GgufError {
    path: Option<PathBuf>,
    offset: Option<u64>,
    kind: ErrorKind,
}

/// What went wrong. The `String`s are complete sentences that already name the key or tensor.
#[derive(Debug)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Opening, mapping or writing the file failed.
    Io(io::Error),
    /// The bytes are not a valid little-endian GGUF v2/v3 file.
    Format(String),
    /// A metadata key that the caller asked for is absent.
    MissingKey(String),
    /// A metadata value has a type the accessor cannot convert.
    WrongType { key: String, expected: &'static str, found: String },
    /// A metadata value does not fit the requested type (negative count, u64 into u32, ...).
    OutOfRange { key: String, value: String, target: &'static str },
    /// A tensor the caller asked for is absent.
    MissingTensor(String),
    /// The writer was given something it cannot encode.
    Invalid(String),
}

impl GgufError {
    pub(crate) fn new(kind: ErrorKind) -> Self {
        GgufError { path: None, offset: None, kind }
    }

    /// A structural problem found at byte `offset` of the input.
    pub(crate) fn format_at(offset: u64, message: impl Into<String>) -> Self {
        GgufError { path: None, offset: Some(offset), kind: ErrorKind::Format(message.into()) }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid(message.into()))
    }

    pub(crate) fn io(path: &Path, err: io::Error) -> Self {
        GgufError { path: Some(path.to_path_buf()), offset: None, kind: ErrorKind::Io(err) }
    }

    /// Attaches a file name unless one is already set.
    pub(crate) fn in_file(mut self, path: Option<&Path>) -> Self {
        if self.path.is_none() {
            self.path = path.map(Path::to_path_buf);
        }
        self
    }

    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The file the error is about, when the input came from a file.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Byte offset in the input where the offending item starts, for structural errors.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// True when a requested metadata key is absent (as opposed to present but unusable),
    /// so callers can treat optional hparams as optional.
    pub fn is_missing_key(&self) -> bool {
        matches!(self.kind, ErrorKind::MissingKey(_))
    }
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(path) = &self.path {
            write!(f, "{}: ", path.display())?;
        }
        if let Some(offset) = self.offset {
            write!(f, "byte 0x{offset:x}: ")?;
        }
        match &self.kind {
            ErrorKind::Io(err) => write!(f, "{err}"),
            ErrorKind::Format(msg) | ErrorKind::Invalid(msg) => f.write_str(msg),
            ErrorKind::MissingKey(key) => write!(f, "metadata key '{key}' is missing"),
            ErrorKind::WrongType { key, expected, found } => {
                write!(f, "metadata key '{key}' is {found}, expected {expected}")
            }
            ErrorKind::OutOfRange { key, value, target } => {
                write!(f, "metadata key '{key}' = {value} does not fit in {target}")
            }
            ErrorKind::MissingTensor(name) => write!(f, "tensor '{name}' is missing"),
        }
    }
}

impl std::error::Error for GgufError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            ErrorKind::Io(err) => Some(err),
            _ => None,
        }
    }
}
