//! Writer → reader round trips: every metadata type and array type, several alignments,
//! tensors of several types read back byte-identical; and the writer's own refusals.

mod common;

use common::Rng;
use memra_gguf::quant;
use memra_gguf::{GgmlType, Gguf, GgufFile, GgufWriter, MetaArray, MetaArrayRef, MetaValue, MetaValueRef};

fn every_metadata_type() -> Vec<(String, MetaValue)> {
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let pairs: Vec<(&str, MetaValue)> = vec![
        ("t.u8", MetaValue::U8(255)),
        ("t.i8", MetaValue::I8(-128)),
        ("t.u16", MetaValue::U16(65535)),
        ("t.i16", MetaValue::I16(-32768)),
        ("t.u32", MetaValue::U32(u32::MAX)),
        ("t.i32", MetaValue::I32(i32::MIN)),
        ("t.f32", MetaValue::F32(-1.5e-7)),
        ("t.bool.true", MetaValue::Bool(true)),
        ("t.bool.false", MetaValue::Bool(false)),
        ("t.str", MetaValue::Str("Grüße, ▁world\n\"quoted\"".into())),
        ("t.str.empty", MetaValue::Str(String::new())),
        ("t.u64", MetaValue::U64(u64::MAX)),
        ("t.i64", MetaValue::I64(i64::MIN)),
        ("t.f64", MetaValue::F64(std::f64::consts::PI)),
        ("a.u8", MetaArray::U8(vec![0, 1, 255]).into()),
        ("a.i8", MetaArray::I8(vec![-1, 0, 127]).into()),
        ("a.u16", MetaArray::U16(vec![1, 65535]).into()),
        ("a.i16", MetaArray::I16(vec![-2, 2]).into()),
        ("a.u32", MetaArray::U32(vec![7; 5]).into()),
        ("a.i32", MetaArray::I32(vec![i32::MIN, i32::MAX]).into()),
        ("a.f32", MetaArray::F32(vec![0.0, -0.0, f32::MAX, f32::MIN_POSITIVE]).into()),
        ("a.bool", MetaArray::Bool(vec![true, false, true]).into()),
        ("a.str", MetaArray::Str(s(&["a", "", "▁b c", "<0x0A>"])).into()),
        ("a.u64", MetaArray::U64(vec![u64::MAX, 0]).into()),
        ("a.i64", MetaArray::I64(vec![i64::MIN, -1]).into()),
        ("a.f64", MetaArray::F64(vec![1e300, -1e-300]).into()),
        ("a.empty.str", MetaArray::Str(vec![]).into()),
        ("a.empty.u32", MetaArray::U32(vec![]).into()),
    ];
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

#[test]
fn every_metadata_type_round_trips_in_order() {
    let pairs = every_metadata_type();
    let mut w = GgufWriter::new();
    for (k, v) in &pairs {
        w.add_meta(k.as_str(), v.clone());
    }
    let bytes = w.to_bytes().unwrap();
    let f = Gguf::parse(&bytes[..]).unwrap();
    let read: Vec<(String, MetaValue)> =
        f.metadata().iter().map(|(k, v)| (k.to_string(), v.into_owned())).collect();
    assert_eq!(read, pairs);
    // Every borrowed form agrees with its owned copy, and lookup by key finds each pair.
    for (k, v) in &pairs {
        assert_eq!(f.get(k).unwrap(), *v, "{k}");
    }
    let Some(MetaValueRef::Array(MetaArrayRef::Str(strs))) = f.get("a.str") else { panic!() };
    assert_eq!(strs, ["a", "", "▁b c", "<0x0A>"]);
    assert_eq!((strs.get(2), strs.get(4)), (Some("▁b c"), None));
    assert!(f.tensors().is_empty());
    // Floats are compared bitwise by PartialEq above except -0.0 == 0.0; check the sign too.
    let Some(MetaValueRef::Array(MetaArrayRef::F32(v))) = f.get("a.f32") else { panic!() };
    assert!(v.get(1).unwrap().is_sign_negative());
}

/// Tensors of several types and odd sizes; returns (name, dims, type, bytes).
fn tensors(rng: &mut Rng) -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, dims, ty) in [
        ("a.f32", vec![3u64], GgmlType::F32),
        ("b.f16", vec![5, 3], GgmlType::F16),
        ("c.bf16", vec![7, 1, 2], GgmlType::BF16),
        ("d.q8_0", vec![32, 3], GgmlType::Q8_0),
        ("e.q4_k", vec![256, 2, 1, 2], GgmlType::Q4_K),
        ("f.q6_k", vec![256], GgmlType::Q6_K),
        ("g.i8", vec![1], GgmlType::I8),
    ] {
        let n = ty.row_bytes(dims[0]).unwrap() * dims[1..].iter().product::<u64>();
        out.push((name.to_string(), dims, ty, rng.bytes(n as usize)));
    }
    out
}

#[test]
fn tensors_read_back_byte_identical_at_several_alignments() {
    let seed = common::seed("tensors_read_back_byte_identical_at_several_alignments");
    let mut rng = Rng::new(seed);
    for alignment in [1u32, 8, 32, 64, 256, 4096] {
        let expected = tensors(&mut rng);
        let mut w = GgufWriter::new().with_alignment(alignment);
        w.add_meta("general.architecture", "tiny");
        for (name, dims, ty, data) in &expected {
            w.add_tensor_bytes(name.as_str(), dims, *ty, data.clone()).unwrap();
        }
        let bytes = w.to_bytes().unwrap();
        let f = Gguf::parse(&bytes[..]).unwrap();
        let ctx = format!("alignment {alignment}, seed {seed}");
        assert_eq!(f.alignment(), alignment, "{ctx}");
        let recorded = f.get("general.alignment").map(MetaValueRef::into_owned);
        let expected_key = (alignment != 32).then_some(MetaValue::U32(alignment));
        assert_eq!(recorded, expected_key, "{ctx}");
        assert_eq!(f.data_offset() % u64::from(alignment), 0, "{ctx}");
        assert_eq!(bytes.len() as u64 % u64::from(alignment), 0, "{ctx}");
        assert_eq!(f.tensors().len(), expected.len(), "{ctx}");
        for (t, (name, dims, ty, data)) in f.tensors().iter().zip(&expected) {
            assert_eq!((t.name, t.dims.as_slice(), t.ggml_type), (name.as_str(), &dims[..], *ty), "{ctx}");
            assert_eq!(t.offset % u64::from(alignment), 0, "{ctx} {name}");
            assert_eq!(f.tensor_data(t), &data[..], "{ctx} {name}");
        }
    }
}

#[test]
fn f32_tensors_are_encoded_through_quant() {
    let seed = common::seed("f32_tensors_are_encoded_through_quant");
    let mut rng = Rng::new(seed);
    let values: Vec<f32> = (0..512).map(|_| rng.f32_sym() * 3.0).collect();
    let mut w = GgufWriter::new();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_K] {
        w.add_tensor_f32(format!("t.{ty}"), &[256, 2], ty, &values).unwrap();
    }
    let bytes = w.to_bytes().unwrap();
    let f = Gguf::parse(&bytes[..]).unwrap();
    for t in f.tensors() {
        let data = f.tensor_data(t);
        assert_eq!(data, quant::quantize(t.ggml_type, &values).unwrap(), "{} seed {seed}", t.name);
        let back = quant::dequantize(t.ggml_type, data, 512).unwrap();
        let max_err = back.iter().zip(&values).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        // |values| < 3: half an ulp (F16, BF16) or half a quant step, plus scale rounding.
        let tolerance = match t.ggml_type {
            GgmlType::F32 => 0.0,
            GgmlType::F16 => 2f32.powi(-10),
            GgmlType::BF16 => 2f32.powi(-7),
            GgmlType::Q8_0 => 0.5 * 3.0 / 127.0 + 3.0 * 2f32.powi(-11),
            _ => 0.75 * 6.0 / 15.0,
        };
        assert!(max_err <= tolerance, "{}: max error {max_err} > {tolerance}, seed {seed}", t.name);
    }
}

#[test]
fn write_file_then_open() {
    let dir = std::env::temp_dir().join(format!("memra-gguf-writer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("fixture.gguf");
    common::fixture_writer().write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.bytes(), common::fixture_bytes());
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, ["fixture.gguf"], "the temporary file was renamed away");
    std::fs::remove_dir_all(&dir).unwrap();

    let e = common::fixture_writer().write_file(dir.join("no/such/dir.gguf")).unwrap_err();
    assert!(e.to_string().contains("dir.gguf"), "{e}");
}

#[test]
fn writer_refuses_what_the_reader_would_reject() {
    let refuse = |w: &GgufWriter, needle: &str| {
        let e = w.to_bytes().unwrap_err().to_string();
        assert!(e.contains(needle), "expected '{needle}' in: {e}");
    };
    let mut w = GgufWriter::new();
    w.add_meta("k", 1u32).add_meta("k", 2u32);
    refuse(&w, "duplicate metadata key 'k'");

    refuse(&GgufWriter::new().with_alignment(3), "alignment 3");
    refuse(&GgufWriter::new().with_alignment(0), "alignment 0");
    let mut w = GgufWriter::new().with_alignment(64);
    w.add_meta("general.alignment", 32u32);
    refuse(&w, "general.alignment");
    let mut w = GgufWriter::new().with_alignment(64);
    w.add_meta("general.alignment", 64u64);
    refuse(&w, "UINT64");
    let mut w = GgufWriter::new().with_alignment(64);
    w.add_meta("general.alignment", 64u32);
    assert_eq!(Gguf::parse(w.to_bytes().unwrap()).unwrap().alignment(), 64);

    let mut w = GgufWriter::new();
    w.add_tensor_bytes("x", &[4], GgmlType::F32, vec![0; 16]).unwrap();
    w.add_tensor_bytes("x", &[4], GgmlType::F32, vec![0; 16]).unwrap();
    refuse(&w, "duplicate tensor name 'x'");

    let mut w = GgufWriter::new();
    let err = |r: Result<&mut GgufWriter, memra_gguf::GgufError>| r.unwrap_err().to_string();
    let e = err(w.add_tensor_bytes("short", &[4], GgmlType::F32, vec![0; 15]));
    assert!(e.contains("'short'") && e.contains("16 bytes"), "{e}");
    let e = err(w.add_tensor_bytes("odd", &[100], GgmlType::Q4_K, vec![]));
    assert!(e.contains("'odd'") && e.contains("block size 256"), "{e}");
    let e = err(w.add_tensor_bytes("five", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]));
    assert!(e.contains("5 dimensions"), "{e}");
    let e = err(w.add_tensor_bytes("zero", &[0], GgmlType::F32, vec![]));
    assert!(e.contains("'zero'"), "{e}");
    let e = err(w.add_tensor_bytes("n".repeat(64), &[1], GgmlType::F32, vec![0; 4]));
    assert!(e.contains("63"), "{e}");
    let e = err(w.add_tensor_f32("count", &[4], GgmlType::F32, &[1.0; 3]));
    assert!(e.contains("'count'") && e.contains("3 values"), "{e}");
    let e = err(w.add_tensor_f32("unsupported", &[256], GgmlType::Q2_K, &[0.0; 256]));
    assert!(e.contains("'unsupported'") && e.contains("Q2_K"), "{e}");
}
