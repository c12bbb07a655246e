//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp's
//! `llm_tokenizer_spm` and SentencePiece's `bpe_model.cc` do it:
//! 1. ' ' becomes U+2581 (▁); with `tokenizer.ggml.add_space_prefix` (default true, gemma3
//!    files set false) a ▁ goes in front of the text at the start and after a special token.
//!    No other normalization (no NFKC).
//! 2. The text is split into UTF-8 characters; repeatedly, the adjacent pair whose concatenation
//!    is a vocabulary piece with the highest score is merged (ties: leftmost pair).
//! 3. Each final symbol is its piece's id; a symbol with no piece is emitted as byte tokens
//!    `<0xXX>` (byte fallback), else as the unknown token.
//!
//! One deliberate difference from llama.cpp: merges only form NORMAL, USER_DEFINED and UNUSED
//! pieces, as in SentencePiece (llama.cpp looks up any token, so literal text such as `<0x41>`
//! could merge into a BYTE or CONTROL token). UNUSED pieces are split back into the pair that
//! formed them (SentencePiece's resegmentation).

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use memra_gguf::Gguf;

use super::{
    KEY_ADD_SPACE_PREFIX, KEY_SCORES, KEY_TOKENS, KEY_UNK, TokenId, TokenType, TokenizerError,
    Vocab, gguf_err,
};

/// U+2581, SentencePiece's visible space.
pub const SPACE_MARKER: char = '\u{2581}';

pub(crate) struct SpmModel {
    scores: Vec<f32>,
    add_space_prefix: bool,
    /// `<0xXX>` token of each byte, if the vocabulary has it.
    byte_tokens: [Option<TokenId>; 256],
    unk: Option<TokenId>,
}

impl SpmModel {
    pub(crate) fn from_gguf<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        vocab: &Vocab,
    ) -> Result<SpmModel, TokenizerError> {
        let scores = gguf.get_f32_array(KEY_SCORES).map_err(gguf_err)?;
        if scores.len() != vocab.len() {
            return Err(TokenizerError::new(
                gguf.path(),
                format!(
                    "metadata key '{KEY_SCORES}' has {} entries but '{KEY_TOKENS}' has {}",
                    scores.len(),
                    vocab.len()
                ),
            ));
        }
        if let Some(i) = scores.iter().position(|s| s.is_nan()) {
            return Err(TokenizerError::new(
                gguf.path(),
                format!("metadata key '{KEY_SCORES}[{i}]' is NaN"),
            ));
        }
        let add_space_prefix = match gguf.get_bool(KEY_ADD_SPACE_PREFIX) {
            Ok(v) => v,
            Err(e) if e.is_missing_key() => true,
            Err(e) => return Err(gguf_err(e)),
        };
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab.id(&format!("<0x{b:02X}>"));
        }
        let unk = super::optional_id(gguf, KEY_UNK, vocab.len())?;
        Ok(SpmModel {
            scores: scores.to_vec(),
            add_space_prefix,
            byte_tokens,
            unk,
        })
    }

    /// Pieces a merge may form (SentencePiece's `pieces_`).
    fn mergeable(vocab: &Vocab, text: &str) -> Option<TokenId> {
        let id = vocab.id(text)?;
        matches!(
            vocab.token_type(id)?,
            TokenType::Normal | TokenType::UserDefined | TokenType::Unused | TokenType::Undefined
        )
        .then_some(id)
    }

    /// Encodes one fragment of plain text (no special tokens in it), appending to `out`.
    pub(crate) fn encode(
        &self,
        vocab: &Vocab,
        text: &str,
        after_special: bool,
        out: &mut Vec<TokenId>,
    ) -> Result<(), String> {
        let mut escaped = String::with_capacity(text.len() + 3);
        if self.add_space_prefix && after_special {
            escaped.push(SPACE_MARKER);
        }
        for c in text.chars() {
            escaped.push(if c == ' ' { SPACE_MARKER } else { c });
        }
        if escaped.is_empty() {
            return Ok(());
        }

        let mut symbols: Vec<Symbol> = Vec::with_capacity(escaped.len());
        for (start, c) in escaped.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }

        let mut queue = BinaryHeap::new();
        // Pairs that formed an UNUSED piece, to split it again at the end.
        let mut rev_merge: RevMerge = HashMap::new();
        let try_pair =
            |symbols: &[Symbol], left: usize, right: usize, queue: &mut BinaryHeap<Bigram>| {
                let (l, r) = (&symbols[left], &symbols[right]);
                let piece = &escaped[l.start..r.start + r.len];
                if let Some(id) = Self::mergeable(vocab, piece) {
                    queue.push(Bigram {
                        score: self.scores[id as usize],
                        left,
                        right,
                        size: piece.len(),
                    });
                }
            };
        for i in 1..symbols.len() {
            try_pair(&symbols, i - 1, i, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (&symbols[b.left], &symbols[b.right]);
            // Stale: one side was merged away or grew since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size || l.next != Some(b.right) {
                continue;
            }
            let piece = &escaped[l.start..l.start + b.size];
            if vocab.id(piece).and_then(|id| vocab.token_type(id)) == Some(TokenType::Unused) {
                rev_merge.insert((l.start, b.size), ((l.start, l.len), (r.start, r.len)));
            }
            let right_next = r.next;
            symbols[b.left].len = b.size;
            symbols[b.right].len = 0;
            symbols[b.left].next = right_next;
            if let Some(n) = right_next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = symbols[b.left].prev {
                try_pair(&symbols, p, b.left, &mut queue);
            }
            if let Some(n) = right_next {
                try_pair(&symbols, b.left, n, &mut queue);
            }
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let s = &symbols[i];
            self.resegment(vocab, &escaped, s.start, s.len, &rev_merge, out)?;
            at = s.next;
        }
        Ok(())
    }

    /// Emits the piece `escaped[start..start+len]`: its id, or the two pieces an UNUSED piece
    /// was merged from, or byte fallback.
    fn resegment(
        &self,
        vocab: &Vocab,
        escaped: &str,
        start: usize,
        len: usize,
        rev_merge: &RevMerge,
        out: &mut Vec<TokenId>,
    ) -> Result<(), String> {
        let piece = &escaped[start..start + len];
        if let Some(id) = vocab.id(piece) {
            match vocab.token_type(id) {
                Some(TokenType::Unused) => {
                    if let Some(&((ls, ll), (rs, rl))) = rev_merge.get(&(start, len)) {
                        self.resegment(vocab, escaped, ls, ll, rev_merge, out)?;
                        return self.resegment(vocab, escaped, rs, rl, rev_merge, out);
                    }
                    // A single character that is an UNUSED piece: fall back to bytes.
                }
                Some(TokenType::Unknown) => {}
                _ => {
                    out.push(id);
                    return Ok(());
                }
            }
        }
        for &b in piece.as_bytes() {
            match self.byte_tokens[b as usize].or(self.unk) {
                Some(id) => out.push(id),
                None => {
                    return Err(format!(
                        "cannot encode {piece:?}: no token <0x{b:02X}> for byte fallback and no unknown token ('{KEY_UNK}')"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Bytes of a NORMAL/BYTE token: `<0xXX>` is that byte, ▁ is a space.
    pub(crate) fn token_bytes<'a>(&self, text: &'a str, ty: TokenType) -> Cow<'a, [u8]> {
        if ty == TokenType::Byte
            && let Some(b) = parse_byte_token(text)
        {
            return Cow::Owned(vec![b]);
        }
        if text.contains(SPACE_MARKER) {
            Cow::Owned(text.replace(SPACE_MARKER, " ").into_bytes())
        } else {
            Cow::Borrowed(text.as_bytes())
        }
    }
}

/// `"<0x41>"` → `0x41`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// (start, len) of a merged UNUSED piece → (start, len) of its left and right parts.
type RevMerge = HashMap<(usize, usize), ((usize, usize), (usize, usize))>;

#[derive(Clone, Copy)]
struct Symbol {
    /// Byte range in the escaped text; `len == 0` once merged into its left neighbour.
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right` into a piece of `size` bytes.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x41>"), Some(0x41));
        assert_eq!(parse_byte_token("<0xFF>"), Some(0xFF));
        assert_eq!(parse_byte_token("<0x4>"), None);
        assert_eq!(parse_byte_token("0x41"), None);
    }
}
