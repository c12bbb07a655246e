//! Writes the fuzz targets' seed corpora: `memra-fuzz-corpus <repo root> <corpus dir> [gemma3.gguf]`.
//!
//! - `spec_parse/`: every `specs/*.toml` as is, plus a copy with an added `fuzz-tiny` preset
//!   whose model is small enough for the target's fixture round trip.
//! - `gguf_parse/`, `gguf_dequant/`: per spec, the fixture writer's file for the tiny dims
//!   (random values, quantized), then shrunk: same metadata, same tensor names and types, each
//!   tensor cut to its first block. The real gemma3 file, if given, shrunk the same way with
//!   every metadata array cut to its first 64 elements (the full header is MBs of tokenizer,
//!   which would slow every execution). `gguf_dequant/` also gets one file with two rows of
//!   every CPU-supported type, quantized from seeded random values.
//!
//! Inputs are kept under 64 KiB: the fuzz script runs with `-max_len=65536`.

use std::error::Error;
use std::fs;
use std::path::{Path, PathBuf};

use memra_codegen::dims::{self, ModelDims};
use memra_codegen::fixture::{self, Fill};
use memra_codegen::spec::{ArchSpec, HParamType, TypeChoice, Value};
use memra_gguf::{GgmlType, Gguf, GgufWriter, MetaArray, MetaValue, quant};

type Res<T> = Result<T, Box<dyn Error>>;

const SEED: u64 = 0x6d65_6d72_615f_667a;
const MAX_ARRAY: usize = 64;
const MAX_SEED_BYTES: usize = 65536;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (root, out) = match args.as_slice() {
        [root, out, ..] => (PathBuf::from(root), PathBuf::from(out)),
        _ => return Err("usage: memra-fuzz-corpus <repo root> <corpus dir> [gemma3.gguf]".into()),
    };
    let real = args.get(2).map(PathBuf::from);
    for t in ["spec_parse", "gguf_parse", "gguf_dequant"] {
        fs::create_dir_all(out.join(t))?;
    }
    let mut specs: Vec<PathBuf> = fs::read_dir(root.join("specs"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    specs.sort();
    for path in &specs {
        let text = fs::read_to_string(path)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        // A spec that does not load (being edited) is still a fine spec_parse seed.
        write(&out, "spec_parse", &name, text.as_bytes())?;
        let spec = match ArchSpec::load(path) {
            Ok(spec) => spec,
            Err(e) => {
                eprintln!(
                    "memra-fuzz-corpus: skipping the fixture seeds of {}: {e}",
                    path.display()
                );
                continue;
            }
        };
        let tiny = tiny_dims(&spec)?;
        match tiny_preset_text(&spec, &tiny) {
            Ok(extra) => {
                let with_tiny = format!("{text}\n{extra}");
                write(
                    &out,
                    "spec_parse",
                    &format!("{}-tiny.toml", spec.arch),
                    with_tiny.as_bytes(),
                )?
            }
            Err(e) => eprintln!("{}: no tiny preset seed: {e}", spec.arch),
        }
        let image = fixture::writer_for(&spec, &tiny, Fill::Random(SEED))?.to_bytes()?;
        let shrunk = shrink(&Gguf::parse(image.as_slice())?)?;
        for target in ["gguf_parse", "gguf_dequant"] {
            write(
                &out,
                target,
                &format!("{}-fixture.gguf", spec.arch),
                &shrunk,
            )?;
        }
    }
    if let Some(real) = real {
        let file = memra_gguf::GgufFile::open(&real)?;
        let shrunk = shrink(&file)?;
        for target in ["gguf_parse", "gguf_dequant"] {
            write(&out, target, "gemma3-real-header.gguf", &shrunk)?;
        }
    }
    write(&out, "gguf_dequant", "every-type.gguf", &every_type()?)?;
    Ok(())
}

fn write(out: &Path, target: &str, name: &str, bytes: &[u8]) -> Res<()> {
    if bytes.len() > MAX_SEED_BYTES {
        return Err(format!(
            "seed {target}/{name} is {} bytes (> {MAX_SEED_BYTES})",
            bytes.len()
        )
        .into());
    }
    let path = out.join(target).join(name);
    fs::write(&path, bytes)?;
    println!("{} ({} bytes)", path.display(), bytes.len());
    Ok(())
}

/// The default preset with a 256-token vocabulary and every other integer hparam (layer
/// count included) lowered greedily to the smallest power of two up to 256 that still resolves.
fn tiny_dims(spec: &ArchSpec) -> Res<ModelDims> {
    let mut overrides: Vec<(String, Value)> = Vec::new();
    if spec.hparam("n_vocab").is_some() {
        overrides.push(("n_vocab".to_string(), Value::Int(256)));
    }
    let resolve = |o: &[(String, Value)]| {
        let pairs: Vec<(&str, Value)> = o.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        dims::from_preset_with(spec, None, &pairs)
    };
    let mut current = resolve(&overrides).map_err(|e| format!("{}: {e}", spec.arch))?;
    for h in spec.hparams.iter().filter(|h| h.ty == HParamType::U32) {
        if overrides.iter().any(|(n, _)| *n == h.name) {
            continue;
        }
        let Some(now) = current.int(&h.name) else {
            continue;
        };
        for v in [1, 2, 4, 8, 16, 32, 64, 128, 256]
            .into_iter()
            .filter(|&v| v < now)
        {
            overrides.push((h.name.clone(), Value::Int(v)));
            match resolve(&overrides) {
                Ok(d) => {
                    current = d;
                    break;
                }
                Err(_) => {
                    overrides.pop();
                }
            }
        }
    }
    Ok(current)
}

/// A `[presets.fuzz-tiny]` table reproducing `d` (hparams, tensor types, absent tensors).
fn tiny_preset_text(spec: &ArchSpec, d: &ModelDims) -> Res<String> {
    let base = spec
        .preset(&spec.default_preset)
        .ok_or("no default preset")?;
    let absent: Vec<String> = base.absent.iter().map(|a| format!("{a:?}")).collect();
    let mut s = format!(
        "[presets.fuzz-tiny]\nsource = \"fuzz seed\"\nabsent = [{}]\n\n[presets.fuzz-tiny.hparams]\n",
        absent.join(", ")
    );
    for (name, _, _) in &base.hparams {
        let v = d
            .value(name)
            .ok_or_else(|| format!("no value for `{name}`"))?;
        s += &format!("{name} = {v}\n");
    }
    s += &format!(
        "\n[presets.fuzz-tiny.types]\ndefault = \"{}\"\n",
        base.default_type.name()
    );
    for (field, choice, _) in &base.types {
        let Some(t) = spec.tensors.iter().find(|t| &t.field == field) else {
            continue;
        };
        let types: Vec<String> = d
            .tensors
            .iter()
            .filter(|i| spec.tensors[i.spec_index].name == t.name)
            .map(|i| format!("\"{}\"", i.ggml_type.name()))
            .collect();
        match choice {
            TypeChoice::All(ty) => s += &format!("{field} = \"{}\"\n", ty.name()),
            TypeChoice::PerLayer(_) => s += &format!("{field} = [{}]\n", types.join(", ")),
        }
    }
    let check = format!(
        "{}\n{s}",
        fs::read_to_string(spec.loc.file.as_path()).unwrap_or_default()
    );
    let parsed = ArchSpec::parse(spec.loc.file.as_path(), &check).map_err(|e| e.to_string())?;
    dims::from_preset(&parsed, Some("fuzz-tiny")).map_err(|e| e.to_string())?;
    Ok(s)
}

/// Same metadata (arrays cut to `MAX_ARRAY` elements), same tensor names and types, each
/// tensor cut to its first block.
fn shrink<B: AsRef<[u8]>>(file: &Gguf<B>) -> Res<Vec<u8>> {
    let mut w = GgufWriter::new().with_alignment(file.alignment());
    for (key, value) in file.metadata() {
        let value = match value.into_owned() {
            MetaValue::Array(a) => MetaValue::Array(cut(a)),
            v => v,
        };
        w.add_meta(key, value);
    }
    for t in file.tensors() {
        let block = t.ggml_type.type_size() as usize;
        let data = file.tensor_data(t)[..block].to_vec();
        w.add_tensor_bytes(t.name, &[t.ggml_type.block_size()], t.ggml_type, data)?;
    }
    Ok(w.to_bytes()?)
}

fn cut(a: MetaArray) -> MetaArray {
    macro_rules! cut {
        ($($v:ident),*) => {
            match a {
                $(MetaArray::$v(mut x) => { x.truncate(MAX_ARRAY); MetaArray::$v(x) })*
            }
        };
    }
    cut!(U8, I8, U16, I16, U32, I32, F32, Bool, Str, U64, I64, F64)
}

/// Two rows of every CPU-supported type, quantized from seeded uniform values in [-2, 2).
fn every_type() -> Res<Vec<u8>> {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", "fuzz");
    let mut state = SEED;
    for ty in GgmlType::all().filter(|t| quant::is_supported(*t)) {
        let row = ty.block_size().max(32);
        let values: Vec<f32> = (0..2 * row)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect();
        w.add_tensor_f32(format!("t.{}", ty.name()), &[row, 2], ty, &values)?;
    }
    Ok(w.to_bytes()?)
}
