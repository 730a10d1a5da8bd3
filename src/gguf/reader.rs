//! A bounds-checked little-endian cursor over the file's first bytes (the whole file, or a prefix
//! of a file of `file_len` bytes read in ranges); every error carries the offset.

use super::GgufError;

#[derive(Clone)]
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    file_len: u64,
}

impl<'a> Reader<'a> {
    /// A reader over `prefix`, the first bytes of a file of `file_len` bytes.
    pub fn new(prefix: &'a [u8], file_len: u64) -> Self {
        Self { bytes: prefix, pos: 0, file_len: file_len.max(prefix.len() as u64) }
    }

    pub fn offset(&self) -> u64 {
        self.pos as u64
    }

    /// Bytes left in the file (not only in the prefix).
    pub fn remaining(&self) -> u64 {
        self.file_len - self.pos as u64
    }

    /// Bytes left in the prefix held in memory.
    fn prefix_remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.into(),
                offset: self.offset(),
                needed: n,
                file_len: self.file_len,
            });
        }
        if n > self.prefix_remaining() as u64 {
            return Err(GgufError::HeaderPastPrefix { read: self.bytes.len() as u64, needed: self.offset() + n });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    pub fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    pub fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items that each take at least `min_item_bytes`; rejects counts the rest of the
    /// file cannot hold, so callers may allocate `count` items.
    pub fn count(&mut self, what: &str, min_item_bytes: u64) -> Result<usize, GgufError> {
        let offset = self.offset();
        let count = self.u64(what)?;
        let remaining = self.remaining();
        if count.saturating_mul(min_item_bytes) > remaining {
            return Err(GgufError::CountTooLarge { what: what.into(), offset, count, remaining });
        }
        Ok(count as usize)
    }

    /// A string (u64 length, then UTF-8 bytes), borrowed from the prefix.
    pub fn str(&mut self, what: &str) -> Result<&'a str, GgufError> {
        let len = self.u64(what)?;
        let offset = self.offset();
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 { offset })
    }
}
