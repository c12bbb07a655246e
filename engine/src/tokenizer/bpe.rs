//! GPT-2 byte-level BPE (`tokenizer.ggml.model = "gpt2"`), as llama.cpp's
//! `llm_tokenizer_bpe` and HF `tokenizers` (ByteLevel + BPE) do it:
//! 1. The text is cut into pre-tokens by a regex chosen by `tokenizer.ggml.pre` (see
//!    [`PreTokenizer`]).
//! 2. Each pre-token's UTF-8 bytes are mapped to printable characters (GPT-2's
//!    `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the other 68 bytes to
//!    U+0100.. in order, so ' ' is 'Ġ').
//! 3. Starting from single characters, the adjacent pair with the lowest merge rank
//!    (`tokenizer.ggml.merges`, line i has rank i) is merged until none applies (ties: leftmost).
//! 4. Each symbol is its token's id. With `ignore_merges` (llama3) a pre-token that is itself a
//!    vocabulary entry is emitted whole first.
//!
//! The regexes are hand-written matchers (the `regex` crate has no look-ahead); `\p{L}`, `\p{P}` and
//! `\p{N}` use the Unicode tables of `regex-syntax`, `\s` is Unicode White_Space
//! (`char::is_whitespace`), as in Oniguruma and llama.cpp's unicode.cpp.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::OnceLock;

use memra_gguf::Gguf;

use super::{KEY_MERGES, KEY_PRE, KEY_TOKENS, TokenId, TokenizerError, Vocab, gguf_err};

/// Pre-tokenizer regexes (HF `tokenizer.json` patterns; llama.cpp `llama-vocab.cpp`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// Llama 3 (`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`), with ignore_merges.
    Llama3,
    /// Qwen2 / Qwen3: the Llama 3 pattern with single digits (`\p{N}`), no ignore_merges.
    Qwen2,
    /// llama.cpp's default (`default`, or no `tokenizer.ggml.pre`): four patterns in turn, each
    /// cutting every piece of the one before into its matches and the text between them:
    /// `[\p{P}\$\+<=>\^~\|]+`, the GPT-2 pattern, `\p{N}+`, `[0-9][0-9][0-9]`.
    Default,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value; `None` if unknown.
    pub fn from_gguf_name(name: &str) -> Option<PreTokenizer> {
        Some(match name {
            "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
            // GLM-4's tokenizer.json uses the Llama 3 pattern.
            "llama3" | "llama-bpe" | "llama-v3" | "smaug-bpe" | "dbrx" | "falcon3" | "pixtral"
            | "glm4" => PreTokenizer::Llama3,
            "gpt2" | "gpt-2" | "olmo" => PreTokenizer::Gpt2,
            "default" => PreTokenizer::Default,
            _ => return None,
        })
    }

    /// Whether a pre-token that is itself a vocabulary entry is emitted whole, before any merge:
    /// llama.cpp does so for the Llama 3 family only, not for dbrx, smaug-bpe or glm4, which
    /// share its pattern.
    pub fn ignores_merges(name: &str) -> bool {
        matches!(name, "llama3" | "llama-bpe" | "llama-v3" | "falcon3" | "pixtral")
    }

    fn name(self) -> &'static str {
        match self {
            PreTokenizer::Gpt2 => "gpt2",
            PreTokenizer::Llama3 => "llama3",
            PreTokenizer::Qwen2 => "qwen2",
            PreTokenizer::Default => "default",
        }
    }

    /// Splits `text` into pre-tokens (contiguous, covering all of `text`).
    pub fn split(self, text: &str) -> Vec<&str> {
        let one_match: fn(&[(usize, char)], usize) -> usize = match self {
            PreTokenizer::Gpt2 => gpt2_match,
            PreTokenizer::Llama3 => |chars, i| llama3_match(chars, i, 3),
            PreTokenizer::Qwen2 => |chars, i| llama3_match(chars, i, 1),
            PreTokenizer::Default => return default_split(text),
        };
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let n = one_match(&chars, i);
            debug_assert!(n > 0);
            let start = chars[i].0;
            let end = chars.get(i + n).map_or(text.len(), |c| c.0);
            out.push(&text[start..end]);
            i += n;
        }
        out
    }
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if is_letter(c) {
        Class::Letter
    } else if is_number(c) {
        Class::Number
    } else {
        Class::Other
    }
}

/// `\p{L}`: general category Letter (Lu, Ll, Lt, Lm, Lo).
fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    static RANGES: OnceLock<Vec<(char, char)>> = OnceLock::new();
    in_ranges(RANGES.get_or_init(|| unicode_class(r"\p{L}")), c)
}

/// `\p{N}`: general category Number (Nd, Nl, No), from the same Unicode version as `\p{L}`
/// (`char::is_numeric` follows the standard library's newer one, which split a few new code
/// points differently from HF `tokenizers`).
fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    static RANGES: OnceLock<Vec<(char, char)>> = OnceLock::new();
    in_ranges(RANGES.get_or_init(|| unicode_class(r"\p{N}")), c)
}

/// `[\p{P}\$\+<=>\^~\|]`: general category Punctuation, and the ASCII symbols llama.cpp's
/// default pattern adds.
fn is_default_punct(c: char) -> bool {
    static RANGES: OnceLock<Vec<(char, char)>> = OnceLock::new();
    matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|') || in_ranges(RANGES.get_or_init(|| unicode_class(r"\p{P}")), c)
}

fn in_ranges(ranges: &[(char, char)], c: char) -> bool {
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// The sorted ranges of a Unicode class, from regex-syntax's tables.
fn unicode_class(pattern: &str) -> Vec<(char, char)> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    let hir =
        regex_syntax::parse(pattern).unwrap_or_else(|e| panic!("built-in pattern {pattern}: {e}"));
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(cls)) => {
            cls.ranges().iter().map(|r| (r.start(), r.end())).collect()
        }
        other => panic!("built-in pattern {pattern} is not a Unicode class: {other:?}"),
    }
}

fn run(chars: &[(usize, char)], from: usize, pred: impl Fn(char) -> bool) -> usize {
    chars[from..].iter().take_while(|&&(_, c)| pred(c)).count()
}

fn is_newline(c: char) -> bool {
    c == '\r' || c == '\n'
}

/// `'s|'t|'re|'ve|'m|'ll|'d`, ASCII case-insensitive when `any_case`; returns its length.
fn contraction(chars: &[(usize, char)], i: usize, any_case: bool) -> Option<usize> {
    if chars[i].1 != '\'' {
        return None;
    }
    let at = |k: usize| {
        chars
            .get(i + k)
            .map(|&(_, c)| if any_case { c.to_ascii_lowercase() } else { c })
    };
    match (at(1), at(2)) {
        (Some('s' | 't' | 'm' | 'd'), _) => Some(2),
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => Some(3),
        _ => None,
    }
}

/// Whitespace at `i` (a run of `len`): `\s+(?!\S)|\s+`. Before a non-space the run gives up
/// its last character, which then leads the next pre-token.
fn space_run(chars: &[(usize, char)], i: usize) -> usize {
    let len = run(chars, i, char::is_whitespace);
    if i + len == chars.len() || len == 1 {
        len
    } else {
        len - 1
    }
}

/// One match of the Llama 3 / Qwen2 pattern at `i`, in characters.
fn llama3_match(chars: &[(usize, char)], i: usize, max_digits: usize) -> usize {
    let c = chars[i].1;
    let next = chars.get(i + 1).map(|&(_, c)| class(c));
    if let Some(n) = contraction(chars, i, true) {
        return n;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    match class(c) {
        Class::Letter => return run(chars, i, is_letter),
        Class::Space | Class::Other if !is_newline(c) && next == Some(Class::Letter) => {
            return 1 + run(chars, i + 1, is_letter);
        }
        // \p{N}{1,max}
        Class::Number => return run(chars, i, is_number).min(max_digits),
        _ => {}
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let lead = usize::from(c == ' ' && next == Some(Class::Other));
    if class(chars[i + lead].1) == Class::Other {
        let k = i + lead;
        let others = run(chars, k, |c| class(c) == Class::Other);
        let newlines = run(chars, k + others, is_newline);
        return lead + others + newlines;
    }
    // `\s*[\r\n]+`: up to the last newline of the whitespace run.
    let len = run(chars, i, char::is_whitespace);
    if let Some(last) = chars[i..i + len].iter().rposition(|&(_, c)| is_newline(c)) {
        return last + 1;
    }
    space_run(chars, i)
}

/// llama.cpp's default chain ([`PreTokenizer::Default`]). Each pattern sees one piece at a time,
/// as llama.cpp's splitter does.
fn default_split(text: &str) -> Vec<&str> {
    cut_runs(text, is_default_punct)
        .into_iter()
        .flat_map(|p| PreTokenizer::Gpt2.split(p))
        .flat_map(|p| cut_runs(p, is_number))
        .flat_map(digit_triples)
        .collect()
}

/// `text` cut where `pred` changes: the runs it holds for (the matches of `[...]+`) and the
/// runs between them.
fn cut_runs(text: &str, pred: impl Fn(char) -> bool) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut prev = None;
    for (i, c) in text.char_indices() {
        let now = pred(c);
        if prev.is_some_and(|p| p != now) {
            out.push(&text[start..i]);
            start = i;
        }
        prev = Some(now);
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

/// `[0-9][0-9][0-9]` left to right: each three ASCII digits a piece, the text between them too.
fn digit_triples(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let (mut out, mut gap, mut i) = (Vec::new(), 0, 0);
    while i < b.len() {
        if i + 3 <= b.len() && b[i..i + 3].iter().all(u8::is_ascii_digit) {
            if gap < i {
                out.push(&text[gap..i]);
            }
            out.push(&text[i..i + 3]);
            i += 3;
            gap = i;
        } else {
            i += 1;
        }
    }
    if gap < b.len() {
        out.push(&text[gap..]);
    }
    out
}

/// One match of the GPT-2 pattern at `i`, in characters.
fn gpt2_match(chars: &[(usize, char)], i: usize) -> usize {
    if let Some(n) = contraction(chars, i, false) {
        return n;
    }
    let c = chars[i].1;
    let lead = usize::from(c == ' ' && i + 1 < chars.len() && !chars[i + 1].1.is_whitespace());
    match class(chars[i + lead].1) {
        Class::Letter => lead + run(chars, i + lead, is_letter),
        Class::Number => lead + run(chars, i + lead, is_number),
        Class::Other => lead + run(chars, i + lead, |c| class(c) == Class::Other),
        Class::Space => space_run(chars, i),
    }
}

/// GPT-2's `bytes_to_unicode`.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\u{FFFD}')
        };
    }
    table
}

pub(crate) struct BpeModel {
    pre: PreTokenizer,
    ignore_merges: bool,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(TokenId, TokenId), (u32, TokenId)>,
    byte_to_char: [char; 256],
    char_to_byte: HashMap<char, u8>,
    /// Token of each byte's character.
    byte_tokens: [Option<TokenId>; 256],
}

impl BpeModel {
    pub(crate) fn from_gguf<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        vocab: &Vocab,
    ) -> Result<BpeModel, TokenizerError> {
        let path = gguf.path();
        let (pre, ignore_merges) = match gguf.get_str(KEY_PRE) {
            Ok(name) => (PreTokenizer::from_gguf_name(name).ok_or_else(|| {
                TokenizerError::new(
                    path,
                    format!(
                        "metadata key '{KEY_PRE}' = \"{name}\" is not a known pre-tokenizer \
                         (known: qwen2, llama-bpe/llama3, dbrx, smaug-bpe, glm4, gpt2/olmo, default)"
                    ),
                )
            })?, PreTokenizer::ignores_merges(name)),
            // llama.cpp falls back to its default chain (and warns that quality may suffer).
            Err(e) if e.is_missing_key() => (PreTokenizer::Default, false),
            Err(e) => return Err(gguf_err(e)),
        };
        let lines = gguf.get_str_array(KEY_MERGES).map_err(gguf_err)?;
        let mut merges = HashMap::with_capacity(lines.len());
        for (rank, line) in lines.iter().enumerate() {
            let bad = |why: &str| {
                TokenizerError::new(
                    path,
                    format!("metadata key '{KEY_MERGES}[{rank}]' = {line:?}: {why}"),
                )
            };
            let (left, right) = line
                .split_once(' ')
                .ok_or_else(|| bad("expected two tokens separated by a space"))?;
            let id = |t: &str| {
                vocab
                    .id(t)
                    .ok_or_else(|| bad(&format!("{t:?} is not in '{KEY_TOKENS}'")))
            };
            let key = (id(left)?, id(right)?);
            let merged = id(&format!("{left}{right}"))?;
            // A repeated merge keeps its first (best) rank.
            merges.entry(key).or_insert((rank as u32, merged));
        }
        let byte_to_char = byte_to_char_table();
        let char_to_byte = byte_to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab.id(byte_to_char[b].encode_utf8(&mut [0u8; 4]));
        }
        Ok(BpeModel {
            pre,
            ignore_merges,
            merges,
            byte_to_char,
            char_to_byte,
            byte_tokens,
        })
    }

    pub(crate) fn pre_name(&self) -> &'static str {
        self.pre.name()
    }

    /// Encodes one fragment of plain text, appending to `out`.
    pub(crate) fn encode(
        &self,
        vocab: &Vocab,
        text: &str,
        out: &mut Vec<TokenId>,
    ) -> Result<(), String> {
        let mut symbols: Vec<TokenId> = Vec::new();
        for word in self.pre.split(text) {
            if self.ignore_merges {
                let mapped: String = word
                    .bytes()
                    .map(|b| self.byte_to_char[b as usize])
                    .collect();
                if let Some(id) = vocab.id(&mapped) {
                    out.push(id);
                    continue;
                }
            }
            symbols.clear();
            for b in word.bytes() {
                let id = self.byte_tokens[b as usize].ok_or_else(|| {
                    format!(
                        "cannot encode {word:?}: byte 0x{b:02X} ({:?}) has no token",
                        self.byte_to_char[b as usize]
                    )
                })?;
                symbols.push(id);
            }
            // Lowest rank first, leftmost on ties. Words are short, so a scan per merge is fine.
            loop {
                let best = symbols
                    .windows(2)
                    .enumerate()
                    .filter_map(|(at, pair)| {
                        self.merges
                            .get(&(pair[0], pair[1]))
                            .map(|&(rank, id)| (rank, at, id))
                    })
                    .min();
                let Some((_, at, merged)) = best else { break };
                symbols[at] = merged;
                symbols.remove(at + 1);
            }
            out.extend_from_slice(&symbols);
        }
        Ok(())
    }

    /// Bytes of a NORMAL token: its characters mapped back through `bytes_to_unicode`
    /// (a character outside the map stands for its own UTF-8).
    pub(crate) fn token_bytes<'a>(&self, text: &'a str) -> Cow<'a, [u8]> {
        let mut bytes = Vec::with_capacity(text.len());
        for c in text.chars() {
            match self.char_to_byte.get(&c) {
                Some(&b) => bytes.push(b),
                None => bytes.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
            }
        }
        Cow::Owned(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pre: PreTokenizer, text: &str) -> Vec<&str> {
        let parts = pre.split(text);
        assert_eq!(parts.concat(), text, "pre-tokens must cover the text");
        parts
    }

    // Expectations worked out by hand from the regexes in the PreTokenizer docs.
    #[test]
    fn qwen2_pattern() {
        let q = PreTokenizer::Qwen2;
        assert_eq!(split(q, "Hello world"), ["Hello", " world"]);
        assert_eq!(split(q, "I'LL don't"), ["I", "'LL", " don", "'t"]);
        assert_eq!(split(q, "abc 1234"), ["abc", " ", "1", "2", "3", "4"]);
        assert_eq!(split(q, "a   b"), ["a", "  ", " b"]);
        assert_eq!(split(q, "end   "), ["end", "   "]);
        assert_eq!(split(q, "x \n\n y"), ["x", " \n\n", " y"]);
        assert_eq!(split(q, "hi!!\n\nthere"), ["hi", "!!\n\n", "there"]);
        assert_eq!(split(q, " ?! ok"), [" ?!", " ok"]);
        assert_eq!(split(q, "\tTab"), ["\tTab"]);
        assert_eq!(split(q, "(x)"), ["(x", ")"]);
        // Combining marks are not \p{L}: the mark is an "other" character.
        assert_eq!(split(q, "e\u{301}t"), ["e", "\u{301}t"]);
        assert_eq!(split(q, "日本語"), ["日本語"]);
    }

    #[test]
    fn llama3_groups_three_digits() {
        assert_eq!(split(PreTokenizer::Llama3, "1234567"), ["123", "456", "7"]);
    }

    #[test]
    fn gpt2_pattern() {
        let g = PreTokenizer::Gpt2;
        assert_eq!(
            split(g, "Hello world  12 ab's !?"),
            ["Hello", " world", " ", " 12", " ab", "'s", " !?"]
        );
        assert_eq!(split(g, "I'LL"), ["I", "'", "LL"]);
        assert_eq!(split(g, "a\n\nb  "), ["a", "\n", "\n", "b", "  "]);
    }

    #[test]
    fn default_chain_cuts_each_pieces_of_the_one_before() {
        let d = PreTokenizer::Default;
        assert_eq!(split(d, "x $+ y"), ["x", " ", "$+", " y"]);
        assert_eq!(split(d, "'s"), ["'", "s"]);
        assert_eq!(split(d, " 1"), [" ", "1"]);
        assert_eq!(split(d, "1234567"), ["123", "456", "7"]);
        assert_eq!(split(d, "ab12345, c"), ["ab", "123", "45", ",", " c"]);
        assert_eq!(split(d, "a\u{00BF}b `q"), ["a", "\u{00BF}", "b", " `", "q"]);
        assert_eq!(split(d, ""), Vec::<&str>::new());
    }

    #[test]
    fn only_the_llama3_family_ignores_merges() {
        for name in ["llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral"] {
            assert!(PreTokenizer::ignores_merges(name), "{name}");
        }
        for name in ["dbrx", "smaug-bpe", "glm4", "qwen2", "gpt2", "default"] {
            assert!(!PreTokenizer::ignores_merges(name), "{name}");
        }
    }

    #[test]
    fn byte_map_is_gpt2s() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(t[b'\n' as usize], '\u{10A}'); // Ċ
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[0xAD], '\u{143}');
        let mut sorted = t.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256, "the map is a bijection");
    }
}
