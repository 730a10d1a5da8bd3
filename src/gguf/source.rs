//! Where a GGUF file's bytes come from, read in ranges: the header first (as much as it needs),
//! then the tensors in pieces (src/gpu/weights.rs), so a model larger than host memory (or than
//! wasm32's 4 GiB) loads into GPU buffers with one piece of at most 8 MiB in memory. Implemented for bytes in memory, natively
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

    /// The parsed header; a split model (`SplitSource`) merges its parts' headers.
    fn header(&self) -> impl Future<Output = Result<Gguf, GgufError>> {
        Gguf::read(self)
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A model split by llama.cpp's gguf-split into parts (`name-00001-of-00003.gguf`), read as the
/// concatenation of its parts: each part is a GGUF file of its own whose tensors' offsets are
/// shifted by the part's start. Part 1 holds the metadata; `split.count`, `split.no` and
/// `split.tensors.count` are checked.
pub struct SplitSource<S> {
    parts: Vec<S>,
    starts: Vec<u64>,
}

impl<S: ByteSource> SplitSource<S> {
    pub fn new(parts: Vec<S>) -> Self {
        let mut starts = Vec::with_capacity(parts.len());
        let mut end = 0;
        for p in &parts {
            starts.push(end);
            end += p.len();
        }
        Self { parts, starts }
    }
}

impl<S: ByteSource> ByteSource for SplitSource<S> {
    fn len(&self) -> u64 {
        self.starts.last().zip(self.parts.last()).map_or(0, |(s, p)| s + p.len())
    }

    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        // A tensor lies within one part; a read of the whole model (the CPU backend) spans them.
        let (end, mut pos) = (offset + len, offset);
        let mut out = Vec::with_capacity(len as usize);
        while pos < end {
            let i = self.starts.partition_point(|&s| s <= pos) - 1;
            let local = pos - self.starts[i];
            let n = (end - pos).min(self.parts[i].len() - local);
            out.extend(self.parts[i].read(local, n).await?);
            pos += n;
        }
        Ok(out)
    }

    async fn header(&self) -> Result<Gguf, GgufError> {
        let mut headers = Vec::with_capacity(self.parts.len());
        for part in &self.parts {
            headers.push(Gguf::read(part).await?);
        }
        Gguf::merge_split(headers, &self.starts)
    }
}

impl<T: ByteSource + ?Sized> ByteSource for &T {
    fn len(&self) -> u64 {
        (**self).len()
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        (**self).read(offset, len).await
    }
    async fn header(&self) -> Result<Gguf, GgufError> {
        (**self).header().await
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
        // Checked before opening: opening a FIFO waits for a writer, possibly forever.
        let not_a_file = || GgufError::Read(format!("{} is not a regular file", path.display()));
        if !std::fs::metadata(path).map_err(err)?.is_file() {
            return Err(not_a_file());
        }
        let file = std::fs::File::open(path).map_err(err)?;
        let meta = file.metadata().map_err(err)?;
        if !meta.is_file() {
            return Err(not_a_file());
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
