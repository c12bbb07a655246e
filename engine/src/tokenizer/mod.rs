//! Tokenizers built from a GGUF vocabulary (`tokenizer.ggml.*` keys), following llama.cpp's
//! `llama-vocab.cpp`:
//! - `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE over scores, with byte fallback
//!   and the U+2581 space marker ([`spm`]; gemma3, llama 1/2).
//! - `tokenizer.ggml.model = "gpt2"`: GPT-2 byte-level BPE over ranked merges, with a
//!   pre-tokenizer regex chosen by `tokenizer.ggml.pre` ([`bpe`]; qwen3, olmoe, glm).
//!
//! Shared by both (llama.cpp `tokenizer_st_partition`): special tokens are cut out of the text
//! before the model sees it, longest token text first. USER_DEFINED tokens are always cut out;
//! CONTROL (and UNKNOWN) tokens only when the caller asks (`parse_special`), so that user text
//! containing `<start_of_turn>` stays text unless a chat template put it there.

pub mod bpe;
pub mod spm;

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use memra_gguf::Gguf;

use bpe::BpeModel;
use spm::SpmModel;

pub type TokenId = u32;

pub const KEY_MODEL: &str = "tokenizer.ggml.model";
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
pub const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
pub const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
pub const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
pub const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// Token texts that end generation when they are CONTROL tokens, besides `eos`/`eot`/`eom`
/// (llama.cpp adds the same kind of list to `special_eog_ids`).
const EOG_TEXTS: &[&str] = &[
    "<end_of_turn>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|user|>",
    "<|observation|>",
];

/// GGUF `tokenizer.ggml.token_type` values (the SentencePiece piece types).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// 0, or any value outside 1..=6.
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    pub fn from_gguf(v: i32) -> TokenType {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Tokens that `tokenizer_st_partition` may cut out of the text.
    fn is_special(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown
        )
    }
}

/// A malformed vocabulary or an input the vocabulary cannot encode. The message names the file
/// (when known) and the key or token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerError {
    path: Option<PathBuf>,
    message: String,
}

impl TokenizerError {
    pub(crate) fn new(path: Option<&Path>, message: impl Into<String>) -> Self {
        TokenizerError {
            path: path.map(Path::to_path_buf),
            message: message.into(),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{}: {}", p.display(), self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for TokenizerError {}

/// Token texts, types and the text → id index, shared by both models.
pub struct Vocab {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, TokenId>,
}

impl Vocab {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The id of the token whose text is exactly `text` (the first one if several share it).
    pub fn id(&self, text: &str) -> Option<TokenId> {
        self.token_to_id.get(text).copied()
    }

    pub fn text(&self, id: TokenId) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_type(&self, id: TokenId) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }
}

enum Model {
    Spm(Box<SpmModel>),
    Bpe(Box<BpeModel>),
}

/// A tokenizer for one GGUF file: encode text to ids, decode ids (or a stream of them) to text.
pub struct Tokenizer {
    path: Option<PathBuf>,
    vocab: Vocab,
    model: Model,
    /// Special tokens in matching order: longest text first, then lower id.
    specials: Vec<TokenId>,
    bos: Option<TokenId>,
    eos: Option<TokenId>,
    eog: Vec<TokenId>,
    add_bos: bool,
    add_eos: bool,
}

/// Reads an optional token-id key; present but out of range is an error naming the key.
fn optional_id<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    key: &str,
    n_vocab: usize,
) -> Result<Option<TokenId>, TokenizerError> {
    let path = gguf.path();
    match gguf.get_i64(key) {
        Ok(-1) => Ok(None),
        Ok(id) if id >= 0 && (id as u64) < n_vocab as u64 => Ok(Some(id as TokenId)),
        Ok(id) => Err(TokenizerError::new(
            path,
            format!(
                "metadata key '{key}' = {id} is not a token id (the vocabulary has {n_vocab} tokens)"
            ),
        )),
        Err(e) if e.is_missing_key() => Ok(None),
        Err(e) => Err(TokenizerError::new(None, e.to_string())),
    }
}

fn optional_bool<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    key: &str,
) -> Result<Option<bool>, TokenizerError> {
    match gguf.get_bool(key) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_missing_key() => Ok(None),
        Err(e) => Err(TokenizerError::new(None, e.to_string())),
    }
}

/// A GGUF getter's error already names the file and key.
pub(crate) fn gguf_err(e: memra_gguf::GgufError) -> TokenizerError {
    TokenizerError::new(None, e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer described by the `tokenizer.ggml.*` keys of `gguf`.
    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Tokenizer, TokenizerError> {
        let path = gguf.path();
        let model_name = gguf.get_str(KEY_MODEL).map_err(gguf_err)?;
        let tokens = gguf.get_str_array(KEY_TOKENS).map_err(gguf_err)?;
        let n_vocab = tokens.len();
        if n_vocab == 0 {
            return Err(TokenizerError::new(
                path,
                format!("metadata key '{KEY_TOKENS}' is empty"),
            ));
        }
        if n_vocab > TokenId::MAX as usize {
            return Err(TokenizerError::new(
                path,
                format!("'{KEY_TOKENS}' has {n_vocab} tokens, more than ids can hold"),
            ));
        }
        // llama.cpp: a missing token_type array means every token is NORMAL.
        let types: Vec<TokenType> = match gguf.get_i32_array(KEY_TOKEN_TYPE) {
            Ok(t) if t.len() == n_vocab => t.iter().map(TokenType::from_gguf).collect(),
            Ok(t) => {
                return Err(TokenizerError::new(
                    path,
                    format!(
                        "metadata key '{KEY_TOKEN_TYPE}' has {} entries but '{KEY_TOKENS}' has {n_vocab}",
                        t.len()
                    ),
                ));
            }
            Err(e) if e.is_missing_key() => vec![TokenType::Normal; n_vocab],
            Err(e) => return Err(gguf_err(e)),
        };
        let mut token_to_id = HashMap::with_capacity(n_vocab);
        for (id, text) in tokens.iter().enumerate() {
            // Duplicated texts: the first id wins, as in llama.cpp's token_to_id.
            token_to_id.entry(text.to_string()).or_insert(id as TokenId);
        }
        let vocab = Vocab {
            tokens: tokens.to_vec(),
            types,
            token_to_id,
        };

        let model = match model_name {
            "llama" => Model::Spm(Box::new(SpmModel::from_gguf(gguf, &vocab)?)),
            "gpt2" => Model::Bpe(Box::new(BpeModel::from_gguf(gguf, &vocab)?)),
            other => {
                return Err(TokenizerError::new(
                    path,
                    format!(
                        "metadata key '{KEY_MODEL}' = \"{other}\" is not supported (expected \"llama\" or \"gpt2\")"
                    ),
                ));
            }
        };

        let bos = optional_id(gguf, KEY_BOS, n_vocab)?;
        let eos = optional_id(gguf, KEY_EOS, n_vocab)?;
        // llama.cpp defaults: SPM adds BOS, BPE files say so explicitly when they do. Only an
        // explicit add_bos without a BOS id is an error.
        let add_bos = optional_bool(gguf, KEY_ADD_BOS)?
            .unwrap_or(matches!(model, Model::Spm(_)) && bos.is_some());
        let add_eos = optional_bool(gguf, KEY_ADD_EOS)?.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::new(
                path,
                format!("'{KEY_ADD_BOS}' is set but '{KEY_BOS}' is missing"),
            ));
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::new(
                path,
                format!("'{KEY_ADD_EOS}' is set but '{KEY_EOS}' is missing"),
            ));
        }

        let mut eog: Vec<TokenId> = Vec::new();
        for key in [KEY_EOS, KEY_EOT, KEY_EOM] {
            eog.extend(optional_id(gguf, key, n_vocab)?);
        }
        for text in EOG_TEXTS {
            if let Some(id) = vocab.id(text)
                && vocab.token_type(id) == Some(TokenType::Control)
            {
                eog.push(id);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let mut specials: Vec<TokenId> = (0..n_vocab as TokenId)
            .filter(|&id| {
                vocab.types[id as usize].is_special() && !vocab.tokens[id as usize].is_empty()
            })
            .collect();
        specials.sort_by_key(|&id| (std::cmp::Reverse(vocab.tokens[id as usize].len()), id));

        Ok(Tokenizer {
            path: path.map(Path::to_path_buf),
            vocab,
            model,
            specials,
            bos,
            eos,
            eog,
            add_bos,
            add_eos,
        })
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.len()
    }

    /// A short description: `"llama (SentencePiece)"` or `"gpt2 (byte-level BPE, pre qwen2)"`.
    pub fn describe(&self) -> String {
        match &self.model {
            Model::Spm(_) => "llama (SentencePiece)".to_string(),
            Model::Bpe(m) => format!("gpt2 (byte-level BPE, pre-tokenizer {})", m.pre_name()),
        }
    }

    pub fn bos(&self) -> Option<TokenId> {
        self.bos
    }

    pub fn eos(&self) -> Option<TokenId> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// End-of-generation tokens: eos, eot, eom and CONTROL tokens such as `<end_of_turn>`.
    pub fn is_eog(&self, id: TokenId) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Text to token ids.
    /// - `add_special`: add BOS/EOS as the file says (`tokenizer.ggml.add_bos_token`, ...).
    /// - `parse_special`: recognize CONTROL token texts (`<start_of_turn>`) in `text`; otherwise
    ///   they are encoded as plain text. USER_DEFINED tokens are always recognized.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<TokenId>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        // SPM (llama.cpp): the space prefix goes before the first text and after each special.
        let mut after_special = true;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    match &self.model {
                        Model::Spm(m) => m
                            .encode(&self.vocab, t, after_special, &mut out)
                            .map_err(|e| self.err(e))?,
                        Model::Bpe(m) => m
                            .encode(&self.vocab, t, &mut out)
                            .map_err(|e| self.err(e))?,
                    }
                    after_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    fn err(&self, message: String) -> TokenizerError {
        TokenizerError::new(self.path.as_deref(), message)
    }

    /// Cuts special-token texts out of `text` (llama.cpp `tokenizer_st_partition`): each
    /// special token in turn, longest first, splits every remaining text fragment at its
    /// occurrences, left to right.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        for &id in &self.specials {
            let ty = self.vocab.types[id as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = self.vocab.tokens[id as usize].as_str();
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The bytes token `id` stands for (llama.cpp `token_to_piece`). CONTROL and UNKNOWN
    /// tokens give their text only when `special` is set, else nothing.
    pub fn token_bytes(&self, id: TokenId, special: bool) -> Result<Cow<'_, [u8]>, TokenizerError> {
        let Some(text) = self.vocab.text(id) else {
            return Err(self.err(format!(
                "token id {id} is out of range (vocabulary of {})",
                self.n_vocab()
            )));
        };
        let ty = self.vocab.types[id as usize];
        Ok(match ty {
            TokenType::Control | TokenType::Unknown => {
                if special {
                    Cow::Borrowed(text.as_bytes())
                } else {
                    Cow::Borrowed(&[][..])
                }
            }
            TokenType::UserDefined => Cow::Borrowed(text.as_bytes()),
            TokenType::Normal | TokenType::Undefined | TokenType::Unused | TokenType::Byte => {
                match &self.model {
                    Model::Spm(m) => m.token_bytes(text, ty),
                    Model::Bpe(m) => m.token_bytes(text),
                }
            }
        })
    }

    /// Ids to text; invalid UTF-8 (a sequence cut short) becomes U+FFFD.
    pub fn decode(&self, ids: &[TokenId], special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(&self.token_bytes(id, special)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A decoder for tokens arriving one at a time (generation): it holds back the bytes of a
    /// UTF-8 character split across tokens until the character is complete.
    pub fn stream_decoder(&self, special: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            special,
            pending: Vec::new(),
        }
    }
}

enum Fragment<'a> {
    Text(&'a str),
    Token(TokenId),
}

/// See [`Tokenizer::stream_decoder`].
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: TokenId) -> Result<String, TokenizerError> {
        let bytes = self.tokenizer.token_bytes(id, self.special)?;
        self.pending.extend_from_slice(&bytes);
        Ok(self.take_complete())
    }

    /// Flushes what is left; an unfinished character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    /// Everything up to a trailing, possibly incomplete, UTF-8 sequence; invalid bytes in the
    /// middle become U+FFFD now rather than blocking the stream.
    fn take_complete(&mut self) -> String {
        let keep = incomplete_suffix_len(&self.pending);
        let done = self.pending.len() - keep;
        let text = String::from_utf8_lossy(&self.pending[..done]).into_owned();
        self.pending.drain(..done);
        text
    }
}

/// Length of a trailing UTF-8 sequence that has a valid lead byte but too few continuation
/// bytes so far (0 if the buffer ends on a character boundary or on invalid bytes).
fn incomplete_suffix_len(bytes: &[u8]) -> usize {
    // A sequence is at most 4 bytes: look at the last 3 for its lead byte.
    for back in 1..=bytes.len().min(3) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue; // continuation byte: keep looking for the lead
        }
        let need = match b {
            0xC2..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF4 => 4,
            _ => return 0,
        };
        return if back < need { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incomplete_suffix_is_held_back() {
        let euro = "€".as_bytes(); // E2 82 AC
        assert_eq!(incomplete_suffix_len(&euro[..1]), 1);
        assert_eq!(incomplete_suffix_len(&euro[..2]), 2);
        assert_eq!(incomplete_suffix_len(euro), 0);
        let smile = "😀".as_bytes(); // 4 bytes
        assert_eq!(incomplete_suffix_len(&smile[..3]), 3);
        assert_eq!(incomplete_suffix_len(b"ab"), 0);
        assert_eq!(
            incomplete_suffix_len(&[b'a', 0x80]),
            0,
            "stray continuation byte"
        );
        assert_eq!(incomplete_suffix_len(&[0xFF]), 0, "invalid lead byte");
    }
}
