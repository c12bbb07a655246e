//! The GGUF reader on arbitrary bytes: header, metadata and tensor table through
//! `Gguf::parse`, then every accessor on every key and tensor, then a write/re-read round
//! trip. Parsing must return an error, never panic; whatever parses must be self-consistent.

#![no_main]

use libfuzzer_sys::fuzz_target;
use memra_gguf::{Gguf, GgufWriter, MetaArrayRef, MetaValueRef};

fuzz_target!(|data: &[u8]| {
    let Ok(file) = Gguf::parse(data) else { return };
    walk(&file);
    round_trip(&file);
});

fn walk(file: &Gguf<&[u8]>) {
    let _ = (
        file.version(),
        file.alignment(),
        file.data_offset(),
        format!("{file:?}"),
    );
    let _ = file.architecture().map(|_| file.arch_key("block_count"));
    let metadata = file.metadata();
    assert_eq!(metadata.iter().count(), metadata.len());
    assert!(metadata.get(metadata.len()).is_none());
    for (key, value) in metadata {
        // Lookup by key finds the same value (keys are unique, the parser checked).
        let found = file.get(key).expect("every listed key can be looked up");
        assert_eq!(format!("{found:?}"), format!("{value:?}"), "key '{key}'");
        let _ = (
            value.value_type(),
            value.type_description(),
            value.to_string(),
        );
        let _ = (
            value.as_integer(),
            value.as_f64(),
            value.as_bool(),
            value.as_str(),
        );
        // Every typed getter: Ok or an error naming the key.
        for e in [
            file.get_u64(key).err(),
            file.get_u32(key).err(),
            file.get_usize(key).err(),
            file.get_i64(key).err(),
            file.get_f32(key).err(),
            file.get_bool(key).err(),
            file.get_str(key).err(),
            file.get_array(key).err(),
            file.get_str_array(key).err(),
            file.get_f32_array(key).err(),
            file.get_i32_array(key).err(),
            file.get_u64_array(key).err(),
        ]
        .into_iter()
        .flatten()
        {
            assert!(
                e.to_string().contains(key),
                "error '{e}' does not name key '{key}'"
            );
        }
        if let MetaValueRef::Array(array) = value {
            walk_array(array);
        }
        let _ = value.into_owned();
    }

    let tensors = file.tensors();
    assert_eq!(tensors.iter().count(), tensors.len());
    assert!(tensors.get(tensors.len()).is_none());
    for info in tensors {
        let (n, row_len, n_rows, row_bytes) = (
            info.n_elements(),
            info.row_len(),
            info.n_rows(),
            info.row_bytes(),
        );
        assert_eq!(
            row_len.checked_mul(n_rows),
            Some(n),
            "tensor '{}'",
            info.name
        );
        assert_eq!(
            row_bytes.checked_mul(n_rows),
            Some(info.n_bytes),
            "tensor '{}'",
            info.name
        );
        assert_eq!(file.tensor(info.name), Some(info));
        let bytes = file.tensor_data(info);
        assert_eq!(
            bytes.len() as u64,
            info.n_bytes,
            "tensor '{}' data",
            info.name
        );
        assert_eq!(file.tensor_bytes(info.name).ok(), Some(bytes));
    }
    assert!(file.tensor("\u{0}not a tensor").is_none());
    assert!(file.get("\u{0}not a key").is_none());
}

fn walk_array(array: MetaArrayRef<'_>) {
    let _ = (array.element_type(), array.is_empty(), array.to_string());
    for i in 0..array.len() {
        assert!(array.get(i).is_some(), "element {i} of {}", array.len());
    }
    assert!(array.get(array.len()).is_none());
    match array {
        MetaArrayRef::Str(s) => assert_eq!(s.iter().count(), s.len()),
        MetaArrayRef::F32(v) => assert_eq!(v.iter().count(), v.len()),
        MetaArrayRef::I32(v) => assert_eq!(v.to_vec().len(), v.len()),
        _ => {}
    }
}

/// What parses can be written back, and re-reads to the same keys, values and tensors.
fn round_trip(file: &Gguf<&[u8]>) {
    let mut w = GgufWriter::new().with_alignment(file.alignment());
    for (key, value) in file.metadata() {
        w.add_meta(key, value.into_owned());
    }
    for t in file.tensors() {
        w.add_tensor_bytes(t.name, &t.dims, t.ggml_type, file.tensor_data(t).to_vec())
            .unwrap_or_else(|e| panic!("a parsed tensor is rejected by the writer: {e}"));
    }
    // The writer may refuse what the reader tolerates (e.g. long keys); nothing to compare then.
    let Ok(bytes) = w.to_bytes() else { return };
    let again = Gguf::parse(bytes.as_slice())
        .unwrap_or_else(|e| panic!("the writer's output does not parse: {e}"));
    let show = |f: &Gguf<&[u8]>| {
        f.metadata()
            .iter()
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect::<Vec<_>>()
    };
    assert_eq!(show(&again), show(file));
    assert_eq!(again.tensors().len(), file.tensors().len());
    for (a, b) in again.tensors().iter().zip(file.tensors()) {
        assert_eq!((a.name, a.dims, a.ggml_type), (b.name, b.dims, b.ggml_type));
        assert_eq!(
            again.tensor_data(a),
            file.tensor_data(b),
            "tensor '{}'",
            a.name
        );
    }
}
