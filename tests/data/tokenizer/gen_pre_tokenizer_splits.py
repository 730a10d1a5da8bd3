#!/usr/bin/env python3
"""Writes pre_tokenizer_splits.json: how each byte-level pre-tokenizer cuts a few texts, computed
with Python's `regex` module (not the Rust crates under test) on the patterns of the original
tokenizer.json files, which llama.cpp's llama-vocab.cpp quotes next to each rule.

Run from this folder: `pip install regex && python3 gen_pre_tokenizer_splits.py`.
"""
import json

import regex

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TEXTS = [
    "In 2024 there were 366 days; 1234567 is big, 3.14159 too.",
    "don't I'LL we're They've she's it'd you'll I'm",
    "line one\nline two\n\n  indented\r\n\tTab\n",
    "   leading and trailing   ",
    "Hello,world!!! (ok) <tag> a/b/c https://x.org/p?q=1",
    "x² ½ ٣٤٥ １２ CamelCaseWord HTTPServer éte",
]


def split(pattern, text):
    """Matches and the text between them, in order (Split with the `isolated` behaviour)."""
    pieces, last = [], 0
    for m in regex.finditer(pattern, text):
        if m.start() > last:
            pieces.append(text[last:m.start()])
        pieces.append(m.group())
        last = m.end()
    if last < len(text):
        pieces.append(text[last:])
    return pieces


def digits_then(pattern, text):
    """SmolLM: every digit (\\p{N}) on its own first, then the regex on what is between."""
    pieces = []
    for part in regex.split(r"(\p{N})", text):
        if part:
            pieces.extend([part] if regex.fullmatch(r"\p{N}", part) else split(pattern, part))
    return pieces


PRE_TOKENIZERS = {
    "gpt2": lambda t: split(GPT2, t),
    "smollm": lambda t: digits_then(GPT2, t),
    "llama-bpe": lambda t: split(LLAMA3, t),
    "qwen2": lambda t: split(QWEN2, t),
    "gpt-4o": lambda t: split(GPT4O, t),
    "tekken": lambda t: split(TEKKEN, t),
}

out = {
    "description": "pieces = how tokenizer.ggml.pre = <name> cuts text before BPE; made by gen_pre_tokenizer_splits.py",
    "cases": [{"pre": name, "text": text, "pieces": f(text)} for name, f in PRE_TOKENIZERS.items() for text in TEXTS],
}
with open("pre_tokenizer_splits.json", "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
    f.write("\n")
