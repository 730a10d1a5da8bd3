//! Where a GGUF file's bytes come from, read in ranges: the header first (as much as it needs),
//! then one tensor at a time, so a model larger than host memory (or than wasm32's 4 GiB) loads
//! into GPU buffers with about one tensor in memory. Implemented for bytes in memory, natively
//! for files, and in the browser for Blobs (src/wasm.rs).

use super::{Gguf, GgufError, TensorInfo};
use std::future::Future;

/// First read of a header; it grows (at least doubling) while the header needs more.
const FIRST_HEADER_READ: u64 = 1 << 20;

pub trait ByteSource {
    /// The file's length in bytes.
    fn len(&self) -> u64;

    /// `len` bytes at `offset` (within the file: callers check bounds first).
    fn read(&self, offset: u64, len: u64) -> impl Future<Output = Result<Vec<u8>, GgufError>>;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ByteSource for [u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        Ok(self[offset as usize..(offset + len) as usize].to_vec())
    }
}

impl Gguf {
    /// Reads and parses the header from a source, reading no more of the file than the header.
    pub async fn read(source: &(impl ByteSource + ?Sized)) -> Result<Self, GgufError> {
        let file_len = source.len();
        let mut want = FIRST_HEADER_READ.min(file_len);
        loop {
            let prefix = source.read(0, want).await?;
            match Self::parse_prefix(&prefix, file_len) {
                Err(GgufError::HeaderPastPrefix { needed, .. }) => want = needed.max(want * 2).min(file_len),
                other => return other,
            }
        }
    }

    /// A tensor's bytes.
    pub async fn tensor_data(source: &(impl ByteSource + ?Sized), info: &TensorInfo) -> Result<Vec<u8>, GgufError> {
        source.read(info.file_offset, info.byte_size).await
    }
}

/// A file on disk, read in ranges (native only).
#[cfg(not(target_arch = "wasm32"))]
pub struct FileSource {
    file: std::sync::Mutex<std::fs::File>,
    len: u64,
    path: String,
}

#[cfg(not(target_arch = "wasm32"))]
impl FileSource {
    /// Opens a regular file; a device, pipe or directory is refused (it could be endless).
    pub fn open(path: &std::path::Path) -> Result<Self, GgufError> {
        let err = |e: std::io::Error| GgufError::Read(format!("{}: {e}", path.display()));
        let file = std::fs::File::open(path).map_err(err)?;
        let meta = file.metadata().map_err(err)?;
        if !meta.is_file() {
            return Err(GgufError::Read(format!("{} is not a regular file", path.display())));
        }
        Ok(Self { file: std::sync::Mutex::new(file), len: meta.len(), path: path.display().to_string() })
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl ByteSource for FileSource {
    fn len(&self) -> u64 {
        self.len
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        use std::io::{Read, Seek, SeekFrom};
        let mut buf = vec![0u8; len as usize];
        let mut file = self.file.lock().map_err(|_| GgufError::Read(format!("{}: a reader panicked", self.path)))?;
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| GgufError::Read(format!("{}: {e}", self.path)))?;
        Ok(buf)
    }
}
