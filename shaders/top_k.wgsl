// Top-k for sampling on the GPU: the K largest logits, ties going to the lower id as the CPU
// sampler orders them, found by a radix select (8 bits a pass) over the logits' order-preserving
// bit patterns in one workgroup. The host reads back K (id, logit) pairs instead of the whole
// vocabulary and finishes top-p, min-p and the seeded draw on them.
// Bindings: 0 logits (N), 1 want (K, at most the output's room), 2 out: [count, then count pairs
// (id, logit bits), in no order]. Dispatch: (1, 1, 1).

override N: u32;
const WG: u32 = 256u;

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> want: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> hist: array<atomic<u32>, 256>;
// The selected key's bits so far, which bits are selected, how many of the keys equal to the
// selection are still to take.
var<workgroup> state: array<u32, 3>;
var<workgroup> ties_before: array<u32, WG>;
var<workgroup> written: atomic<u32>;

// Larger float, larger key (NaN aside: the argmax kernel flags those).
fn key(l: f32) -> u32 {
    let b = bitcast<u32>(l);
    return select(b | 0x80000000u, ~b, (b >> 31u) == 1u);
}

fn emit(i: u32) {
    let s = atomicAdd(&written, 1u);
    out[1u + 2u * s] = i;
    out[2u + 2u * s] = bitcast<u32>(logits[i]);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) t: u32) {
    if (t == 0u) {
        state[0] = 0u;
        state[1] = 0u;
        state[2] = min(want[0], N);
        atomicStore(&written, 0u);
    }
    for (var shift = 24u; shift < 32u; shift -= 8u) {
        atomicStore(&hist[t], 0u);
        workgroupBarrier();
        let prefix = state[0];
        let mask = state[1];
        for (var i = t; i < N; i += WG) {
            let k = key(logits[i]);
            if ((k & mask) == prefix) { atomicAdd(&hist[(k >> shift) & 255u], 1u); }
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
    for (var i = lo; i < hi; i++) {
        let k = key(logits[i]);
        if (k > threshold) { emit(i); } else if (k == threshold) { equal += 1u; }
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
    for (var i = lo; i < hi && before < take_ties; i++) {
        if (key(logits[i]) == threshold) {
            emit(i);
            before += 1u;
        }
    }
    workgroupBarrier();
    if (t == 0u) { out[0] = atomicLoad(&written); }
}
