//! The spec parser on arbitrary text, then dims resolution of every preset. When a preset
//! resolves to a small model, its fixture is written, re-read, and resolved again from the
//! GGUF header, which must give the same tensors.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use memra_codegen::fixture::{self, Fill};
use memra_codegen::{ArchSpec, dims};
use memra_gguf::Gguf;

/// Fixtures above this many bytes are skipped to keep one input's work bounded.
const FIXTURE_BYTE_BUDGET: u64 = 1 << 18;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let spec = match ArchSpec::parse(Path::new("fuzz.toml"), text) {
        Ok(spec) => spec,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let _ = (spec.module_name(), spec.type_prefix(), spec.feature());
    for preset in &spec.presets {
        let d = match dims::from_preset(&spec, Some(&preset.name)) {
            Ok(d) => d,
            Err(e) => {
                let _ = e.to_string();
                continue;
            }
        };
        let bytes: Option<u64> = d.tensors.iter().try_fold(0u64, |sum, t| {
            let rows = t.shape[1..]
                .iter()
                .try_fold(1u64, |n, &x| n.checked_mul(x))?;
            sum.checked_add(t.ggml_type.row_bytes(t.shape[0])?.checked_mul(rows)?)
        });
        if bytes.is_none_or(|b| b > FIXTURE_BYTE_BUDGET) {
            continue;
        }
        let Ok(writer) = fixture::writer_for(&spec, &d, Fill::Zeros) else {
            continue;
        };
        let Ok(image) = writer.to_bytes() else {
            continue;
        };
        let file = Gguf::parse(image.as_slice())
            .unwrap_or_else(|e| panic!("fixture of preset `{}` does not parse: {e}", preset.name));
        if let Ok(again) = dims::from_gguf(&spec, &file) {
            let key = |m: &dims::ModelDims| {
                m.tensors
                    .iter()
                    .map(|t| (t.name.clone(), t.shape.clone(), t.ggml_type))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                key(&again),
                key(&d),
                "preset `{}`: fixture re-read differs",
                preset.name
            );
        }
    }
});
