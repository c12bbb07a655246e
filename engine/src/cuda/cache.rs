//! The compiled-kernel cache: memory first, then disk, then NVRTC.
//!
//! Layout: `${MEMRA_CACHE:-$HOME/.cache/memra}/kernels/<memra version>/sm_<arch>/<name>-<hash16>.cubin`
//! (compiled code is not portable across architectures, and a new memra may render different
//! code under the same name). The key hashes everything that changes the cubin: the source, all
//! template headers, the NVRTC options, the NVRTC version, the arch and the memra version.
//!
//! Entry file (little endian):
//! ```text
//!  0  8  magic "MEMRAKC1"
//!  8 32  full sha256 key (the file name holds only 16 hex digits of it)
//! 40  8  cubin length
//! 48  4  log length
//! 52 32  sha256(cubin ‖ log)
//! 84  …  cubin bytes, then the NVRTC log (UTF-8; holds the ptxas -v report)
//! ```
//! A file that is foreign, truncated, corrupted or for another key is rebuilt with one warning.
//!
//! Concurrency without locks: a writer fills a private temp file in the entry's directory and
//! renames it over the entry. rename(2) within one directory is atomic, so a reader sees no
//! entry or a complete one, never a partial write. Two processes that miss at once both compile
//! and both rename; either result is a valid entry for the key, so the only cost is the duplicate
//! compile a lock would have saved, which is rare and cheap next to a lock's failure modes (stale
//! lock files, NFS). Files are not fsynced: a torn entry after a power loss fails its checksum
//! and is rebuilt.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::nvrtc::{self, Cubin, HeaderSet};
use super::{Error, SmArch, library};

const MAGIC: &[u8; 8] = b"MEMRAKC1";
const HEADER_LEN: usize = 84;
const MEMRA_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Where the cache lives and whether it may compile.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// The `kernels` directory; `None` keeps everything in memory.
    pub dir: Option<PathBuf>,
    /// `false` (`MEMRA_NO_NVRTC=1`): a miss is an error instead of a compile.
    pub allow_compile: bool,
}

impl CacheConfig {
    /// `${MEMRA_CACHE:-$HOME/.cache/memra}/kernels`, compiling unless `MEMRA_NO_NVRTC=1`.
    pub fn from_env() -> CacheConfig {
        let forbid = std::env::var("MEMRA_NO_NVRTC").is_ok_and(|v| !v.is_empty() && v != "0");
        CacheConfig { dir: Some(library::memra_cache_root().join("kernels")), allow_compile: !forbid }
    }

    /// A cache rooted at `dir` (tests, tools).
    pub fn at(dir: impl Into<PathBuf>) -> CacheConfig {
        CacheConfig { dir: Some(dir.into()), allow_compile: true }
    }

    pub fn memory_only() -> CacheConfig {
        CacheConfig { dir: None, allow_compile: true }
    }
}

/// Where a cubin came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    Memory,
    Disk,
    Compiled,
}

impl CacheOutcome {
    pub fn is_hit(self) -> bool {
        self != CacheOutcome::Compiled
    }

    pub fn label(self) -> &'static str {
        match self {
            CacheOutcome::Memory => "hit (memory)",
            CacheOutcome::Disk => "hit",
            CacheOutcome::Compiled => "miss",
        }
    }
}

/// One kernel to compile.
#[derive(Clone, Copy)]
pub struct CompileJob<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub headers: &'a HeaderSet,
    pub arch: SmArch,
}

/// A kernel cache handle. Cheap to share across threads (`&KernelCache` is `Sync`).
pub struct KernelCache {
    config: CacheConfig,
    memory: Mutex<HashMap<[u8; 32], Arc<Cubin>>>,
    disk_writes_off: AtomicBool,
    read_warned: AtomicBool,
    warnings: Mutex<Vec<String>>,
}

impl KernelCache {
    pub fn new(config: CacheConfig) -> KernelCache {
        KernelCache {
            config,
            memory: Mutex::new(HashMap::new()),
            disk_writes_off: AtomicBool::new(false),
            read_warned: AtomicBool::new(false),
            warnings: Mutex::new(Vec::new()),
        }
    }

    pub fn from_env() -> KernelCache {
        KernelCache::new(CacheConfig::from_env())
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The warnings printed so far (each also went to stderr once).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The full cache key of a job. Needs NVRTC (its version is part of the key).
    pub fn key(&self, job: &CompileJob<'_>) -> Result<[u8; 32], Error> {
        let (major, minor) = nvrtc::version()?;
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(MAGIC);
        field(MEMRA_VERSION.as_bytes());
        field(job.arch.to_string().as_bytes());
        field(format!("nvrtc {major}.{minor}").as_bytes());
        field(nvrtc::nvrtc_options(job.arch).join("\0").as_bytes());
        field(job.headers.digest());
        field(job.name.as_bytes());
        field(job.source.as_bytes());
        Ok(h.finalize().into())
    }

    /// `<dir>/<memra version>/sm_<arch>/<name>-<hash16>.cubin`, or `None` for a memory-only cache.
    pub fn entry_path(&self, job: &CompileJob<'_>, key: &[u8; 32]) -> Option<PathBuf> {
        let dir = self.config.dir.as_ref()?;
        let short: String = key[..8].iter().map(|b| format!("{b:02x}")).collect();
        Some(dir.join(MEMRA_VERSION).join(job.arch.to_string()).join(format!("{}-{short}.cubin", job.name)))
    }

    /// Memory, then disk; `None` on a miss. Invalid disk entries count as misses (with a warning).
    pub fn lookup(&self, job: &CompileJob<'_>) -> Result<Option<(Arc<Cubin>, CacheOutcome)>, Error> {
        let key = self.key(job)?;
        Ok(self.lookup_key(job, &key))
    }

    fn lookup_key(&self, job: &CompileJob<'_>, key: &[u8; 32]) -> Option<(Arc<Cubin>, CacheOutcome)> {
        if let Some(hit) = self.memory.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
            return Some((hit.clone(), CacheOutcome::Memory));
        }
        let path = self.entry_path(job, key)?;
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            // NotADirectory: a file sits where a cache directory should be; the write path
            // reports that (once) as an unwritable cache.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => return None,
            Err(e) => {
                if !self.read_warned.swap(true, Ordering::Relaxed) {
                    self.warn(format!("cannot read kernel cache entry {} ({e}); recompiling what cannot be read", path.display()));
                }
                return None;
            }
        };
        match decode_entry(&bytes, key) {
            Ok(cubin) => {
                let cubin = Arc::new(cubin);
                self.remember(key, &cubin);
                Some((cubin, CacheOutcome::Disk))
            }
            Err(why) => {
                self.warn(format!("kernel cache entry {} {why}; rebuilding it", path.display()));
                None
            }
        }
    }

    /// The cubin for `job`: from memory, from disk, or compiled with NVRTC and stored.
    pub fn get_or_compile(&self, job: &CompileJob<'_>) -> Result<(Arc<Cubin>, CacheOutcome), Error> {
        let key = self.key(job)?;
        if let Some(hit) = self.lookup_key(job, &key) {
            return Ok(hit);
        }
        let path = self.entry_path(job, &key);
        if !self.config.allow_compile {
            return Err(Error::CompileForbidden { name: job.name.to_string(), arch: job.arch, path });
        }
        let cubin = Arc::new(nvrtc::compile_cubin(job.name, job.source, job.headers, job.arch)?);
        if let Some(path) = path {
            self.store(&path, &key, &cubin);
        }
        self.remember(&key, &cubin);
        Ok((cubin, CacheOutcome::Compiled))
    }

    /// Removes every cached kernel under the cache dir (all memra versions and archs).
    /// Returns the removed directory, if there was one.
    pub fn clear(&self) -> Result<Option<PathBuf>, Error> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let Some(dir) = &self.config.dir else { return Ok(None) };
        match std::fs::remove_dir_all(dir) {
            Ok(()) => Ok(Some(dir.clone())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(dir, e)),
        }
    }

    fn remember(&self, key: &[u8; 32], cubin: &Arc<Cubin>) {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).insert(*key, cubin.clone());
    }

    fn store(&self, path: &Path, key: &[u8; 32], cubin: &Cubin) {
        if self.disk_writes_off.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = write_atomically(path, &encode_entry(key, cubin)) {
            // The first failure turns disk writes off for this handle: one warning, not one per kernel.
            if !self.disk_writes_off.swap(true, Ordering::Relaxed) {
                let dir = self.config.dir.as_deref().unwrap_or(path);
                self.warn(format!(
                    "kernel cache {} is not writable ({e}); keeping compiled kernels in memory for this run",
                    dir.display()
                ));
            }
        }
    }

    fn warn(&self, message: String) {
        eprintln!("warning: memra: {message}");
        self.warnings.lock().unwrap_or_else(|p| p.into_inner()).push(message);
    }
}

fn encode_entry(key: &[u8; 32], cubin: &Cubin) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + cubin.bytes.len() + cubin.log.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(key);
    out.extend_from_slice(&(cubin.bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&(cubin.log.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload_checksum(&cubin.bytes, cubin.log.as_bytes()));
    out.extend_from_slice(&cubin.bytes);
    out.extend_from_slice(cubin.log.as_bytes());
    out
}

fn payload_checksum(cubin: &[u8], log: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(cubin);
    h.update(log);
    h.finalize().into()
}

/// Checks an entry; the error says what is wrong with it (completes "entry <path> …").
fn decode_entry(bytes: &[u8], key: &[u8; 32]) -> Result<Cubin, String> {
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err("is not a memra cache entry (bad magic)".to_string());
    }
    if bytes.len() < HEADER_LEN {
        return Err(format!("is truncated ({} bytes, header needs {HEADER_LEN})", bytes.len()));
    }
    if &bytes[8..40] != key {
        return Err("belongs to another key".to_string());
    }
    let cubin_len = u64::from_le_bytes(bytes[40..48].try_into().expect("8-byte slice"));
    let log_len = u32::from_le_bytes(bytes[48..52].try_into().expect("4-byte slice")) as u64;
    // Checked: a hostile header can make the sum wrap around to the file's length.
    let expected = (HEADER_LEN as u64)
        .checked_add(cubin_len)
        .and_then(|n| n.checked_add(log_len))
        .unwrap_or(u64::MAX);
    if bytes.len() as u64 != expected {
        let what = if (bytes.len() as u64) < expected { "truncated" } else { "too long" };
        return Err(format!("is {what} ({} bytes, header says {expected})", bytes.len()));
    }
    let cubin_end = HEADER_LEN + cubin_len as usize;
    let (cubin, log) = (&bytes[HEADER_LEN..cubin_end], &bytes[cubin_end..]);
    if payload_checksum(cubin, log) != bytes[52..84] {
        return Err("is corrupted (checksum mismatch)".to_string());
    }
    Ok(Cubin { bytes: cubin.to_vec(), log: String::from_utf8_lossy(log).into_owned() })
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().ok_or_else(|| std::io::Error::other("cache entry path has no parent"))?;
    std::fs::create_dir_all(dir)?;
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // pid + a per-process counter: unique across processes and across threads of one process.
    let tmp = dir.join(format!(".{file_name}.tmp.{}.{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ([u8; 32], Cubin) {
        ([7u8; 32], Cubin { bytes: (0..200u8).collect(), log: "ptxas info : Used 8 registers".to_string() })
    }

    #[test]
    fn entry_round_trips() {
        let (key, cubin) = sample();
        assert_eq!(decode_entry(&encode_entry(&key, &cubin), &key), Ok(cubin));
    }

    #[test]
    fn damaged_entries_are_rejected_with_the_reason() {
        let (key, cubin) = sample();
        let good = encode_entry(&key, &cubin);
        let mut flipped = good.clone();
        flipped[HEADER_LEN + 10] ^= 0x40;
        assert!(decode_entry(&flipped, &key).unwrap_err().contains("checksum"));
        assert!(decode_entry(&good[..good.len() - 1], &key).unwrap_err().contains("truncated"));
        assert!(decode_entry(&good[..20], &key).unwrap_err().contains("truncated"));
        assert!(decode_entry(b"\x7fELF not ours", &key).unwrap_err().contains("not a memra cache entry"));
        assert!(decode_entry(&good, &[8u8; 32]).unwrap_err().contains("another key"));
        let mut longer = good.clone();
        longer.push(0);
        assert!(decode_entry(&longer, &key).unwrap_err().contains("too long"));
    }

    #[test]
    fn lengths_whose_sum_wraps_are_rejected_not_a_panic() {
        // cubin_len = u64::MAX and log_len = 17: 84 + cubin_len + log_len wraps to 100, the
        // file's length; unchecked, that sum passed and slicing the cubin panicked.
        let key = [7u8; 32];
        let mut bytes = vec![0u8; 100];
        bytes[..8].copy_from_slice(MAGIC);
        bytes[8..40].copy_from_slice(&key);
        bytes[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        bytes[48..52].copy_from_slice(&17u32.to_le_bytes());
        let err = decode_entry(&bytes, &key).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
    }
}
