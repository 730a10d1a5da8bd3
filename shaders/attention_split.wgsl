override SPLITS: u32;

// Decode attention's split of a row's keys (shared by attention_decode.wgsl, which scores each
// split, and attention_combine.wgsl, which merges them; `kernels::decode_splits_used` counts the
// same on the host). The keys first .. seq - 1 go to at most SPLITS workgroups in ranges of whole
// CHUNK-key tiles, as few tiles each as spread them over all SPLITS: the records grow with the
// splits used, not with the context, and a long context keeps every workgroup busy for longer.

// The keys of split s: [x, y), empty past the last split used.
fn split_keys(first: u32, seq: u32, s: u32) -> vec2<u32> {
    let per = split_tiles(first, seq) * CHUNK;
    let x = min(first + s * per, seq);
    return vec2<u32>(x, min(x + per, seq));
}

// Tiles a split takes.
fn split_tiles(first: u32, seq: u32) -> u32 {
    let tiles = (seq - first + CHUNK - 1u) / CHUNK;
    return max((tiles + SPLITS - 1u) / SPLITS, 1u);
}

// Splits holding keys.
fn splits_used(first: u32, seq: u32) -> u32 {
    let tiles = (seq - first + CHUNK - 1u) / CHUNK;
    let per = split_tiles(first, seq);
    return (tiles + per - 1u) / per;
}
