#!/usr/bin/env python3
"""Reference vectors for the CPU block decoders (tests/quant.rs): random blocks of every type the
engine runs, dequantized by gguf-py's `gguf.quants.dequantize` (the reference implementation
llama.cpp's Python tools use). Writes tests/data/quant/<TYPE>.blocks (raw GGUF bytes) and
<TYPE>.f32 (little-endian float32 values). Needs `pip install gguf numpy`. Every type is drawn
from one generator in a fixed order (new types go last, so the older files do not change);
--only writes just the named types' files.
    python3 scripts/gen-quant-vectors.py [--seed N] [--only MXFP4 ...]
"""
import argparse
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# Byte offsets of each block's f16 scales: random bytes there could be NaN or inf; they get
# random finite scales instead (as a quantizer would write).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.IQ4_NL: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_XS: [0],
}
FLOATS = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}
# Byte offsets of each block's E8M0 exponent: every exponent 0 .. 255 once (subnormal half
# scales at 0 and 1, products past f32's range at 253 .. 255), so 256 blocks.
E8M0_FIELDS = {T.MXFP4: [0]}
BLOCKS = 16


def random_blocks(rng, qtype):
    values, size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOATS:
        x = rng.standard_normal(BLOCKS * values).astype(np.float32) * 4
        if qtype == T.BF16:
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.astype(FLOATS[qtype]).view(np.uint8)
    if qtype in E8M0_FIELDS:
        data = rng.integers(0, 256, size=(256, size), dtype=np.uint8)
        for off in E8M0_FIELDS[qtype]:
            data[:, off] = rng.permutation(256).astype(np.uint8)
        return data.reshape(-1)
    data = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        # Mixed signs and magnitudes, including subnormal-range and large scales.
        scale = (rng.standard_normal(BLOCKS) * 10.0 ** rng.uniform(-6, 1, BLOCKS)).astype(np.float16)
        data[:, off:off + 2] = scale.view(np.uint8).reshape(BLOCKS, 2)
    return data.reshape(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", nargs="+", metavar="TYPE", help="write only these types' files")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "quant"
    out.mkdir(parents=True, exist_ok=True)
    for qtype in list(FLOATS) + list(F16_FIELDS) + list(E8M0_FIELDS):
        raw = random_blocks(rng, qtype)
        with np.errstate(over="ignore"):  # MXFP4's largest exponents give inf, as in ggml
            values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        if args.only and qtype.name not in args.only:
            continue
        (out / f"{qtype.name}.blocks").write_bytes(raw.tobytes())
        (out / f"{qtype.name}.f32").write_bytes(values.astype("<f4").tobytes())
        print(f"{qtype.name}: {raw.size} bytes -> {values.size} values")


if __name__ == "__main__":
    main()
