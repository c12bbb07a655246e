#!/usr/bin/env python3
"""Write the reference tokenizations that tests/tests/tokenizer.rs compares memra's tokenizer with.

    tests/data/tokenizer/gemma3.json   SentencePiece (real `sentencepiece` library) on the vocab of
                                       the real Gemma 3 270M GGUF
    tests/data/tokenizer/bpe.json      HF `tokenizers` byte-level BPE on a tiny synthetic vocab;
                                       the Rust test writes that vocab into a GGUF with GgufWriter

Needs gguf, sentencepiece, protobuf, tokenizers. Usage:
    python -m venv V && V/bin/pip install gguf==0.19.0 numpy sentencepiece protobuf tokenizers
    V/bin/python scripts/make-tokenizer-golden.py [path/to/gemma-3-270m-q4_k_m.gguf]
(default path: $MEMRA_GEMMA3_GGUF, else the memra cache).

## gemma3: how the SentencePiece model is rebuilt from the GGUF

The GGUF holds no ModelProto, only tokens / scores / token types. We build one that behaves as
llama.cpp's SPM tokenizer (llm_tokenizer_spm) does on this file:
- model_type BPE (SentencePiece BPE merges the adjacent pair whose merged piece has the highest
  score; ties go to the leftmost pair — the same rule as llm_tokenizer_spm), byte_fallback on
  (`<0xXX>` pieces are type BYTE in the GGUF).
- Normalizer "identity" with no precompiled charsmap: llama.cpp applies no NFKC, only the
  ' ' -> U+2581 escape. add_dummy_prefix = `tokenizer.ggml.add_space_prefix` (False in gemma3
  files, so no leading space is added); remove_extra_whitespaces False (llama.cpp keeps runs of
  spaces); escape_whitespaces True.
- Piece types are the GGUF token types (same numbering as SentencePiece). `<unk>` is CONTROL in
  the GGUF but SentencePiece needs exactly one UNKNOWN piece, so it becomes UNKNOWN (unk_id).
- llama.cpp matches USER_DEFINED tokens on the raw text before escaping; SentencePiece matches
  them on the escaped text. So ' ' in user-defined pieces (gemma3 has runs of 2..31 spaces) is
  written as U+2581 in the proto; no piece collides with that. (Text that itself holds U+2581
  next to a space would then match those runs here but not in llama.cpp; the cases hold none.
  A differential fuzz of 25k strings on 2026-12-01 found no other difference.)
- SentencePiece never recognizes CONTROL pieces in text (= parse_special off). For the
  parse_special cases the text is first cut at CONTROL token texts (longest first, as llama.cpp's
  tokenizer_st_partition does) and each piece of plain text is encoded on its own.
- BOS is prepended when `tokenizer.ggml.add_bos_token` is true (add_special), as llama.cpp does.

## bpe: the GPT-2 byte-level BPE reference

A tiny BPE (~700 tokens) is trained here with `tokenizers` on a fixed text (GPT-2 pre-tokenizer,
so digit runs get merges); its vocab and merges are stored in bpe.json with the expected ids for
three pre-tokenizers, each as in the model's tokenizer.json: `qwen2` (Split on the qwen2 regex,
isolated, then ByteLevel without its own regex; single digits), `llama-bpe` (the llama3 regex:
digit groups of 1-3, and ignore_merges: a pre-token that is a whole vocab entry is emitted as
is) and `gpt2` (ByteLevel with its built-in GPT-2 regex).
Special tokens: an instance with them registered gives parse_special=true ids, one without them
gives parse_special=false ids.
"""

import hashlib
import json
import os
import random
import sys

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "data", "tokenizer")
SEED = 20250107

# The fixed test strings; the Rust test also round-trips each through decode.
TEXTS = [
    "",
    " ",
    "   ",
    "Hello world",
    "Hello world!",
    "Water boils at a temperature of",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces   in    between",
    "tabs\tand\t\tmore\ttabs",
    "\tleading tab",
    "new\nline",
    "two\n\nnewlines\n",
    "\n\n\nleading newlines",
    "windows\r\nline\r\nend",
    "mixed \t \n whitespace \n\t ",
    "digits 1234567890 and 3.14159, 1,000,000",
    "2024-01-07T12:34:56Z",
    "café naïve résumé Ångström façade",
    "e\u0301 (combining) vs \u00e9 (precomposed)",
    "Ünïcödé ÀÉÎÕÜ ß ø æ œ",
    "日本語のテキストです。",
    "中文测试，你好世界！",
    "한국어 문장입니다",
    "Привет, мир! Ελληνικά",
    "नमस्ते दुनिया",
    "مرحبا بالعالم",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
    "private use \ue000\U000f0000 and \x01\x02 controls",
    "ﬁ ligature ① circled ＡＢＣ fullwidth",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "don't I'LL we've they're it's",
    "fn main() {\n    println!(\"hi\");\n}\n",
    "<table><tr><td>cell</td></tr></table>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "text<bos>inside<eos>",
    "!!!???...,,,;;;",
    "a\u00a0non-breaking\u3000ideographic space",
]

# Alphabet for seeded random strings: every class the tokenizers treat differently.
RANDOM_ALPHABET = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    + list("0123456789")
    + [" ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\u00a0"]
    + list(".,;:!?'\"()[]{}<>-_/\\@#$%^&*+=~`|")
    + ["'s", "'t", "'re", "'LL", "'d"]
    + list("éèêëàâäçñüöøåßÉÀ")
    + ["e\u0301", "a\u0308"]
    + list("日本語中文字한국어")
    + list("ПриветΕλλνκά")
    + list("नमस्ते")
    + ["😀", "🎉", "👍🏽", "🇫🇷", "𝔘", "\ue000", "\x01", "\U000f0000"]
    + ["<start_of_turn>", "<end_of_turn>", "<bos>", "<table>", "<|im_start|>", "<|im_end|>"]
)


def random_texts(rng, count):
    out = []
    for _ in range(count):
        n = rng.randint(1, 24)
        out.append("".join(rng.choice(RANDOM_ALPHABET) for _ in range(n)))
    return out


def default_model_path():
    if os.environ.get("MEMRA_GEMMA3_GGUF"):
        return os.environ["MEMRA_GEMMA3_GGUF"]
    cache = os.environ.get("MEMRA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "memra"))
    return os.path.join(cache, "models", "gemma-3-270m-q4_k_m.gguf")


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        sys.exit(f"{key} missing from the GGUF")
    return f.contents()


def partition_control(text, control):
    """Cut `text` at occurrences of CONTROL token texts, longest token first (llama.cpp
    tokenizer_st_partition). Returns a list of str (plain text) and int (token id)."""
    frags = [text]
    for tid, piece in control:
        new = []
        for frag in frags:
            if not isinstance(frag, str):
                new.append(frag)
                continue
            while True:
                at = frag.find(piece)
                if at < 0:
                    if frag:
                        new.append(frag)
                    break
                if at > 0:
                    new.append(frag[:at])
                new.append(tid)
                frag = frag[at + len(piece):]
        frags = new
    return frags


def gemma3(path):
    reader = gguf.GGUFReader(path)
    assert field(reader, "tokenizer.ggml.model") == "llama"
    tokens = field(reader, "tokenizer.ggml.tokens")
    scores = field(reader, "tokenizer.ggml.scores")
    types = field(reader, "tokenizer.ggml.token_type")
    bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    unk = int(field(reader, "tokenizer.ggml.unknown_token_id"))
    pad = int(field(reader, "tokenizer.ggml.padding_token_id"))
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token"))
    add_space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix"))

    proto = model_pb2.ModelProto()
    T = model_pb2.ModelProto.SentencePiece.Type
    for i, (piece, score, ty) in enumerate(zip(tokens, scores, types)):
        sp = proto.pieces.add()
        ty = int(ty)
        if i == unk:
            ty = T.UNKNOWN
        if ty == T.USER_DEFINED:
            piece = piece.replace(" ", "\u2581")
        sp.piece = piece
        sp.score = float(score)
        sp.type = ty
    ts = proto.trainer_spec
    ts.model_type = model_pb2.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = True
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = unk, bos, eos, pad
    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.precompiled_charsmap = b""
    ns.add_dummy_prefix = add_space_prefix
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())

    control = [(i, t) for i, t in enumerate(tokens) if int(types[i]) == T.CONTROL]
    control.sort(key=lambda c: (-len(c[1].encode()), c[0]))

    def encode(text, parse_special):
        ids = [bos] if add_bos else []
        frags = partition_control(text, control) if parse_special else [text]
        for frag in frags:
            ids.extend([frag] if isinstance(frag, int) else sp.encode(frag))
        return ids

    rng = random.Random(SEED)
    cases = []
    for text in TEXTS + random_texts(rng, 60):
        cases.append({"text": text, "parse_special": False, "ids": encode(text, False)})
    for text in [t for t in TEXTS if "<" in t] + ["<start_of_turn><end_of_turn>", "<eos>"]:
        cases.append({"text": text, "parse_special": True, "ids": encode(text, True)})

    with open(path, "rb") as f:
        head = hashlib.sha256(f.read()).hexdigest()
    return {
        "about": "Expected ids from SentencePiece (BPE, byte_fallback, identity normalizer) "
        "on the vocab of the Gemma 3 270M GGUF; add_special is on (BOS first). "
        "Written by scripts/make-tokenizer-golden.py.",
        "sentencepiece_version": spm.__version__,
        "model_sha256": head,
        "n_vocab": len(tokens),
        "add_space_prefix": add_space_prefix,
        "cases": cases,
    }


QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TRAIN_TEXT = """
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
Water boils at a temperature of 100 degrees Celsius at sea level; ice melts at 0 degrees.
In 2024, 12345 people visited the museum 678 times. Prices: $3.99, $10.50, 1,000,000.
def main():
    print("hello, world")
    for i in range(10):
        if i % 2 == 0:
            continue
It's a test. I'm sure they're fine, we've seen it, you'll see, he'd know. DON'T SHOUT.
café naïve résumé — 日本語のテキスト 中文测试 你好 Привет мир नमस्ते 😀🎉
\tTabs\tand  double  spaces   and\n\nnewlines\r\nwindows
"""


def pre_tokenizer(regex):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def bpe():
    trainer_tok = Tokenizer(models.BPE())
    # GPT-2's pre-tokenizer keeps digit runs and contractions whole, so the vocab learns merges
    # such as "12" that make the three regexes give different ids.
    trainer_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=1,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainer_tok.train_from_iterator([TRAIN_TEXT] * 3, trainer=trainer)
    state = json.loads(trainer_tok.to_str())
    vocab = state["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    assert all(t is not None for t in tokens)
    # Whole words no merge sequence reaches: only ignore_merges (llama-bpe) emits them whole.
    tokens += [t for t in ["zebra", "\u0120zebra"] if t not in vocab]
    n_plain = len(tokens)
    tokens += BPE_SPECIALS
    # GGUF token types: 1 NORMAL, 3 CONTROL.
    types = [1] * n_plain + [3] * len(BPE_SPECIALS)

    def build(regex, ignore_merges, with_specials):
        tok = Tokenizer(models.BPE(
            vocab={t: i for i, t in enumerate(tokens[:n_plain])},
            merges=[tuple(m.split(" ")) for m in merges],
            ignore_merges=ignore_merges,
        ))
        if regex is None:  # GPT-2: ByteLevel's own regex
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizer(regex)
        tok.decoder = decoders.ByteLevel()
        if with_specials:
            added = tok.add_special_tokens(BPE_SPECIALS)
            assert added == len(BPE_SPECIALS)
            for i, s in enumerate(BPE_SPECIALS):
                assert tok.token_to_id(s) == n_plain + i
        return tok

    rng = random.Random(SEED + 1)
    texts = [t.replace("<start_of_turn>", "<|im_start|>").replace("<end_of_turn>", "<|im_end|>")
             for t in TEXTS] + ["zebra", "a zebra crossing"] + random_texts(rng, 60)
    configs = []
    for pre, regex, ignore_merges in [
        ("qwen2", QWEN2_REGEX, False),
        ("llama-bpe", LLAMA3_REGEX, True),
        ("gpt2", None, False),
    ]:
        plain = build(regex, ignore_merges, False)
        special = build(regex, ignore_merges, True)
        cases = []
        for text in texts:
            cases.append({"text": text, "parse_special": False,
                          "ids": plain.encode(text, add_special_tokens=False).ids})
            if "<|" in text:
                cases.append({"text": text, "parse_special": True,
                              "ids": special.encode(text, add_special_tokens=False).ids})
        configs.append({"pre": pre, "cases": cases})
    return {
        "about": "Expected ids from HF tokenizers byte-level BPE on this vocab/merges with the "
        "named pre-tokenizer regex. Written by scripts/make-tokenizer-golden.py.",
        "tokenizers_version": tokenizers.__version__,
        "tokens": tokens,
        "token_types": types,
        "merges": merges,
        "eos_token_id": tokens.index("<|endoftext|>"),
        "configs": configs,
    }


def write(name, data):
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    # One case per line so that a change shows up as a readable diff.
    def dump(value, indent):
        pad = " " * indent
        def nested(v):
            return isinstance(v, list) and v and isinstance(v[0], dict)

        if isinstance(value, dict) and any(nested(v) for v in value.values()):
            items = [f'{pad} {json.dumps(k)}: {dump(v, indent + 1)}' for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if nested(value):
            items = [pad + " " + dump(v, indent + 1) for v in value]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]"
        return json.dumps(value, ensure_ascii=True, separators=(",", ":"))

    with open(path, "w", encoding="utf-8") as f:
        f.write(dump(data, 0) + "\n")
    json.load(open(path, encoding="utf-8"))
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else default_model_path()
    write("gemma3.json", gemma3(path))
    write("bpe.json", bpe())


if __name__ == "__main__":
    main()
