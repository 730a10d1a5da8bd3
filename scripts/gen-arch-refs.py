#!/usr/bin/env python3
"""Generate tiny random-weight reference models (GGUF) + transformers float32 oracle data.

Writes tests/data/arch/<name>/{model.gguf, reference.json, tensors.txt} for five architectures
(qwen2, qwen3, phi3, llama3 rope scaling, mistral) plus tests/data/arch/README.md.

Pipeline per model (everything deterministic from --seed):
  1. a tiny byte-level BPE tokenizer (512 tokens) trained with `tokenizers` on TRAIN_TEXT below
     (shared by all five models; SmolLM2-style pre-tokenizer: Digits(individual) + GPT-2 ByteLevel);
  2. a transformers model built from a config (AutoConfig.for_model), every parameter overwritten
     with numpy PCG64 draws (matrices N(0, 0.08), embeddings / lm_head N(0, 0.4), biases N(0, 0.2),
     RMSNorm weights U(0.5, 1.5)), saved with save_pretrained (safetensors, float32);
  3. llama.cpp's own convert_hf_to_gguf.py (vendored in the llama-cpp-python sdist) with
     `--outtype f32`, run in a subprocess through runpy with two patches:
       - TextModel.get_vocab_base_pre -> "smollm" (our tokenizer's pre-tokenizer hash is unknown to it),
       - phi3 only: Phi3MiniModel.set_vocab -> _set_vocab_gpt2 (the converter otherwise wants a
         SentencePiece tokenizer.model; this is the same branch it takes for GPT2Tokenizer Phi-4 checkpoints);
  4. oracle: transformers (float32, eager attention, CPU, 1 thread) greedy generate() with KV cache,
     cross-checked against a full no-cache forward;
  5. independent check: a float64 numpy forward pass that reads only the GGUF (gguf-py GGUFReader),
     implementing llama.cpp's math (NORM vs NEOX rope, partial rope, rope_freqs, fused qkv / gate_up,
     q/k norms, biases, GQA, tied output).

Setup (outside the repo):
  python3 -m venv /work/venv-refs
  /work/venv-refs/bin/pip install torch transformers accelerate gguf numpy sentencepiece tokenizers \
      safetensors scikit-build-core cmake ninja
  /work/venv-refs/bin/pip download --no-deps --no-binary :all: --no-build-isolation \
      llama-cpp-python==0.3.36 -d /work/llcpp && tar xzf /work/llcpp/llama_cpp_python-0.3.36.tar.gz -C /work/llcpp

  # optional, for --llama-cpp-check (compiles llama.cpp, ~15 min on 2 cores):
  /work/venv-refs/bin/pip install --no-build-isolation /work/llcpp/llama_cpp_python-0.3.36.tar.gz

Run (from the repo root; the committed files were made with exactly this):
  /work/venv-refs/bin/python scripts/gen-arch-refs.py --llama-cpp-check \
      --llama-cpp /work/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp
  (--out defaults to tests/data/arch, --seed to 20261201; --check-only re-runs the numpy check (and with
  --llama-cpp-check the llama.cpp one) on the committed files without regenerating anything.)
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "tests", "data", "arch")
DEFAULT_LLAMA_CPP = "/work/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp"
DEFAULT_SEED = 20261201

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
PROMPT_LENS = [5, 12, 40]
N_GEN = 16
TOPK = 20

STD_MATRIX = 0.08
STD_EMBED = 0.4
STD_BIAS = 0.2
STD_CONV = 0.5  # LFM2's short-convolution taps (3 per channel): large enough to move the logits
NORM_LO, NORM_HI = 0.5, 1.5
# Tied models (qwen3, llama3): with the scheme above the token just fed dominates the residual stream
# and, through the shared embedding, its own logit (E[t].E[t] >> E[t].E[v]), so greedy decoding
# repeats the input token forever. A small embedding, larger residual-writing matrices (o_proj,
# down_proj) and a larger final-norm weight give varied greedy paths and logits of a useful size.
TIED_STD_EMBED = 0.1
TIED_STD_RESID_OUT = 0.3
TIED_FINAL_NORM = (1.5, 4.5)

# Tokenizer training text (written for this script; no external data).
TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model with random weights is still a model:
it takes token ids, mixes them through attention and a gated feed-forward network, and returns
logits for the next token. These reference files test that an engine reads every tensor of a
GGUF file correctly, applies the right rotary position embedding to the right dimensions, and
adds the biases, norms and scaling factors that each architecture needs.
Qwen2 adds biases to the query, key and value projections. Qwen3 normalizes every query and key
head with its own RMSNorm weight. Phi-3 fuses the query, key and value projections into one matrix
and the gate and up projections into another, and rotates only part of each head. Llama 3 scales
the low rotary frequencies with a smooth ramp between the high and low frequency factors. Mistral
is the plain Llama layout with grouped-query attention.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,000,000 and 12:30.
Punctuation: (parentheses) [brackets] {braces} "quotes" 'apostrophes' -- dashes; semicolons!
Questions? Answers. Lists: first, second, third. The end of the text is near, and then it ends.
"""


# ----------------------------------------------------------------------------------------------
# Architecture specs
# ----------------------------------------------------------------------------------------------
ARCHS = [
    {
        "name": "qwen2",
        "gguf_name": "Tiny Random Qwen2",
        "model_type": "qwen2",
        "hf_class": "Qwen2ForCausalLM",
        "exercises": "q/k/v projection biases (nonzero random), NEOX rope, GQA 4/2, untied output.weight, eps 1e-6",
        "config": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    },
    {
        "name": "qwen3",
        "gguf_name": "Tiny Random Qwen3",
        "model_type": "qwen3",
        "hf_class": "Qwen3ForCausalLM",
        "exercises": "per-head q_norm/k_norm RMSNorm (random weights, applied before rope), explicit head_dim 32 "
                     "with n_head*head_dim=128 != hidden 64, NEOX rope, GQA 4/2, tied output (no output.weight)",
        "config": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                       attention_bias=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    },
    {
        "name": "phi3",
        # general.name must not contain "phi3"/"phi-3": llama.cpp's vocab loader then sets attributes on
        # "</s>", "<unk>", "<s>" with unordered_map::at and fails to load a vocab without them.
        "gguf_name": "Tiny Random Phi 3",
        "model_type": "phi3",
        "hf_class": "Phi3ForCausalLM",
        "exercises": "fused attn_qkv and fused gate|up ffn_up (2*n_ff rows, gate first), partial rotary "
                     "factor 0.75 (rope on 12 of 16 head dims, NEOX pairs within those 12), GQA 4/2, untied output",
        "config": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096,
                       original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, sliding_window=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75}),
    },
    {
        "name": "llama3",
        "gguf_name": "Tiny Random Llama3",
        "model_type": "llama",
        "hf_class": "LlamaForCausalLM",
        "exercises": "llama3 rope scaling via rope_freqs.weight (per-frequency divisors: some 1, some smoothed, "
                     "most 8), rope_theta 500000, head_dim 24, NORM rope with converter-permuted q/k, GQA 4/2, "
                     "tied output (no output.weight)",
        "config": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    },
    {
        "name": "mistral",
        "gguf_name": "Tiny Random Mistral",
        "model_type": "mistral",
        "hf_class": "MistralForCausalLM",
        "exercises": "plain llama layout under arch 'llama' (converter maps MistralForCausalLM to LLAMA), "
                     "4 layers, rope_theta 1e6, NORM rope with permuted q/k, GQA 4/2, untied output, "
                     "sliding_window None (full causal attention)",
        "config": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, sliding_window=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    },
    {
        "name": "smollm3",
        "gguf_name": "Tiny Random SmolLM3",
        "model_type": "smollm3",
        "hf_class": "SmolLM3ForCausalLM",
        "exercises": "NoPE layers: every 4th layer (3 and 7 of 8) has no RoPE (transformers' no_rope_layer_interval 4; "
                     "the GGUF does not say so, llama.cpp hard-codes n_no_rope_layer_step = 4), NORM rope with "
                     "converter-permuted q/k, GQA 4/2, tied output",
        "config": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 2000000.0}),
    },
    {
        "name": "gemma2",
        "gguf_name": "Tiny Random Gemma2",
        "model_type": "gemma2",
        "hf_class": "Gemma2ForCausalLM",
        "exercises": "attention-score soft-capping (cap 4) and final-logit soft-capping (cap 6), sliding (window 8: "
                     "the 12- and 40-token prompts cross it) and global layers alternating (even layers slide), "
                     "post-attention and post-FFN RMSNorms, embeddings times sqrt(hidden), GELU (tanh), norm weights "
                     "+1 (written so by the converter), query_pre_attn_scalar = head_dim, tied output",
        "config": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=8,
                       attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                       hidden_activation="gelu_pytorch_tanh",
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    },
    {
        "name": "qwen3moe",
        "gguf_name": "Tiny Random Qwen3 MoE",
        "model_type": "qwen3_moe",
        "hf_class": "Qwen3MoeForCausalLM",
        "exercises": "mixture of experts: 8 experts of FFN width 32, the router's top 2 per token with their "
                     "softmax weights renormalized (norm_topk_prob, which llama.cpp hard-codes for qwen3moe), "
                     "stacked expert tensors ffn_{gate,up,down}_exps, plus Qwen3's q/k norms, NEOX rope, GQA 4/2, "
                     "untied output",
        "config": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       use_sliding_window=False, sliding_window=None, attention_bias=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    },
    {
        "name": "qwen3yarn",
        "gguf_name": "Tiny Random Qwen3 YaRN",
        "model_type": "qwen3",
        "hf_class": "Qwen3ForCausalLM",
        "exercises": "YaRN RoPE scaling (factor 64 over an original context of 16 positions, the 1024 trained; theta 10000, beta_fast 32 / "
                     "beta_slow 1 by default: the pairs between the correction dims mix interpolated and original "
                     "frequencies; cos and sin times 0.1 ln 64 + 1), written by the converter as rope.scaling.type yarn, "
                     "factor and original_context_length; Qwen3 q/k norms, NEOX rope, GQA 4/2, tied output",
        "config": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                       attention_bias=False,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 64.0,
                                        "original_max_position_embeddings": 16}),
    },
    {
        "name": "gptoss",
        "gguf_name": "Tiny Random GPT-OSS",
        "model_type": "gpt_oss",
        "hf_class": "GptOssForCausalLM",
        # Its many biases (q, k, v, o, router, experts) at the others' 0.2 make every token's
        # residual stream alike and greedy decoding one token (the sinks, drawn alike, still move
        # every softmax: exp(sink) joins each denominator).
        "bias_std": 0.02,
        "exercises": "gpt-oss: attention sinks (a learned logit per head in every softmax's denominator), q/k/v and "
                     "output biases, sliding (window 8, even layers) and full layers alternating, YaRN RoPE "
                     "(factor 4 over 16 positions, transformers' truncate=False), a mixture of 8 experts (top 2: "
                     "softmax over the chosen logits) with router and expert biases and the clamped SwiGLU "
                     "((up + 1) * gate * sigmoid(1.702 gate), gate <= 7, |up| <= 7), F32 experts (the converter "
                     "keeps unquantized experts as they are), untied output",
        "config": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       sliding_window=8, max_position_embeddings=64, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, attention_bias=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 16}),
    },
    {
        "name": "lfm2",
        "gguf_name": "Tiny Random LFM2",
        "model_type": "lfm2",
        "hf_class": "Lfm2ForCausalLM",
        "exercises": "hybrid: gated short-convolution layers (0, 1, 3: in_proj to B, C, x; B*x through a causal "
                     "depthwise convolution over 3 positions; C times it; out_proj) beside attention layers (2, 4: "
                     "q/k RMSNorms, NEOX rope, GQA 4/2); conv layers marked by 0 in the per-layer "
                     "attention.head_count_kv array (as llama.cpp reads them); the final norm is token_embd_norm; "
                     "tied output; conv taps N(0, 0.5) so the convolution moves the logits",
        "config": dict(hidden_size=64, intermediate_size=160, block_auto_adjust_ff_dim=False, num_hidden_layers=5,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, norm_eps=1e-5,
                       layer_types=["conv", "conv", "full_attention", "conv", "full_attention"],
                       conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    },
]

# llama.cpp src/llama-model.cpp llama_model_rope_type(): which pairs rotate.
ROPE_STYLE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "phi3": "neox", "smollm3": "norm",
              "gemma2": "neox", "qwen3moe": "neox", "lfm2": "neox", "gpt-oss": "neox"}


def f32(v):
    """Shortest decimal that round-trips the float32 value."""
    return float(str(np.float32(v)))


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------
def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator([TRAIN_TEXT], trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[BOS_ID],
                                   eos_token=SPECIAL_TOKENS[EOS_ID], unk_token=SPECIAL_TOKENS[UNK_ID],
                                   pad_token=SPECIAL_TOKENS[UNK_ID])


# ----------------------------------------------------------------------------------------------
# HF model
# ----------------------------------------------------------------------------------------------
def build_hf_model(spec, seed, arch_index):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(spec["model_type"], vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID,
                               eos_token_id=EOS_ID, pad_token_id=UNK_ID, hidden_act="silu",
                               attention_dropout=0.0, **spec["config"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == spec["hf_class"], type(model).__name__
    rng = np.random.default_rng([seed, arch_index])
    tied = bool(cfg.tie_word_embeddings)
    if tied:
        assert "lm_head.weight" not in dict(model.named_parameters())
    init_log = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if tied and name in ("model.norm.weight", "model.embedding_norm.weight"):
                lo, hi = TIED_FINAL_NORM
                v = rng.uniform(lo, hi, size=shape)
                kind = "final rmsnorm (tied model) U(%g,%g)" % (lo, hi)
            elif name.endswith("norm.weight"):
                v = rng.uniform(NORM_LO, NORM_HI, size=shape)
                kind = "rmsnorm U(%g,%g)" % (NORM_LO, NORM_HI)
            elif name.endswith((".bias", "_bias", ".sinks")):
                std = spec.get("bias_std", STD_BIAS)
                v = rng.normal(0.0, std, size=shape)
                kind = "bias N(0,%g)" % std
            elif "embed_tokens" in name or name == "lm_head.weight":
                std = TIED_STD_EMBED if tied else STD_EMBED
                v = rng.normal(0.0, std, size=shape)
                kind = "embedding N(0,%g)" % std
            elif name.endswith("conv.conv.weight"):
                v = rng.normal(0.0, STD_CONV, size=shape)
                kind = "short-convolution taps N(0,%g)" % STD_CONV
            elif tied and name.endswith(("o_proj.weight", "down_proj.weight")):
                v = rng.normal(0.0, TIED_STD_RESID_OUT, size=shape)
                kind = "residual-writing matrix (tied model) N(0,%g)" % TIED_STD_RESID_OUT
            else:
                assert p.dim() in (2, 3), name  # 3: a mixture's stacked experts
                v = rng.normal(0.0, STD_MATRIX, size=shape)
                kind = "matrix N(0,%g)" % STD_MATRIX
            p.copy_(torch.from_numpy(v.astype(np.float32)))
            init_log[name] = kind
    model.eval()
    return model, init_log


# ----------------------------------------------------------------------------------------------
# Conversion (llama.cpp convert_hf_to_gguf.py in a subprocess)
# ----------------------------------------------------------------------------------------------
CONVERT_RUNNER = r"""
import sys, runpy
llcpp, arch = sys.argv[1], sys.argv[2]
sys.argv = [llcpp + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path.insert(0, llcpp)
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
if arch == "phi3":
    import conversion.phi
    conversion.phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
if arch == "gemma2":
    import conversion.gemma
    conversion.gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
runpy.run_path(llcpp + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(llcpp, hf_dir, out_path, name, model_name, log_path):
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.path.join(llcpp, "gguf-py")
    cmd = [sys.executable, "-c", CONVERT_RUNNER, llcpp, name, hf_dir, "--outtype", "f32",
           "--outfile", out_path, "--model-name", model_name]
    with open(log_path, "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(hf_dir))
    if r.returncode != 0:
        sys.stderr.write(open(log_path).read()[-5000:])
        raise SystemExit(f"conversion of {name} failed")


# ----------------------------------------------------------------------------------------------
# Oracle (transformers)
# ----------------------------------------------------------------------------------------------
def topk_list(row, k=TOPK):
    row = np.asarray(row, dtype=np.float32)
    idx = np.argsort(-row, kind="stable")[:k]
    return {"ids": [int(i) for i in idx], "logits": [f32(row[i]) for i in idx]}


def make_prompts(seed, arch_index):
    rng = np.random.default_rng([seed, arch_index, 7])
    prompts = []
    for j, n in enumerate(PROMPT_LENS):
        ids = rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE, size=n).tolist()
        if j == 0:
            ids[0] = BOS_ID
        prompts.append([int(x) for x in ids])
    return prompts


def run_oracle(model, prompts):
    import torch
    from transformers import GenerationConfig
    # EOS must not stop generation, and must not be suppressed either (a min_new_tokens processor would
    # mask its logit): clear it in the model's own generation_config too, which generate() merges in.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    gc = GenerationConfig(do_sample=False, max_new_tokens=N_GEN, eos_token_id=None,
                          bos_token_id=None, pad_token_id=UNK_ID, num_beams=1, use_cache=True,
                          output_logits=True, return_dict_in_generate=True)
    cases = []
    for pi, prompt in enumerate(prompts):
        inp = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gc)
        seq = out.sequences[0].tolist()
        assert seq[:len(prompt)] == prompt
        gen = seq[len(prompt):]
        assert len(gen) == N_GEN, len(gen)
        step_logits = torch.stack([l[0] for l in out.logits]).float().numpy()  # (N_GEN, V)
        # greedy consistency: generated token = argmax of that step's logits
        for s in range(N_GEN):
            assert int(np.argmax(step_logits[s])) == gen[s], (pi, s)
        # full forward without cache over prompt + gen[:-1]
        full_ids = torch.tensor([prompt + gen[:-1]], dtype=torch.long)
        with torch.no_grad():
            full = model(full_ids, attention_mask=torch.ones_like(full_ids), use_cache=False).logits[0].float().numpy()
        full_steps = full[len(prompt) - 1:]
        nocache_diff = float(np.max(np.abs(full_steps - step_logits)))
        argmax_agree = int(np.sum(np.argmax(full_steps, axis=-1) == np.array(gen)))
        srt = np.sort(step_logits, axis=-1)
        margins = (srt[:, -1] - srt[:, -2]).tolist()
        case = {
            "prompt_ids": prompt,
            "greedy_ids": gen,
            "top1_top2_margins": [f32(m) for m in margins],
            "min_margin": f32(min(margins)),
            "min_margin_step": int(np.argmin(margins)),
            "kv_cache_vs_full_forward_max_abs_logit_diff": nocache_diff,
            "full_forward_argmax_agrees": f"{argmax_agree}/{N_GEN}",
            "logits_step0": [f32(x) for x in step_logits[0]],
            "top20": [dict(step=s, position=len(prompt) - 1 + s, **topk_list(step_logits[s]))
                      for s in range(N_GEN)],
        }
        if pi == len(prompts) - 1:
            pin = torch.tensor([prompt], dtype=torch.long)
            with torch.no_grad():
                allpos = model(pin, attention_mask=torch.ones_like(pin), use_cache=False).logits[0].float().numpy()
            case["all_positions_logits"] = [[f32(x) for x in row] for row in allpos]
            case["all_positions_vs_generate_step0_max_abs_diff"] = float(np.max(np.abs(allpos[-1] - step_logits[0])))
        cases.append((case, step_logits, full))
    return cases


# ----------------------------------------------------------------------------------------------
# Independent numpy (float64) forward from the GGUF only
# ----------------------------------------------------------------------------------------------
class NpGGUF:
    """llama.cpp math for arch llama / qwen2 / qwen3 / phi3, float64, weights read from the GGUF.

    Tensors are F32; GGUFReader gives each 2-D tensor as (ne1, ne0) = (out_features, in_features).
    Rope: theta_i = pos * freq_base^(-2i/n_rot) / rope_freqs[i] (rope_freqs = 1 when absent), i < n_rot/2.
      norm: rotate (x[2i], x[2i+1]);  neox: rotate (x[i], x[i + n_rot/2]); dims >= n_rot untouched.
    llama/mistral GGUF q/k rows are permuted by the converter so that the norm style on them equals
    HF's rotate_half on the original weights; we use the GGUF layout as is (no un-permute).
    """

    def __init__(self, path):
        from gguf import GGUFReader, GGMLQuantizationType
        r = GGUFReader(path)
        f = lambda k, d=None: r.fields[k].contents() if k in r.fields else d
        self.arch = f("general.architecture")
        a = self.arch
        self.n_layer = int(f(f"{a}.block_count"))
        self.n_embd = int(f(f"{a}.embedding_length"))
        self.n_head = int(f(f"{a}.attention.head_count"))
        kv = f(f"{a}.attention.head_count_kv")
        # LFM2 writes one count per layer, 0 for a short-convolution layer.
        self.kv_per_layer = list(kv) if isinstance(kv, list) else None
        self.n_kv = max(self.kv_per_layer) if self.kv_per_layer else int(kv)
        self.conv_l = int(f(f"{a}.shortconv.l_cache", 0))
        self.n_ff = int(f(f"{a}.feed_forward_length"))
        self.eps = float(f(f"{a}.attention.layer_norm_rms_epsilon"))
        self.base = float(f(f"{a}.rope.freq_base", 10000.0))
        self.head_dim = int(f(f"{a}.attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(f(f"{a}.rope.dimension_count", self.head_dim))
        self.style = ROPE_STYLE[a]
        # What llama.cpp hard-codes per architecture (src/models/<arch>.cpp, load_arch_hparams):
        # Gemma 2's soft-capping (defaults 50 / 30), its sliding layers (even ones: swa pattern 2),
        # embedding scale and GELU; SmolLM3's NoPE layers (n_no_rope_layer_step = 4).
        gemma = a == "gemma2"
        self.attn_cap = float(f(f"{a}.attn_logit_softcapping", 50.0)) if gemma else None
        self.final_cap = float(f(f"{a}.final_logit_softcapping", 30.0)) if gemma else None
        self.window = int(f(f"{a}.attention.sliding_window", 0)) or None
        self.sliding = (lambda l: l % 2 == 0) if gemma else (lambda l: False)
        self.no_rope = (lambda l: (l + 1) % 4 == 0) if a == "smollm3" else (lambda l: False)
        self.embed_scale = np.sqrt(self.n_embd) if gemma else 1.0
        self.gelu = gemma
        # Mixture of experts: softmax over the router's logits, top expert_used_count, renormalized
        # (llama.cpp's qwen3moe graph: build_moe_ffn(..., norm_w = true)).
        self.n_expert = int(f(f"{a}.expert_count", 0))
        self.n_expert_used = int(f(f"{a}.expert_used_count", 0))
        self.norm_topk = True
        self.w = {}
        for t in r.tensors:
            assert t.tensor_type == GGMLQuantizationType.F32, (t.name, t.tensor_type)
            arr = np.asarray(t.data, dtype=np.float32)
            if len(t.shape) > 1:
                # ggml order reversed: (experts,) rows, cols
                arr = arr.reshape([int(x) for x in reversed(t.shape)])
            else:
                arr = arr.reshape(-1)
            self.w[t.name] = arr.astype(np.float64)
        self.out_w = self.w.get("output.weight", self.w["token_embd.weight"])
        self.final_norm = "token_embd_norm.weight" if a == "lfm2" else "output_norm.weight"
        half = self.n_rot // 2
        ff = self.w.get("rope_freqs.weight", np.ones(half))
        assert ff.shape == (half,)
        self.inv_freq = self.base ** (-(2.0 * np.arange(half)) / self.n_rot) / ff
        self.mscale = 1.0
        self.gptoss = a == "gpt-oss"
        if self.gptoss:
            # gpt-oss: sliding layers are the even ones (llama.cpp's swa pattern 2, transformers' layer_types).
            self.sliding = lambda l: l % 2 == 0
        if f(f"{a}.rope.scaling.type") == "yarn":
            # llama.cpp's rope_yarn with ggml_rope_yarn_corr_dims (beta_fast 32, beta_slow 1).
            factor = float(f(f"{a}.rope.scaling.factor"))
            orig = float(f(f"{a}.rope.scaling.original_context_length"))
            corr = lambda rot: self.n_rot * np.log(orig / (rot * 2 * np.pi)) / (2 * np.log(self.base))
            # gpt-oss's checkpoints say truncate=False (transformers keeps the fractional correction
            # dims; llama.cpp floors and ceils them for every architecture).
            rnd_lo, rnd_hi = (lambda v: v, lambda v: v) if self.gptoss else (np.floor, np.ceil)
            low, high = max(0.0, rnd_lo(corr(32.0))), min(self.n_rot - 1.0, rnd_hi(corr(1.0)))
            ramp = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)  # extrapolation share
            self.inv_freq = self.inv_freq * ((1.0 - ramp) / factor + ramp)
            self.mscale = 0.1 * np.log(factor) + 1.0

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        ang = pos[:, None] * self.inv_freq[None, :]
        c, s = self.mscale * np.cos(ang)[:, None, :], self.mscale * np.sin(ang)[:, None, :]
        out = x.copy()
        n = self.n_rot
        if self.style == "norm":
            x0, x1 = x[..., 0:n:2], x[..., 1:n:2]
            out[..., 0:n:2] = x0 * c - x1 * s
            out[..., 1:n:2] = x0 * s + x1 * c
        else:
            h = n // 2
            x0, x1 = x[..., :h], x[..., h:n]
            out[..., :h] = x0 * c - x1 * s
            out[..., h:n] = x0 * s + x1 * c
        return out

    def lin(self, x, name):
        y = x @ self.w[name + ".weight"].T
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        return y

    def short_conv(self, h, p):
        bcx = h @ self.w[p + "shortconv.in_proj.weight"].T
        d = self.n_embd
        b, c, xx = bcx[:, :d], bcx[:, d:2 * d], bcx[:, 2 * d:]
        bx = b * xx
        taps = self.w[p + "shortconv.conv.weight"]  # (d, L): channel, tap (oldest first)
        L = taps.shape[1]
        padded = np.concatenate([np.zeros((L - 1, d)), bx], axis=0)
        conv = np.stack([(padded[t:t + L] * taps.T).sum(axis=0) for t in range(h.shape[0])])
        return (c * conv) @ self.w[p + "shortconv.out_proj.weight"].T

    def ffn(self, h, p):
        g, u = self.lin(h, p + "ffn_gate"), self.lin(h, p + "ffn_up")
        return self.lin(g / (1.0 + np.exp(-g)) * u, p + "ffn_down")

    def moe(self, h, p):
        logits = h @ self.w[p + "ffn_gate_inp.weight"].T + self.w.get(p + "ffn_gate_inp.bias", 0.0)
        if self.gptoss:
            return self.moe_oai(h, p, logits)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            top = np.argsort(-probs[t], kind="stable")[:self.n_expert_used]
            w = probs[t][top]
            if self.norm_topk:
                w = w / w.sum()
            for e, we in zip(top, w):
                g = self.w[p + "ffn_gate_exps.weight"][e] @ h[t]
                u = self.w[p + "ffn_up_exps.weight"][e] @ h[t]
                out[t] += we * (self.w[p + "ffn_down_exps.weight"][e] @ (g / (1.0 + np.exp(-g)) * u))
        return out

    def moe_oai(self, h, p, logits):
        # gpt-oss: softmax over the chosen experts' logits; biased experts; clamped SwiGLU.
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            top = np.argsort(-logits[t], kind="stable")[:self.n_expert_used]
            w = np.exp(logits[t][top] - logits[t][top].max())
            w = w / w.sum()
            for e, we in zip(top, w):
                bias = lambda n: self.w[p + n][e] if p + n in self.w else 0.0
                g = self.w[p + "ffn_gate_exps.weight"][e] @ h[t] + bias("ffn_gate_exps.bias")
                u = self.w[p + "ffn_up_exps.weight"][e] @ h[t] + bias("ffn_up_exps.bias")
                g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
                a = (u + 1.0) * g / (1.0 + np.exp(-1.702 * g))
                out[t] += we * (self.w[p + "ffn_down_exps.weight"][e] @ a + bias("ffn_down_exps.bias"))
        return out

    def forward(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        H, KV, hd = self.n_head, self.n_kv, self.head_dim
        rep = H // KV
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][ids] * self.embed_scale
        causal = np.triu(np.full((T, T), -np.inf), k=1)
        # Sliding layers: query t sees keys t - window + 1 .. t.
        slide = causal + (np.tril(np.full((T, T), -np.inf), k=-self.window) if self.window else 0.0)
        for l in range(self.n_layer):
            mask = slide if self.sliding(l) else causal
            p = f"blk.{l}."
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            if self.kv_per_layer and self.kv_per_layer[l] == 0:
                x = x + self.short_conv(h, p)
                x = x + self.ffn(self.rms(x, self.w[p + "ffn_norm.weight"]), p)
                continue
            if p + "attn_qkv.weight" in self.w:
                qkv = self.lin(h, p + "attn_qkv")
                q, k, v = np.split(qkv, [H * hd, H * hd + KV * hd], axis=-1)
            else:
                q, k, v = self.lin(h, p + "attn_q"), self.lin(h, p + "attn_k"), self.lin(h, p + "attn_v")
            q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
            if p + "attn_q_norm.weight" in self.w:
                q = self.rms(q, self.w[p + "attn_q_norm.weight"])
                k = self.rms(k, self.w[p + "attn_k_norm.weight"])
            if not self.no_rope(l):
                q, k = self.rope(q, pos), self.rope(k, pos)
            att = np.empty((T, H, hd))
            for hh in range(H):
                sc = q[:, hh, :] @ k[:, hh // rep, :].T / np.sqrt(hd)
                if self.attn_cap:
                    sc = self.attn_cap * np.tanh(sc / self.attn_cap)
                sc = sc + mask
                if p + "attn_sinks.weight" in self.w:
                    # gpt-oss: the head's sink is one more logit in the softmax, with no value.
                    sink = self.w[p + "attn_sinks.weight"][hh]
                    mx = np.maximum(sc.max(axis=-1, keepdims=True), sink)
                    e = np.exp(sc - mx)
                    att[:, hh, :] = (e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - mx))) @ v[:, hh // rep, :]
                    continue
                sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
                att[:, hh, :] = (sc / sc.sum(axis=-1, keepdims=True)) @ v[:, hh // rep, :]
            o = self.lin(att.reshape(T, H * hd), p + "attn_output")
            if p + "post_attention_norm.weight" in self.w and not self.gptoss:
                o = self.rms(o, self.w[p + "post_attention_norm.weight"])
            x = x + o
            # gpt-oss names its pre-FFN norm post_attention_norm.
            h = self.rms(x, self.w[p + ("post_attention_norm.weight" if self.gptoss else "ffn_norm.weight")])
            if self.n_expert:
                x = x + self.moe(h, p)
                continue
            if p + "ffn_gate.weight" in self.w:
                g, u = self.lin(h, p + "ffn_gate"), self.lin(h, p + "ffn_up")
            else:  # phi3: fused [gate; up] in ffn_up, gate = first n_ff rows
                g, u = np.split(self.lin(h, p + "ffn_up"), 2, axis=-1)
            if self.gelu:
                a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
            else:
                a = g / (1.0 + np.exp(-g))
            o = self.lin(a * u, p + "ffn_down")
            if p + "post_ffw_norm.weight" in self.w:
                o = self.rms(o, self.w[p + "post_ffw_norm.weight"])
            x = x + o
        x = self.rms(x, self.w[self.final_norm])
        logits = x @ self.out_w.T
        if self.final_cap:
            logits = self.final_cap * np.tanh(logits / self.final_cap)
        return logits


def negative_controls(gguf_path, ref):
    """Step-0 logit diffs of deliberately wrong variants: shows what the references discriminate."""
    out = {}
    case = ref["cases"][-1]
    want = np.array(case["logits_step0"])

    def run(mod):
        m = NpGGUF(gguf_path)
        mod(m)
        return float(np.max(np.abs(m.forward(case["prompt_ids"])[-1] - want)))

    def flip(m):
        m.style = "neox" if m.style == "norm" else "norm"
    out["wrong_rope_style"] = run(flip)
    m0 = NpGGUF(gguf_path)
    if "rope_freqs.weight" in m0.w:
        def nofreqs(m):
            half = m.n_rot // 2
            m.inv_freq = m.base ** (-(2.0 * np.arange(half)) / m.n_rot)
        out["ignore_rope_freqs"] = run(nofreqs)
    if m0.n_rot != m0.head_dim:
        def fullrot(m):
            m.n_rot = m.head_dim
            half = m.n_rot // 2
            m.inv_freq = m.base ** (-(2.0 * np.arange(half)) / m.n_rot)
        out["rope_all_head_dims"] = run(fullrot)
    if any(k.endswith("attn_q_norm.weight") for k in m0.w):
        out["skip_qk_norm"] = run(lambda m: [m.w.pop(k) for k in list(m.w) if k.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))])
    if any(k.endswith(".bias") for k in m0.w):
        out["drop_biases"] = run(lambda m: [m.w.pop(k) for k in list(m.w) if k.endswith(".bias")])
    if "output.weight" in m0.w:
        out["use_token_embd_as_output"] = run(lambda m: setattr(m, "out_w", m.w["token_embd.weight"]))
    if m0.attn_cap:
        out["no_attention_softcap"] = run(lambda m: setattr(m, "attn_cap", None))
        out["no_final_softcap"] = run(lambda m: setattr(m, "final_cap", None))
    if m0.window:
        out["no_sliding_window"] = run(lambda m: setattr(m, "window", None))
    if m0.gptoss:
        out["no_attention_sinks"] = run(lambda m: [m.w.pop(k) for k in list(m.w) if k.endswith("attn_sinks.weight")])
        out["sliding_on_odd_layers"] = run(lambda m: setattr(m, "sliding", lambda l: l % 2 == 1))
    if m0.mscale != 1.0:
        out["yarn_without_attention_factor"] = run(lambda m: setattr(m, "mscale", 1.0))
        def plain_rope(m):
            half = m.n_rot // 2
            m.inv_freq = m.base ** (-(2.0 * np.arange(half)) / m.n_rot)
        out["rope_without_yarn"] = run(plain_rope)
    if m0.kv_per_layer:
        def no_conv(m):
            m.short_conv = lambda h, p: np.zeros_like(h)
        out["no_short_convolution"] = run(no_conv)
        def last_only(m):
            for k in [k for k in m.w if k.endswith("shortconv.conv.weight")]:
                m.w[k] = m.w[k] * np.array([0.0, 0.0, 1.0])
        out["convolution_sees_its_own_position_only"] = run(last_only)
    if m0.n_expert:
        out["no_topk_renormalization"] = run(lambda m: setattr(m, "norm_topk", False))
        out["one_expert_fewer"] = run(lambda m: setattr(m, "n_expert_used", m.n_expert_used - 1))
    if m0.arch == "smollm3":
        out["rope_on_every_layer"] = run(lambda m: setattr(m, "no_rope", lambda l: False))
    return out


def numpy_check(gguf_path, ref):
    m = NpGGUF(gguf_path)
    res = {"step0_max_abs_diff": 0.0, "all_steps_max_abs_diff": 0.0, "all_positions_max_abs_diff": None,
           "argmax_agrees": 0, "argmax_total": 0}
    for case in ref["cases"]:
        prompt, gen = case["prompt_ids"], case["greedy_ids"]
        lg = m.forward(prompt + gen[:-1])
        steps = lg[len(prompt) - 1:]
        d0 = float(np.max(np.abs(steps[0] - np.array(case["logits_step0"]))))
        res["step0_max_abs_diff"] = max(res["step0_max_abs_diff"], d0)
        for s, t in enumerate(case["top20"]):
            d = float(np.max(np.abs(steps[s][t["ids"]] - np.array(t["logits"]))))
            res["all_steps_max_abs_diff"] = max(res["all_steps_max_abs_diff"], d)
        res["argmax_agrees"] += int(np.sum(np.argmax(steps, axis=-1) == np.array(gen)))
        res["argmax_total"] += len(gen)
        if "all_positions_logits" in case:
            ap = np.array(case["all_positions_logits"])
            res["all_positions_max_abs_diff"] = float(np.max(np.abs(lg[:len(prompt)] - ap)))
    res["all_steps_max_abs_diff"] = max(res["all_steps_max_abs_diff"], res["step0_max_abs_diff"])
    res["negative_controls_step0_max_abs_diff_last_prompt"] = negative_controls(gguf_path, ref)
    return res


def llama_cpp_check(gguf_path, ref):
    """Optional: real llama.cpp (llama-cpp-python built from the same 0.3.36 sdist), CPU, F32 weights."""
    import llama_cpp
    # F32 KV cache (default is F16, which alone moves logits by ~5e-3), no flash attention.
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=128, n_batch=128, logits_all=True, n_threads=1,
                          verbose=False, seed=0, flash_attn=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    res = {"llama_cpp_python": llama_cpp.__version__, "step0_max_abs_diff": 0.0, "all_steps_max_abs_diff": 0.0,
           "all_positions_max_abs_diff": None, "argmax_agrees": 0, "argmax_total": 0}
    for case in ref["cases"]:
        prompt, gen = case["prompt_ids"], case["greedy_ids"]
        llm.reset()
        llm.eval(prompt + gen[:-1])
        lg = np.array(llm.scores[:llm.n_tokens], dtype=np.float64)
        steps = lg[len(prompt) - 1:]
        res["step0_max_abs_diff"] = max(res["step0_max_abs_diff"],
                                        float(np.max(np.abs(steps[0] - np.array(case["logits_step0"])))))
        for s_, t in enumerate(case["top20"]):
            d = float(np.max(np.abs(steps[s_][t["ids"]] - np.array(t["logits"]))))
            res["all_steps_max_abs_diff"] = max(res["all_steps_max_abs_diff"], d)
        res["argmax_agrees"] += int(np.sum(np.argmax(steps, axis=-1) == np.array(gen)))
        res["argmax_total"] += len(gen)
        if "all_positions_logits" in case:
            res["all_positions_max_abs_diff"] = float(np.max(np.abs(lg[:len(prompt)] - np.array(case["all_positions_logits"]))))
    res["all_steps_max_abs_diff"] = max(res["all_steps_max_abs_diff"], res["step0_max_abs_diff"])
    del llm
    return res


# ----------------------------------------------------------------------------------------------
# GGUF listing
# ----------------------------------------------------------------------------------------------
def gguf_listing(path):
    from gguf import GGUFReader
    r = GGUFReader(path)
    lines = [f"# {os.path.basename(os.path.dirname(path))}/model.gguf  sha256 {sha256_file(path)}",
             f"# {os.path.getsize(path)} bytes, GGUF v{r.fields['GGUF.version'].contents()}",
             "# metadata (key: type = value; long arrays abbreviated)"]
    summary = {"metadata": {}, "tensors": []}
    for k, fld in r.fields.items():
        if k.startswith("GGUF."):
            continue
        types = [t.name for t in fld.types]
        val = fld.contents()
        if isinstance(val, list) and len(val) > 8:
            shown = f"[{len(val)} items] first: {val[:4]!r}"
            summary["metadata"][k] = f"array[{len(val)}]"
        else:
            shown = repr(val)
            summary["metadata"][k] = val
        lines.append(f"{k}: {'/'.join(types)} = {shown}")
    lines.append("# tensors: name  type  ne (ggml order: ne0 = contiguous / input dim first)  n_elements")
    for t in r.tensors:
        ne = [int(x) for x in t.shape]
        lines.append(f"{t.name}  {t.tensor_type.name}  {ne}  {int(t.n_elements)}")
        summary["tensors"].append((t.name, t.tensor_type.name, ne))
        if t.name == "rope_freqs.weight":
            vals = [f32(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
            lines.append(f"#   rope_freqs values (divisors of base^(-2i/n_rot)): {vals}")
            summary["rope_freqs"] = vals
    return "\n".join(lines) + "\n", summary


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def versions():
    import torch, transformers, tokenizers
    import importlib.metadata as md
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "numpy": np.__version__, "gguf_pip": md.version("gguf"),
            "llama_cpp_python_sdist": "0.3.36 (vendor/llama.cpp convert_hf_to_gguf.py + vendored gguf-py)"}


def rope_summary(spec, cfg):
    rp = dict(cfg.rope_parameters)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_rot = int(hd * rp.get("partial_rotary_factor", 1.0))
    return {"rope_parameters": rp, "head_dim": hd, "n_rot": n_rot}


def generate(args):
    import torch
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="arch-refs-")
    vers = versions()
    tok = build_tokenizer()
    results = []
    try:
        for ai, spec in enumerate(ARCHS):
            if args.only and spec["name"] not in args.only:
                # Kept as committed: its files go into the README as they are.
                d = os.path.join(args.out, spec["name"])
                ref = json.load(open(os.path.join(d, "reference.json")))
                results.append((spec, ref["meta"], gguf_listing(os.path.join(d, "model.gguf"))[1], ref))
                continue
            name = spec["name"]
            print(f"== {name}", flush=True)
            hf_dir = os.path.join(work, f"tiny-random-{name}")
            model, init_log = build_hf_model(spec, args.seed, ai)
            model.save_pretrained(hf_dir, safe_serialization=True)
            tok.save_pretrained(hf_dir)
            dst = os.path.join(args.out, name)
            os.makedirs(dst, exist_ok=True)
            gguf_path = os.path.join(dst, "model.gguf")
            convert(args.llama_cpp, hf_dir, gguf_path, name, spec["gguf_name"], os.path.join(work, f"convert-{name}.log"))
            listing, summary = gguf_listing(gguf_path)
            with open(os.path.join(dst, "tensors.txt"), "w") as fh:
                fh.write(listing)

            prompts = make_prompts(args.seed, ai)
            cases = run_oracle(model, prompts)
            cfg = model.config
            hd = rope_summary(spec, cfg)
            meta = {
                "name": name,
                "hf_architecture": spec["hf_class"],
                "gguf_architecture": summary["metadata"].get("general.architecture"),
                "rope_style_llama_cpp": ROPE_STYLE[summary["metadata"]["general.architecture"]],
                "exercises": spec["exercises"],
                "gguf_sha256": sha256_file(gguf_path),
                "gguf_bytes": os.path.getsize(gguf_path),
                "seed": args.seed,
                "config": {
                    "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                    "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
                    "num_attention_heads": cfg.num_attention_heads,
                    "num_key_value_heads": cfg.num_key_value_heads, "head_dim": hd["head_dim"],
                    "rope_dims": hd["n_rot"], "rope_parameters": hd["rope_parameters"],
                    "rms_norm_eps": getattr(cfg, "rms_norm_eps", getattr(cfg, "norm_eps", None)), "tie_word_embeddings": cfg.tie_word_embeddings,
                    "max_position_embeddings": cfg.max_position_embeddings,
                    "sliding_window": getattr(cfg, "sliding_window", None),
                    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                },
                "hf_config_json": json.load(open(os.path.join(hf_dir, "config.json"))),
                "init": {"matrices": f"N(0,{STD_MATRIX})", "embeddings_and_lm_head": f"N(0,{STD_EMBED})",
                         "biases": f"N(0,{STD_BIAS})", "rmsnorm_weights": f"U({NORM_LO},{NORM_HI})",
                         "tied_models": f"embedding N(0,{TIED_STD_EMBED}), o_proj/down_proj "
                                        f"N(0,{TIED_STD_RESID_OUT}), final norm U{TIED_FINAL_NORM}",
                         "rng": "numpy default_rng([seed, arch_index]) over parameters sorted by name",
                         "per_parameter": init_log},
                "oracle": "transformers float32 eager attention CPU 1 thread; greedy generate(), KV cache, "
                          "attention_mask=ones, eos not a stop (eos_token_id=None in the model's and the call's "
                          "generation config; no logits processors; argmax of the raw logits checked at every step)",
                "versions": vers,
            }
            ref = {"meta": meta, "cases": [c for c, _, _ in cases]}
            nc = numpy_check(gguf_path, ref)
            meta["numpy_float64_crosscheck"] = nc
            if args.llama_cpp_check:
                lc = llama_cpp_check(gguf_path, ref)
                meta["llama_cpp_crosscheck"] = lc
                print(f"   llama.cpp check {lc}", flush=True)
                assert lc["argmax_agrees"] == lc["argmax_total"], lc
            print(f"   gguf {meta['gguf_bytes']} B; numpy check {nc}", flush=True)
            for c in ref["cases"]:
                print(f"   prompt {len(c['prompt_ids'])}: greedy {c['greedy_ids']} min margin "
                      f"{c['min_margin']:.4f} kv-vs-full {c['kv_cache_vs_full_forward_max_abs_logit_diff']:.2e}")
            assert nc["step0_max_abs_diff"] < 1e-4, nc
            assert nc["all_steps_max_abs_diff"] < 1e-4, nc
            with open(os.path.join(dst, "reference.json"), "w") as fh:
                json.dump(ref, fh, separators=(",", ":"))
                fh.write("\n")
            results.append((spec, meta, summary, ref))
    finally:
        if args.keep_work:
            print("work dir kept:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    write_readme(args, results, vers)


def check_only(args):
    ok = True
    for spec in ARCHS:
        d = os.path.join(args.out, spec["name"])
        ref = json.load(open(os.path.join(d, "reference.json")))
        gp = os.path.join(d, "model.gguf")
        sha_ok = sha256_file(gp) == ref["meta"]["gguf_sha256"]
        nc = numpy_check(gp, ref)
        good = sha_ok and nc["all_steps_max_abs_diff"] < 1e-4
        ok &= good
        print(spec["name"], "sha ok" if sha_ok else "SHA MISMATCH", nc)
        if args.llama_cpp_check:
            print("   llama.cpp:", llama_cpp_check(gp, ref))
    raise SystemExit(0 if ok else 1)


def write_readme(args, results, vers):
    rows = []
    details = []
    for spec, meta, summary, ref in results:
        c = meta["config"]
        nc = meta["numpy_float64_crosscheck"]
        kvdiff = max(x["kv_cache_vs_full_forward_max_abs_logit_diff"] for x in ref["cases"])
        minm = min(x["min_margin"] for x in ref["cases"])
        rows.append(f"| {spec['name']} | {spec['hf_class']} | `{meta['gguf_architecture']}` | "
                    f"{meta['rope_style_llama_cpp'].upper()} | {c['num_hidden_layers']} | {c['hidden_size']} | "
                    f"{c['num_attention_heads']}/{c['num_key_value_heads']} | {c['head_dim']} | {c['rope_dims']} | "
                    f"{c['intermediate_size']} | {meta['gguf_bytes']} | {nc['step0_max_abs_diff']:.2e} | "
                    f"{nc['all_steps_max_abs_diff']:.2e} | {nc['all_positions_max_abs_diff']:.2e} | "
                    f"{kvdiff:.2e} | {minm:.4f} |")
        md = summary["metadata"]
        arch = meta["gguf_architecture"]
        keys = [k for k in md if k.startswith(arch + ".")]
        tens = summary["tensors"]
        blk0 = [t for t in tens if t[0].startswith("blk.0.")]
        other = [t for t in tens if not t[0].startswith("blk.")]
        details.append(
            f"### {spec['name']}\n\n"
            f"Exercises: {spec['exercises']}.\n\n"
            f"- GGUF sha256 `{meta['gguf_sha256']}`\n"
            f"- rope: {json.dumps(c['rope_parameters'])}; llama.cpp style {meta['rope_style_llama_cpp'].upper()}\n"
            + (f"- `rope_freqs.weight` values: {summary['rope_freqs']}\n" if "rope_freqs" in summary else "")
            +
            f"- numpy negative controls (max |diff| of step-0 logits, 40-token prompt, deliberately wrong math): "
            + ", ".join(f"{k} {v:.3g}" for k, v in nc["negative_controls_step0_max_abs_diff_last_prompt"].items())
            + "\n"
            + (f"- real llama.cpp (llama-cpp-python {meta['llama_cpp_crosscheck']['llama_cpp_python']}, CPU, 1 thread): "
               f"step0 max diff {meta['llama_cpp_crosscheck']['step0_max_abs_diff']:.2e}, all steps "
               f"{meta['llama_cpp_crosscheck']['all_steps_max_abs_diff']:.2e}, all positions "
               f"{meta['llama_cpp_crosscheck']['all_positions_max_abs_diff']:.2e}, greedy argmax agrees "
               f"{meta['llama_cpp_crosscheck']['argmax_agrees']}/{meta['llama_cpp_crosscheck']['argmax_total']}\n"
               if "llama_cpp_crosscheck" in meta else "")
            + f"- eps {c['rms_norm_eps']}, tied output: {c['tie_word_embeddings']}, sliding_window: {c['sliding_window']}\n"
            f"- arch metadata: " + ", ".join(f"`{k[len(arch) + 1:]}`={md[k]!r}" for k in keys) + "\n"
            f"- non-block tensors: " + ", ".join(f"`{n}` {ne}" for n, _, ne in other) + "\n"
            f"- per-block tensors (blk.0): " + ", ".join(f"`{n[6:]}` {ne}" for n, _, ne in blk0) + "\n"
            f"- greedy (prompt lengths {', '.join(str(len(x['prompt_ids'])) for x in ref['cases'])}): "
            + "; ".join(str(x["greedy_ids"]) for x in ref["cases"]) + "\n")
    text = README_TEMPLATE.format(
        seed=args.seed, vers="; ".join(f"{k} {v}" for k, v in vers.items()),
        table="\n".join(rows), details="\n".join(details), n_gen=N_GEN, topk=TOPK,
        std_m=STD_MATRIX, std_e=STD_EMBED, std_b=STD_BIAS, lo=NORM_LO, hi=NORM_HI,
        t_e=TIED_STD_EMBED, t_o=TIED_STD_RESID_OUT, t_lo=TIED_FINAL_NORM[0], t_hi=TIED_FINAL_NORM[1],
        lens=", ".join(map(str, PROMPT_LENS)))
    with open(os.path.join(args.out, "README.md"), "w") as fh:
        fh.write(text)


README_TEMPLATE = """# Tiny random-weight reference models per architecture

Generated by `scripts/gen-arch-refs.py --llama-cpp-check` (seed {seed}; setup steps in the script's docstring;
smollm3, gemma2, qwen3moe and lfm2 were added later with `--only NAME`, without the llama.cpp run);
rerun it to regenerate everything (the GGUF bytes, reference values and this README are deterministic for a given
seed and library versions: two full runs gave byte-identical files).
Versions: {vers}.

Each `<name>/` holds:
- `model.gguf`: written by llama.cpp's own `convert_hf_to_gguf.py --outtype f32` (all tensors F32, so the
  weights are exactly the transformers weights, up to the converter's q/k row permutation for `llama`).
- `reference.json`: oracle data from transformers (float32, eager attention, CPU).
- `tensors.txt`: every GGUF metadata key (type and value, long arrays abbreviated) and every tensor
  (name, type, shape in ggml `ne` order, i.e. input dimension first).

## How the models were made
- Tokenizer (shared by all): byte-level BPE with 512 tokens trained by `tokenizers` on a fixed text in the
  script; pre-tokenizer `Digits(individual_digits=True)` + GPT-2 `ByteLevel` regex (SmolLM2's, = llama.cpp
  `tokenizer.ggml.pre = "smollm"`). Specials: 0 `<|endoftext|>` (unk/pad), 1 `<|im_start|>` (BOS), 2 `<|im_end|>` (EOS).
- Weights: every parameter redrawn with numpy (PCG64, seed `[seed, arch_index]`, parameters in name order):
  matrices N(0, {std_m}), token embedding and lm_head N(0, {std_e}), biases N(0, {std_b}), every RMSNorm weight
  (layer norms, final norm, Qwen3 q_norm/k_norm) U({lo}, {hi}). The tied models (qwen3, llama3, smollm3, gemma2) differ:
  embedding N(0, {t_e}), o_proj/down_proj N(0, {t_o}), final norm U({t_lo}, {t_hi}); with the untied scheme the
  fed token dominates the residual stream and, through the shared embedding, its own logit, so greedy decoding
  just repeats the last input token. `meta.init.per_parameter` lists the distribution of every parameter.
- Conversion: `convert_hf_to_gguf.py` from the llama-cpp-python 0.3.36 sdist (`vendor/llama.cpp`, with its vendored
  gguf-py), run via `runpy` with two monkey-patches: `TextModel.get_vocab_base_pre` returns `"smollm"` (the
  converter does not know our tokenizer's pre-tokenizer hash), and for phi3 `Phi3MiniModel.set_vocab` is replaced by
  `_set_vocab_gpt2` (the converter otherwise requires a SentencePiece `tokenizer.model`; the GPT-2 path is the same
  branch it takes for Phi-4 checkpoints whose tokenizer_class is GPT2Tokenizer). So every GGUF has
  `tokenizer.ggml.model = "gpt2"`, `tokenizer.ggml.pre = "smollm"`, 512 tokens and the BPE merges.
- `general.name` is set with `--model-name` ("Tiny Random <Name>"); for phi3 it is "Tiny Random Phi 3" because
  llama.cpp's vocab loader applies a Phi-3 special-token fix-up whenever general.name contains "phi3"/"phi-3" and
  then fails (`unordered_map::at`) on a vocab without `</s>`, `<unk>`, `<s>`.
- MistralForCausalLM is converted by the converter's LlamaModel class: its GGUF architecture is `llama`, exactly
  like the llama3 model. Mistral uses `sliding_window: None` (full causal attention; the converter writes no
  sliding-window key for it). Qwen2/Qwen3 have `use_sliding_window=False, sliding_window=None`; Phi3 has
  `sliding_window=None`, which the converter writes as `phi3.attention.sliding_window = 0`.

## Rope styles (llama.cpp `llama_model_rope_type`, src/llama-model.cpp)
- `llama` (llama3, mistral): NORM: rotate adjacent pairs (x[2i], x[2i+1]). The converter permutes the rows of
  `attn_q`/`attn_k` per head (HF `rotate_half` halves -> interleaved), so NORM on the GGUF weights equals HF's
  NEOX-style math on the original weights. Attention scores are invariant to the consistent in-head order; V/O are
  not permuted.
- `smollm3`: NORM, converted by the converter's LlamaModel (q/k permuted); llama.cpp lists it with the NORM models.
- `qwen2`, `qwen3`, `phi3`, `gemma2`: NEOX: rotate (x[i], x[i + n_rot/2]); no permutation.
- Angle: theta_i = pos * freq_base^(-2i / n_rot) / rope_freqs[i] for i < n_rot/2, `n_rot = rope.dimension_count`
  (phi3: 12 of 16 head dims; the last 4 dims pass through unrotated). `rope_freqs.weight` (llama3 only) holds
  divisors: 1 for high frequencies (wavelength < orig_ctx/high_freq_factor), `factor` (8) for low frequencies
  (wavelength > orig_ctx/low_freq_factor), and 1/((1-s)/factor + s), s = (orig_ctx/wavelength - low)/(high - low),
  in between.
- Missing keys and their llama.cpp defaults: qwen2/qwen3 GGUFs have no `rope.dimension_count` (n_rot = head_dim);
  qwen2 and phi3 have no `attention.key_length` (head_dim = n_embd / n_head); no GGUF here has `rope.scaling.type`
  (llama3 scaling lives only in `rope_freqs.weight`; phi3 gets `rope.scaling.original_context_length` but no
  long/short factor tensors, so plain rope). The converter also logs "Unknown RoPE type: default" for the
  transformers-5 `rope_parameters` of the unscaled models; harmless.
- Phi3 `ffn_up` is the fused gate|up matrix (2*n_ff rows): the first n_ff outputs are the gate (SiLU), the last n_ff
  the up projection (llama.cpp LLM_FFN_SWIGLU on the fused tensor = HF `chunk(2)`). `attn_qkv` rows are
  [q (n_head*head_dim); k (n_kv*head_dim); v (n_kv*head_dim)].
- Qwen3: `attn_q_norm`/`attn_k_norm` ([head_dim]) are RMSNorms over each head (same eps), applied before rope;
  attention scale is 1/sqrt(head_dim) with head_dim = `attention.key_length` (32), not hidden/n_head.

## What the files leave implicit (llama.cpp hard-codes it; so do our plans)
- SmolLM3: no RoPE on every 4th layer ((l + 1) % 4 == 0: layers 3 and 7 here). transformers'
  `no_rope_layer_interval` (default 4) decides it; the GGUF has no key for it; llama.cpp's
  `llama_model_smollm3::load_arch_hparams` sets `n_no_rope_layer_step = 4`.
- Gemma 2: sliding and global layers alternate with the first sliding (llama.cpp's swa pattern 2, unless the file
  has `attention.sliding_window_pattern`; transformers' `layer_types`); both use the one RoPE base (the converter
  writes none: 10000); soft-capping caps from `attn_logit_softcapping` / `final_logit_softcapping` (written by the
  converter; llama.cpp's defaults 50 / 30); attention scale 1/sqrt(head_dim) except the 46-layer 27B
  (1/sqrt(hidden/heads)), so the tiny model sets `query_pre_attn_scalar = head_dim`; the converter skips `lm_head`
  (always tied) and adds 1 to every norm weight (Gemma's `1 + w` RMSNorm); its vocab is patched to the GPT-2 path
  like phi3's.

- LFM2: which layers are short convolutions: those whose entry in the per-layer `attention.head_count_kv` array
  is 0 (the converter writes the array from `layer_types`; llama.cpp's `load_arch_hparams` marks them recurrent
  so); the kernel length is `shortconv.l_cache`; the final norm is `token_embd_norm` (transformers'
  `embedding_norm`, applied after the last layer).

## reference.json
- `meta`: names, GGUF architecture, rope style, `gguf_sha256`, `config` (hidden, heads, kv heads, head_dim,
  rope dims, rope parameters, eps, tying, sliding window), the saved HF `config.json`, init scheme, versions and
  `numpy_float64_crosscheck` results.
- `cases[3]`: prompts of random ids in [3, 512), lengths {lens}; the first starts with BOS id 1. Per case:
  `prompt_ids`; `greedy_ids` ({n_gen} tokens from `generate()`, KV-cached, attention_mask of ones, EOS not a stop);
  `top1_top2_margins` per step, `min_margin`, `min_margin_step`; `logits_step0` (all 512 float32 logits at the
  last prompt position); `top{topk}` per step (`ids`, `logits`; step s is the output after feeding greedy_ids[s-1],
  `position` = absolute position of the fed token); `kv_cache_vs_full_forward_max_abs_logit_diff` (generate's
  logits vs one no-cache forward over prompt+greedy[:-1]) and `full_forward_argmax_agrees`.
  The last case also has `all_positions_logits` (40 x 512, every prompt position from one forward pass).
  Floats are written as the shortest decimal that round-trips the float32 value.

## Independent cross-check
`NpGGUF` in the script is a float64 numpy forward pass that reads only the GGUF (gguf-py `GGUFReader`) and
implements the llama.cpp math above (rope style by architecture, partial rope, rope_freqs, fused qkv and gate|up,
q/k norms, biases, GQA, tied output when `output.weight` is absent). It is compared with the transformers logits:
`step0` = logits_step0 of the three prompts, `all steps` = the top-20 logits of all 16 steps of all prompts
(numpy runs one full forward over prompt+greedy[:-1]), `all pos` = all_positions_logits. The script fails if a
step difference reaches 1e-4. It also records negative controls (`meta.numpy_float64_crosscheck.
negative_controls_step0_max_abs_diff_last_prompt`): the same forward with one thing deliberately wrong (other rope
style, rope_freqs ignored, rope over all head dims, q/k norms skipped, biases dropped, token_embd used as output,
no soft-capping of scores or of logits, no sliding window, RoPE on SmolLM3's NoPE layers);
each moves the logits by O(1), so the references do pin each of these details.
`python scripts/gen-arch-refs.py --check-only` reruns just this check (and the
sha256) on the committed files.

## Real llama.cpp check
Generated with `--llama-cpp-check`: each GGUF is also run in real llama.cpp (llama-cpp-python 0.3.36 built from the
same sdist, `pip install --no-build-isolation llama_cpp_python-0.3.36.tar.gz`, CPU, 1 thread, F32 KV cache, no
flash attention); `meta.llama_cpp_crosscheck` and the per-model sections below give its max logit diffs against
the transformers values and its greedy agreement. This confirms llama.cpp loads every file and agrees with the
oracle (rope style, partial rope, rope_freqs, biases, q/k norms, fused tensors). With llama.cpp's default F16 KV
cache the diffs grow to ~5e-3.

## Guidance for tests
- Logits of a float32 engine on these F32 weights: compare within ~1e-4 absolute (logits are O(1-10); numpy float64
  vs transformers float32 differ by < 1e-5, KV-cached vs no-cache by < 1e-5). Greedy ids: exact equality expected;
  the smallest top1-top2 margin of any step is in the table (> 1000x the float32 noise).
- Random models settle into short cycles on some prompts (e.g. qwen2 and mistral on the 40-token prompt); that is
  expected and still pins the math.

| model | HF class | GGUF arch | rope | layers | hidden | heads/kv | head_dim | rope dims | ffn | GGUF bytes | numpy step0 max diff | numpy all steps | numpy all pos | torch KV vs no-cache | min top1-top2 margin |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{table}

## Per model

{details}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA_CPP))
    ap.add_argument("--only", nargs="*", help="regenerate only these models (the others' files are kept and "
                    "go into the README as committed)")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary HF model dirs")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--llama-cpp-check", action="store_true",
                    help="also run the GGUFs in real llama.cpp via an installed llama-cpp-python (built from the "
                         "0.3.36 sdist) and record the logit diffs in meta/README")
    args = ap.parse_args()
    if args.check_only:
        check_only(args)
    else:
        generate(args)


if __name__ == "__main__":
    main()
