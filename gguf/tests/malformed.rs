//! Malformed input: every truncation of a valid file, seeded random corruption, and
//! hand-built headers with absurd counts, lengths, offsets and types. The reader must
//! return an error (with a message naming the key, tensor or offset), never panic, never
//! hand out a tensor view outside the buffer, and never allocate more than the input size.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

use memra_gguf::{Gguf, GgufError};

// ---- allocation accounting (per thread, so parallel tests do not mix) ----

struct CountingAlloc;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(n: usize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get().saturating_add(n);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn note_free(n: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(n)));
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping only
// touches const-initialized thread-locals, which never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note_free(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note_free(layout.size());
            note_alloc(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Peak bytes allocated on this thread while `f` runs, above what was live before.
fn peak_allocation<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    (r, PEAK.with(Cell::get).saturating_sub(base))
}

/// A successful parse allocates at most the input's size. A failed one may add its error
/// message, whose untrusted parts (keys, names) are cut short.
fn allocation_limit(input_len: usize, failed: bool) -> usize {
    input_len + if failed { ERROR_MESSAGE_ALLOWANCE } else { 0 }
}
const ERROR_MESSAGE_ALLOWANCE: usize = 1024;

/// Parses `bytes` and checks the reader's promises. Returns the parse error, if any, or a
/// description of a broken promise (panic, view outside the buffer, huge allocation).
fn parse_checked(bytes: &[u8]) -> Result<Result<(), GgufError>, String> {
    let (outcome, peak) = peak_allocation(|| catch_unwind(AssertUnwindSafe(|| Gguf::parse(bytes))));
    let parsed = outcome.map_err(|_| "the reader panicked".to_string())?;
    if peak > allocation_limit(bytes.len(), parsed.is_err()) {
        return Err(format!("allocated {peak} bytes for a {}-byte input", bytes.len()));
    }
    match parsed {
        Err(e) => {
            if e.to_string().is_empty() || e.offset().is_none() {
                return Err(format!("error without message or offset: {e:?}"));
            }
            Ok(Err(e))
        }
        Ok(f) => {
            for t in f.tensors() {
                let end = f.data_offset() as u128 + t.offset as u128 + t.n_bytes as u128;
                if end > bytes.len() as u128 || f.tensor_data(t).len() as u64 != t.n_bytes {
                    return Err(format!("tensor '{}' view is outside the buffer", t.name));
                }
            }
            Ok(Ok(()))
        }
    }
}

fn expect_error(bytes: &[u8], needles: &[&str]) {
    match parse_checked(bytes) {
        Err(broken) => panic!("{broken}"),
        Ok(Ok(())) => panic!("parsed OK, expected an error containing {needles:?}"),
        Ok(Err(e)) => {
            let msg = e.to_string();
            for needle in needles {
                assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
            }
        }
    }
}

// ---- truncation and random corruption of a valid file ----

#[test]
fn every_truncation_of_a_valid_file_is_an_error() {
    let bytes = common::fixture_bytes();
    let f = Gguf::parse(&bytes[..]).unwrap();
    // The writer pads after the last tensor; cuts inside that padding lose nothing.
    let needed =
        f.data_offset() + f.tensors().iter().map(|t| t.offset + t.n_bytes).max().unwrap();
    assert!(needed <= bytes.len() as u64);
    for cut in 0..=bytes.len() {
        let result = parse_checked(&bytes[..cut]).unwrap_or_else(|broken| {
            panic!("truncated at {cut} of {}: {broken}", bytes.len())
        });
        if (cut as u64) < needed {
            let e = result.expect_err(&format!("truncated at {cut} should fail"));
            let msg = e.to_string();
            assert!(
                msg.contains("end of file") || msg.contains("left"),
                "cut {cut}: {msg}"
            );
        } else {
            assert!(result.is_ok(), "cut {cut} keeps every tensor: {result:?}");
        }
    }
}

#[test]
fn random_corruption_never_panics() {
    let seed = common::seed("random_corruption_never_panics");
    let iterations: u64 = std::env::var("MEMRA_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let mut rng = common::Rng::new(seed);
    let original = common::fixture_bytes();
    let header_len = Gguf::parse(&original[..]).unwrap().data_offset();
    let interesting: [u64; 8] =
        [0, 1, 0xFF, 0xFFFF_FFFF, 1 << 32, i64::MAX as u64, u64::MAX, original.len() as u64];
    let (mut ok, mut err) = (0u64, 0u64);
    for iteration in 0..iterations {
        let mut bytes = original.clone();
        for _ in 0..1 + rng.below(4) {
            // Mostly the header: corrupting tensor data alone cannot break parsing.
            let span = if rng.below(8) == 0 { bytes.len() as u64 } else { header_len };
            let at = rng.below(span) as usize;
            match rng.below(4) {
                0 => bytes[at] ^= 1 << rng.below(8),
                1 => bytes[at] = rng.next_u64() as u8,
                2 => bytes[at] = 0xFF,
                _ => {
                    let value = interesting[rng.below(8) as usize].to_le_bytes();
                    let n = value.len().min(bytes.len() - at);
                    bytes[at..at + n].copy_from_slice(&value[..n]);
                }
            }
        }
        if rng.below(16) == 0 {
            bytes.truncate(rng.below(bytes.len() as u64) as usize);
        }
        match parse_checked(&bytes) {
            Err(broken) => panic!("seed {seed}, iteration {iteration}: {broken}"),
            Ok(Ok(())) => ok += 1,
            Ok(Err(_)) => err += 1,
        }
    }
    eprintln!("seed {seed}: {iterations} corrupted files, {ok} still parsed, {err} rejected");
    assert!(err > iterations / 2, "corruption should usually be caught (seed {seed})");
}

// ---- hand-built headers ----

const T_U32: u32 = 4;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const F32: u32 = 0;
const Q4_K: u32 = 12;
const F64: u32 = 28;

/// Little-endian byte builder for GGUF headers.
#[derive(Clone)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn header(version: u32, tensor_count: u64, kv_count: u64) -> Bytes {
        Bytes(b"GGUF".to_vec()).u32(version).u64(tensor_count).u64(kv_count)
    }
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(self, s: &str) -> Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    fn kv_u32(self, key: &str, v: u32) -> Self {
        self.str(key).u32(T_U32).u32(v)
    }
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut b = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            b = b.u64(d);
        }
        b.u32(ty).u64(offset)
    }
    /// Zero padding to `align`, then `n` data bytes.
    fn data(mut self, align: usize, n: usize) -> Self {
        let padded = self.0.len().div_ceil(align) * align;
        self.0.resize(padded + n, 0);
        self
    }
}

/// A one-tensor file with the given shape and type id (data sized for 4 bytes/element).
fn one_tensor(dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    Bytes::header(3, 1, 0).tensor("blk.0.x.weight", dims, ty, offset).data(32, 64).0
}

#[test]
fn the_builder_makes_valid_files() {
    // Guards the cases below: each differs from a valid file in one field only.
    let ok = Bytes::header(3, 1, 1).kv_u32("a.b", 1).tensor("t", &[4, 2], F32, 0).data(32, 32);
    assert!(matches!(parse_checked(&ok.0), Ok(Ok(()))));
    assert!(matches!(parse_checked(&one_tensor(&[4], F32, 0)), Ok(Ok(()))));
    assert!(matches!(parse_checked(&Bytes::header(3, 0, 0).0), Ok(Ok(()))));
}

#[test]
fn bad_magic_version_and_endianness() {
    expect_error(b"", &["end of file", "magic"]);
    expect_error(b"GGUF\x03", &["end of file", "version"]);
    expect_error(&Bytes(b"GGML".to_vec()).u32(3).u64(0).u64(0).0, &["not a GGUF file", "GGML"]);
    expect_error(&Bytes::header(0, 0, 0).0, &["version 0"]);
    expect_error(&Bytes::header(1, 0, 0).0, &["version 1"]);
    expect_error(&Bytes::header(4, 0, 0).0, &["version 4"]);
    expect_error(&Bytes::header(3u32.swap_bytes(), 0, 0).0, &["big-endian"]);
}

#[test]
fn absurd_counts_are_rejected_before_allocating() {
    expect_error(&Bytes::header(3, u64::MAX, 0).0, &["tensor count 18446744073709551615"]);
    expect_error(&Bytes::header(3, 0, u64::MAX / 2).0, &["metadata key count"]);
    let second_key_cut = Bytes::header(3, 0, 2).kv_u32("a", 1).u64(5).raw(b"ab").0;
    expect_error(&second_key_cut, &["metadata key #1", "string length 5"]);
    let one_of_two = Bytes::header(3, 2, 0).tensor("only.one", &[4], F32, 0).data(32, 16).0;
    expect_error(&one_of_two, &["tensor count 2 is impossible"]);
}

#[test]
fn absurd_string_lengths() {
    let key_len = Bytes::header(3, 0, 1).u64(u64::MAX).raw(&[0; 16]).0;
    expect_error(&key_len, &["metadata key #0", "string length 18446744073709551615"]);
    let value = Bytes::header(3, 0, 1).str("general.name").u32(T_STRING).u64(u64::MAX).0;
    expect_error(&value, &["'general.name'", "string length"]);
    let long_key = "k".repeat(65536);
    expect_error(&Bytes::header(3, 0, 1).kv_u32(&long_key, 1).0, &["65536 bytes", "65535"]);
    let ok_key = "k".repeat(65535);
    assert!(matches!(parse_checked(&Bytes::header(3, 0, 1).kv_u32(&ok_key, 1).0), Ok(Ok(()))));
    let bad_utf8 = Bytes::header(3, 0, 1).u64(2).raw(&[0xC3, 0x28]).u32(T_U32).u32(0).0;
    expect_error(&bad_utf8, &["UTF-8", "#0"]);
    let long_name = "n".repeat(64);
    let b = Bytes::header(3, 1, 0).tensor(&long_name, &[1], F32, 0).data(32, 4).0;
    expect_error(&b, &["64 bytes", "at most 63"]);
}

#[test]
fn absurd_arrays() {
    let arr = |elem: u32, count: u64| {
        Bytes::header(3, 0, 1).str("tokenizer.ggml.tokens").u32(T_ARRAY).u32(elem).u64(count)
    };
    expect_error(&arr(T_STRING, 1 << 40).0, &["'tokenizer.ggml.tokens'", "array of 1099511627776"]);
    expect_error(&arr(T_U64, u64::MAX).0, &["'tokenizer.ggml.tokens'", "UINT64"]);
    expect_error(&arr(T_STRING, 2).str("a").u64(u64::MAX).0, &["element 1 of key"]);
    expect_error(&arr(T_ARRAY, 1).u32(T_U32).u64(0).0, &["nested arrays", "tokenizer.ggml.tokens"]);
    expect_error(&arr(13, 0).0, &["unknown array element type 13"]);
    expect_error(&arr(T_BOOL, 3).u8(1).u8(2).u8(0).0, &["element 1 of key", "bool byte is 2"]);
    // An array that fits exactly is fine.
    assert!(matches!(parse_checked(&arr(T_STRING, 2).str("a").str("").0), Ok(Ok(()))));
}

#[test]
fn bad_value_types_and_bools() {
    let b = Bytes::header(3, 0, 1).str("x.flag").u32(13).u32(0).0;
    expect_error(&b, &["'x.flag'", "unknown value type 13"]);
    let b = Bytes::header(3, 0, 1).str("x.flag").u32(u32::MAX).0;
    expect_error(&b, &["unknown value type 4294967295"]);
    let b = Bytes::header(3, 0, 1).str("x.flag").u32(T_BOOL).u8(2).0;
    expect_error(&b, &["'x.flag'", "bool byte is 2"]);
    let b = Bytes::header(3, 0, 2).kv_u32("dup", 1).kv_u32("dup", 2).0;
    expect_error(&b, &["duplicate metadata key 'dup'"]);
}

#[test]
fn bad_alignment() {
    let with = |b: Bytes| b.tensor("t", &[8], F32, 0).data(64, 32).0;
    let kv = || Bytes::header(3, 1, 1).str("general.alignment");
    expect_error(&with(kv().u32(T_U32).u32(0)), &["general.alignment = 0", "power of two"]);
    expect_error(&with(kv().u32(T_U32).u32(3)), &["general.alignment = 3"]);
    expect_error(&with(kv().u32(T_U64).u64(64)), &["general.alignment", "UINT32", "UINT64"]);
    assert!(matches!(parse_checked(&with(kv().u32(T_U32).u32(64))), Ok(Ok(()))));
    // With alignment 64 the data starts at 64, not 32.
    let f = Gguf::parse(with(kv().u32(T_U32).u32(64))).unwrap();
    assert_eq!((f.alignment(), f.data_offset()), (64, 128));
}

#[test]
fn bad_tensor_shapes_and_types() {
    expect_error(&one_tensor(&[1, 1, 1, 1, 1], F32, 0), &["'blk.0.x.weight'", "5 dimensions"]);
    expect_error(&one_tensor(&[], F32, 0), &["'blk.0.x.weight'", "0 dimensions"]);
    expect_error(&one_tensor(&[4, 0], F32, 0), &["'blk.0.x.weight'", "dimension 1 is 0"]);
    expect_error(&one_tensor(&[1 << 63], F32, 0), &["dimension 0", "negative"]);
    expect_error(&one_tensor(&[1 << 32, 1 << 32], F32, 0), &["'blk.0.x.weight'", "overflows"]);
    expect_error(&one_tensor(&[1 << 62], F64, 0), &["'blk.0.x.weight'", "byte size", "overflows"]);
    expect_error(&one_tensor(&[4], 4, 0), &["'blk.0.x.weight'", "unknown ggml type id 4"]);
    expect_error(&one_tensor(&[4], 1000, 0), &["unknown ggml type id 1000"]);
    expect_error(&one_tensor(&[100], Q4_K, 0), &["'blk.0.x.weight'", "block size 256"]);
}

#[test]
fn bad_tensor_offsets() {
    expect_error(&one_tensor(&[4], F32, 4), &["'blk.0.x.weight'", "not a multiple of the alignment 32"]);
    expect_error(&one_tensor(&[4], F32, 64), &["'blk.0.x.weight'", "extends past end of file"]);
    expect_error(&one_tensor(&[32], F32, 0), &["'blk.0.x.weight'", "128 bytes", "file is"]);
    expect_error(
        &one_tensor(&[4], F32, u64::MAX - 31),
        &["'blk.0.x.weight'", "extends past end of file"],
    );
    let two = |second_offset| {
        Bytes::header(3, 2, 0)
            .tensor("a", &[16], F32, 0)
            .tensor("b", &[8], F32, second_offset)
            .data(32, 128)
            .0
    };
    expect_error(&two(32), &["'a'", "'b'", "overlap"]);
    assert!(matches!(parse_checked(&two(64)), Ok(Ok(()))));
    let dup = Bytes::header(3, 2, 0).tensor("a", &[8], F32, 0).tensor("a", &[8], F32, 32);
    expect_error(&dup.data(32, 64).0, &["duplicate tensor name 'a'"]);
}

#[test]
fn errors_carry_offsets() {
    // The unknown type id sits right after the key: 24-byte header + 8 + 6 ("x.flag").
    let b = Bytes::header(3, 0, 1).str("x.flag").u32(13).u32(0).0;
    let e = Gguf::parse(&b[..]).unwrap_err();
    assert_eq!(e.offset(), Some(38));
    assert!(e.to_string().starts_with("byte 0x26: "), "{e}");
}

// ---- adversarial inputs that maximize what the reader keeps per input byte ----

/// Parses `bytes`, which must be valid, and returns the peak allocation.
fn parse_ok_peak(bytes: &[u8]) -> usize {
    let (f, peak) = peak_allocation(|| Gguf::parse(bytes).map(|f| f.metadata().len()));
    f.unwrap_or_else(|e| panic!("{e}"));
    assert!(peak <= bytes.len(), "allocated {peak} bytes for a {}-byte input", bytes.len());
    peak
}

#[test]
fn a_million_empty_strings_stay_within_the_input_size() {
    let n = 1_000_000;
    let mut b = Bytes::header(3, 0, 1).str("tokenizer.ggml.tokens").u32(T_ARRAY).u32(T_STRING).u64(n);
    b.0.resize(b.0.len() + 8 * n as usize, 0);
    let peak = parse_ok_peak(&b.0);
    let f = Gguf::parse(&b.0[..]).unwrap();
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), n as usize);
    assert!(tokens.iter().all(str::is_empty));
    assert!(peak >= 4 * n as usize, "one offset per element expected, peak {peak}");
    // The same with a last element longer than the bytes left is an error, within the bound.
    let last = b.0.len() - 8;
    b.0[last] = 1;
    expect_error(&b.0, &["element 999999 of key 'tokenizer.ggml.tokens'"]);
}

#[test]
fn many_tiny_keys_stay_within_the_input_size() {
    let n = 100_000u64;
    let mut b = Bytes::header(3, 0, n);
    let names: Vec<String> = (0..n).map(|i| format!("{i:x}")).collect();
    for name in &names {
        b = b.str(name).u32(0).u8(name.len() as u8);
    }
    parse_ok_peak(&b.0);
    let f = Gguf::parse(&b.0[..]).unwrap();
    assert_eq!(f.metadata().len(), n as usize);
    for name in names.iter().step_by(997) {
        assert_eq!(f.get_u32(name).unwrap(), name.len() as u32, "{name}");
    }
    assert!(f.get("zz").is_none());
    // 1-byte names: a duplicate among 256 keys is found and named.
    let mut b = Bytes::header(3, 0, 257);
    for i in 0..=255u8 {
        b = b.u64(1).u8(i).u32(0).u8(1);
    }
    let b = b.u64(1).u8(b'q').u32(0).u8(1);
    // Bytes >= 0x80 alone are not UTF-8, so the first such key fails first.
    expect_error(&b.0, &["metadata key #128", "UTF-8"]);
    let mut ascii = Bytes::header(3, 0, 129);
    for i in 0..128u8 {
        ascii = ascii.u64(1).u8(i).u32(0).u8(1);
    }
    expect_error(&ascii.u64(1).u8(b'q').u32(0).u8(1).0, &["duplicate metadata key 'q'"]);
}

#[test]
fn huge_byte_and_bool_arrays_stay_within_the_input_size() {
    let n = 4 << 20;
    for ty in [0, T_BOOL] {
        let mut b = Bytes::header(3, 0, 1).str("x.a").u32(T_ARRAY).u32(ty).u64(n);
        b.0.resize(b.0.len() + n as usize, 1);
        let peak = parse_ok_peak(&b.0);
        assert!(peak < 1024, "numeric arrays are borrowed, yet {peak} bytes were allocated");
        let f = Gguf::parse(&b.0[..]).unwrap();
        assert_eq!(f.get_array("x.a").unwrap().len(), n as usize);
    }
}

#[test]
fn minimal_tensor_infos_stay_within_the_input_size() {
    // 1-byte and empty names, one dimension, I8 (1 byte each), alignment 1: the smallest
    // tensor table per tensor that the format allows.
    const I8: u32 = 24;
    let n = 60_000u64;
    let mut b = Bytes::header(3, n, 1).str("general.alignment").u32(T_U32).u32(1);
    for i in 0..n {
        let name = if i == 0 { String::new() } else { format!("{i:x}") };
        b = b.tensor(&name, &[1], I8, i);
    }
    let b = b.data(1, n as usize);
    parse_ok_peak(&b.0);
    let f = Gguf::parse(&b.0[..]).unwrap();
    assert_eq!(f.tensors().len(), n as usize);
    let t = f.tensor("ea5f").unwrap();
    assert_eq!((t.name, t.offset, t.n_bytes, t.dims.as_slice()), ("ea5f", 0xea5f, 1, &[1][..]));
    assert_eq!(f.tensor("").unwrap().offset, 0);
    // The same table with two tensors sharing a byte is rejected within the bound.
    let mut b = Bytes::header(3, n, 1).str("general.alignment").u32(T_U32).u32(1);
    for i in 0..n {
        b = b.tensor(&format!("{i:x}"), &[1], I8, i.min(n - 2));
    }
    expect_error(&b.data(1, n as usize).0, &["overlap"]);
}

#[test]
fn allocation_accounting_sees_allocations() {
    // Guards `parse_checked`: the counter must notice a large allocation.
    let (v, peak) = peak_allocation(|| vec![1u8; 1 << 20]);
    assert!(peak >= 1 << 20 && v.len() == 1 << 20, "peak {peak}");
}
