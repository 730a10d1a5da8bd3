#!/usr/bin/env python3
"""Reference data for structured output (constrained greedy decoding) on SmolLM2-135M-Instruct Q4_1.

Makes tests/data/constrained/smollm2.json (and nothing else; README.md beside it is hand-written).

Truth:
  * logits: transformers float32 on the CPU, loaded exactly as ../shared/golden/scripts/gen_golden.py does
    (GGUF loader dequantizes every tensor to float32, eager attention, KV-cached incremental loop), with the
    tokenizer's pre-tokenizer restored to SmolLM2's real one (Digits(individual_digits=True) + ByteLevel);
  * mask: PyPI `llguidance` 1.9.1 (same version as the Rust crate), tokenizer built with
    `llguidance.hf.from_tokenizer(tok)` (EOS = 2 `<|im_end|>`), grammars from
    `LLMatcher.grammar_from_json_schema(schema)` (default options), `grammar_from_regex(rx)`,
    `grammar_from_lark(lark)`; the mask of each step comes from `llguidance.numpy.fill_next_token_bitmask`
    and is cross-checked against `LLMatcher.compute_logit_bias()` at every step;
  * next token = argmax of the float32 logits over the allowed ids (lowest id on exact ties), then
    `LLMatcher.consume_token(t)`.
  Loop per case: for step in range(max_tokens): compute mask; pick t; consume t (fail loudly on is_error());
  stop when t == EOS (2) -> "eos", or when after consuming t the matcher is_stopped() -> "matcher_stopped:<reason>"
  (its mask then allows only EOS; no EOS is appended to greedy_ids), or at max_tokens -> "max_tokens".
  JSON cases that end invalid or at max_tokens are re-run with max_tokens raised (48 -> 64 -> 80 -> 96).

Deterministic; CPU only, 2 threads. About a minute or two.

Setup (outside the repo; the venv of scripts/gen-arch-refs.py plus two packages):
  /work/venv-refs/bin/pip install llguidance==1.9.1 jsonschema
  (fresh: python3 -m venv V && V/bin/pip install torch transformers==5.24.0 tokenizers==0.23.3 gguf==0.19.0
   numpy accelerate llguidance==1.9.1 jsonschema)
Run (from the repo root; MODEL_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf, sha256 b179c952...):
  /work/venv-refs/bin/python scripts/gen-constrained-refs.py [--model-dir /work/models-ref] \
      [--out tests/data/constrained/smollm2.json]
"""
import argparse
import hashlib
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import tokenizers  # noqa: E402
import gguf  # noqa: E402
import jsonschema  # noqa: E402
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.numpy as llnp  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from transformers import AutoTokenizer, AutoModelForCausalLM  # noqa: E402

torch.set_num_threads(2)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EOS_ID = 2
MAX_TOKENS = 48
MAX_TOKENS_CAP = 96
N_UNCONSTRAINED = 16
STEP0_LIST_LIMIT = 300
SYSTEM = "You are a helpful assistant."

# The SmolLM2 pre-tokenizer (see ../shared/golden/README.md): transformers' GGUF converter drops the digit split.
SMOLLM_PRE = pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
])

CASES = [
    {
        "name": "person_flat",
        "kind": "json_schema",
        "exercises": "required string, integer with minimum 0, string enum, additionalProperties false",
        "user": "Describe a fictional person as JSON with their name, age and favorite color.",
        "constraint": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "color": {"type": "string", "enum": ["red", "green", "blue"]},
            },
            "required": ["name", "age", "color"],
            "additionalProperties": False,
        },
        "unconstrained": True,
    },
    {
        "name": "nested_person_tags",
        "kind": "json_schema",
        "exercises": "nested object, array of strings with minItems 1 / maxItems 3, two required keys, additionalProperties false at both levels",
        "user": "Give me a JSON object about a famous scientist: their first and last name, and a few tags describing them.",
        "constraint": {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                    "required": ["first", "last"],
                    "additionalProperties": False,
                },
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            },
            "required": ["person", "tags"],
            "additionalProperties": False,
        },
    },
    {
        "name": "pattern_anyof",
        "kind": "json_schema",
        "exercises": "string pattern (regex inside JSON string), anyOf integer | const string",
        "user": "Return JSON for a product with a code like ABC-12 and the quantity in stock, or \"unknown\" if you do not know it.",
        "constraint": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "quantity": {"anyOf": [{"type": "integer"}, {"type": "string", "const": "unknown"}]},
            },
            "required": ["code", "quantity"],
            "additionalProperties": False,
        },
    },
    {
        "name": "json_object_mode",
        "kind": "json_object",
        "exercises": "OpenAI response_format json_object, implemented as the JSON schema {\"type\": \"object\"} "
                     "(any JSON object; keys and values free)",
        "user": "List three fruits and their colors as a JSON object.",
        "constraint": {"type": "object"},
        "unconstrained": True,
    },
    {
        "name": "regex_yes_no",
        "kind": "regex",
        "exercises": "regex alternation, bounded character-class repetition, literal tail; matcher stops after '.'",
        "user": "Is the sky blue on a clear day? Answer yes or no, and give a short reason.",
        "constraint": r"(yes|no), because [a-z ]{5,40}\.",
    },
    {
        "name": "lark_answer",
        "kind": "lark",
        "exercises": "llguidance Lark grammar: string literal, regex terminal, literal tail",
        "user": "What is 7 times 6?",
        "constraint": 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/\n',
    },
    {
        "name": "cities_array",
        "kind": "json_schema",
        "exercises": "top-level array of objects, minItems 1 / maxItems 2, integer field",
        "user": "List two large cities with their populations as a JSON array of objects with name and population.",
        "constraint": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
                "required": ["name", "population"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
]


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def grammar_for(case):
    kind, c = case["kind"], case["constraint"]
    if kind in ("json_schema", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(c)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(c)
    raise ValueError(kind)


def allowed_ids(matcher, vocab):
    """Allowed ids of the next step, from the bitmask; cross-checked against compute_logit_bias."""
    bm = llnp.allocate_token_bitmask(1, vocab)
    llnp.fill_next_token_bitmask(matcher, bm)
    bits = np.unpackbits(bm[0].view(np.uint8), bitorder="little")
    assert not bits[vocab:].any()
    ids = np.nonzero(bits[:vocab])[0]
    lb = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)
    assert lb.shape[0] >= vocab and not lb[vocab:].any()
    assert np.array_equal(np.nonzero(lb[:vocab])[0], ids), "bitmask != logit_bias"
    if matcher.is_error():
        raise RuntimeError(f"matcher error: {matcher.get_error()}")
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/work/models-ref")
    ap.add_argument("--out", default=os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "constrained", "smollm2.json")))
    args = ap.parse_args()
    t_start = time.time()

    def log(*a):
        print(f"[{time.time() - t_start:6.1f}s]", *a, flush=True)

    path = os.path.join(args.model_dir, GGUF_FILE)
    sha = sha256_of(path)
    assert sha == EXPECTED_SHA256, sha

    tok = AutoTokenizer.from_pretrained(args.model_dir, gguf_file=GGUF_FILE)
    tok.backend_tokenizer.pre_tokenizer = SMOLLM_PRE
    assert tok.encode("a  1", add_special_tokens=False) == [81, 256, 33]
    assert tok.eos_token_id == EOS_ID

    def enc(text):
        return list(tok.encode(text, add_special_tokens=False))

    def dec(ids):
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    lltok = llguidance.hf.from_tokenizer(tok)
    vocab = lltok.vocab_size
    assert vocab == 49152 and lltok.eos_token == EOS_ID and lltok.eos_tokens == [EOS_ID], \
        (vocab, lltok.eos_token, lltok.eos_tokens)
    special_ids = [i for i in range(vocab) if lltok.is_special_token(i)]

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    log("model + tokenizers loaded")

    class Session:
        """KV-cached incremental forward; logits() = float32 logits predicting the next token."""

        @torch.no_grad()
        def __init__(self, prompt_ids):
            out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            self.past = out.past_key_values
            self.last = out.logits[0, -1].float().numpy().copy()

        @torch.no_grad()
        def feed(self, t):
            out = model(input_ids=torch.tensor([[t]]), past_key_values=self.past, use_cache=True)
            self.past = out.past_key_values
            self.last = out.logits[0, -1].float().numpy().copy()

    def run_constrained(prompt_ids, grammar, max_tokens):
        m = llguidance.LLMatcher(lltok, grammar, log_level=1)
        if m.is_error():
            raise RuntimeError(f"grammar error: {m.get_error()}")
        sess = Session(prompt_ids)
        ids, counts, margins, id_sums, step0 = [], [], [], [], None
        stopped = "max_tokens"
        for step in range(max_tokens):
            allowed = allowed_ids(m, vocab)
            if len(allowed) == 0:
                raise RuntimeError(f"empty mask at step {step}")
            if step == 0:
                step0 = allowed
            L = sess.last
            la = L[allowed]
            best = int(allowed[int(np.argmax(la))])          # lowest id on exact ties (allowed is sorted)
            if len(allowed) > 1:
                s = np.sort(la.astype(np.float64))[::-1]
                margins.append(float(s[0] - s[1]))
            else:
                margins.append(None)
            counts.append(int(len(allowed)))
            id_sums.append(int(allowed.sum()))
            ids.append(best)
            ok = m.consume_token(best)
            if not ok or m.is_error():
                raise RuntimeError(f"consume_token({best}) failed at step {step}: {m.get_error()}")
            if best == EOS_ID:
                stopped = "eos"
                break
            if m.is_stopped():
                stopped = f"matcher_stopped:{m.stop_reason()}"
                after = allowed_ids(m, vocab)
                assert list(after) == [EOS_ID], after     # only EOS remains
                break
            sess.feed(best)
        return {"ids": ids, "counts": counts, "margins": margins, "id_sums": id_sums, "step0": step0,
                "stopped": stopped, "accepting": bool(m.is_accepting()),
                "warnings": list(m.get_grammar_warnings())}

    def run_unconstrained(prompt_ids, n):
        sess = Session(prompt_ids)
        ids = []
        for _ in range(n):
            t = int(np.argmax(sess.last))
            ids.append(t)
            sess.feed(t)
        return ids

    out_cases = []
    for case in CASES:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": case["user"]}]
        ptxt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        pids = enc(ptxt)
        grammar = grammar_for(case)
        is_json = case["kind"] in ("json_schema", "json_object")
        max_tokens = MAX_TOKENS
        while True:
            r = run_constrained(pids, grammar, max_tokens)
            gen = r["ids"]
            body = gen[:-1] if gen and gen[-1] == EOS_ID else gen
            text = dec(body)
            valid = None
            if is_json:
                try:
                    obj = json.loads(text)
                    jsonschema.validators.validator_for(case["constraint"])(case["constraint"]).validate(obj)
                    valid = True
                except (ValueError, jsonschema.ValidationError):
                    valid = False
                if (not valid or r["stopped"] == "max_tokens") and max_tokens < MAX_TOKENS_CAP:
                    log(f"{case['name']}: max_tokens {max_tokens} not enough ({r['stopped']}, valid={valid}); raising")
                    max_tokens += 16
                    continue
                if not valid or r["stopped"] == "max_tokens":
                    raise RuntimeError(f"{case['name']}: no valid complete JSON within {MAX_TOKENS_CAP} tokens: "
                                       f"{text!r}")
            break
        step0 = r["step0"]
        if len(step0) < STEP0_LIST_LIMIT:
            s0 = {"n_allowed": int(len(step0)), "allowed_ids": [int(i) for i in step0]}
        else:
            s0 = {"n_allowed": int(len(step0)), "sum_of_ids": int(step0.sum())}
        non_null = [(i, mg) for i, mg in enumerate(r["margins"]) if mg is not None]
        mi = min(non_null, key=lambda x: x[1]) if non_null else (None, None)
        c = {
            "name": case["name"],
            "kind": case["kind"],
            "exercises": case["exercises"],
            "constraint": case["constraint"],
            "llguidance_grammar": grammar,
            "messages": msgs,
            "prompt_text": ptxt,
            "prompt_ids": pids,
            "max_tokens": max_tokens,
            "greedy_ids": gen,
            "n_generated": len(gen),
            "text": text,
            "stopped": r["stopped"],
            "matcher_accepting_at_end": r["accepting"],
            "allowed_counts": r["counts"],
            "allowed_id_sums": r["id_sums"],
            "margins": r["margins"],
            "min_margin": mi[1],
            "min_margin_step": mi[0],
            "step0_mask": s0,
        }
        if is_json:
            c["valid"] = valid
        if r["warnings"]:
            c["grammar_warnings"] = r["warnings"]
        if case.get("unconstrained"):
            u = run_unconstrained(pids, N_UNCONSTRAINED)
            c["unconstrained_greedy_ids"] = u
            c["unconstrained_text"] = dec(u)
            assert u != gen[:N_UNCONSTRAINED], "constraint changed nothing"
        out_cases.append(c)
        log(f"{case['name']}: P={len(pids)} n={len(gen)} stop={r['stopped']} valid={valid} "
            f"min_margin={mi[1]}@{mi[0]} step0={s0['n_allowed']}\n    {text!r}")

    doc = {
        "description": "Constrained greedy decoding references. Logits: transformers float32 (GGUF dequantized to "
                       "float32, eager attention, KV cache, CPU). Mask: llguidance (Python) LLMatcher with the HF "
                       "tokenizer (SmolLM2 pre-tokenizer fix). Each step: allowed = mask; next = argmax of logits over "
                       "allowed (lowest id on exact ties); consume. greedy_ids[k] is chosen at step k; allowed_counts, "
                       "allowed_id_sums (sum of the allowed ids) and margins (top1 - top2 float32 logit among the "
                       "allowed ids, in float64; null when one id is allowed) have one entry per step. stopped: 'eos' "
                       "(EOS id 2 chosen and included in greedy_ids), 'matcher_stopped:<llguidance StopReason>' (after "
                       "consuming the last id the matcher is_stopped(); its mask then allows only EOS, which is NOT "
                       "appended), or 'max_tokens'. text = decode(greedy_ids without a final EOS). Prompts: chat "
                       "template with add_generation_prompt=True, encoded without extra special tokens. JSON options: "
                       "llguidance defaults (no JsonCompileOptions): item separator ',', key separator ':', "
                       "whitespace_flexible true (any [ \\t\\n\\r]+ allowed between JSON tokens, none before the "
                       "top-level value), additionalProperties as in the schema (absent = allowed). step0_mask: "
                       f"allowed ids at step 0 when fewer than {STEP0_LIST_LIMIT}, else their count and sum.",
        "model": {"file": GGUF_FILE, "sha256": sha},
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"), "numpy": np.__version__,
            "llguidance": _dist_version("llguidance"), "jsonschema": _dist_version("jsonschema"),
        },
        "torch_threads": torch.get_num_threads(),
        "eos": EOS_ID,
        "vocab_size": vocab,
        "llguidance_special_token_ids": special_ids,
        "system_prompt": SYSTEM,
        "cases": out_cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    log(f"wrote {args.out}")


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    sys.exit(main())
