//! Wrappers of shaders/attention_decode.wgsl and shaders/attention_prefill(_direct).wgsl.

use super::{Dispatch, Groups, Segment, Traffic};
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::{Gpu, KernelStyle};
use crate::model::reference::AttentionKind;
use crate::model::ModelConfig;

/// Queries per prefill workgroup of one head (fewer where the workgroup memory is short; with a
/// KV head's query heads packed, rows of them: `prefill_tiles`).
const BQ: u32 = 8;
/// The most rows (queries times heads) a packed prefill tile takes.
const PACKED_ROWS: u32 = 32;

/// Keys per tile of decode attention (a split walks whole tiles; shaders/attention_split.wgsl).
pub const DECODE_CHUNK: usize = 64;
/// Query heads one decode-attention workgroup scores at a time (its registers per invocation).
const DECODE_HEAD_BATCH: usize = 8;

/// Query heads a decode-attention workgroup scores at a time: all of a group up to
/// DECODE_HEAD_BATCH, fewer where their q rows, scores and partial sums would overflow the
/// device's workgroup memory (shaders/attention_decode.wgsl: per head 2 HEAD_DIM + CHUNK + 3 +
/// THREADS floats, and a row index per key).
fn decode_head_batch(gpu: &Gpu, head_dim: usize, group: usize) -> u32 {
    let (chunk, threads) = (DECODE_CHUNK as u32, decode_threads(gpu));
    let words = gpu.limits.max_compute_workgroup_storage_size / 4 - chunk;
    let fits = words / (2 * head_dim as u32 + chunk + 3 + threads);
    (group.min(DECODE_HEAD_BATCH) as u32).min(fits).max(1)
}

/// Invocations of a decode-attention workgroup (both passes): one per key on CPU adapters; on GPUs
/// four, so that each walks a quarter of a key's dimensions (a fraction of the keys for the
/// values, of the chunks when merging).
fn decode_threads(gpu: &Gpu) -> u32 {
    match gpu.style {
        KernelStyle::Cpu => DECODE_CHUNK as u32,
        KernelStyle::Gpu => 4 * DECODE_CHUNK as u32,
    }
}

/// Workgroups decode attention spreads a KV head's keys over at most: on GPUs enough that, with
/// the KV heads, a long context fills a large GPU's units several times (the H200's 132 at
/// 8 KV heads: 512 workgroups) while the combine reads few records. On CPU adapters a tile
/// each however long the context (`ONE_TILE`): lavapipe runs the tile loop, whose body holds
/// barriers, twice as slowly as a single tile when its count is not a constant.
fn max_splits(gpu: &Gpu) -> usize {
    match gpu.style {
        KernelStyle::Cpu => usize::MAX,
        KernelStyle::Gpu => 64,
    }
}

/// The splits decode attention's kernels are built for at a context of `context` keys: a tile
/// each up to `max_splits`, then more tiles each.
pub fn decode_splits(gpu: &Gpu, context: usize) -> usize {
    context.div_ceil(DECODE_CHUNK).clamp(1, max_splits(gpu))
}

/// The longest context decode attention serves: unbounded on GPUs (their splits stop at 64),
/// on CPU adapters as many tiles as a row's records fit in `max_binding` bytes and a dispatch
/// has workgroups along x.
pub fn decode_max_context(gpu: &Gpu, c: &ModelConfig, max_binding: usize) -> usize {
    if max_splits(gpu) != usize::MAX {
        return usize::MAX;
    }
    // The direct kernel's records hold up to 64 / GROUP more splits than hold keys
    // (`record_splits`).
    let tiles = (max_binding / (4 * c.n_heads * (c.head_dim + 2)).max(1))
        .saturating_sub(64 / (c.n_heads / c.n_kv_heads).max(1))
        .min(gpu.limits.max_compute_workgroups_per_dimension as usize);
    tiles.saturating_mul(DECODE_CHUNK)
}

/// Whether decode attention runs shaders/attention_decode_direct.wgsl (CPU adapters, heads of
/// whole vec4s): an invocation per (split, query head), no barriers.
fn decode_direct(gpu: &Gpu, c: &ModelConfig) -> bool {
    gpu.style == KernelStyle::Cpu && c.head_dim % 4 == 0
}

/// Records a query head holds, one per split: `splits`, or for the direct kernel as many as its
/// dispatch has invocations for, `nwg.x * 64 / GROUP`, which it reads at run time, so that it
/// is built once per shape and not once per context.
fn record_splits(gpu: &Gpu, c: &ModelConfig, splits: usize) -> usize {
    let group = c.n_heads / c.n_kv_heads;
    match decode_direct(gpu, c) {
        true => (splits * group).div_ceil(64) * 64 / group,
        false => splits,
    }
}

/// The splits holding keys when `keys` keys are attended over `splits` (the count
/// shaders/attention_split.wgsl's `splits_used` makes on the GPU).
pub fn decode_splits_used(keys: usize, splits: usize) -> usize {
    let tiles = keys.div_ceil(DECODE_CHUNK);
    tiles.div_ceil(tiles.div_ceil(splits).max(1))
}

/// The split records decode attention passes from its first kernel to its second: floats for
/// one sequence's query over a context of `context` keys (a batch takes one such a row).
pub fn decode_partials_len(gpu: &Gpu, c: &ModelConfig, context: usize) -> usize {
    c.n_heads * record_splits(gpu, c, decode_splits(gpu, context)) * (c.head_dim + 2)
}

/// The source of one of decode attention's kernels: shaders/`$file` after the files it shares.
macro_rules! decode_source {
    ($($file:literal),+) => {
        concat!($(include_str!(concat!("../../../shaders/", $file))),+)
    };
}

/// The longest context at which decode attention can run as one dispatch
/// (shaders/attention_decode_one.wgsl; CPU adapters): a split a tile, as many tiles as one
/// workgroup's 64 invocations hold splits for a KV head's query heads. 0 where there is no
/// such kernel.
pub fn decode_short_keys(gpu: &Gpu, c: &ModelConfig) -> usize {
    match decode_direct(gpu, c) {
        true => 64 / (c.n_heads / c.n_kv_heads).max(1) * DECODE_CHUNK,
        false => 0,
    }
}

/// Decode attention as two dispatches: every (split of the keys, KV head) for all the group's
/// query heads, then the merge of the splits per head (shaders/attention_decode.wgsl,
/// shaders/attention_combine.wgsl), for each of the pass's rows (a sequence's query each), on
/// the decode rows' segment. With `short` (CPU adapters, `decode_short_keys` > 0) also the two
/// in one dispatch for short contexts (shaders/attention_decode_one.wgsl), on
/// `Segment::ShortDecode`, and the two passes on `Segment::LongDecode`: a pass encodes one or
/// the other by its rows' contexts (`SegmentRows::short`).
/// `partials` holds `decode_partials_len(c, context)` floats a row.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    c: &ModelConfig,
    kind: AttentionKind,
    context: usize,
    short: bool,
    qkv: &wgpu::Buffer,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
    partials: &wgpu::Buffer,
    out: &wgpu::Buffer,
    batch: &wgpu::Buffer,
    sinks: Option<&wgpu::Buffer>,
) -> Vec<Dispatch> {
    let group = c.n_heads / c.n_kv_heads;
    let splits = decode_splits(gpu, context);
    let consts = [
        ("HEAD_DIM", c.head_dim as u32),
        ("CHUNK", DECODE_CHUNK as u32),
        ("HB", decode_head_batch(gpu, c.head_dim, group)),
        ("THREADS", decode_threads(gpu)),
    ];
    let window = ("WINDOW", kind.window.unwrap_or(0) as f64);
    // CPU adapters: an invocation per (split, query head), no barriers, reading the record
    // stride from its dispatch (shaders/attention_decode_direct.wgsl): no SPLITS.
    let direct = decode_direct(gpu, c);
    let mut overrides = vec![
        ("KV_DIM", c.kv_dim() as f64),
        ("GROUP", group as f64),
        ("QKV_STRIDE", (c.q_dim() + 2 * c.kv_dim()) as f64),
        ("SCALE", kind.scale as f64),
        ("ONE_TILE", f64::from(u8::from(max_splits(gpu) == usize::MAX))),
        window,
    ];
    overrides.extend((!direct).then_some(("SPLITS", splits as f64)));
    let split_needs = softcapped(kind, &mut overrides);
    // The one-dispatch kernel's (direct only): the first pass's, and the merge's SPLITS and SINKS.
    let sinks_on = ("SINKS", sinks.is_some() as u32 as f64);
    let one_overrides: Vec<_> = overrides.iter().copied().chain([("SPLITS", splits as f64), sinks_on]).collect();
    let (source, x_groups) = match direct {
        true => (
            decode_source!("attention_decode_io.wgsl", "attention_split_record.wgsl", "attention_decode_direct.wgsl"),
            (splits * group).div_ceil(64) as u32,
        ),
        false => {
            (decode_source!("attention_split.wgsl", "attention_decode_io.wgsl", "attention_decode.wgsl"), splits as u32)
        }
    };
    let pipeline = cache.get(gpu, "attention_decode", source, split_needs, &consts, &overrides);
    let bind_group = gpu.bind_group("attention_decode", &pipeline, &[qkv, k_cache, v_cache, partials, batch]);
    let (q_bytes, records) = (4 * c.q_dim() as u64, 4 * (c.n_heads * (c.head_dim + 2)) as u64);
    let split = Dispatch {
        label: "attention_decode",
        pipeline,
        bind_group,
        groups: Groups { fixed: [x_groups, c.n_kv_heads as u32, 1], tokens: Some((2, 1)), segment: Default::default() },
        // q, every key and value attended, the split records written.
        traffic: Traffic {
            activations: q_bytes,
            kv_per_key: 2 * c.kv_dim() as u64 * gpu.kv_bytes(),
            records_per_split: records,
            splits,
            window: kind.window,
            ..Default::default()
        },
    };
    // CPU adapters: an invocation per output value, no barriers
    // (shaders/attention_combine_direct.wgsl).
    let (source, x_groups) = match direct {
        true => (
            decode_source!("attention_split.wgsl", "attention_merge.wgsl", "attention_combine_direct.wgsl"),
            (c.n_heads * c.head_dim).div_ceil(64) as u32,
        ),
        false => (decode_source!("attention_split.wgsl", "attention_combine.wgsl"), c.n_heads as u32),
    };
    let mut overrides =
        vec![("SPLITS", splits as f64), ("RECORDS", record_splits(gpu, c, splits) as f64), window, sinks_on];
    overrides.extend(direct.then_some(("N_HEADS", c.n_heads as f64)));
    let needs = Needs { batch: true, ..Default::default() };
    let pipeline = cache.get(gpu, "attention_combine", source, needs, &consts, &overrides);
    let bind_group = gpu.bind_group("attention_combine", &pipeline, &[partials, out, batch, sinks.unwrap_or(partials)]);
    let records_read =
        Traffic { activations: q_bytes, records_per_split: records, splits, window: kind.window, ..Default::default() };
    let combine = Dispatch {
        label: "attention_combine",
        pipeline,
        bind_group,
        groups: Groups::per_token(x_groups, 1, 1),
        // The records read, the output written.
        traffic: records_read,
    };
    if !short {
        return vec![split.on(Segment::Decode), combine.on(Segment::Decode)];
    }
    assert!(direct && context.min(decode_short_keys(gpu, c)) > 0, "no one-dispatch decode attention here");
    let source = decode_source!(
        "attention_split.wgsl",
        "attention_decode_io.wgsl",
        "attention_split_record.wgsl",
        "attention_merge.wgsl",
        "attention_decode_one.wgsl"
    );
    let pipeline = cache.get(gpu, "attention_decode_one", source, split_needs, &consts, &one_overrides);
    // Without sinks a read-only stand-in: `partials` is bound for writing.
    let entries = [qkv, k_cache, v_cache, partials, batch, out, sinks.unwrap_or(qkv)];
    let bind_group = gpu.bind_group("attention_decode_one", &pipeline, &entries);
    let one = Dispatch {
        label: "attention_decode_one",
        pipeline,
        bind_group,
        groups: Groups { fixed: [1, c.n_kv_heads as u32, 1], tokens: Some((2, 1)), segment: Segment::ShortDecode },
        // The two passes' bytes: the records still go through memory, written then read.
        traffic: Traffic { activations: 2 * q_bytes, records_per_split: 2 * records, ..split.traffic },
    };
    vec![split.on(Segment::LongDecode), combine.on(Segment::LongDecode), one]
}

/// An attention kernel's needs: the cache, and `softcap`, which soft-caps its scores where the
/// layer says so (the SOFTCAP override; without it the identity).
fn softcapped(kind: AttentionKind, overrides: &mut Vec<(&str, f64)>) -> Needs {
    overrides.extend(kind.softcap.map(|cap| ("SOFTCAP", cap as f64)));
    Needs { kv: true, softcap: true, ..Default::default() }
}

/// The tiled prefill kernel's block within the device's workgroup memory: (rows, heads a row
/// block, keys). The `group` query heads of a KV head share a block, so that each K/V tile is
/// read once for all of them, with ceil(BQ / group) queries each (at least BQ rows: never more
/// workgroups than one head a block; fewer queries where memory is short), while that leaves
/// room for 2 keys a block and the rows fit the `invocations` (one a row for the softmax).
/// Otherwise one head: BQ queries (fewer for wide heads on small limits: Gemma 4's 512-dim
/// heads in WebGPU's minimum 16 KiB). Keys: as many as fit, up to 32.
fn prefill_tiles(head_dim: u32, group: u32, invocations: u32, workgroup_bytes: u32) -> (u32, u32, u32) {
    // q tile, the row max/sum/scale and the score rows' padding; per key: its padded K row,
    // its V row and a score per row (shaders/attention_prefill.wgsl).
    let keys = |rows: u32| {
        let fixed = (rows * head_dim + 4 * rows) * 4;
        let per_key = (2 * head_dim + 1 + rows) * 4;
        workgroup_bytes.saturating_sub(fixed) / per_key
    };
    let packed = (1..=BQ.div_ceil(group)).rev().map(|queries| queries * group);
    let packed = packed.filter(|&rows| rows <= PACKED_ROWS.min(invocations)).find(|&rows| keys(rows) >= 2);
    let (rows, heads) = match packed {
        Some(rows) if group > 1 => (rows, group),
        _ => ([BQ, BQ / 2, BQ / 4].into_iter().find(|&bq| keys(bq) >= 2).unwrap_or(1), 1),
    };
    (rows, heads, keys(rows).clamp(1, 32))
}

#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    c: &ModelConfig,
    kind: AttentionKind,
    qkv: &wgpu::Buffer,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
    out: &wgpu::Buffer,
    batch: &wgpu::Buffer,
    sinks: Option<&wgpu::Buffer>,
) -> Dispatch {
    let hd = c.head_dim as u32;
    let group = (c.n_heads / c.n_kv_heads) as u32;
    let (per, wg) = super::head_invocations(hd);
    let (rows, heads, bk) = prefill_tiles(hd, group, wg, gpu.limits.max_compute_workgroup_storage_size);
    let consts = [("HD", hd), ("VPI", per), ("WG", wg), ("BQ", rows), ("BK", bk), ("HEADS", heads)];
    let mut overrides = vec![
        ("Q_DIM", c.q_dim() as f64),
        ("KV_DIM", c.kv_dim() as f64),
        ("GROUP", group as f64),
        ("SCALE", kind.scale as f64),
        ("WINDOW", kind.window.unwrap_or(0) as f64),
        ("SINKS", sinks.is_some() as u32 as f64),
    ];
    let needs = softcapped(kind, &mut overrides);
    // CPU adapters: one query per invocation, no tiles (shaders/attention_prefill_direct.wgsl),
    // the lanes of a workgroup on the same keys (UNIFORM_KEYS) but where SwiftShader's compiler
    // runs them (`Gpu::unroll_rows`), which gathers every load anyway and would only do the
    // extra keys (attention 3.1-3.4 -> 3.7-3.8 s at 256 tokens; lavapipe 26: 1.7 -> 0.6 s at 512).
    let (source, queries_per_group, heads) = match gpu.style {
        KernelStyle::Gpu => (include_str!("../../../shaders/attention_prefill.wgsl"), rows / heads, heads),
        KernelStyle::Cpu => {
            overrides.push(("UNIFORM_KEYS", !gpu.unroll_rows as u32 as f64));
            (include_str!("../../../shaders/attention_prefill_direct.wgsl"), 64, 1)
        }
    };
    let pipeline = cache.get(gpu, "attention_prefill", source, needs, &consts, &overrides);
    let sinks = sinks.unwrap_or(qkv);
    let bind_group =
        gpu.bind_group("attention_prefill", &pipeline, &[params, qkv, k_cache, v_cache, out, batch, sinks]);
    let mut groups = Groups::per_token(1, 0, queries_per_group);
    groups.fixed[1] = c.n_heads as u32 / heads;
    // Prefill only: the decode ledger never counts it.
    Dispatch { label: "attention_prefill", pipeline, bind_group, groups, traffic: Traffic::default() }
}

#[cfg(test)]
mod tests {
    use super::prefill_tiles;

    /// Blocks counted by hand from the workgroup memory formula: (rows * HD + 4 rows) floats
    /// fixed, (2 HD + 1 + rows) floats a key.
    #[test]
    fn prefill_tiles_pack_a_kv_heads_query_heads_where_they_fit() {
        // SmolLM2: 64-dim heads, 3 a KV head, 16 KiB: 3 queries of 3 heads; 2448 bytes fixed,
        // 552 a key: 25 keys.
        assert_eq!(prefill_tiles(64, 3, 64, 16384), (9, 3, 25));
        // Gemma 3 270M: 256-dim heads, 4 a KV head, 32 KiB: 2 queries of 4 heads; 8320 fixed,
        // 2084 a key: 11 keys.
        assert_eq!(prefill_tiles(256, 4, 256, 32768), (8, 4, 11));
        // No grouping: 8 queries of one head.
        assert_eq!(prefill_tiles(64, 1, 64, 16384), (8, 1, 25));
        // 8 heads a KV head: one query of the 8. 16 heads would need 16 rows: past 8
        // invocations, one head a block keeps its 8 queries.
        assert_eq!(prefill_tiles(64, 8, 64, 16384), (8, 8, 25));
        assert_eq!(prefill_tiles(64, 16, 8, 16384), (8, 1, 25));
        // Gemma 4's 512-dim heads in WebGPU's minimum 16 KiB: 2 rows (one query of both heads)
        // leave room for 2 keys, 4 rows for 1.
        assert_eq!(prefill_tiles(512, 2, 256, 16384), (2, 2, 2));
    }

    /// What the shader assumes of any block: rows within the workgroup (one invocation a row's
    /// softmax state), heads 1 or the whole group and dividing the rows, at least one key.
    #[test]
    fn prefill_tiles_fit_the_shaders_assumptions_for_every_shape() {
        for hd in [16, 32, 64, 80, 96, 128, 256, 512] {
            let (_, wg) = crate::gpu::kernels::head_invocations(hd);
            for group in [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64] {
                for bytes in [16384, 32768, 49152] {
                    let (rows, heads, keys) = prefill_tiles(hd, group, wg, bytes);
                    let at = format!("HD {hd}, group {group}, {bytes} bytes: {rows} rows of {heads} heads");
                    assert!(rows >= 1 && rows <= wg && rows % heads == 0, "{at}");
                    assert!(heads == 1 || heads == group, "{at}");
                    assert!((1..=32).contains(&keys), "{at}");
                    let fixed = (rows * hd + 4 * rows) * 4;
                    assert!(fixed + keys * (2 * hd + 1 + rows) * 4 <= bytes, "{at}: {keys} keys overflow");
                }
            }
        }
    }
}
