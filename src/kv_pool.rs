//! The host-side bookkeeping of a paged KV cache (vLLM's PagedAttention block tables): the GPU's
//! K/V buffers hold `blocks × block_tokens` token rows, cut into fixed-size blocks that sequences
//! take from one shared pool, so many sequences (a batch, beams, a draft and its verifier, chats
//! sharing a system prompt) fit in the memory of their actual lengths rather than each reserving
//! the whole context. A sequence's position `p` lives in row
//! `table[p / block_tokens] * block_tokens + p % block_tokens`.
//!
//! Forking shares the prefix's blocks (a reference count per block) instead of copying them; a
//! shared block is copied only when a sequence is about to write into it (copy-on-write). The
//! pool does no GPU work: `reserve` tells the caller which blocks to copy, and the caller uploads
//! the tables.
//!
//! The pool is also the prefix cache (vLLM's block pool): a full block whose tokens are known
//! (`commit`) is registered under a chained hash of the tokens of its sequence up to its end;
//! when no sequence holds it any more it is not freed but kept, least recently used first, and
//! handed out again only when the free blocks run out (evicted, its registration dropped). A new
//! sequence starts from the longest registered prefix of its tokens (`create_cached`), whoever
//! wrote it: a chat's next turn, a shared system prompt, a repeated or preempted prompt. A hit is
//! checked against the block's own tokens and its parent block, so a hash collision can never hand
//! out another prefix's keys and values; a registered block is never written (a sequence that
//! would write into one copies it first, as into a shared one).
//!
//! Invariants, kept by every method: a block's reference count is the number of table entries
//! pointing at it; a block with count 0 is free, or, when registered, in the cache's
//! least-recently-used list (and counts as free: taking it evicts it); a sequence of length `len`
//! holds exactly `ceil(len / block_tokens)` blocks, none twice. No method panics on a bad
//! `SeqId`: the queries answer as for an empty sequence, the mutators do nothing, and the
//! fallible ones return `Error::InvalidOption`.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// No block (the ends of the cache's list, a first block's parent).
const NONE: u32 = u32::MAX;

/// A sequence slot, `0..max_seqs`. Slots are reused: after `free`, the next `create` may hand
/// out the same id, so a caller must drop its copies of an id when it frees the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(pub usize);

/// One sequence slot. A freed slot keeps its table's capacity, so reusing it does not allocate.
#[derive(Debug, Clone, Default)]
#[cfg_attr(test, derive(PartialEq))]
struct Slot {
    live: bool,
    /// Positions held; positions past it in the last block are garbage, overwritten at will.
    len: usize,
    /// Block ids in position order; always `ceil(len / block_tokens)` of them.
    table: Vec<u32>,
    /// The chained hashes of its first blocks, full and committed (at most `len / block_tokens`).
    hashes: Vec<u64>,
}

/// The prefix cache's side of the pool (per block, indexed by block id).
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(PartialEq))]
struct PrefixCache {
    /// Chained hash -> the block registered under it.
    by_hash: HashMap<u64, u32>,
    /// Per block: the hash it is registered under.
    hash: Vec<Option<u64>>,
    /// Per registered block: its tokens (`block_tokens` each), and its parent (the block before
    /// it, with that block's generation then), which a hit must match.
    tokens: Vec<u32>,
    parent: Vec<(u32, u32)>,
    /// Per block: how many times its registration was dropped (a child registered under an
    /// older generation of its parent is never a hit).
    generation: Vec<u32>,
    /// Registered blocks no sequence holds, least recently used first: a doubly linked list
    /// over block ids (no allocation as blocks come and go).
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    idle: usize,
}

impl PrefixCache {
    fn new(blocks: usize, block_tokens: usize) -> Self {
        Self {
            by_hash: HashMap::with_capacity(blocks),
            hash: vec![None; blocks],
            tokens: vec![0; blocks * block_tokens],
            parent: vec![(NONE, 0); blocks],
            generation: vec![0; blocks],
            prev: vec![NONE; blocks],
            next: vec![NONE; blocks],
            head: NONE,
            tail: NONE,
            idle: 0,
        }
    }

    fn push_idle(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NONE;
        match self.tail {
            NONE => self.head = b,
            t => self.next[t as usize] = b,
        }
        self.tail = b;
        self.idle += 1;
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        match p {
            NONE => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NONE => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.idle -= 1;
    }

    /// Drops block `b`'s registration (it is about to hold other tokens).
    fn unregister(&mut self, b: u32) {
        if let Some(h) = self.hash[b as usize].take() {
            self.by_hash.remove(&h);
            self.generation[b as usize] = self.generation[b as usize].wrapping_add(1);
        }
    }
}

/// The chained hash of a block: of its parent's hash (0 for the first) and its tokens.
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The block tables of every sequence and the free blocks of one KV cache.
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(PartialEq))]
pub struct KvPool {
    block_tokens: usize,
    /// Per block: how many table entries point at it (0 = free).
    refcount: Vec<usize>,
    /// The free blocks as a stack, allocated at full size up front so that freeing never
    /// allocates; blocks are pushed so that a freed run pops back in its old order.
    free: Vec<u32>,
    slots: Vec<Slot>,
    cache: PrefixCache,
}

impl KvPool {
    /// A pool of `capacity_tokens / block_tokens` blocks (the remainder of the capacity is not
    /// used) for at most `max_seqs` sequences at once. Never fails: a pool of 0 blocks (a
    /// capacity below one block, or `block_tokens` 0, which `block_tokens()` then reports as 1
    /// so that callers' divisions stay defined) answers every `reserve` that needs a block with
    /// `Error::KvPoolFull`.
    pub fn new(capacity_tokens: usize, block_tokens: usize, max_seqs: usize) -> Self {
        // Block ids are u32 on the GPU, so more blocks than that could not be addressed.
        let blocks = capacity_tokens.checked_div(block_tokens).unwrap_or(0).min(u32::MAX as usize);
        KvPool {
            block_tokens: block_tokens.max(1),
            refcount: vec![0; blocks],
            // Reversed, so that a fresh pool hands out blocks 0, 1, 2, ...
            free: (0..blocks as u32).rev().collect(),
            slots: vec![Slot::default(); max_seqs],
            cache: PrefixCache::new(blocks, block_tokens.max(1)),
        }
    }

    /// Token rows per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Blocks in the pool, free or not.
    pub fn blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks no sequence holds: free, or kept by the prefix cache (taken last, evicting them).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.cache.idle
    }

    /// Blocks registered in the prefix cache (held by sequences or not).
    pub fn cached_blocks(&self) -> usize {
        self.cache.by_hash.len()
    }

    /// A block for a sequence to write: a free one, else the least recently used cached one
    /// (evicted). The caller has counted that there is one.
    fn take(&mut self) -> u32 {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.cache.head;
                debug_assert!(b != NONE, "counted by free_blocks");
                self.cache.unlink(b);
                self.cache.unregister(b);
                b
            }
        };
        self.refcount[b as usize] = 1;
        // A child registered under this block's earlier contents never matches it again.
        self.cache.generation[b as usize] = self.cache.generation[b as usize].wrapping_add(1);
        b
    }

    /// Drops a table entry's reference to `b`: with none left, a registered block waits in the
    /// cache (most recently used), any other is free.
    fn release(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.cache.hash[b as usize].is_some() {
                self.cache.push_idle(b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Forgets every cached block no sequence holds (they become free).
    pub fn evict_cached(&mut self) {
        while self.cache.head != NONE {
            let b = self.cache.head;
            self.cache.unlink(b);
            self.cache.unregister(b);
            self.free.push(b);
        }
    }

    /// Registers `seq`'s full blocks up to position `tokens.len()` (`tokens`: its tokens from
    /// position 0, whose keys and values it holds), so that later sequences can start from
    /// them. A block already registered, or whose prefix another block is registered for, is
    /// left as it is. Cheap when no block filled since the last call.
    pub fn commit(&mut self, seq: SeqId, tokens: &[u32]) {
        let bt = self.block_tokens;
        let Some(slot) = self.slots.get_mut(seq.0).filter(|s| s.live) else { return };
        let full = tokens.len().min(slot.len) / bt;
        for i in slot.hashes.len()..full {
            let parent = slot.hashes.last().copied().unwrap_or(0);
            let block = &tokens[i * bt..(i + 1) * bt];
            let h = chain(parent, block);
            slot.hashes.push(h);
            let b = slot.table[i];
            let c = &mut self.cache;
            if c.hash[b as usize].is_some() || c.by_hash.contains_key(&h) {
                continue;
            }
            c.by_hash.insert(h, b);
            c.hash[b as usize] = Some(h);
            c.tokens[b as usize * bt..][..bt].copy_from_slice(block);
            c.parent[b as usize] = match i {
                0 => (NONE, 0),
                _ => (slot.table[i - 1], c.generation[slot.table[i - 1] as usize]),
            };
        }
    }

    /// Calls `hit(block, hash)` for each block of the longest registered prefix of `tokens`
    /// (whole blocks, each checked against its tokens and its parent).
    fn walk(&self, tokens: &[u32], mut hit: impl FnMut(u32, u64)) {
        let bt = self.block_tokens;
        let c = &self.cache;
        let (mut parent_hash, mut parent) = (0, (NONE, 0));
        for block in tokens.chunks_exact(bt) {
            let h = chain(parent_hash, block);
            let Some(&b) = c.by_hash.get(&h) else { return };
            if c.parent[b as usize] != parent || c.tokens[b as usize * bt..][..bt] != *block {
                return;
            }
            hit(b, h);
            (parent_hash, parent) = (h, (b, c.generation[b as usize]));
        }
    }

    /// Positions of the longest cached prefix of `tokens` (whole blocks) and how many of its
    /// blocks no sequence holds now (taking them lowers `free_blocks`).
    pub fn cached_prefix(&self, tokens: &[u32]) -> (usize, usize) {
        let (mut n, mut idle) = (0, 0);
        self.walk(tokens, |b, _| {
            n += 1;
            idle += usize::from(self.refcount[b as usize] == 0);
        });
        (n * self.block_tokens, idle)
    }

    /// A new sequence holding the longest cached prefix of `tokens` (shared, as a fork shares):
    /// its id and length. `Error::TooManySequences` when every slot is in use.
    pub fn create_cached(&mut self, tokens: &[u32]) -> Result<(SeqId, usize)> {
        let seq = self.create()?;
        let mut table = std::mem::take(&mut self.slots[seq.0].table);
        let mut hashes = std::mem::take(&mut self.slots[seq.0].hashes);
        self.walk(tokens, |b, h| {
            table.push(b);
            hashes.push(h);
        });
        for &b in &table {
            if self.refcount[b as usize] == 0 {
                self.cache.unlink(b);
            }
            self.refcount[b as usize] += 1;
        }
        let len = table.len() * self.block_tokens;
        self.slots[seq.0] = Slot { live: true, len, table, hashes };
        Ok((seq, len))
    }

    /// Sequence slots: the most sequences that can exist at once.
    pub fn max_seqs(&self) -> usize {
        self.slots.len()
    }

    /// Sequence slots not in use: how many more sequences `create` or `fork` can make.
    pub fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| !s.live).count()
    }

    /// The longest table a sequence can have, for sizing the GPU's table buffer: the whole pool,
    /// since a single sequence may use every block.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.blocks()
    }

    /// A new empty sequence in the lowest free slot (lowest, so ids stay small and dense for
    /// the GPU's per-sequence arrays); `Error::TooManySequences` when every slot is in use.
    pub fn create(&mut self) -> Result<SeqId> {
        let i = self.free_slot()?;
        let slot = &mut self.slots[i];
        slot.live = true;
        slot.len = 0;
        slot.table.clear();
        slot.hashes.clear();
        Ok(SeqId(i))
    }

    /// Positions the sequence holds (0 for an unknown or freed one).
    pub fn len(&self, seq: SeqId) -> usize {
        self.live(seq).map_or(0, |s| s.len)
    }

    /// The sequence's block ids in position order (empty for an unknown or freed one).
    pub fn table(&self, seq: SeqId) -> &[u32] {
        self.live(seq).map_or(&[], |s| &s.table)
    }

    /// Blocks `reserve(seq, len)` would take from the free list: the blocks appended, and a
    /// shared last block copied before it is written (0 for an unknown sequence).
    pub fn blocks_to_reserve(&self, seq: SeqId, len: usize) -> usize {
        self.live(seq).map_or(0, |slot| {
            let (add, cow) = self.growth(slot, len);
            add + usize::from(cow)
        })
    }

    /// What `reserve(seq, len)` does to `slot`: the blocks it appends, and whether its last
    /// block holds old positions, will take new ones and is shared or registered in the prefix
    /// cache (so is copied first).
    fn growth(&self, slot: &Slot, len: usize) -> (usize, bool) {
        let bt = self.block_tokens;
        if len <= slot.len {
            return (0, false);
        }
        let cow = slot.len % bt != 0 && {
            let last = slot.table[slot.len / bt] as usize;
            self.refcount[last] > 1 || self.cache.hash[last].is_some()
        };
        (len.div_ceil(bt) - slot.table.len(), cow)
    }

    /// Makes positions 0..len of `seq` writable from its current length on: appends free blocks
    /// as needed, and for a block that is shared (refcount > 1) and will be written (it holds a
    /// position in old_len..len), copy-on-write: takes a free block, pushes (old_block,
    /// new_block) onto `copies`, and points the table at the new one (the old one's refcount
    /// drops). Since a table holds exactly the blocks its length covers, the only block that can
    /// be both present and written is the partially filled last one, so at most one copy is
    /// pushed per call. The caller copies those blocks' K/V rows on the GPU before writing.
    ///
    /// Sets the sequence's length to max(len, current); a `len` at or below the current length
    /// writes nothing and changes nothing. Returns whether the table changed (the caller then
    /// uploads it). All or nothing: when the free blocks do not suffice, nothing changes and
    /// `Err(Error::KvPoolFull)`, whose token counts are whole blocks (what the pool lacks is
    /// blocks). `copies` is only pushed to, never cleared: the caller's reused Vec, so that a
    /// decode step that stays inside its last block allocates nothing.
    pub fn reserve(&mut self, seq: SeqId, len: usize, copies: &mut Vec<(u32, u32)>) -> Result<bool> {
        let bt = self.block_tokens;
        let Some(slot) = self.live(seq) else { return Err(self.unknown(seq)) };
        let old_len = slot.len;
        if len <= old_len {
            return Ok(false);
        }
        let (add, cow) = self.growth(slot, len);
        let needed = add + usize::from(cow);
        if needed > self.free_blocks() {
            return Err(Error::KvPoolFull {
                needed_tokens: needed.saturating_mul(bt),
                free_tokens: self.free_blocks() * bt,
                capacity_tokens: self.blocks() * bt,
            });
        }
        if cow {
            let i = old_len / bt;
            let new = self.take();
            let old = std::mem::replace(&mut self.slots[seq.0].table[i], new);
            self.release(old);
            copies.push((old, new));
        }
        for _ in 0..add {
            let new = self.take();
            self.slots[seq.0].table.push(new);
        }
        self.slots[seq.0].len = len;
        Ok(needed > 0)
    }

    /// A new sequence holding the first `len` positions of `seq` (len <= its length): shares
    /// those blocks (refcount + 1), no copy, so beams and a conversation's branches cost no
    /// memory until they diverge (`reserve` copies a shared block only when it is written).
    pub fn fork(&mut self, seq: SeqId, len: usize) -> Result<SeqId> {
        let Some(src) = self.live(seq) else { return Err(self.unknown(seq)) };
        if len > src.len {
            return Err(Error::InvalidOption {
                name: "fork length",
                value: len.to_string(),
                expected: format!("at most the {} positions the forked sequence holds", src.len),
            });
        }
        let n = len.div_ceil(self.block_tokens);
        let dst = self.free_slot()?;
        let mut table = std::mem::take(&mut self.slots[dst].table);
        table.clear();
        table.extend_from_slice(&self.slots[seq.0].table[..n]);
        for &b in &table {
            self.refcount[b as usize] += 1;
        }
        let mut hashes = std::mem::take(&mut self.slots[dst].hashes);
        hashes.clear();
        let src = &self.slots[seq.0].hashes;
        hashes.extend_from_slice(&src[..src.len().min(len / self.block_tokens)]);
        self.slots[dst] = Slot { live: true, len, table, hashes };
        Ok(SeqId(dst))
    }

    /// Keeps the first `len` positions (speculative rollback, a conversation's shared prefix);
    /// frees the blocks past them (those no other sequence holds go back to the pool). A `len`
    /// at or past the current length, or an unknown sequence, changes nothing.
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        let Some(slot) = self.slots.get_mut(seq.0).filter(|s| s.live) else { return };
        if len >= slot.len {
            return;
        }
        let keep = len.div_ceil(self.block_tokens);
        slot.hashes.truncate(len / self.block_tokens);
        slot.len = len;
        let mut table = std::mem::take(&mut slot.table);
        // In reverse, so that the pool hands these blocks out again in their old order.
        for &b in table[keep..].iter().rev() {
            self.release(b);
        }
        table.truncate(keep);
        self.slots[seq.0].table = table;
    }

    /// Frees the sequence and every block only it held; its slot can be created again. An
    /// unknown or already freed sequence changes nothing.
    pub fn free(&mut self, seq: SeqId) {
        self.truncate(seq, 0);
        if let Some(slot) = self.slots.get_mut(seq.0) {
            slot.live = false;
        }
    }

    /// Whether block `b` is registered in the prefix cache (held by sequences, or idle).
    pub fn is_cached(&self, b: usize) -> bool {
        self.cache.hash.get(b).is_some_and(Option::is_some)
    }

    /// For the page's "Inside the engine" panel and `engine.info()`: for every block, the
    /// sequences whose tables hold it, in slot order (empty = free or, `is_cached`, idle in the
    /// prefix cache).
    pub fn owners(&self) -> Vec<Vec<usize>> {
        let mut owners = vec![Vec::new(); self.blocks()];
        for (i, slot) in self.slots.iter().enumerate().filter(|(_, s)| s.live) {
            for &b in &slot.table {
                owners[b as usize].push(i);
            }
        }
        owners
    }

    fn live(&self, seq: SeqId) -> Option<&Slot> {
        self.slots.get(seq.0).filter(|s| s.live)
    }

    fn free_slot(&self) -> Result<usize> {
        self.slots.iter().position(|s| !s.live).ok_or(Error::TooManySequences { max: self.slots.len() })
    }

    fn unknown(&self, seq: SeqId) -> Error {
        Error::InvalidOption {
            name: "sequence id",
            value: seq.0.to_string(),
            expected: format!(
                "a sequence that exists (below {}, created and not freed); this one was never created or was freed",
                self.slots.len()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks every invariant against the pool's private state, recomputed from the tables.
    fn check(p: &KvPool) {
        let bt = p.block_tokens;
        let mut rc = vec![0usize; p.blocks()];
        for (i, s) in p.slots.iter().enumerate() {
            if !s.live {
                assert!(s.table.is_empty() && s.len == 0, "freed slot {i} holds {s:?}");
                continue;
            }
            assert_eq!(s.table.len(), s.len.div_ceil(bt), "slot {i}: table length vs len {}", s.len);
            let mut seen = s.table.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), s.table.len(), "slot {i} holds a block twice: {:?}", s.table);
            for &b in &s.table {
                rc[b as usize] += 1;
            }
        }
        assert_eq!(rc, p.refcount, "refcounts vs table entries");
        let c = &p.cache;
        let registered = |b: u32| c.hash[b as usize].is_some();
        let mut free = p.free.clone();
        free.sort_unstable();
        let zero: Vec<u32> = (0..p.blocks() as u32).filter(|&b| rc[b as usize] == 0 && !registered(b)).collect();
        assert_eq!(free, zero, "free list vs unregistered blocks of refcount 0");
        // The cache's list, walked both ways, holds the registered blocks of refcount 0.
        let mut idle = Vec::new();
        let mut b = c.head;
        while b != NONE {
            idle.push(b);
            b = c.next[b as usize];
        }
        let mut back = Vec::new();
        let mut b = c.tail;
        while b != NONE {
            back.push(b);
            b = c.prev[b as usize];
        }
        back.reverse();
        assert_eq!(idle, back, "the cache's list forwards vs backwards");
        idle.sort_unstable();
        let cached: Vec<u32> = (0..p.blocks() as u32).filter(|&b| rc[b as usize] == 0 && registered(b)).collect();
        assert_eq!(idle, cached, "the cache's list vs registered blocks of refcount 0");
        assert_eq!(c.idle, cached.len());
        assert_eq!(p.free_blocks(), zero.len() + cached.len());
        assert_eq!(c.by_hash.len(), (0..p.blocks() as u32).filter(|&b| registered(b)).count());
        for (&h, &b) in &c.by_hash {
            assert_eq!(c.hash[b as usize], Some(h), "block {b} vs the hash it is found under");
        }
        for (i, s) in p.slots.iter().enumerate().filter(|(_, s)| s.live) {
            assert!(s.hashes.len() <= s.len / bt, "slot {i}: {} hashes for {} positions", s.hashes.len(), s.len);
        }
    }

    fn reserve(p: &mut KvPool, s: SeqId, len: usize) -> (bool, Vec<(u32, u32)>) {
        let mut copies = Vec::new();
        let changed = p.reserve(s, len, &mut copies).unwrap();
        check(p);
        (changed, copies)
    }

    #[test]
    fn new_sizes_the_pool() {
        let p = KvPool::new(70, 16, 3);
        assert_eq!((p.blocks(), p.free_blocks(), p.block_tokens(), p.max_seqs()), (4, 4, 16, 3));
        assert_eq!(p.max_blocks_per_seq(), 4);
        check(&p);
        let mut empty = KvPool::new(15, 16, 1);
        assert_eq!(empty.blocks(), 0);
        let s = empty.create().unwrap();
        assert!(matches!(
            empty.reserve(s, 1, &mut Vec::new()),
            Err(Error::KvPoolFull { needed_tokens: 16, free_tokens: 0, capacity_tokens: 0 })
        ));
        assert!(!empty.reserve(s, 0, &mut Vec::new()).unwrap());
        let mut zero = KvPool::new(64, 0, 1);
        assert_eq!((zero.blocks(), zero.block_tokens()), (0, 1));
        let s = zero.create().unwrap();
        assert!(matches!(zero.reserve(s, 5, &mut Vec::new()), Err(Error::KvPoolFull { .. })));
        check(&zero);
    }

    #[test]
    fn reserve_grows_across_block_boundaries() {
        let mut p = KvPool::new(16, 4, 2);
        let a = p.create().unwrap();
        assert_eq!((p.len(a), p.table(a)), (0, &[][..]));
        assert_eq!(reserve(&mut p, a, 1), (true, vec![]));
        assert_eq!(p.table(a), [0]);
        assert_eq!(reserve(&mut p, a, 4), (false, vec![])); // still block 0
        assert_eq!(reserve(&mut p, a, 5), (true, vec![]));
        assert_eq!(p.table(a), [0, 1]);
        assert_eq!(reserve(&mut p, a, 3), (false, vec![])); // shorter: nothing written
        assert_eq!(p.len(a), 5);
        let b = p.create().unwrap();
        assert_eq!(reserve(&mut p, b, 6), (true, vec![])); // a prefill of 6: two blocks at once
        assert_eq!(p.table(b), [2, 3]);
        assert_eq!(reserve(&mut p, a, 8), (false, vec![]));
        assert_eq!((p.len(a), p.free_blocks()), (8, 0));
        // Row of position p: table[p / 4] * 4 + p % 4.
        assert_eq!(p.table(b)[5 / 4] as usize * 4 + 5 % 4, 13);
    }

    #[test]
    fn fork_shares_and_copies_only_the_written_shared_last_block() {
        let mut p = KvPool::new(32, 4, 3);
        let a = p.create().unwrap();
        reserve(&mut p, a, 6); // blocks 0 (full), 1 (2 of 4)
        let b = p.fork(a, 6).unwrap();
        check(&p);
        assert_eq!((b, p.len(b), p.table(b)), (SeqId(1), 6, &[0, 1][..]));
        assert_eq!(p.free_blocks(), 6);
        assert_eq!(p.owners()[..3], [vec![0, 1], vec![0, 1], vec![]]);
        // b writes position 6, inside shared block 1: b gets a copy (block 2), a keeps block 1.
        assert_eq!(reserve(&mut p, b, 7), (true, vec![(1, 2)]));
        assert_eq!((p.table(a), p.table(b)), (&[0, 1][..], &[0, 2][..]));
        // a writes position 6: block 1 is a's alone now, so it is written in place.
        assert_eq!(reserve(&mut p, a, 7), (false, vec![]));
        // Crossing into a new block never copies: block 0 stays shared.
        assert_eq!(reserve(&mut p, a, 9), (true, vec![]));
        assert_eq!(p.table(a), [0, 1, 3]);
        assert_eq!(p.owners()[..4], [vec![0, 1], vec![0], vec![1], vec![0]]);
        // A fork at a block boundary shares only full blocks: its first write takes a new block.
        let c = p.fork(a, 4).unwrap();
        assert_eq!(p.table(c), [0]);
        assert_eq!(reserve(&mut p, c, 5), (true, vec![]));
        assert_eq!(p.table(c), [0, 4]);
        assert_eq!(p.owners()[0], [0, 1, 2]);
        // A fork of length 0 holds nothing.
        p.free(c);
        let d = p.fork(a, 0).unwrap();
        assert_eq!((p.len(d), p.table(d)), (0, &[][..]));
        check(&p);
    }

    #[test]
    fn fork_shorter_than_the_source_copies_when_either_writes_the_shared_block() {
        let mut p = KvPool::new(16, 4, 2);
        let a = p.create().unwrap();
        reserve(&mut p, a, 7); // blocks 0, 1
        let b = p.fork(a, 5).unwrap(); // shares 0, 1; b's positions 5, 6 in block 1 are garbage
        assert_eq!((p.len(b), p.table(b)), (5, &[0, 1][..]));
        // a writes position 7 into block 1, which b still reads (its position 4): a copies.
        assert_eq!(reserve(&mut p, a, 8), (true, vec![(1, 2)]));
        assert_eq!(reserve(&mut p, b, 6), (false, vec![])); // block 1 is b's alone
        assert_eq!((p.table(a), p.table(b)), (&[0, 2][..], &[0, 1][..]));
    }

    #[test]
    fn writing_into_a_full_shared_block_after_truncate_copies_it() {
        let mut p = KvPool::new(16, 4, 2);
        let a = p.create().unwrap();
        reserve(&mut p, a, 8); // blocks 0, 1, both full
        let b = p.fork(a, 8).unwrap();
        assert_eq!(reserve(&mut p, b, 8), (false, vec![])); // nothing new written
        p.truncate(b, 6); // rollback into block 1, still shared
        check(&p);
        assert_eq!((p.len(b), p.table(b)), (6, &[0, 1][..]));
        assert_eq!(reserve(&mut p, b, 7), (true, vec![(1, 2)]));
        assert_eq!(p.table(b), [0, 2]);
        assert_eq!(p.table(a), [0, 1]);
        // Truncating to a block boundary drops the block: the next write takes a new one.
        p.truncate(b, 4);
        check(&p);
        assert_eq!(p.table(b), [0]);
        assert_eq!(reserve(&mut p, b, 5), (true, vec![]));
        assert_eq!(p.table(b), [0, 2]); // block 2 came back to the pool and out again
    }

    #[test]
    fn truncate_frees_blocks_past_the_length() {
        let mut p = KvPool::new(20, 4, 2);
        let a = p.create().unwrap();
        reserve(&mut p, a, 17); // blocks 0..=4
        assert_eq!(p.free_blocks(), 0);
        p.truncate(a, 9);
        check(&p);
        assert_eq!((p.len(a), p.table(a), p.free_blocks()), (9, &[0, 1, 2][..], 2));
        p.truncate(a, 12); // longer than it holds: nothing
        assert_eq!(p.len(a), 9);
        let b = p.fork(a, 9).unwrap();
        p.truncate(a, 0); // shared blocks stay with b
        check(&p);
        assert_eq!((p.len(a), p.table(a), p.free_blocks()), (0, &[][..], 2));
        assert_eq!(p.table(b), [0, 1, 2]);
        p.truncate(b, 1);
        check(&p);
        assert_eq!(p.free_blocks(), 4);
        // Freed blocks come back in their old order.
        assert_eq!(reserve(&mut p, a, 12), (true, vec![]));
        assert_eq!(p.table(a), [1, 2, 3]);
    }

    #[test]
    fn free_returns_every_block_and_the_slot() {
        let mut p = KvPool::new(24, 4, 2);
        let a = p.create().unwrap();
        reserve(&mut p, a, 10);
        let b = p.fork(a, 10).unwrap();
        reserve(&mut p, b, 14); // copies 2 -> 3, adds 4
        assert_eq!((p.table(b), p.free_blocks()), (&[0, 1, 3, 4][..], 1));
        p.free(a);
        check(&p);
        assert_eq!((p.len(a), p.table(a)), (0, &[][..]));
        assert_eq!(p.free_blocks(), 2); // block 2 was a's alone; 0 and 1 stay with b
        p.free(b);
        check(&p);
        assert_eq!(p.free_blocks(), 6);
        assert!(p.owners().iter().all(Vec::is_empty));
        assert_eq!(p.create().unwrap(), SeqId(0));
        assert_eq!(p.create().unwrap(), SeqId(1));
    }

    #[test]
    fn kv_pool_full_changes_nothing() {
        let mut p = KvPool::new(16, 4, 3);
        let a = p.create().unwrap();
        reserve(&mut p, a, 10); // blocks 0, 1, 2
        let b = p.fork(a, 10).unwrap();
        let before = p.clone();
        let mut copies = vec![(7, 7)];
        // b writing position 10 needs a copy of block 2 and a new block for 12: 2 blocks, 1 free.
        let err = p.reserve(b, 13, &mut copies).unwrap_err();
        assert!(matches!(err, Error::KvPoolFull { needed_tokens: 8, free_tokens: 4, capacity_tokens: 16 }), "{err:?}");
        assert_eq!(err.to_string(), "the KV cache pool is full: 8 more tokens needed, 4 free of 16; finish or free other sequences, or load with a longer context");
        assert_eq!(err.code(), "kv-pool-full");
        assert_eq!(p, before);
        assert_eq!(copies, [(7, 7)]);
        // a too shares block 2: 22 new blocks and a copy.
        assert!(matches!(p.reserve(a, 100, &mut copies), Err(Error::KvPoolFull { needed_tokens: 92, .. })));
        assert_eq!(p, before);
        // One block fits: the copy alone.
        assert!(p.reserve(b, 12, &mut copies).unwrap());
        assert_eq!(copies, [(7, 7), (2, 3)]);
        check(&p);
    }

    #[test]
    fn too_many_sequences() {
        let mut p = KvPool::new(16, 4, 2);
        let a = p.create().unwrap();
        let b = p.create().unwrap();
        assert_eq!((a, b), (SeqId(0), SeqId(1)));
        let err = p.create().unwrap_err();
        assert!(matches!(err, Error::TooManySequences { max: 2 }), "{err:?}");
        assert_eq!(err.code(), "too-many-sequences");
        assert!(matches!(p.fork(a, 0), Err(Error::TooManySequences { max: 2 })));
        p.free(a);
        assert_eq!(p.fork(b, 0).unwrap(), SeqId(0));
        let mut none = KvPool::new(16, 4, 0);
        assert!(matches!(none.create(), Err(Error::TooManySequences { max: 0 })));
        check(&p);
    }

    #[test]
    fn unknown_and_freed_sequences_are_harmless() {
        let mut p = KvPool::new(16, 4, 2);
        let a = p.create().unwrap();
        reserve(&mut p, a, 5);
        p.free(a);
        let before = p.clone();
        for s in [a, SeqId(1), SeqId(99)] {
            assert_eq!((p.len(s), p.table(s)), (0, &[][..]));
            assert!(matches!(p.reserve(s, 3, &mut Vec::new()), Err(Error::InvalidOption { .. })));
            assert!(matches!(p.fork(s, 0), Err(Error::InvalidOption { .. })));
            p.truncate(s, 0);
            p.free(s);
            assert_eq!(p, before);
        }
        let a = p.create().unwrap();
        reserve(&mut p, a, 5);
        assert!(matches!(p.fork(a, 6), Err(Error::InvalidOption { name: "fork length", .. })));
        check(&p);
    }

    #[test]
    fn owners_lists_the_sequences_of_each_block() {
        let mut p = KvPool::new(24, 4, 3);
        let a = p.create().unwrap();
        reserve(&mut p, a, 6); // 0, 1
        let b = p.fork(a, 6).unwrap();
        reserve(&mut p, b, 9); // copies 1 -> 2, adds 3
        let c = p.fork(b, 4).unwrap(); // shares 0
        assert_eq!(p.owners(), [vec![0, 1, 2], vec![0], vec![1], vec![1], vec![], vec![]]);
        p.free(b);
        assert_eq!(p.owners(), [vec![0, 2], vec![0], vec![], vec![], vec![], vec![]]);
        assert_eq!(c, SeqId(2));
    }

    #[test]
    fn freed_committed_blocks_stay_cached_until_evicted_least_recently_used_first() {
        let mut p = KvPool::new(16, 4, 3); // 4 blocks
        let (a, b) = (p.create().unwrap(), p.create().unwrap());
        let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (100..106).collect());
        reserve(&mut p, a, 8);
        reserve(&mut p, b, 6);
        p.commit(a, &ta);
        p.commit(b, &tb); // one full block; the partial one is not registered
        check(&p);
        assert_eq!(p.cached_blocks(), 3);
        // Positions, and blocks no sequence holds, of the cached prefixes (whole blocks only).
        assert_eq!(p.cached_prefix(&ta), (8, 0));
        assert_eq!(p.cached_prefix(&ta[..7]), (4, 0));
        assert_eq!(p.cached_prefix(&[0, 1, 2, 9]), (0, 0));
        assert_eq!(p.cached_prefix(&tb), (4, 0));
        p.free(a);
        p.free(b);
        check(&p);
        assert_eq!((p.free_blocks(), p.cached_blocks()), (4, 3));
        assert_eq!(p.cached_prefix(&ta), (8, 2));
        // A new sequence takes the free block (b's partial one, 3) first, then evicts the least
        // recently freed cached block: a's blocks went back last first, so its block 1.
        let c = p.create().unwrap();
        reserve(&mut p, c, 8);
        check(&p);
        assert_eq!(p.table(c), [3, 1]);
        assert_eq!(p.cached_prefix(&ta), (4, 1), "a's second block was evicted, its first kept");
        assert_eq!(p.cached_prefix(&tb), (4, 1));
        // A hit takes the block out of the cache's list: it no longer counts as free.
        let (d, len) = p.create_cached(&tb).unwrap();
        assert_eq!((len, p.table(d), p.free_blocks()), (4, &[2][..], 1));
        // Writing on from the end of a cached full block appends a block; truncating into it
        // and writing copies it (it is registered).
        assert_eq!(reserve(&mut p, d, 5), (true, vec![]));
        p.truncate(d, 3);
        p.free(c);
        assert_eq!(reserve(&mut p, d, 4), (true, vec![(2, 3)]));
        assert_eq!(p.cached_prefix(&tb), (4, 1), "the cached block is intact");
        p.evict_cached();
        check(&p);
        assert_eq!((p.cached_blocks(), p.cached_prefix(&tb)), (0, (0, 0)));
    }

    /// A tiny xorshift64 so the random test needs no dependency and replays from its seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Random create / reserve / fork / truncate / free / commit / create_cached against a
    /// simulated GPU buffer: every write stamps into the row the table names (after applying the
    /// returned copies) a value that depends on the sequence's tokens up to that position, as a
    /// key or a value does; each live sequence must always read back the stamps of its own
    /// tokens (so no two sequences ever write the same block, and a block from the prefix cache
    /// holds exactly what the sequence would have written), every block written has refcount 1
    /// and is not registered. Tokens are drawn from two values, so prefixes repeat and hit.
    #[test]
    fn random_operations_keep_sequences_apart() {
        // What the run went through, so that it cannot pass by never reaching the hard cases.
        let (mut cows, mut fulls, mut forks, mut hits, mut evictions) = (0, 0, 0, 0, 0);
        let stamp = |tokens: &[u32]| chain(7, tokens);
        for seed in 1..=60u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let bt = 1 + rng.below(5);
            let max_seqs = 1 + rng.below(6);
            let mut p = KvPool::new(bt * (2 + rng.below(12)) + rng.below(bt), bt, max_seqs);
            let mut rows = vec![0u64; p.blocks() * bt];
            // Each slot's tokens (those of its positions).
            let mut toks: Vec<Vec<u32>> = vec![Vec::new(); max_seqs];
            let mut copies = Vec::new();
            for step in 0..400 {
                // Mostly live ids, sometimes a slot that may be free, rarely one out of range.
                let live: Vec<usize> = (0..max_seqs).filter(|&i| p.live(SeqId(i)).is_some()).collect();
                let s = if !live.is_empty() && rng.below(8) != 0 {
                    SeqId(live[rng.below(live.len())])
                } else {
                    SeqId(rng.below(max_seqs + 2))
                };
                let is_live = p.live(s).is_some();
                let before = p.clone();
                match rng.below(13) {
                    0 => match p.create() {
                        Ok(n) => {
                            assert!(p.len(n) == 0);
                            toks[n.0].clear();
                        }
                        Err(e) => {
                            assert!(matches!(e, Error::TooManySequences { .. }) && live.len() == max_seqs)
                        }
                    },
                    1..=5 => {
                        let old = p.len(s);
                        let len = old.saturating_sub(bt) + rng.below(3 * bt + 2);
                        copies.clear();
                        let cached_before = p.cached_blocks();
                        match p.reserve(s, len, &mut copies) {
                            Ok(changed) => {
                                assert_eq!(changed, p.table(s) != before.table(s), "seed {seed} step {step}");
                                evictions += cached_before.saturating_sub(p.cached_blocks());
                                cows += copies.len();
                                for &(from, to) in &copies {
                                    assert_eq!(p.refcount[to as usize], 1);
                                    let (from, to) = (from as usize * bt, to as usize * bt);
                                    rows.copy_within(from..from + bt, to);
                                }
                                for pos in old..len {
                                    let block = p.table(s)[pos / bt];
                                    assert_eq!(p.refcount[block as usize], 1, "seed {seed} step {step}: shared write");
                                    assert!(
                                        p.cache.hash[block as usize].is_none(),
                                        "seed {seed} step {step}: cached write"
                                    );
                                    toks[s.0].push(rng.below(2) as u32);
                                    rows[block as usize * bt + pos % bt] = stamp(&toks[s.0]);
                                }
                                assert_eq!(p.len(s), len.max(old));
                            }
                            Err(Error::KvPoolFull { needed_tokens, free_tokens, capacity_tokens }) => {
                                fulls += 1;
                                assert!(is_live && needed_tokens > free_tokens);
                                assert_eq!(capacity_tokens, p.blocks() * bt);
                                assert_eq!(p, before);
                                assert!(copies.is_empty());
                            }
                            Err(e) => {
                                assert!(!is_live && matches!(e, Error::InvalidOption { .. }), "{e:?}");
                                assert_eq!(p, before);
                            }
                        }
                    }
                    6 | 7 => {
                        let len = rng.below(p.len(s) + 2);
                        match p.fork(s, len) {
                            Ok(n) => {
                                forks += 1;
                                assert!(len <= before.len(s));
                                toks[n.0] = toks[s.0][..len].to_vec();
                            }
                            Err(_) => assert_eq!(p, before),
                        }
                    }
                    8 => {
                        let len = rng.below(p.len(s) + 2);
                        p.truncate(s, len);
                        if is_live {
                            toks[s.0].truncate(len);
                        } else {
                            assert_eq!(p, before);
                        }
                    }
                    9 => {
                        // Up to all its tokens (the caller commits positions it has written).
                        let n = rng.below(p.len(s) + 1);
                        if is_live {
                            p.commit(s, &toks[s.0][..n]);
                        }
                    }
                    10 | 11 => {
                        let tokens: Vec<u32> = (0..rng.below(4 * bt + 1)).map(|_| rng.below(2) as u32).collect();
                        let (want_len, idle) = p.cached_prefix(&tokens);
                        let free = p.free_blocks();
                        match p.create_cached(&tokens) {
                            Ok((n, len)) => {
                                assert_eq!((len, p.len(n)), (want_len, want_len));
                                assert_eq!(p.free_blocks(), free - idle, "seed {seed} step {step}");
                                hits += usize::from(len > 0);
                                toks[n.0] = tokens[..len].to_vec();
                            }
                            Err(e) => assert!(matches!(e, Error::TooManySequences { .. }) && live.len() == max_seqs),
                        }
                    }
                    _ => {
                        // The check below forgets what a freed sequence wrote.
                        p.free(s);
                        assert!(p.live(s).is_none());
                    }
                }
                check(&p);
                for (i, want) in toks.iter_mut().enumerate() {
                    let seq = SeqId(i);
                    if p.live(seq).is_none() {
                        want.clear();
                        continue;
                    }
                    assert_eq!(p.len(seq), want.len(), "seed {seed} step {step} seq {i}");
                    for pos in 0..want.len() {
                        let row = p.table(seq)[pos / bt] as usize * bt + pos % bt;
                        assert_eq!(rows[row], stamp(&want[..=pos]), "seed {seed} step {step}: seq {i} position {pos}");
                    }
                }
            }
        }
        assert!(hits > 50 && evictions > 20, "cache hits {hits}, evictions {evictions}");
        assert!(cows > 50 && fulls > 50 && forks > 50, "copies {cows}, full {fulls}, forks {forks}");
    }
}
