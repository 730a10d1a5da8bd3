// Top-k for sampling on the GPU: the K largest logits, ties going to the lower id as the CPU
// sampler orders them, found by a radix select (8 bits a pass) over the logits' order-preserving
// bit patterns, one workgroup a row of logits. The host reads back K (id, logit) pairs instead
// of the whole vocabulary and finishes top-p, min-p and the seeded draw on them.
// With a temperature T (a top-p/min-p sampler without top-k): also what the host needs of the
// logits not selected: the sum of exp(l / T - l_max / T) over them, and the largest |logit|.
// Bindings: 0 logits (rows of N), 1 want (per row: K, at most the output's room, 0 = skip the
// row; T's bits, 0 = no tail), 2 out (per row OUT words: [count (K or N), tail sum, largest
// |logit|, then count pairs (id, logit bits), in no order]), 3 the constraint masks
// (kernels::mask_wgsl): a masked row selects among its allowed tokens alone, and its tail weighs
// only those (K is at most the allowed count). Dispatch: (rows, 1, 1).

override N: u32;
override OUT: u32;
const WG: u32 = 256u;
const PAIRS: u32 = 3u;

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> want: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> hist: array<atomic<u32>, 256>;
// The selected key's bits so far, which bits are selected, how many of the keys equal to the
// selection are still to take.
var<workgroup> state: array<u32, 3>;
var<workgroup> ties_before: array<u32, WG>;
var<workgroup> written: atomic<u32>;
// With a tail: per-invocation partial maxima and sums.
var<workgroup> red: array<vec2<f32>, WG>;
// This row's K and T's bits, read by every invocation as one (so that the barriers after a
// test of them stay in uniform control flow).
var<workgroup> row_k: u32;
var<workgroup> row_t: u32;
// The row's logits and output start.
var<private> base: u32;
var<private> out_base: u32;
var<private> row: u32;
var<private> masked: bool;

// Token i may be selected: the row has no mask, or its mask allows i.
fn ok(i: u32) -> bool {
    return !masked || token_allowed(row, i);
}

// Larger float, larger key (NaN aside: the argmax kernel flags those).
fn key(l: f32) -> u32 {
    let b = bitcast<u32>(l);
    return select(b | 0x80000000u, ~b, (b >> 31u) == 1u);
}

fn emit(i: u32) {
    let s = atomicAdd(&written, 1u);
    out[out_base + PAIRS + 2u * s] = i;
    out[out_base + PAIRS + 1u + 2u * s] = bitcast<u32>(logits[base + i]);
}

// The workgroup's sum (of .x and .y alike, `max_of` false) or maximum of `red`, into red[0].
fn reduce(t: u32, max_of: bool) {
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if (t < s) { red[t] = select(red[t] + red[t + s], max(red[t], red[t + s]), max_of); }
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    row = wg.x;
    base = row * N;
    out_base = row * OUT;
    if (t == 0u) {
        row_k = want[2u * row];
        row_t = want[2u * row + 1u];
    }
    let k_wanted = workgroupUniformLoad(&row_k);
    if (k_wanted == 0u) { return; }
    let t_bits = workgroupUniformLoad(&row_t);
    let tail_on = t_bits != 0u;
    masked = row_masked(row);
    if (t == 0u) {
        state[0] = 0u;
        state[1] = 0u;
        state[2] = min(k_wanted, N);
        atomicStore(&written, 0u);
    }
    for (var shift = 24u; shift < 32u; shift -= 8u) {
        atomicStore(&hist[t], 0u);
        workgroupBarrier();
        let prefix = state[0];
        let mask = state[1];
        for (var i = t; i < N; i += WG) {
            let k = key(logits[base + i]);
            if ((k & mask) == prefix && ok(i)) { atomicAdd(&hist[(k >> shift) & 255u], 1u); }
        }
        workgroupBarrier();
        if (t == 0u) {
            // From the top bin down, take whole bins until the one holding the K-th key.
            var remaining = state[2];
            var b = 255u;
            loop {
                let c = atomicLoad(&hist[b]);
                if (c >= remaining || b == 0u) { break; }
                remaining -= c;
                b -= 1u;
            }
            state[0] = prefix | (b << shift);
            state[1] = mask | (255u << shift);
            state[2] = remaining;
        }
        workgroupBarrier();
    }
    let threshold = state[0];
    let take_ties = state[2];
    // Each invocation a contiguous range of ids, so that the keys equal to the threshold are
    // taken lowest id first.
    let chunk = (N + WG - 1u) / WG;
    let lo = min(t * chunk, N);
    let hi = min(lo + chunk, N);
    var equal = 0u;
    // With a tail: the weights of the keys below the threshold, then of the equal ones not taken.
    let temperature = bitcast<f32>(t_bits);
    var top = 0.0;
    var tail = 0.0;
    if (tail_on) {
        var m = vec2<f32>(-3.4e38, 0.0);
        for (var i = t; i < N; i += WG) {
            if (ok(i)) { let l = logits[base + i]; m = max(m, vec2<f32>(l, abs(l))); }
        }
        red[t] = m;
        reduce(t, true);
        top = red[0].x / temperature;
        if (t == 0u) { out[out_base + 2u] = bitcast<u32>(red[0].y); }
    }
    for (var i = lo; i < hi; i++) {
        if (!ok(i)) { continue; }
        let l = logits[base + i];
        let k = key(l);
        if (k > threshold) { emit(i); } else if (k == threshold) { equal += 1u; } else if (tail_on) { tail += exp(l / temperature - top); }
    }
    ties_before[t] = equal;
    workgroupBarrier();
    if (t == 0u) {
        var sum = 0u;
        for (var j = 0u; j < WG; j++) {
            let n = ties_before[j];
            ties_before[j] = sum;
            sum += n;
        }
    }
    workgroupBarrier();
    var before = ties_before[t];
    for (var i = lo; i < hi && (tail_on || before < take_ties); i++) {
        let l = logits[base + i];
        if (key(l) == threshold && ok(i)) {
            if (before < take_ties) { emit(i); } else { tail += exp(l / temperature - top); }
            before += 1u;
        }
    }
    if (tail_on) {
        red[t] = vec2<f32>(tail, 0.0);
        reduce(t, false);
        if (t == 0u) { out[out_base + 1u] = bitcast<u32>(red[0].x); }
    }
    workgroupBarrier();
    if (t == 0u) { out[out_base] = atomicLoad(&written); }
}
