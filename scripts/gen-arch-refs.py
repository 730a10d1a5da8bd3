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
     q/k norms, biases, GQA, tied output; later: soft-capping, sliding windows, experts, sinks, short
     convolutions, Qwen3.5's Gated DeltaNet and gated attention, Qwen3.5 MoE's shared expert, Gemma 4's per-layer
     embeddings, KV sharing, per-type head sizes and proportional RoPE).
  6. qwen35 and qwen35moe: random `mtp.*` (multi-token prediction) tensors are added to the checkpoint before step 3, and
     reference.json's `mtp` holds the MTP head's logits computed by NpGGUF.mtp from the GGUF as llama.cpp's
     graph_mtp (transformers does not run it), cross-checked with transformers modules on the HF weights.
  7. gptossmxfp4: gptoss's draws with every expert weight rounded to MXFP4 values (gguf-py's quantizer, then dequantized)
     before step 4; the checkpoint given to step 3 stores the experts as OpenAI's MXFP4 *_blocks / *_scales
     (quant_method mxfp4), so the converter writes them as GGML MXFP4 tensors; the script asserts that they dequantize
     to the transformers weights bit for bit (NpGGUF reads them with gguf-py's dequantize).

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
STD_CONV = 0.5  # LFM2's short-convolution taps (3 per channel), Qwen3.5's conv1d (4): large enough to move the logits
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
    {
        "name": "qwen35",
        "gguf_name": "Tiny Random Qwen3.5",
        "model_type": "qwen3_5_text",
        "hf_class": "Qwen3_5ForCausalLM",
        # Qwen3.5's RMSNorms are zero-centred ((1 + w) in transformers; the converter writes 1 + w) except the
        # Gated DeltaNet's gated output norm (plain w, written as is): drawn so that every effective norm
        # multiplier is the other models' (U(0.5, 1.5); the tied final norm U(1.5, 4.5)).
        "zero_centred_norms": True,
        # One multi-token-prediction block (transformers ignores mtp.*; added to the checkpoint before converting).
        "mtp": True,
        "exercises": "hybrid Qwen3.5 dense: Gated DeltaNet linear-attention layers (0, 2: fused qkv projection, "
                     "causal depthwise convolution over 4 positions + SiLU, L2-normalised q/k, per-v-head decay "
                     "g = ssm_a * softplus(alpha + dt_bias) and beta = sigmoid(b), delta-rule state 16x16 per v head, "
                     "gated RMSNorm times SiLU(z), ssm_out) with 4 value heads over 2 key heads (the converter's "
                     "grouped -> tiled v-head reorder: GGUF v head i uses k head i % 2) beside gated full-attention "
                     "layers (1, 3: q projection = per-head [query | gate], q/k RMSNorms, partial interleaved-MRoPE "
                     "on 8 of 16 head dims (sections [2, 1, 1], = NEOX pairs at text positions), sigmoid(gate) * attention "
                     "before o_proj, GQA 4/2); layer kinds from attention.recurrent_layers (full_attention_interval 2 "
                     "agrees); zero-centred norms written +1 by the converter; tied output (no output.weight); one MTP "
                     "(nextn) block blk.4 (block_count 5 = 4 + nextn_predict_layers 1) whose logits are reference.json's "
                     "`mtp` (numpy from the GGUF as llama.cpp's graph_mtp, cross-checked with torch modules on the HF "
                     "mtp.* weights)",
        # 4 layers and FFN width 64 (tied output) keep the F32 GGUF under 800 kB with the MTP block.
        "config": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attention_bias=False,
                       layer_types=["linear_attention", "full_attention"] * 2,
                       full_attention_interval=2,
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_hidden_layers=1,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    },
    {
        "name": "qwen35moe",
        "gguf_name": "Tiny Random Qwen3.5 MoE",
        "model_type": "qwen3_5_moe_text",
        "hf_class": "Qwen3_5MoeForCausalLM",
        "zero_centred_norms": True,
        "mtp": True,
        "exercises": "hybrid Qwen3.5 MoE: qwen35's layers (Gated DeltaNet 0, 2 with 4 value heads over 2 key heads in "
                     "the converter's tiled order; gated full attention 1, 3 with partial IMROPE on 8 of 16 dims) with a "
                     "mixture-of-experts FFN in every block: router ffn_gate_inp, softmax over 8 experts, the top 2 "
                     "per token with their probabilities renormalised to sum 1 (transformers hard-codes it; llama.cpp's "
                     "qwen35moe graph passes norm_w = true and softmax gating, no GGUF key says so), SiLU-gated experts "
                     "of width 8 (ffn_{gate,up,down}_exps), plus a shared expert of width 16 (ffn_{gate,up,down}_shexp) "
                     "always on, scaled by sigmoid(ffn_gate_inp_shexp . x) per token; zero-centred norms written +1; "
                     "tied output; one MTP (nextn) block blk.4 whose FFN is the same MoE + gated shared expert, its "
                     "logits in reference.json's `mtp` (numpy from the GGUF as llama.cpp's qwen35moe graph_mtp, "
                     "cross-checked with transformers modules on the HF mtp.* weights)",
        # Experts of width 8 and a shared expert of width 16 (different, so that expert_feed_forward_length and
        # expert_shared_feed_forward_length cannot be confused) keep the F32 GGUF under 1 MB with the MTP block.
        "config": dict(hidden_size=64, moe_intermediate_size=8, shared_expert_intermediate_size=16, num_experts=8,
                       num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attention_bias=False,
                       layer_types=["linear_attention", "full_attention"] * 2,
                       full_attention_interval=2,
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_hidden_layers=1,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    },
    {
        "name": "gemma4",
        "gguf_name": "Tiny Random Gemma 4",
        "model_type": "gemma4_text",
        "hf_class": "Gemma4ForCausalLM",
        # Gemma 4's activation is hidden_activation (GELU tanh); no hidden_act.
        "hidden_act": None,
        # layer_scalar is a buffer (not a parameter): drawn too, after the parameters.
        "layer_scalar": (0.5, 1.5),
        # Attention scale 1 on RMS-normed q and k: with norm weights U(0.5, 1.5) the scores of 16- and 32-dim heads
        # have a spread of ~5 (near one-hot attention) and float32 transformers drifts 8e-5 from float64 on the
        # 40-token prompt; U(0.25, 0.75) gives 1-3e-5.
        "qk_norm": (0.25, 0.75),
        # The embedding is multiplied by sqrt(64) = 8: N(0, 0.03) (0.24 after scaling) keeps the fed token from
        # dominating its own (tied) logit; with the tied models' N(0, 0.1) greedy decoding repeats one token 11 times.
        "tied_std_embed": 0.03,
        "exercises": "Gemma 4 text: per-layer embeddings (PLE: a 512 x (6 layers x 8) token table times sqrt(8), plus "
                     "the scaled embedding projected by per_layer_model_proj / sqrt(64) and RMS-normed, summed / sqrt(2); "
                     "each layer adds RMSNorm(proj(GELU(inp_gate x) * its slice)) to the residual), sliding (window 8: "
                     "the 12- and 40-token prompts cross it) and full layers ([S, S, F] x 2, from the per-layer "
                     "attention.sliding_window_pattern) with their own head sizes (16 / 32), KV heads (2 / 1) and RoPE "
                     "(sliding: NEOX over all 16 dims, base 10000; full: proportional RoPE, 4 of 16 pairs rotated with "
                     "theta = base^(-2i/32), base 1e6, the other pairs' rope_freqs 1e30), key-equals-value attention on "
                     "the full layers (no attn_v: V is the raw K projection), v RMS-norm without weight, q/k RMS-norms, "
                     "attention scale 1 (not 1/sqrt(d)), KV sharing (the last 3 layers keep no K/V: sliding ones read "
                     "layer 1's, the full one layer 2's), double-wide FFN (width 64 instead of 32) on the KV-shared "
                     "layers, GELU (tanh), post-attention / post-FFN norms, embeddings times sqrt(64), a per-layer "
                     "output scalar (layer_output_scale), final-logit soft-capping (cap 3), tied output",
        # 6 layers [S, S, F, S, S, F] with 3 KV-shared: llama.cpp's gemma4 KV reuse is hard-coded (a shared sliding
        # layer reads layer n_kv - 2, a shared full layer n_kv - 1, n_kv = block_count - shared_kv_layers = 3), which is
        # what transformers does (the last non-shared layer of each type) when layer n_kv - 1 is full and n_kv - 2
        # sliding.
        "config": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                       attention_k_eq_v=True, num_kv_shared_layers=3, use_double_wide_mlp=True,
                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                       sliding_window=8, final_logit_softcapping=3.0, max_position_embeddings=1024,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                       enable_moe_block=False,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                           "rope_theta": 1000000.0}}),
    },
    {
        "name": "lfm2moe",
        "gguf_name": "Tiny Random LFM2 MoE",
        "model_type": "lfm2_moe",
        "hf_class": "Lfm2MoeForCausalLM",
        # The router's expert selection bias (feed_forward.expert_bias) is a buffer, not a parameter (zeros in
        # transformers' init): drawn N(0, 0.1) after the parameters, about the spread of the sigmoid scores (~0.15),
        # so that it changes which experts are chosen for many tokens.
        "expert_bias_std": 0.1,
        "exercises": "LFM2 MoE: LFM2's hybrid layers (gated short convolutions 0, 2, 3 over 3 positions; attention 1, 4 "
                     "with q/k RMSNorms, NEOX rope, GQA 4/2; conv layers marked by 0 in the per-layer "
                     "attention.head_count_kv) with a mixture of experts after the leading dense blocks: layers 0-1 "
                     "a dense SiLU FFN of width 96 (leading_dense_block_count 2), layers 2-4 8 SiLU experts of width "
                     "16, the router's sigmoid scores (expert_gating_func 2) plus a per-expert selection bias "
                     "(exp_probs_b, N(0, 0.1)) choose the top 3, weighted by their unbiased sigmoid scores "
                     "renormalised to sum 1 (llama.cpp hard-codes norm_w; routed_scaling_factor 1, which llama.cpp "
                     "does not read); the final norm is token_embd_norm; tied output",
        # Experts of width 16 (not 32) keep the F32 GGUF under 1 MB; the dense FFN's 96 differs from it, so that
        # feed_forward_length and expert_feed_forward_length cannot be confused.
        "config": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_experts=8,
                       num_experts_per_tok=3, num_dense_layers=2, use_expert_bias=True, norm_topk_prob=True,
                       routed_scaling_factor=1.0, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, norm_eps=1e-5,
                       layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
                       conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    },
    {
        "name": "gptossmxfp4",
        "gguf_name": "Tiny Random GPT-OSS MXFP4",
        "model_type": "gpt_oss",
        "hf_class": "GptOssForCausalLM",
        "bias_std": 0.02,
        # gptoss's random draws and prompts (numpy default_rng([seed, index of gptoss])): the same model, except that
        # every expert weight is then rounded to the nearest MXFP4 value (per block of 32 along the input dimension,
        # the scale gguf-py's / ggml's quantizer picks), and the GGUF stores the experts as MXFP4 (GGML type 39).
        "rng_like": "gptoss",
        "mxfp4_experts": True,
        "exercises": "gptoss's model (attention sinks, q/k/v/o biases, sliding and full layers alternating, YaRN, 8 "
                     "experts top 2 with router and expert biases, clamped SwiGLU, untied output) with its expert "
                     "matrices ffn_{gate,up,down}_exps stored as MXFP4 (GGML type 39: per 32 values along the input "
                     "dimension one E8M0 power-of-two scale byte and 32 E2M1 codes {0, +-0.5, +-1, +-1.5, +-2, +-3, "
                     "+-4, +-6}, 17 bytes), as real gpt-oss GGUFs store them: the weights were rounded to MXFP4 values "
                     "before running transformers, the checkpoint handed to the converter holds them as OpenAI's "
                     "*_blocks / *_scales (quant_method mxfp4), and the converter repacks those bits into ggml's layout, "
                     "so the GGUF's MXFP4 blocks dequantize exactly to the transformers float32 weights; every other "
                     "tensor F32",
        "config": None,  # gptoss's, set below
    },
    {
        "name": "gemma4e",
        "gguf_name": "Tiny Random Gemma 4 E",
        "model_type": "gemma4_text",
        "hf_class": "Gemma4ForCausalLM",
        "hidden_act": None,
        "layer_scalar": (0.5, 1.5),
        # gemma4's scheme with the real Gemma 4 E2B/E4B head sizes (256 sliding, 512 full). The attention score of an
        # RMS-normed q and k (scale 1) grows like sqrt(head_dim) * w_q * w_k, so 16x gemma4's head sizes want its
        # U(0.25, 0.75) about halved; U(0.125, 0.375) still left float32 transformers 3.9e-5 from float64 (KV-cached
        # vs no-cache 2.7e-5), U(0.1, 0.3) gives < 8e-6 with the widest top1-top2 margins of the ranges tried.
        "qk_norm": (0.1, 0.3),
        "tied_std_embed": 0.03,
        "exercises": "Gemma 4 E2B/E4B-sized attention heads: sliding layers with head size 256 and full layers with head "
                     "size 512 (the real E2B/E4B sizes; 2 query heads over 1 KV head on both, as E2B), everything else "
                     "tiny (hidden 64): sliding (window 8: the 12- and 40-token prompts cross it) and full layers "
                     "[S, F, S, F] (attention.sliding_window_pattern), a scalar attention.head_count_kv (1: with "
                     "attention_k_eq_v off, as in E2B/E4B, the full layers have no KV-head override and the converter "
                     "writes no per-layer array), separate attn_v on every non-shared layer (no key-equals-value), "
                     "RoPE: sliding NEOX over all 256 dims, base 10000; full proportional RoPE, 64 of 256 pairs rotated "
                     "with theta = base^(-2i/512), base 1e6, the other pairs' rope_freqs 1e30; q/k RMS-norms, v "
                     "RMS-norm without weight, attention scale 1, KV sharing (the last 2 layers keep no K/V: the sliding "
                     "one reads layer 0's, the full one layer 1's), double-wide FFN (64 instead of 32) on the KV-shared "
                     "layers, per-layer embeddings (a 512 x (4 layers x 8) token table), GELU (tanh), post-attention / "
                     "post-FFN norms, embeddings times sqrt(64), layer_output_scale, final-logit soft-capping (cap 3), "
                     "tied output",
        # 4 layers [S, F, S, F] with 2 KV-shared: llama.cpp's hard-coded KV reuse (a shared sliding layer reads layer
        # n_kv - 2, a shared full layer n_kv - 1, n_kv = 4 - 2 = 2) equals transformers' (the last non-shared layer
        # of each type), as in the real E2B (35 layers, 20 shared: layer 14 full, 13 sliding) and E4B (42, 18: 23
        # full, 22 sliding). attention_k_eq_v False as E2B/E4B's config.json (only the 26B-A4B / 31B set it), so
        # num_global_key_value_heads is ignored by transformers (the full layers keep num_key_value_heads = 1) and the
        # full layers have their own v_proj. Even so the head sizes make this the largest file (~2.4 MB): the
        # attention matrices alone are 480k floats.
        "config": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
                       attention_k_eq_v=False, num_kv_shared_layers=2, use_double_wide_mlp=True,
                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       sliding_window=8, final_logit_softcapping=3.0, max_position_embeddings=1024,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                       enable_moe_block=False,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                           "rope_theta": 1000000.0}}),
    },
]
_by_name = {a["name"]: a for a in ARCHS}
_by_name["gptossmxfp4"]["config"] = dict(_by_name["gptoss"]["config"])

# llama.cpp src/llama-model.cpp llama_model_rope_type(): which pairs rotate.
# qwen35: IMROPE (interleaved multi-section rope; NEOX pairs, each pair's angle from one of 4 position streams).
ROPE_STYLE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "phi3": "neox", "smollm3": "norm",
              "gemma2": "neox", "qwen3moe": "neox", "lfm2": "neox", "gpt-oss": "neox", "qwen35": "imrope",
              "qwen35moe": "imrope", "gemma4": "neox", "lfm2moe": "neox"}

# Qwen3.5 (Gated DeltaNet)
STD_DT_BIAS = 0.5          # dt_bias N(0, 0.5)
A_RANGE = (0.05, 0.6)      # A = exp(A_log) ~ U: per-token decay exp(-A * softplus(alpha + dt_bias)) mostly in (0.5, 1)
L2NORM_EPS = 1e-6          # transformers' l2norm(q or k) = x / sqrt(sum(x^2) + 1e-6) (hard-coded); llama.cpp uses rms eps
MTP_SEED_TAG = 11          # numpy default_rng([seed, arch_index, 11]) draws the mtp.* tensors


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
    act = {"hidden_act": spec.get("hidden_act", "silu")} if spec.get("hidden_act", "silu") else {}
    cfg = AutoConfig.for_model(spec["model_type"], vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID,
                               eos_token_id=EOS_ID, pad_token_id=UNK_ID, **act,
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
                if spec.get("zero_centred_norms"):
                    v = rng.uniform(lo - 1.0, hi - 1.0, size=shape)
                    kind = "final zero-centred rmsnorm (tied model) (1 + w), w U(%g,%g)" % (lo - 1.0, hi - 1.0)
                else:
                    v = rng.uniform(lo, hi, size=shape)
                    kind = "final rmsnorm (tied model) U(%g,%g)" % (lo, hi)
            elif spec.get("zero_centred_norms") and name.endswith("norm.weight") \
                    and not name.endswith("linear_attn.norm.weight"):
                v = rng.uniform(NORM_LO - 1.0, NORM_HI - 1.0, size=shape)
                kind = "zero-centred rmsnorm (1 + w), w U(%g,%g)" % (NORM_LO - 1.0, NORM_HI - 1.0)
            elif spec.get("qk_norm") and name.endswith(("q_norm.weight", "k_norm.weight")):
                lo, hi = spec["qk_norm"]
                v = rng.uniform(lo, hi, size=shape)
                kind = "q/k rmsnorm U(%g,%g)" % (lo, hi)
            elif name.endswith("norm.weight"):
                v = rng.uniform(NORM_LO, NORM_HI, size=shape)
                kind = "rmsnorm U(%g,%g)" % (NORM_LO, NORM_HI)
            elif name.endswith(".A_log"):
                v = np.log(rng.uniform(A_RANGE[0], A_RANGE[1], size=shape))
                kind = "A_log = log U(%g,%g)" % A_RANGE
            elif name.endswith(".dt_bias"):
                v = rng.normal(0.0, STD_DT_BIAS, size=shape)
                kind = "dt_bias N(0,%g)" % STD_DT_BIAS
            elif name.endswith("conv1d.weight"):
                v = rng.normal(0.0, STD_CONV, size=shape)
                kind = "depthwise convolution taps N(0,%g)" % STD_CONV
            elif name.endswith("embed_tokens_per_layer.weight"):
                # Gemma 4's per-layer token table (times sqrt(8)): comparable to the RMS-normed projection it is
                # added to, so both halves of the per-layer input matter.
                v = rng.normal(0.0, STD_EMBED, size=shape)
                kind = "per-layer token embedding N(0,%g)" % STD_EMBED
            elif name.endswith((".bias", "_bias", ".sinks")):
                std = spec.get("bias_std", STD_BIAS)
                v = rng.normal(0.0, std, size=shape)
                kind = "bias N(0,%g)" % std
            elif "embed_tokens" in name or name == "lm_head.weight":
                std = spec.get("tied_std_embed", TIED_STD_EMBED) if tied else STD_EMBED
                v = rng.normal(0.0, std, size=shape)
                kind = "embedding N(0,%g)" % std
            elif name.endswith("conv.conv.weight"):
                v = rng.normal(0.0, STD_CONV, size=shape)
                kind = "short-convolution taps N(0,%g)" % STD_CONV
            elif tied and name.endswith(("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight",
                                         "experts.down_proj")):
                v = rng.normal(0.0, TIED_STD_RESID_OUT, size=shape)
                kind = "residual-writing matrix (tied model) N(0,%g)" % TIED_STD_RESID_OUT
            else:
                assert p.dim() in (2, 3), name  # 3: a mixture's stacked experts
                v = rng.normal(0.0, STD_MATRIX, size=shape)
                kind = "matrix N(0,%g)" % STD_MATRIX
            p.copy_(torch.from_numpy(v.astype(np.float32)))
            init_log[name] = kind
        if spec.get("expert_bias_std"):
            # LFM2 MoE's expert_bias (a buffer): the router's selection bias, drawn after the parameters.
            std = spec["expert_bias_std"]
            for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
                if name.endswith("expert_bias"):
                    b.copy_(torch.from_numpy(rng.normal(0.0, std, size=tuple(b.shape)).astype(np.float32)))
                    init_log[name] = "expert selection bias (buffer) N(0,%g)" % std
        if spec.get("layer_scalar"):
            lo, hi = spec["layer_scalar"]
            for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
                if name.endswith("layer_scalar"):
                    b.copy_(torch.from_numpy(rng.uniform(lo, hi, size=tuple(b.shape)).astype(np.float32)))
                    init_log[name] = "layer scalar (buffer) U(%g,%g)" % (lo, hi)
    model.eval()
    return model, init_log


def mtp_param_shapes(cfg):
    """Qwen3.5's multi-token-prediction block as real checkpoints store it (`mtp.*`, ignored by transformers;
    conversion/qwen.py _QwenMtpMixin maps fc -> eh_proj, pre_fc_norm_embedding -> enorm, pre_fc_norm_hidden ->
    hnorm, norm -> shared_head.norm, layers.0.* -> layer num_hidden_layers; every *norm.weight gets + 1)."""
    d, hd, H, KV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    L = "mtp.layers.0."
    if getattr(cfg, "num_experts", None):
        # Qwen3.5 MoE: the MTP layer's FFN is the MoE block (router, experts stored per expert as the checkpoints
        # and save_pretrained store them, shared expert and its gate).
        E, fe, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        mlp = {L + "mlp.gate.weight": (E, d), L + "mlp.shared_expert_gate.weight": (1, d),
               L + "mlp.shared_expert.gate_proj.weight": (fs, d), L + "mlp.shared_expert.up_proj.weight": (fs, d),
               L + "mlp.shared_expert.down_proj.weight": (d, fs)}
        for e in range(E):
            mlp.update({L + f"mlp.experts.{e}.gate_proj.weight": (fe, d), L + f"mlp.experts.{e}.up_proj.weight": (fe, d),
                        L + f"mlp.experts.{e}.down_proj.weight": (d, fe)})
    else:
        ff = cfg.intermediate_size
        mlp = {L + "mlp.gate_proj.weight": (ff, d), L + "mlp.up_proj.weight": (ff, d), L + "mlp.down_proj.weight": (d, ff)}
    return {
        "mtp.fc.weight": (d, 2 * d),  # input [enorm(embedding); hnorm(hidden)]
        "mtp.pre_fc_norm_embedding.weight": (d,), "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,),
        L + "input_layernorm.weight": (d,), L + "post_attention_layernorm.weight": (d,),
        L + "self_attn.q_proj.weight": (2 * H * hd, d), L + "self_attn.k_proj.weight": (KV * hd, d),
        L + "self_attn.v_proj.weight": (KV * hd, d), L + "self_attn.o_proj.weight": (d, H * hd),
        L + "self_attn.q_norm.weight": (hd,), L + "self_attn.k_norm.weight": (hd,),
        **mlp,
    }


# ----------------------------------------------------------------------------------------------
# MXFP4 experts (gptossmxfp4)
# ----------------------------------------------------------------------------------------------
MXFP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_round_experts(model, init_log):
    """Rounds gpt-oss's stacked expert matrices (transformers: gate_up_proj (E, in, 2 ff), down_proj (E, ff, out);
    input dimension first) to MXFP4 values in place, per block of 32 consecutive input-dimension values of one output
    row, with gguf-py's MXFP4 quantizer (= ggml's quantize_row_mxfp4_ref: scale byte e = floor(log2(max |w|)) - 2 + 127,
    i.e. 2^(e - 127) with max |w| / scale in [4, 8); each value the nearest of the 16 E2M1 codes times the scale),
    then dequantized. Re-quantizing the rounded values must give the same bytes and the same floats bit for bit.
    Returns {param name: ggml block_mxfp4 bytes (E, out, in / 32 * 17)} and statistics."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize, dequantize
    MX = GGMLQuantizationType.MXFP4
    packed, stats = {}, {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                continue
            w = p.detach().numpy().astype(np.float32)                 # (E, in, out)
            rows = np.ascontiguousarray(w.transpose(0, 2, 1))          # (E, out, in): blocks along the input dim
            q = quantize(rows, MX)
            r = dequantize(q, MX).astype(np.float32)
            q2 = quantize(r, MX)
            assert np.array_equal(q2, q), name
            assert np.array_equal(dequantize(q2, MX).astype(np.float32).view(np.uint32), r.view(np.uint32)), name
            p.copy_(torch.from_numpy(np.ascontiguousarray(r.transpose(0, 2, 1))))
            packed[name] = q
            blk = q.reshape(-1, 17)
            codes = np.concatenate([blk[:, 1:] & 0x0F, blk[:, 1:] >> 4], axis=1)
            stats[name] = {"blocks": int(blk.shape[0]),
                           "scale_exponents": sorted({int(e) - 127 for e in blk[:, 0]}),
                           "code_counts": np.bincount(codes.ravel(), minlength=16).tolist(),
                           "relative_rms_rounding_change": float(np.sqrt(np.mean((rows - r) ** 2) / np.mean(rows ** 2)))}
            init_log[name] = init_log[name] + ", then rounded to MXFP4 (blocks of 32 along the input dimension)"
    return packed, stats


def mxfp4_ggml_to_openai(q):
    """ggml block_mxfp4 bytes (..., n_blocks * 17: scale byte, then 16 bytes whose low nibbles are elements 0-15 and
    high nibbles 16-31) -> OpenAI's checkpoint layout: blocks (..., n_blocks, 16) with element 2j in the low and 2j + 1
    in the high nibble of byte j, scales (..., n_blocks) (the same E8M0 byte: 2^(s - 127) times the E2M1 value; ggml
    writes it as 2^(s - 128) times the doubled value). The code indices are the same in both."""
    b = q.reshape(*q.shape[:-1], -1, 17)
    codes = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(b[..., 0])


def write_mxfp4_checkpoint(hf_dir, model, packed):
    """Replaces the saved float32 expert matrices by OpenAI's MXFP4 *_blocks / *_scales (as gpt-oss-20b/120b ship) and
    marks config.json quant_method mxfp4, so that convert_hf_to_gguf.py's GptOssModel repacks them into GGML MXFP4
    tensors (its generate_extra_tensors / repack_mxfp4) instead of writing F32 experts. Checks first that transformers'
    own MXFP4 decoder (integrations.mxfp4.convert_moe_packed_tensors) gives back the model's weights bit for bit."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    params = dict(model.named_parameters())
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    for name, q in packed.items():
        blocks, scales = mxfp4_ggml_to_openai(q)
        deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        want = params[name].detach().numpy()
        assert deq.shape == want.shape and np.array_equal(deq.numpy().view(np.uint32), want.view(np.uint32)), name
        assert np.array_equal(tensors.pop(name).view(np.uint32), want.view(np.uint32)), name
        tensors[name + "_blocks"] = blocks
        tensors[name + "_scales"] = scales
    save_file(tensors, path, metadata={"format": "pt"})
    cpath = os.path.join(hf_dir, "config.json")
    cfg = json.load(open(cpath))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(cpath, "w") as fh:
        json.dump(cfg, fh, indent=2)


def mxfp4_gguf_check(gguf_path, model, packed):
    """The GGUF's expert tensors: MXFP4, the very bytes of gguf-py's quantization of the (rounded) weights, and their
    dequantization equal to transformers' float32 weights bit for bit (gate = even, up = odd gate_up_proj columns).
    Every other tensor F32."""
    from gguf import GGUFReader, GGMLQuantizationType
    from gguf.quants import dequantize
    MX = GGMLQuantizationType.MXFP4
    r = GGUFReader(gguf_path)
    params = {k: v.detach().numpy() for k, v in model.named_parameters()}
    checked, n_bytes = [], 0
    for t in r.tensors:
        if not t.name.endswith("_exps.weight"):
            assert t.tensor_type == GGMLQuantizationType.F32, (t.name, t.tensor_type)
            continue
        assert t.tensor_type == MX, (t.name, t.tensor_type)
        l = int(t.name.split(".")[1])
        kind = t.name.split(".")[2]
        hf = f"model.layers.{l}.mlp.experts." + ("down_proj" if kind == "ffn_down_exps" else "gate_up_proj")
        w = params[hf]                                                  # (E, in, out)
        if kind == "ffn_gate_exps":
            w = w[:, :, 0::2]
        elif kind == "ffn_up_exps":
            w = w[:, :, 1::2]
        want = np.ascontiguousarray(w.transpose(0, 2, 1))              # (E, out, in) = ggml ne reversed
        raw = np.asarray(t.data, dtype=np.uint8)
        shape = [int(x) for x in reversed(t.shape)]
        deq = dequantize(raw, MX).reshape(shape)
        assert np.array_equal(deq.astype(np.float32).view(np.uint32), want.view(np.uint32)), t.name
        q = packed[hf]                                                  # (E, 2 ff or out, bytes)
        if kind == "ffn_gate_exps":
            q = q[:, 0::2]
        elif kind == "ffn_up_exps":
            q = q[:, 1::2]
        assert np.array_equal(raw.reshape(-1), np.ascontiguousarray(q).reshape(-1)), t.name
        checked.append(t.name)
        n_bytes += raw.size
    assert len(checked) == 3 * model.config.num_hidden_layers, checked
    return {"tensors_checked": len(checked), "mxfp4_bytes": n_bytes,
            "dequantized_equal_transformers_weights_bitwise": True,
            "bytes_equal_gguf_py_quantization_of_the_weights": True}


def add_mtp_tensors(hf_dir, cfg, seed, arch_index, init_log):
    """Random mtp.* tensors (the main model's scheme: matrices N(0, 0.08), residual-writing ones N(0, 0.3) when
    tied, zero-centred norms w U(-0.5, 0.5), the head norm mtp.norm like the tied final norm) written into the
    saved model.safetensors so that the converter emits the nextn block; returns them (float32 numpy)."""
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng([seed, arch_index, MTP_SEED_TAG])
    tied = bool(cfg.tie_word_embeddings)
    mtp = {}
    for name, shape in sorted(mtp_param_shapes(cfg).items()):
        if tied and name == "mtp.norm.weight":
            lo, hi = TIED_FINAL_NORM[0] - 1.0, TIED_FINAL_NORM[1] - 1.0
            v = rng.uniform(lo, hi, size=shape)
            init_log[name] = "MTP head norm (tied model) (1 + w), w U(%g,%g)" % (lo, hi)
        elif tied and name.endswith(("o_proj.weight", "down_proj.weight")):
            v = rng.normal(0.0, TIED_STD_RESID_OUT, size=shape)
            init_log[name] = "residual-writing matrix (tied model) N(0,%g)" % TIED_STD_RESID_OUT
        elif name.endswith("norm.weight"):
            v = rng.uniform(NORM_LO - 1.0, NORM_HI - 1.0, size=shape)
            init_log[name] = "zero-centred rmsnorm (1 + w), w U(%g,%g)" % (NORM_LO - 1.0, NORM_HI - 1.0)
        else:
            v = rng.normal(0.0, STD_MATRIX, size=shape)
            init_log[name] = "matrix N(0,%g)" % STD_MATRIX
        mtp[name] = v.astype(np.float32)
    path = os.path.join(hf_dir, "model.safetensors")
    assert os.path.exists(path) and not os.path.exists(path + ".index.json")
    tensors = load_file(path)
    assert not any(k.startswith("mtp.") for k in tensors)
    tensors.update(mtp)
    save_file(tensors, path, metadata={"format": "pt"})
    return mtp


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
if arch in ("gemma4", "gemma4e"):
    # Gemma4Model.set_vocab reads a SentencePiece-style vocab (gguf.LlamaHfVocab, tokenizer model "gemma4").
    import conversion.gemma
    conversion.gemma.Gemma4Model.set_vocab = lambda self: self._set_vocab_gpt2()
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
def mxfp4_decode(raw, variant=None):
    """GGML MXFP4 (block_mxfp4: 1 E8M0 byte e, then 16 bytes; element j < 16 in the low nibble of byte j, element
    16 + j in its high nibble) -> float64, written from ggml's dequantize_row_mxfp4, independently of gguf-py:
    value = E2M1[code] * 2^(e - 127). Variants (negative controls): "nibbles_interleaved" (OpenAI's checkpoint order:
    elements 2j, 2j + 1 in byte j), "scale_doubled" (2^(e - 127) applied to ggml's doubled code table)."""
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, 17)
    lo, hi = b[:, 1:] & 0x0F, b[:, 1:] >> 4
    if variant == "nibbles_interleaved":
        codes = np.stack([lo, hi], axis=-1).reshape(-1, 32)
    else:
        codes = np.concatenate([lo, hi], axis=1)
    scale = np.exp2(b[:, :1].astype(np.float64) - 127.0)
    if variant == "scale_doubled":
        scale = 2.0 * scale
    return (MXFP4_E2M1[codes] * scale).reshape(-1)


def q8_0_round(x):
    """ggml's quantize_row_q8_0 then dequantized (float32 input; per 32 values d = amax / 127, q = round(x / d) with
    1/d from the float32 d, value = fp16(d) * q): what ggml's CPU matmul does to the activations multiplying MXFP4
    weights (its vec_dot_type is Q8_0; the integer dot products are exact)."""
    x32 = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = (np.abs(x32).max(axis=1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.round((x32 * inv).astype(np.float32))  # ties to even (ggml's AVX path; roundf goes away from zero)
    return (q.astype(np.float64) * d.astype(np.float16).astype(np.float64)).reshape(np.shape(x))


class NpGGUF:
    """llama.cpp math for arch llama / qwen2 / qwen3 / phi3 (and the later ones; qwen35: forward_qwen35, mtp),
    float64, weights read from the GGUF.

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
        n_ff = f(f"{a}.feed_forward_length", 0)  # qwen35moe: absent (its FFNs are all experts); gemma4: per layer
        self.n_ff = max(n_ff) if isinstance(n_ff, list) else int(n_ff)
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
        # Qwen3.5 MoE: the shared expert (always on) times sigmoid(ffn_gate_inp_shexp . x); switches for the negative
        # controls: router "softmax" (llama.cpp's hard-coded qwen35moe gating) or "sigmoid" (a wrong variant).
        self.shexp = self.shexp_gate = True
        self.router = "softmax"
        # LFM2 MoE (llama.cpp's lfm2 graph with build_moe_ffn): the file's expert_gating_func (2 = sigmoid; llama.cpp
        # requires the key for lfm2moe), the per-expert selection bias exp_probs_b added to the scores only to choose
        # the experts (the weights are the unbiased scores), norm_w = true hard-coded, no weight scale (lfm2moe's
        # loader does not read expert_weights_scale); the first leading_dense_block_count blocks have a dense FFN.
        # Switches for the negative controls: sel_bias (use exp_probs_b), bias_in_weights (weights from the biased
        # scores), dense_lead (run the leading blocks' dense FFN).
        gating = int(f(f"{a}.expert_gating_func", 0))
        if gating == 2:
            self.router = "sigmoid"
        else:
            assert gating in (0, 1), gating
        self.n_dense_lead = int(f(f"{a}.leading_dense_block_count", 0))
        self.sel_bias = True
        self.bias_in_weights = False
        self.dense_lead = True
        self.sel_log = None  # a list: (layer prefix, k-th minus (k+1)-th selection score, chosen, chosen without bias)
        self.moe_log = None  # a list: collects (layer prefix, chosen experts per token, their weights)
        self.w = {}
        self.mxfp4_raw = {}  # MXFP4 tensors' raw block bytes (for the decoding cross-check and negative controls)
        self.q8_act = False
        for t in r.tensors:
            if t.tensor_type == GGMLQuantizationType.MXFP4:
                # gpt-oss experts (gptossmxfp4): gguf-py's dequantize, cross-checked bitwise with mxfp4_decode.
                from gguf.quants import dequantize
                raw = np.asarray(t.data, dtype=np.uint8)
                shape = [int(x) for x in reversed(t.shape)]
                arr = dequantize(raw, GGMLQuantizationType.MXFP4).astype(np.float32).reshape(shape)
                assert np.array_equal(mxfp4_decode(raw).reshape(shape), arr), t.name  # exact (-0 == +0)
                self.mxfp4_raw[t.name] = (raw, shape)
                self.w[t.name] = arr.astype(np.float64)
                continue
            assert t.tensor_type == GGMLQuantizationType.F32, (t.name, t.tensor_type)
            arr = np.asarray(t.data, dtype=np.float32)
            if len(t.shape) > 1:
                # ggml order reversed: (experts,) rows, cols
                arr = arr.reshape([int(x) for x in reversed(t.shape)])
            else:
                arr = arr.reshape(-1)
            self.w[t.name] = arr.astype(np.float64)
        self.out_w = self.w.get("output.weight", self.w["token_embd.weight"])
        if a == "lfm2moe":
            # The leading dense blocks are exactly those without a router (llama.cpp creates the tensors so).
            for l in range(self.n_layer):
                assert (f"blk.{l}.ffn_gate_inp.weight" in self.w) == (l >= self.n_dense_lead), l
        self.final_norm = "token_embd_norm.weight" if a in ("lfm2", "lfm2moe") else "output_norm.weight"
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
        # Qwen3.5 (hybrid Gated DeltaNet / gated full attention, plus the MTP block after the main layers).
        self.qwen35 = a in ("qwen35", "qwen35moe")
        self.n_nextn = int(f(f"{a}.nextn_predict_layers", 0))
        self.n_main = self.n_layer - self.n_nextn  # block_count counts the nextn (MTP) blocks too
        if self.qwen35:
            # Layer kinds as llama.cpp's load_arch_hparams reads them: the per-layer attention.recurrent_layers
            # array when present, else (i < n_main) && (i + 1) % full_attention_interval != 0 (default 4).
            rec = f(f"{a}.attention.recurrent_layers")
            if rec is None:
                iv = int(f(f"{a}.full_attention_interval", 4))
                rec = [i < self.n_main and (i + 1) % iv != 0 for i in range(self.n_layer)]
            self.recurrent = [bool(x) for x in rec]
            assert len(self.recurrent) == self.n_layer and not any(self.recurrent[self.n_main:])
            self.sections = [int(x) for x in f(f"{a}.rope.dimension_sections")]
            self.d_conv = int(f(f"{a}.ssm.conv_kernel"))
            self.d_state = int(f(f"{a}.ssm.state_size"))      # head_k_dim (= head_v_dim: llama.cpp requires it)
            self.n_kh = int(f(f"{a}.ssm.group_count"))        # key heads
            self.n_vh = int(f(f"{a}.ssm.time_step_rank"))     # value heads
            self.head_v = int(f(f"{a}.ssm.inner_size")) // self.n_vh
            assert self.head_v == self.d_state and self.n_vh % self.n_kh == 0
            self.l2_eps = L2NORM_EPS
            # Which key (and query) head a value head uses, in GGUF order. transformers: v head j (grouped by key
            # head) uses k head j // (n_vh / n_kh) (repeat_interleave). The converter reorders the v heads
            # (in_proj_qkv's v rows, in_proj_z, in_proj_a/b, A_log, dt_bias, conv1d's v channels, out_proj's
            # columns) from grouped to tiled: GGUF v head i = r * n_kh + g is HF v head g * (n_vh / n_kh) + r,
            # and llama.cpp tiles q/k with ggml_repeat_4d (the fused kernel: iq1 = iv1 % neq1), so GGUF v head i
            # uses k head i % n_kh (here v heads 0, 1, 2, 3 -> k heads 0, 1, 0, 1).
            self.v_to_k = lambda i: i % self.n_kh
            # Switches for the negative controls (all True / all taps = the real math).
            self.conv_mask = np.ones(self.d_conv)
            self.gdn_decay = self.gdn_state = self.gdn_l2 = self.ssm_gate = True
            self.attn_gate = self.qg_interleaved = True
            self.mtp_variant = None
            self.gdn_log = None  # a list: collects (g, beta) of every Gated DeltaNet layer
        self.gemma4 = a == "gemma4"
        if self.gemma4:
            self.init_gemma4(f)

    def init_gemma4(self, f):
        """Gemma 4 as llama.cpp's llama_model_gemma4 reads it (load_arch_hparams / the generic loader)."""
        a = self.arch
        self.swa = [bool(x) for x in f(f"{a}.attention.sliding_window_pattern")]  # per layer: true = sliding
        assert len(self.swa) == self.n_layer
        self.n_kv_from = self.n_layer - int(f(f"{a}.attention.shared_kv_layers", 0))  # layers >= this keep no K/V
        kv = f(f"{a}.attention.head_count_kv")
        self.kv_heads = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * self.n_layer
        self.hd_full = int(f(f"{a}.attention.key_length"))
        self.hd_swa = int(f(f"{a}.attention.key_length_swa"))
        assert int(f(f"{a}.attention.value_length")) == self.hd_full
        assert int(f(f"{a}.attention.value_length_swa")) == self.hd_swa
        self.rot_full = int(f(f"{a}.rope.dimension_count", self.hd_full))
        self.rot_swa = int(f(f"{a}.rope.dimension_count_swa", self.rot_full))
        self.base_full = float(f(f"{a}.rope.freq_base"))
        self.base_swa = float(f(f"{a}.rope.freq_base_swa", self.base_full))
        self.window = int(f(f"{a}.attention.sliding_window"))
        self.final_cap = float(f(f"{a}.final_logit_softcapping", 0.0)) or None
        self.n_ple = int(f(f"{a}.embedding_length_per_layer_input", 0))
        # Hard-coded in llama.cpp (no GGUF key): embeddings times sqrt(n_embd), attention scale 1 (f_attention_scale =
        # 1.0), the per-layer token table times sqrt(n_ple), the projection times 1/sqrt(n_embd), their sum times
        # 1/sqrt(2), GELU (tanh) FFNs and PLE gate, V RMS-normed without weight, the KV-shared layers' source
        # (sliding: n_kv_from - 2, full: n_kv_from - 1).
        self.g4 = dict(embed_scale=True, attn_scale=1.0, ple=True, ple_tok=True, ple_proj=True, v_norm=True,
                       layer_scalar=True, window=True, kv_share="cache", full_rope="freqs", full_base=True,
                       v_from="raw_k", qk_norm=True, gelu_fp16=False)
        self.kv_src = lambda l: self.n_kv_from - (2 if self.swa[l] else 1)

    # ---- Gemma 4 -------------------------------------------------------------------------------------
    def gemma4_rope(self, x, pos, l):
        """NEOX rope over the layer's n_rot dims; full layers divide by rope_freqs (1e30 = a pair left unrotated)."""
        g = self.g4
        sw = self.swa[l]
        n_rot = self.rot_swa if sw else self.rot_full
        base = self.base_swa if (sw or not g["full_base"]) else self.base_full
        half = n_rot // 2
        inv = base ** (-(2.0 * np.arange(half)) / n_rot)
        if not sw:
            ff = self.w["rope_freqs.weight"]
            if g["full_rope"] == "freqs":
                inv = inv / ff
            elif g["full_rope"] == "partial_neox":  # negative control: n_rot = the rotated dims only (8 of 32)
                k = int(np.sum(ff < 1e29))
                n_rot, half = 2 * k, k
                inv = base ** (-(2.0 * np.arange(half)) / n_rot)
            elif g["full_rope"] == "swa_head_dim":  # negative control: the sliding layers' rope dims (16) on full heads
                n_rot, half = self.rot_swa, self.rot_swa // 2
                inv = base ** (-(2.0 * np.arange(half)) / n_rot) / ff[:half]
            # "all_pairs": ignore rope_freqs (rotate all 16 pairs)
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        if self.style == "norm":  # negative control: adjacent pairs
            x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = x0 * c - x1 * s
            out[..., 1:n_rot:2] = x0 * s + x1 * c
            return out
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:n_rot] = x0 * s + x1 * c
        return out

    def forward_gemma4(self, ids):
        """llama.cpp's llama_model_gemma4::graph (dense FFN, text tokens), one sequence from position 0."""
        g = self.g4
        gelu = lambda v: 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))
        if g["gelu_fp16"]:
            # ggml's CPU GELU (GGML_GELU_FP16): the input rounded to float16, a float16 table of GELU(tanh) values;
            # |x| >= 10 exact. Only to explain the real llama.cpp run's differences; not the reference math.
            exact = gelu
            def gelu(v):
                h = exact(v.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
                return np.where(v <= -10.0, 0.0, np.where(v >= 10.0, v, h))
        ids = np.asarray(ids, dtype=np.int64)
        T, d, L = len(ids), self.n_embd, self.n_layer
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][ids] * (np.sqrt(d) if g["embed_scale"] else 1.0)
        ple = None
        if self.n_ple and g["ple"]:
            P = self.n_ple
            tok = self.w["per_layer_token_embd.weight"][ids].reshape(T, L, P) * np.sqrt(P)
            proj = (x @ self.w["per_layer_model_proj.weight"].T / np.sqrt(d)).reshape(T, L, P)
            proj = self.rms(proj, self.w["per_layer_proj_norm.weight"])
            ple = ((proj if g["ple_proj"] else 0.0) + (tok if g["ple_tok"] else 0.0)) / np.sqrt(2.0)
        causal = np.triu(np.full((T, T), -np.inf), k=1)
        slide = causal + np.tril(np.full((T, T), -np.inf), k=-self.window)  # query t sees keys t - window + 1 .. t
        kv_store = {}
        for l in range(L):
            p = f"blk.{l}."
            sw = self.swa[l]
            H, KV = self.n_head, self.kv_heads[l]
            hd = self.hd_swa if sw else self.hd_full
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            qk_norm = (lambda t, n: self.rms(t, self.w[n])) if g["qk_norm"] else (lambda t, n: t)
            q = qk_norm(self.lin(h, p + "attn_q").reshape(T, H, -1), p + "attn_q_norm.weight")
            assert q.shape[-1] == hd
            q = self.gemma4_rope(q, pos, l)
            if l < self.n_kv_from:
                kraw = self.lin(h, p + "attn_k").reshape(T, KV, hd)
                vraw = self.lin(h, p + "attn_v").reshape(T, KV, hd) if p + "attn_v.weight" in self.w else kraw
                k = self.gemma4_rope(qk_norm(kraw, p + "attn_k_norm.weight"), pos, l)
                if p + "attn_v.weight" not in self.w and g["v_from"] == "normed_roped_k":  # negative control
                    vraw = k
                v = vraw / np.sqrt(np.mean(vraw * vraw, axis=-1, keepdims=True) + self.eps) if g["v_norm"] else vraw
                kv_store[l] = (k, v)
            elif g["kv_share"] == "cache":
                k, v = kv_store[self.kv_src(l)]
            else:  # negative control "weights": the source layer's K/V projections on this layer's own input
                src = f"blk.{self.kv_src(l)}."
                kraw = self.lin(h, src + "attn_k").reshape(T, -1, hd)
                vraw = self.lin(h, src + "attn_v").reshape(T, -1, hd) if src + "attn_v.weight" in self.w else kraw
                k = self.gemma4_rope(qk_norm(kraw, src + "attn_k_norm.weight"), pos, l)
                v = vraw / np.sqrt(np.mean(vraw * vraw, axis=-1, keepdims=True) + self.eps)
            KV = k.shape[1]
            rep = H // KV
            mask = slide if (sw and g["window"]) else causal
            att = np.empty((T, H, hd))
            scale = g["attn_scale"] if g["attn_scale"] is not None else 1.0 / np.sqrt(hd)
            for hh in range(H):
                sc = q[:, hh, :] @ k[:, hh // rep, :].T * scale + mask
                sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
                att[:, hh, :] = (sc / sc.sum(axis=-1, keepdims=True)) @ v[:, hh // rep, :]
            o = self.rms(self.lin(att.reshape(T, H * hd), p + "attn_output"), self.w[p + "post_attention_norm.weight"])
            x = x + o
            hf = self.rms(x, self.w[p + "ffn_norm.weight"])
            ff = self.lin(gelu(self.lin(hf, p + "ffn_gate")) * self.lin(hf, p + "ffn_up"), p + "ffn_down")
            x = x + self.rms(ff, self.w[p + "post_ffw_norm.weight"])
            if ple is not None:
                gt = gelu(x @ self.w[p + "inp_gate.weight"].T) * ple[:, l, :]
                x = x + self.rms(gt @ self.w[p + "proj.weight"].T, self.w[p + "post_norm.weight"])
            if g["layer_scalar"] and p + "layer_output_scale.weight" in self.w:
                x = x * self.w[p + "layer_output_scale.weight"][0]
        x = self.rms(x, self.w["output_norm.weight"])
        logits = x @ self.out_w.T
        if self.final_cap:
            logits = self.final_cap * np.tanh(logits / self.final_cap)
        return logits

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope_angles(self, pos):
        if self.style != "imrope":
            return pos[:, None] * self.inv_freq[None, :]
        # ggml's interleaved M-RoPE (GGML_ROPE_TYPE_IMROPE, ggml_mrope_cache_init): rotary pair i takes its
        # angle from one of four position streams by sector = i % sum(sections): sector % 3 == 1 and
        # sector < 3 * s1 -> h, % 3 == 2 and < 3 * s2 -> w, % 3 == 0 and < 3 * s0 -> t, any other -> e.
        # For text llama.cpp feeds t = h = w = pos and e = 0 (llm_graph_input_pos); pairs: NEOX (i, i + n_rot/2).
        s = self.sections
        tot = sum(s)
        streams = {"t": pos, "h": pos, "w": pos, "e": np.zeros_like(pos)}
        cols = []
        for i in range(self.n_rot // 2):
            sec = i % tot
            if sec % 3 == 1 and sec < 3 * s[1]:
                st = "h"
            elif sec % 3 == 2 and sec < 3 * s[2]:
                st = "w"
            elif sec % 3 == 0 and sec < 3 * s[0]:
                st = "t"
            else:
                st = "e"
            cols.append(streams[st] * self.inv_freq[i])
        return np.stack(cols, axis=1)

    def rope(self, x, pos):
        ang = self.rope_angles(pos)
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

    def ffn(self, h, p, suffix=""):
        g, u = self.lin(h, p + "ffn_gate" + suffix), self.lin(h, p + "ffn_up" + suffix)
        return self.lin(g / (1.0 + np.exp(-g)) * u, p + "ffn_down" + suffix)

    def ffn_block(self, h, p):
        """A block's FFN: the mixture of experts where the block has a router, else the dense SiLU FFN (LFM2 MoE's
        leading dense blocks; skipped by the negative control dense_lead = False)."""
        if p + "ffn_gate_inp.weight" in self.w:
            return self.moe(h, p)
        if not self.dense_lead:
            return np.zeros_like(h)
        return self.ffn(h, p)

    def moe(self, h, p):
        logits = h @ self.w[p + "ffn_gate_inp.weight"].T + self.w.get(p + "ffn_gate_inp.bias", 0.0)
        if self.gptoss:
            return self.moe_oai(h, p, logits)
        if self.router == "sigmoid":  # lfm2moe; a negative control for qwen35moe
            probs = 1.0 / (1.0 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
        sel = probs
        if self.sel_bias and p + "exp_probs_b.bias" in self.w:
            sel = probs + self.w[p + "exp_probs_b.bias"]
        out = np.zeros_like(h)
        k = self.n_expert_used
        for t in range(h.shape[0]):
            order = np.argsort(-sel[t], kind="stable")
            top = order[:k]
            w = (sel if self.bias_in_weights else probs)[t][top]
            if self.norm_topk:
                w = w / w.sum()
            if self.moe_log is not None:
                self.moe_log.append((p, top.tolist(), w.tolist()))
            if self.sel_log is not None:
                unbiased = np.argsort(-probs[t], kind="stable")[:k]
                self.sel_log.append((p, float(sel[t][order[k - 1]] - sel[t][order[k]]), sorted(top.tolist()),
                                     sorted(unbiased.tolist())))
            for e, we in zip(top, w):
                g = self.w[p + "ffn_gate_exps.weight"][e] @ h[t]
                u = self.w[p + "ffn_up_exps.weight"][e] @ h[t]
                out[t] += we * (self.w[p + "ffn_down_exps.weight"][e] @ (g / (1.0 + np.exp(-g)) * u))
        return out

    def moe_oai(self, h, p, logits):
        # gpt-oss: softmax over the chosen experts' logits; biased experts; clamped SwiGLU.
        # q8_act (diagnostic only, not the reference math): the inputs of MXFP4 expert matrices rounded as ggml's CPU
        # backend does (quantized to Q8_0 blocks, its vec_dot_type for MXFP4), to explain real llama.cpp's logits.
        act = (lambda v, n: q8_0_round(v) if self.q8_act and p + n in self.mxfp4_raw else v)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            top = np.argsort(-logits[t], kind="stable")[:self.n_expert_used]
            w = np.exp(logits[t][top] - logits[t][top].max())
            w = w / w.sum()
            for e, we in zip(top, w):
                bias = lambda n: self.w[p + n][e] if p + n in self.w else 0.0
                g = self.w[p + "ffn_gate_exps.weight"][e] @ act(h[t], "ffn_gate_exps.weight") + bias("ffn_gate_exps.bias")
                u = self.w[p + "ffn_up_exps.weight"][e] @ act(h[t], "ffn_up_exps.weight") + bias("ffn_up_exps.bias")
                g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
                a = (u + 1.0) * g / (1.0 + np.exp(-1.702 * g))
                out[t] += we * (self.w[p + "ffn_down_exps.weight"][e] @ act(a, "ffn_down_exps.weight")
                                + bias("ffn_down_exps.bias"))
        return out

    # ---- Qwen3.5 -------------------------------------------------------------------------------------
    def ffn_qwen35(self, h, p):
        """qwen35: the SiLU-gated FFN; qwen35moe (llama.cpp build_layer_ffn): routed experts (softmax, top-k,
        renormalised) + the shared expert times sigmoid(ffn_gate_inp_shexp . h)."""
        if p + "ffn_gate_inp.weight" not in self.w:
            return self.ffn(h, p)
        out = self.moe(h, p)
        if self.shexp:
            sh = self.ffn(h, p, suffix="_shexp")
            if self.shexp_gate:
                gw = self.w[p + "ffn_gate_inp_shexp.weight"].reshape(-1)
                sh = sh / (1.0 + np.exp(-(h @ gw)))[:, None]
            out = out + sh
        return out

    def gated_attention(self, h, p, pos):
        """llama.cpp qwen35 build_layer_attn: q projection rows per head [query (hd) | gate (hd)]."""
        T = h.shape[0]
        H, KV, hd = self.n_head, self.n_kv, self.head_dim
        rep = H // KV
        qg = self.lin(h, p + "attn_q")
        if self.qg_interleaved:
            qg = qg.reshape(T, H, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]
        else:  # negative control: [all queries | all gates]
            q, gate = qg[:, :H * hd].reshape(T, H, hd), qg[:, H * hd:].reshape(T, H, hd)
        k = self.lin(h, p + "attn_k").reshape(T, KV, hd)
        v = self.lin(h, p + "attn_v").reshape(T, KV, hd)
        if p + "attn_q_norm.weight" in self.w:
            q = self.rms(q, self.w[p + "attn_q_norm.weight"])
            k = self.rms(k, self.w[p + "attn_k_norm.weight"])
        q, k = self.rope(q, pos), self.rope(k, pos)
        mask = np.triu(np.full((T, T), -np.inf), k=1)
        att = np.empty((T, H, hd))
        for hh in range(H):
            sc = q[:, hh, :] @ k[:, hh // rep, :].T / np.sqrt(hd) + mask
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            att[:, hh, :] = (sc / sc.sum(axis=-1, keepdims=True)) @ v[:, hh // rep, :]
        if self.attn_gate:
            att = att / (1.0 + np.exp(-gate))
        return self.lin(att.reshape(T, H * hd), p + "attn_output")

    def gated_delta_net(self, h, p):
        """llama.cpp qwen35 build_layer_attn_linear + delta-net-base (one sequence, from a zero state)."""
        T = h.shape[0]
        nk, nv, dk, dv = self.n_kh, self.n_vh, self.d_state, self.head_v
        silu = lambda x: x / (1.0 + np.exp(-x))
        qkv = self.lin(h, p + "attn_qkv")                      # (T, 2 nk dk + nv dv): [q | k | v]
        z = self.lin(h, p + "attn_gate").reshape(T, nv, dv)
        beta = 1.0 / (1.0 + np.exp(-(h @ self.w[p + "ssm_beta.weight"].T)))               # (T, nv)
        alpha = h @ self.w[p + "ssm_alpha.weight"].T + self.w.get(p + "ssm_dt.bias", 0.0)
        g = self.w[p + "ssm_a"] * np.logaddexp(0.0, alpha)   # ssm_a = -exp(A_log) (converter); g <= 0
        if self.gdn_log is not None:
            self.gdn_log.append((g, beta))
        # Causal depthwise convolution: taps (channels, d_conv), the last tap on the current position.
        taps = self.w[p + "ssm_conv1d.weight"] * self.conv_mask
        K, C = taps.shape[1], taps.shape[0]
        padded = np.concatenate([np.zeros((K - 1, C)), qkv], axis=0)
        conv = silu(np.stack([(padded[t:t + K] * taps.T).sum(axis=0) for t in range(T)]))
        q = conv[:, :nk * dk].reshape(T, nk, dk)
        k = conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
        v = conv[:, 2 * nk * dk:].reshape(T, nv, dv)
        if self.gdn_l2:
            q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + self.l2_eps)
            k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + self.l2_eps)
        q = q / np.sqrt(dk)
        out = np.zeros((T, nv, dv))
        for i in range(nv):
            kh = self.v_to_k(i)
            S = np.zeros((dk, dv))  # S[key dim, value dim]
            for t in range(T):
                if not self.gdn_state:
                    S = np.zeros((dk, dv))
                if self.gdn_decay:
                    S = S * np.exp(g[t, i])
                delta = (v[t, i] - S.T @ k[t, kh]) * beta[t, i]
                S = S + np.outer(k[t, kh], delta)
                out[t, i] = S.T @ q[t, kh]
        o = self.rms(out, self.w[p + "ssm_norm.weight"])      # one [dv] weight shared by all v heads
        if self.ssm_gate:
            o = o * silu(z)
        return o.reshape(T, nv * dv) @ self.w[p + "ssm_out.weight"].T

    def forward_qwen35(self, ids):
        """Main model: returns (logits, h) with h = output_norm(last layer output) (llama.cpp's t_h_nextn) and
        the last layer output before it."""
        ids = np.asarray(ids, dtype=np.int64)
        pos = np.arange(len(ids), dtype=np.float64)
        x = self.w["token_embd.weight"][ids]
        for l in range(self.n_main):
            p = f"blk.{l}."
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            x = x + (self.gated_delta_net(h, p) if self.recurrent[l] else self.gated_attention(h, p, pos))
            x = x + self.ffn_qwen35(self.rms(x, self.w[p + "post_attention_norm.weight"]), p)
        hn = self.rms(x, self.w["output_norm.weight"])
        return hn @ self.out_w.T, hn, x

    def mtp(self, ids, pos_offset=0):
        """llama.cpp qwen35 graph_mtp over a whole sequence x_0..x_{n-1}: row j (0 .. n-2) of the result is the
        MTP's logits for x_{j+2}, from h_j (main model, after output_norm) and the token x_{j+1}, at MTP
        position j + pos_offset, attending causally to MTP positions 0..j. Returns (mtp_logits, main_logits)."""
        ids = np.asarray(ids, dtype=np.int64)
        main, hn, pre = self.forward_qwen35(ids)
        p = f"blk.{self.n_main}."
        var = self.mtp_variant
        emb = self.w.get(p + "nextn.embed_tokens.weight", self.w["token_embd.weight"])
        e = emb[ids[:-1] if var == "token_x_j" else ids[1:]]
        hh = (pre if var == "hidden_before_output_norm" else hn)[:-1]
        e = self.rms(e, self.w[p + "nextn.enorm.weight"])
        hh = self.rms(hh, self.w[p + "nextn.hnorm.weight"])
        cat = np.concatenate([hh, e] if var == "concat_h_e" else [e, hh], axis=1)
        cur = cat @ self.w[p + "nextn.eh_proj.weight"].T
        pos = np.arange(len(cur), dtype=np.float64) + pos_offset
        hin = self.rms(cur, self.w[p + "attn_norm.weight"])
        if var == "no_mtp_kv_history":  # each MTP position attends to itself only
            att = np.concatenate([self.gated_attention(hin[j:j + 1], p, pos[j:j + 1]) for j in range(len(hin))])
        else:
            att = self.gated_attention(hin, p, pos)
        cur = cur + att
        cur = cur + self.ffn_qwen35(self.rms(cur, self.w[p + "post_attention_norm.weight"]), p)
        norm_w = self.w.get(p + "nextn.shared_head_norm.weight", self.w["output_norm.weight"])
        if var == "head_norm_is_output_norm":
            norm_w = self.w["output_norm.weight"]
        cur = self.rms(cur, norm_w)
        head = self.w.get(p + "nextn.shared_head_head.weight", self.out_w)
        return cur @ head.T, main

    def forward(self, ids):
        if self.qwen35:
            return self.forward_qwen35(ids)[0]
        if self.gemma4:
            return self.forward_gemma4(ids)
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
                x = x + self.ffn_block(self.rms(x, self.w[p + "ffn_norm.weight"]), p)
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
                x = x + self.ffn_block(h, p)
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
    if m0.gemma4:
        def g4(**kw):
            return lambda m: m.g4.update(kw)
        out["skip_qk_norm"] = run(g4(qk_norm=False))
        out["no_per_layer_embeddings"] = run(g4(ple=False))
        out["per_layer_inputs_token_table_only"] = run(g4(ple_proj=False))
        out["per_layer_inputs_projection_only"] = run(g4(ple_tok=False))
        out["no_kv_sharing_shared_layers_project_own_kv_with_source_weights"] = run(g4(kv_share="weights"))
        def first_src(m):
            first = {sw: min(i for i in range(m.n_kv_from) if m.swa[i] == sw) for sw in (True, False)}
            m.kv_src = lambda l: first[m.swa[l]]
        first = {sw: min(i for i in range(m0.n_kv_from) if m0.swa[i] == sw) for sw in (True, False)}
        if any(first[m0.swa[l]] != m0.kv_src(l) for l in range(m0.n_kv_from, m0.n_layer)):
            # gemma4e: one non-shared layer of each type, the first is the source: nothing to control.
            out["kv_shared_layers_read_first_layer_of_their_type"] = run(first_src)
        out["full_layers_rope_ignores_rope_freqs"] = run(g4(full_rope="all_pairs"))
        out["full_layers_rope_over_rotated_dims_only"] = run(g4(full_rope="partial_neox"))
        out["full_layers_rope_with_sliding_head_dim"] = run(g4(full_rope="swa_head_dim"))
        out["full_layers_use_sliding_rope_base"] = run(g4(full_base=False))
        out["no_v_norm"] = run(g4(v_norm=False))
        if any(f"blk.{l}.attn_v.weight" not in m0.w for l in range(m0.n_kv_from)):
            # Only with k = v layers (gemma4e has attn_v everywhere: nothing to control).
            out["k_eq_v_value_is_normed_roped_key"] = run(g4(v_from="normed_roped_k"))
        out["attention_scale_inv_sqrt_head_dim"] = run(g4(attn_scale=None))
        out["embeddings_not_scaled_by_sqrt_hidden"] = run(g4(embed_scale=False))
        out["no_layer_scalar"] = run(g4(layer_scalar=False))
        out["no_final_softcap"] = run(lambda m: setattr(m, "final_cap", None))
        out["no_sliding_window"] = run(g4(window=False))
        return out
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
    if m0.mxfp4_raw:
        def mx(variant):
            def f(m):
                for name, (raw, shape) in m.mxfp4_raw.items():
                    m.w[name] = mxfp4_decode(raw, variant).reshape(shape)
            return f
        out["mxfp4_nibbles_in_openai_order"] = run(mx("nibbles_interleaved"))
        out["mxfp4_scale_doubled"] = run(mx("scale_doubled"))
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
    if m0.qwen35:
        out["deltanet_no_state_decay"] = run(lambda m: setattr(m, "gdn_decay", False))
        out["deltanet_state_reset_every_token"] = run(lambda m: setattr(m, "gdn_state", False))
        def own_pos(m):
            m.conv_mask = np.eye(m.d_conv)[-1]
        out["convolution_sees_its_own_position_only"] = run(own_pos)
        out["v_heads_use_k_heads_grouped_not_tiled"] = run(
            lambda m: setattr(m, "v_to_k", lambda i: i // (m.n_vh // m.n_kh)))
        out["deltanet_no_qk_l2norm"] = run(lambda m: setattr(m, "gdn_l2", False))
        out["deltanet_no_silu_z_gate"] = run(lambda m: setattr(m, "ssm_gate", False))
        out["attention_no_sigmoid_gate"] = run(lambda m: setattr(m, "attn_gate", False))
        out["attention_query_gate_halves_not_per_head"] = run(lambda m: setattr(m, "qg_interleaved", False))
    if m0.arch == "lfm2moe":
        out["one_expert_more"] = run(lambda m: setattr(m, "n_expert_used", m.n_expert_used + 1))
        out["no_expert_selection_bias"] = run(lambda m: setattr(m, "sel_bias", False))
        out["selection_bias_also_in_weights"] = run(lambda m: setattr(m, "bias_in_weights", True))
        out["router_softmax_not_sigmoid"] = run(lambda m: setattr(m, "router", "softmax"))
        out["leading_dense_ffn_skipped"] = run(lambda m: setattr(m, "dense_lead", False))
    if m0.qwen35 and m0.n_expert:
        out["one_expert_more"] = run(lambda m: setattr(m, "n_expert_used", m.n_expert_used + 1))
        out["router_sigmoid_not_softmax"] = run(lambda m: setattr(m, "router", "sigmoid"))
        out["no_shared_expert"] = run(lambda m: setattr(m, "shexp", False))
        out["shared_expert_without_sigmoid_gate"] = run(lambda m: setattr(m, "shexp_gate", False))
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


MTP_ABOUT = (
    "Qwen3.5 multi-token prediction, computed (float64 numpy, from the GGUF only) exactly as llama.cpp's qwen35 "
    "graph_mtp; transformers does not run the MTP. Per case the sequence s = prompt_ids + greedy_ids (n tokens, "
    "positions 0..n-1). The main model runs once over s; h_j = output_norm(output of the last main layer at "
    "position j) (llama.cpp's t_h_nextn: after the final norm, before the output matrix). MTP row j, j = 0..n-2: "
    "x = nextn.eh_proj([nextn.enorm(E[s[j+1]]); nextn.hnorm(h_j)]) (E = nextn.embed_tokens when present, else "
    "token_embd; embedding first), then one gated full-attention decoder block with the nextn layer's own tensors "
    "(attn_norm, attn_q per head [query | gate], attn_k, attn_v, q/k norms, IMROPE at MTP position j, causal "
    "attention over MTP rows 0..j, sigmoid(gate), attn_output, residual, post_attention_norm, SiLU FFN, residual), "
    "then nextn.shared_head_norm (else output_norm) and nextn.shared_head_head (else output, else token_embd): "
    "logits predicting s[j+2]. So the MTP row of position j is fed the hidden state of position j and the token of "
    "position j+1 (the main model's greedy output at j). RoPE enters only through position differences: any "
    "constant offset of the MTP positions gives the same logits (position_offset_max_abs_diff).")


def mtp_torch(model, mtp_hf, seq):
    """The MTP from the transformers weights (not the GGUF): Qwen3_5DecoderLayer / Qwen3_5RMSNorm modules loaded
    with the mtp.* tensors (as vLLM's Qwen3.5 MTP composes them), torch float32. Rows as NpGGUF.mtp."""
    import copy
    import torch
    moe = bool(getattr(model.config, "num_experts", None))
    if moe:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mq
        Layer, Norm, Rotary = mq.Qwen3_5MoeDecoderLayer, mq.Qwen3_5MoeRMSNorm, mq.Qwen3_5MoeTextRotaryEmbedding
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
        Layer, Norm, Rotary = mq.Qwen3_5DecoderLayer, mq.Qwen3_5RMSNorm, mq.Qwen3_5TextRotaryEmbedding
    cfg = copy.deepcopy(model.config)
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    layer = Layer(cfg, 0).eval()
    t = lambda n: torch.from_numpy(mtp_hf[n])
    sd = {k[len("mtp.layers.0."):]: t(k) for k in mtp_hf if k.startswith("mtp.layers.0.")}
    if moe:
        # The checkpoint's per-expert tensors -> transformers' stacked experts (gate_up_proj = [gate; up] rows).
        E = cfg.num_experts
        g = [sd.pop(f"mlp.experts.{e}.gate_proj.weight") for e in range(E)]
        u = [sd.pop(f"mlp.experts.{e}.up_proj.weight") for e in range(E)]
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g[e], u[e]], dim=0) for e in range(E)])
        sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    layer.load_state_dict(sd, strict=True)
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = Norm(d, eps=eps)
        norms[n].load_state_dict({"weight": t(f"mtp.{n}.weight")})
    fc = torch.nn.Linear(2 * d, d, bias=False)
    fc.load_state_dict({"weight": t("mtp.fc.weight")})
    rotary = Rotary(cfg)
    with torch.no_grad():
        ids = torch.tensor([seq], dtype=torch.long)
        hn = model.model(ids, use_cache=False).last_hidden_state  # after model.norm
        e = model.model.embed_tokens(ids[:, 1:])
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hn[:, :-1])], dim=-1))
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)[None, None]
        y = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
        if isinstance(y, tuple):
            y = y[0]
        return model.lm_head(norms["norm"](y))[0].float().numpy()


def mtp_reference(gguf_path, ref, model=None, mtp_hf=None):
    m = NpGGUF(gguf_path)
    about = MTP_ABOUT + (" qwen35moe: the block's FFN is the mixture of experts with the gated shared expert, as in the "
                         "main layers (ffn_gate_inp, ffn_*_exps, ffn_*_shexp, ffn_gate_inp_shexp of the nextn block)."
                         if m.n_expert else "")
    out = {"about": about, "nextn_block": m.n_main, "cases": []}
    agree = total = 0
    off_diff = {"1": 0.0, "1000": 0.0}
    torch_diff = 0.0
    for case in ref["cases"]:
        P = len(case["prompt_ids"])
        seq = case["prompt_ids"] + case["greedy_ids"]
        lg, main = m.mtp(seq)
        nxt = np.argmax(main, axis=-1)  # nxt[i] = the main model's greedy token after position i
        assert nxt[P - 1:P - 1 + N_GEN].tolist() == case["greedy_ids"]
        am = np.argmax(lg, axis=-1)
        main_next = nxt[1:]             # row j predicts s[j+2]; the main model's greedy for it: argmax at j+1
        a = int(np.sum(am == main_next))
        agree, total = agree + a, total + len(am)
        for o in off_diff:
            off_diff[o] = max(off_diff[o], float(np.max(np.abs(m.mtp(seq, pos_offset=int(o))[0] - lg))))
        if model is not None:
            torch_diff = max(torch_diff, float(np.max(np.abs(mtp_torch(model, mtp_hf, seq) - lg))))
        c = {"sequence_ids": seq, "n_prompt": P,
             "top20": [dict(position=j, input_token=seq[j + 1], **topk_list(lg[j])) for j in range(len(lg))],
             "argmax_ids": am.tolist(), "main_next_ids": main_next.tolist(),
             "argmax_agrees_with_main": f"{a}/{len(am)}"}
        if "all_positions_logits" in case:
            c["all_positions_logits"] = [[f32(x) for x in row] for row in lg[:P]]
        out["cases"].append(c)
    out["argmax_agrees_with_main_total"] = f"{agree}/{total}"
    out["position_offset_max_abs_diff"] = off_diff
    if model is not None:
        out["torch_crosscheck_max_abs_diff"] = torch_diff
    # Deliberately wrong MTP variants (max |diff| over all MTP rows of the last case).
    seq = ref["cases"][-1]["prompt_ids"] + ref["cases"][-1]["greedy_ids"]
    want = m.mtp(seq)[0]
    nc = {}
    for var in ("token_x_j", "hidden_before_output_norm", "concat_h_e", "head_norm_is_output_norm",
                "no_mtp_kv_history"):
        mm = NpGGUF(gguf_path)
        mm.mtp_variant = var
        nc[var] = float(np.max(np.abs(mm.mtp(seq)[0] - want)))
    out["negative_controls_max_abs_diff_last_case"] = nc
    return out


def mtp_recheck(gguf_path, ref):
    """--check-only: recompute the MTP rows and compare with the stored float32 values."""
    m = NpGGUF(gguf_path)
    d = 0.0
    for c in ref["mtp"]["cases"]:
        lg = m.mtp(c["sequence_ids"])[0]
        for t in c["top20"]:
            d = max(d, float(np.max(np.abs(lg[t["position"]][t["ids"]] - np.array(t["logits"])))))
        if "all_positions_logits" in c:
            d = max(d, float(np.max(np.abs(lg[:c["n_prompt"]] - np.array(c["all_positions_logits"])))))
    return d


def llama_cpp_check(gguf_path, ref):
    """Optional: real llama.cpp (llama-cpp-python built from the same 0.3.36 sdist), CPU, F32 weights."""
    import llama_cpp
    # F32 KV cache (default is F16, which alone moves logits by ~5e-3), no flash attention.
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=128, n_batch=128, logits_all=True, n_threads=1,
                          verbose=False, seed=0, flash_attn=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    res = {"llama_cpp_python": llama_cpp.__version__, "step0_max_abs_diff": 0.0, "all_steps_max_abs_diff": 0.0,
           "all_positions_max_abs_diff": None, "argmax_agrees": 0, "argmax_total": 0}
    npq = NpGGUF(gguf_path)
    if npq.mxfp4_raw:
        # ggml's CPU backend multiplies MXFP4 weights by Q8_0-quantized activations: compare llama.cpp with the numpy
        # forward that rounds those activations the same way (and with the exact one).
        npq.q8_act = True
        res["vs_numpy_q8_0_activations_max_abs_diff"] = 0.0
        res["vs_numpy_exact_max_abs_diff"] = 0.0
        npx = NpGGUF(gguf_path)
    for case in ref["cases"]:
        prompt, gen = case["prompt_ids"], case["greedy_ids"]
        llm.reset()
        llm.eval(prompt + gen[:-1])
        lg = np.array(llm.scores[:llm.n_tokens], dtype=np.float64)
        if npq.mxfp4_raw:
            seq = prompt + gen[:-1]
            res["vs_numpy_q8_0_activations_max_abs_diff"] = max(res["vs_numpy_q8_0_activations_max_abs_diff"],
                                                                 float(np.max(np.abs(lg - npq.forward(seq)))))
            res["vs_numpy_exact_max_abs_diff"] = max(res["vs_numpy_exact_max_abs_diff"],
                                                     float(np.max(np.abs(lg - npx.forward(seq)))))
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
    if "sliding_attention" in rp:  # gemma4: per layer type (head_dim, kv heads are per-layer attributes there)
        hd = spec["config"]["head_dim"]
        return {"rope_parameters": rp, "head_dim": hd, "n_rot": hd}
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
            # gptossmxfp4 draws gptoss's weights and prompts (then rounds its experts to MXFP4).
            ri = [a["name"] for a in ARCHS].index(spec["rng_like"]) if spec.get("rng_like") else ai
            hf_dir = os.path.join(work, f"tiny-random-{name}")
            model, init_log = build_hf_model(spec, args.seed, ri)
            mx_packed = mx_stats = None
            if spec.get("mxfp4_experts"):
                mx_packed, mx_stats = mxfp4_round_experts(model, init_log)
            model.save_pretrained(hf_dir, safe_serialization=True)
            tok.save_pretrained(hf_dir)
            if mx_packed is not None:
                write_mxfp4_checkpoint(hf_dir, model, mx_packed)
            mtp_hf = add_mtp_tensors(hf_dir, model.config, args.seed, ri, init_log) if spec.get("mtp") else None
            dst = os.path.join(args.out, name)
            os.makedirs(dst, exist_ok=True)
            gguf_path = os.path.join(dst, "model.gguf")
            convert(args.llama_cpp, hf_dir, gguf_path, name, spec["gguf_name"], os.path.join(work, f"convert-{name}.log"))
            listing, summary = gguf_listing(gguf_path)
            with open(os.path.join(dst, "tensors.txt"), "w") as fh:
                fh.write(listing)

            prompts = make_prompts(args.seed, ri)
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
                    "intermediate_size": getattr(cfg, "intermediate_size", None),
                    "num_hidden_layers": cfg.num_hidden_layers,
                    "num_attention_heads": cfg.num_attention_heads,
                    "num_key_value_heads": spec["config"].get("num_key_value_heads") or cfg.num_key_value_heads,
                    "head_dim": hd["head_dim"],
                    "rope_dims": hd["n_rot"], "rope_parameters": hd["rope_parameters"],
                    "rms_norm_eps": getattr(cfg, "rms_norm_eps", getattr(cfg, "norm_eps", None)), "tie_word_embeddings": cfg.tie_word_embeddings,
                    "max_position_embeddings": cfg.max_position_embeddings,
                    "sliding_window": getattr(cfg, "sliding_window", None),
                    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                    **({k: getattr(cfg, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                      "shared_expert_intermediate_size")}
                       if spec["name"] == "qwen35moe" else {}),
                    **({k: getattr(cfg, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                      "num_dense_layers", "use_expert_bias", "norm_topk_prob",
                                                      "routed_scaling_factor", "layer_types")}
                       if spec["name"] == "lfm2moe" else {}),
                    **({"num_local_experts": cfg.num_local_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                        "experts_mxfp4": True} if spec.get("mxfp4_experts") else {}),
                    **(gemma4_meta(cfg, summary, model) if spec["model_type"] == "gemma4_text" else {}),
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
            if spec.get("rng_like"):
                meta["init"]["rng"] = (f"numpy default_rng([seed, {ri}]) (the arch index of {spec['rng_like']}: its draws) "
                                       "over parameters sorted by name")
            ref = {"meta": meta, "cases": [c for c, _, _ in cases]}
            if mx_packed is not None:
                mx = {"rounding": "per block of 32 consecutive input-dimension values of one output row of one expert: "
                                  "gguf-py's MXFP4 quantize (scale byte e = floor(log2(max|w|)) - 2 + 127, value "
                                  "2^(e-127) * E2M1 code, each value the nearest code), then dequantize; re-quantizing "
                                  "the result gives the same bytes and floats (asserted)",
                      "per_parameter": mx_stats, "gguf_check": mxfp4_gguf_check(gguf_path, model, mx_packed),
                      "transformers_decoder_check": "transformers.integrations.mxfp4.convert_moe_packed_tensors on the "
                                                    "checkpoint's *_blocks / *_scales == the model's weights, bitwise"}
                base = os.path.join(args.out, spec["rng_like"], "reference.json")
                if os.path.exists(base):
                    # What the rounding did: the same prompts through the unrounded model (gptoss's reference).
                    b = json.load(open(base))
                    if [c["prompt_ids"] for c in b["cases"]] == prompts:
                        mx["step0_logits_vs_unrounded_model_max_abs_diff"] = max(
                            float(np.max(np.abs(np.array(c["logits_step0"]) - np.array(d["logits_step0"]))))
                            for c, d in zip(ref["cases"], b["cases"]))
                        mx["greedy_ids_equal_unrounded_model"] = sum(
                            int(c["greedy_ids"] == d["greedy_ids"]) for c, d in zip(ref["cases"], b["cases"]))
                meta["mxfp4_experts"] = mx
            nc = numpy_check(gguf_path, ref)
            meta["numpy_float64_crosscheck"] = nc
            if spec["name"] in ("qwen35", "qwen35moe"):
                npm = NpGGUF(gguf_path)
                npm.gdn_log = []
                npm.forward(ref["cases"][-1]["prompt_ids"])
                dec = np.exp(np.concatenate([g.ravel() for g, _ in npm.gdn_log]))
                bet = np.concatenate([b.ravel() for _, b in npm.gdn_log])
                meta["deltanet_decay"] = {"min": float(dec.min()), "median": float(np.median(dec)),
                                          "max": float(dec.max()), "beta_min": float(bet.min()),
                                          "beta_max": float(bet.max())}
            if spec["name"] in ("qwen35moe", "lfm2moe"):
                # How the router spreads the 40-token prompt's tokens over the experts (main layers).
                npm = NpGGUF(gguf_path)
                npm.moe_log = []
                npm.sel_log = []
                npm.forward(ref["cases"][-1]["prompt_ids"])
                usage, wmin, wmax = {}, 1.0, 0.0
                for pfx, top, wts in npm.moe_log:
                    u = usage.setdefault(pfx.rstrip("."), [0] * npm.n_expert)
                    for e in top:
                        u[e] += 1
                    wmin, wmax = min(wmin, min(wts)), max(wmax, max(wts))
                meta["expert_usage_last_prompt"] = {"per_layer_counts": usage, "weight_min": wmin, "weight_max": wmax}
                if spec["name"] == "lfm2moe":
                    # The selection bias's effect: (token, layer) pairs whose chosen set differs from the top-k of
                    # the unbiased scores; the smallest gap between the k-th and (k+1)-th biased score (a float32
                    # engine must pick the same experts: the gap is far above float32 rounding).
                    changed = sum(1 for _, _, a_, b_ in npm.sel_log if a_ != b_)
                    npa = NpGGUF(gguf_path)
                    npa.sel_log = []
                    for c in ref["cases"]:
                        npa.forward(c["prompt_ids"] + c["greedy_ids"][:-1])
                    meta["expert_selection_bias"] = {
                        "last_prompt_token_layer_pairs": len(npm.sel_log),
                        "last_prompt_chosen_set_changed_by_bias": changed,
                        "all_cases_token_layer_pairs": len(npa.sel_log),
                        "all_cases_chosen_set_changed_by_bias": sum(1 for _, _, a_, b_ in npa.sel_log if a_ != b_),
                        "all_cases_min_gap_kth_vs_next_selection_score": min(gp for _, gp, _, _ in npa.sel_log)}
            if mtp_hf is not None:
                ref["mtp"] = mtp_reference(gguf_path, ref, model, mtp_hf)
                mt = {k: v for k, v in ref["mtp"].items() if k not in ("cases", "about")}
                print(f"   mtp {mt}", flush=True)
                assert ref["mtp"]["torch_crosscheck_max_abs_diff"] < 1e-4, mt
            if args.llama_cpp_check and "mxfp4_experts" in meta:
                base = os.path.join(args.out, spec["rng_like"])
                meta["mxfp4_experts"]["unrounded_llama_cpp"] = llama_cpp_check(
                    os.path.join(base, "model.gguf"), json.load(open(os.path.join(base, "reference.json"))))
            if args.llama_cpp_check:
                lc = llama_cpp_check(gguf_path, ref)
                meta["llama_cpp_crosscheck"] = lc
                print(f"   llama.cpp check {lc}", flush=True)
                if "vs_numpy_q8_0_activations_max_abs_diff" in lc:
                    # MXFP4 experts: ggml's CPU matmul rounds their input activations to Q8_0 (logits ~0.1 off, an
                    # expert choice can flip); what must hold is that llama.cpp equals the numpy forward that does
                    # the same, i.e. reads the MXFP4 blocks as NpGGUF does.
                    assert lc["vs_numpy_q8_0_activations_max_abs_diff"] < 1e-4, lc
                else:
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
        if "mtp" in ref:
            nc["mtp_recomputed_vs_stored_max_abs_diff"] = mtp_recheck(gp, ref)
            good &= nc["mtp_recomputed_vs_stored_max_abs_diff"] < 1e-5
        ok &= good
        print(spec["name"], "sha ok" if sha_ok else "SHA MISMATCH", nc)
        if args.llama_cpp_check:
            print("   llama.cpp:", llama_cpp_check(gp, ref))
    raise SystemExit(0 if ok else 1)


def gemma4_meta(cfg, summary, model):
    md = summary["metadata"]
    kv = md["gemma4.attention.head_count_kv"]
    kv = kv if isinstance(kv, list) else [kv]  # gemma4e: one value for all layers (no per-layer array)
    rf = summary["rope_freqs"]
    return {"layer_types": list(cfg.layer_types), "num_kv_shared_layers": cfg.num_kv_shared_layers,
            "full_head_dim": md["gemma4.attention.key_length"], "full_num_key_value_heads": min(kv),
            "full_rope_dims_rotated": 2 * sum(1 for x in rf if x < 1e29),
            "full_rope_parameters": dict(cfg.rope_parameters["full_attention"]),
            "attention_k_eq_v": cfg.attention_k_eq_v, "use_double_wide_mlp": cfg.use_double_wide_mlp,
            "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "layer_scalars": [f32(l.layer_scalar.item()) for l in model.model.layers]}


def heads_cell(c):
    if "full_num_key_value_heads" in c:
        return (f"{c['num_attention_heads']}/{c['num_key_value_heads']} (full "
                f"{c['num_attention_heads']}/{c['full_num_key_value_heads']})")
    return f"{c['num_attention_heads']}/{c['num_key_value_heads']}"


def hd_cell(c):
    return f"{c['head_dim']} (full {c['full_head_dim']})" if "full_head_dim" in c else str(c["head_dim"])


def rot_cell(c):
    if "full_head_dim" in c:
        return f"{c['rope_dims']} (full {c['full_rope_dims_rotated']} of {c['full_head_dim']})"
    return str(c["rope_dims"])


def ffn_cell(c):
    if "full_head_dim" in c and c.get("use_double_wide_mlp"):
        return f"{c['intermediate_size']} ({2 * c['intermediate_size']} on KV-shared)"
    if c.get("experts_mxfp4"):
        return f"{c['num_local_experts']}x{c['intermediate_size']} (top {c['num_experts_per_tok']}) MXFP4"
    if "num_dense_layers" in c:
        return (f"{c['intermediate_size']} (blk 0-{c['num_dense_layers'] - 1}) + {c['num_experts']}x"
                f"{c['moe_intermediate_size']} (top {c['num_experts_per_tok']})")
    if c["intermediate_size"] is None and "num_experts" in c:
        return (f"{c['num_experts']}x{c['moe_intermediate_size']} (top {c['num_experts_per_tok']}) "
                f"+ shared {c['shared_expert_intermediate_size']}")
    return str(c["intermediate_size"])


def qt(ty):
    """A tensor's type in the README's tensor lists, when not F32."""
    return "" if ty == "F32" else f" {ty}"


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
                    f"{heads_cell(c)} | {hd_cell(c)} | {rot_cell(c)} | "
                    f"{ffn_cell(c)} | {meta['gguf_bytes']} | {nc['step0_max_abs_diff']:.2e} | "
                    f"{nc['all_steps_max_abs_diff']:.2e} | {nc['all_positions_max_abs_diff']:.2e} | "
                    f"{kvdiff:.2e} | {minm:.4f} |")
        md = summary["metadata"]
        arch = meta["gguf_architecture"]
        keys = [k for k in md if k.startswith(arch + ".")]
        tens = summary["tensors"]
        blk0 = [t for t in tens if t[0].startswith("blk.0.")]
        other = [t for t in tens if not t[0].startswith("blk.")]
        extra = ""
        if arch in ("qwen35", "qwen35moe", "gemma4", "lfm2moe"):
            # The other block kinds: qwen35: a full-attention layer and the nextn (MTP) block; gemma4: full layers,
            # KV-shared sliding and full layers.
            n_blk = md[f"{arch}.block_count"]
            seen = [{(n[6:], tuple(ne)) for n, _, ne in blk0}]
            for b in range(1, n_blk):
                bt = [t for t in tens if t[0].startswith(f"blk.{b}.")]
                names = {(n[len(f"blk.{b}."):], tuple(ne)) for n, _, ne in bt}
                if names not in seen:
                    seen.append(names)
                    extra += (f"- per-block tensors (blk.{b}): "
                              + ", ".join(f"`{n[len(f'blk.{b}.'):]}` {ne}{qt(ty)}" for n, ty, ne in bt) + "\n")
            if "layer_scalars" in c:
                n_kv = n_blk - c["num_kv_shared_layers"]
                src = {l: n_kv - (2 if c["layer_types"][l] == "sliding_attention" else 1) for l in range(n_kv, n_blk)}
                extra += (f"- layer kinds: " + ", ".join(f"{l} {'S' if t == 'sliding_attention' else 'F'}"
                                                         + (f" (K/V of layer {src[l]})" if l in src else "")
                                                         for l, t in enumerate(c["layer_types"]))
                          + f"; `layer_output_scale` values: {c['layer_scalars']}\n")
            if "num_dense_layers" in c:
                extra += ("- layer kinds: " + ", ".join(
                    f"{l} {'conv' if t == 'conv' else 'attention'} + {'dense FFN' if l < c['num_dense_layers'] else 'MoE'}"
                    for l, t in enumerate(c["layer_types"])) + "\n")
            if "expert_usage_last_prompt" in meta:
                eu = meta["expert_usage_last_prompt"]
                extra += (f"- experts chosen (top {md[arch + '.expert_used_count']}) by the 40-token prompt's tokens, counts per "
                          f"expert 0..{md[arch + '.expert_count'] - 1}: "
                          + "; ".join(f"{k} {v}" for k, v in eu["per_layer_counts"].items())
                          + f"; renormalised weights from {eu['weight_min']:.3f} to {eu['weight_max']:.3f}\n")
            if "expert_selection_bias" in meta:
                sb = meta["expert_selection_bias"]
                extra += (f"- the selection bias changes the chosen set (vs the top {md[arch + '.expert_used_count']} of "
                          f"the unbiased scores) for {sb['last_prompt_chosen_set_changed_by_bias']} of the 40-token prompt's "
                          f"{sb['last_prompt_token_layer_pairs']} (token, MoE layer) pairs, "
                          f"{sb['all_cases_chosen_set_changed_by_bias']} of {sb['all_cases_token_layer_pairs']} over all "
                          f"three cases (prompt + greedy); smallest gap between the k-th and (k+1)-th biased score "
                          f"anywhere: {sb['all_cases_min_gap_kth_vs_next_selection_score']:.1e} (float32 rounding of "
                          f"the scores is ~1e-7)\n")
            if "deltanet_decay" in meta:
                dd = meta["deltanet_decay"]
                extra += (f"- Gated DeltaNet per-token decay exp(g) over the 40-token prompt's linear layers and v heads: "
                          f"min {dd['min']:.3f}, median {dd['median']:.3f}, max {dd['max']:.3f}; beta min "
                          f"{dd['beta_min']:.3f}, max {dd['beta_max']:.3f}\n")
        if "mxfp4_experts" in meta:
            mx = meta["mxfp4_experts"]
            pp = mx["per_parameter"]
            exps = sorted({e for v in pp.values() for e in v["scale_exponents"]})
            codes = np.sum([v["code_counts"] for v in pp.values()], axis=0).tolist()
            gc = mx["gguf_check"]
            extra += (f"- MXFP4 experts: {gc['tensors_checked']} tensors, {gc['mxfp4_bytes']} bytes ({sum(v['blocks'] for v in pp.values())} "
                      f"blocks of 17 bytes); block scales 2^{exps[0]} .. 2^{exps[-1]}; E2M1 code counts (codes 0-15 = "
                      f"0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, ... -6): {codes}; rounding changed the drawn weights by "
                      f"{min(v['relative_rms_rounding_change'] for v in pp.values()):.3f}-"
                      f"{max(v['relative_rms_rounding_change'] for v in pp.values()):.3f} relative RMS; the GGUF's MXFP4 "
                      f"bytes equal gguf-py's quantization of the rounded weights and dequantize to transformers' float32 "
                      f"weights bit for bit (gguf-py's dequantize and the script's own decoder agree); transformers' MXFP4 "
                      f"decoder on the converter's input (*_blocks / *_scales) gives the same weights bit for bit\n")
            if "step0_logits_vs_unrounded_model_max_abs_diff" in mx:
                extra += (f"- against gptoss (the same draws, experts not rounded, same prompts): step-0 logits differ by up "
                          f"to {mx['step0_logits_vs_unrounded_model_max_abs_diff']:.3g}, greedy ids equal in "
                          f"{mx['greedy_ids_equal_unrounded_model']} of 3 cases"
                          + (f"; gptoss's F32 GGUF in the same llama.cpp: all steps "
                             f"{mx['unrounded_llama_cpp']['all_steps_max_abs_diff']:.2e}, greedy "
                             f"{mx['unrounded_llama_cpp']['argmax_agrees']}/{mx['unrounded_llama_cpp']['argmax_total']}"
                             if "unrounded_llama_cpp" in mx else "") + "\n")
        if "mtp" in ref:
            mt = ref["mtp"]
            extra += (f"- MTP (`mtp` in reference.json, block blk.{mt['nextn_block']}): {sum(len(x['top20']) for x in mt['cases'])} "
                      f"rows of top-{TOPK} over the three cases, full logits for the 40-token prompt's {mt['cases'][-1]['n_prompt']} "
                      f"positions; torch (transformers modules on the HF mtp.* weights, float32) vs numpy max diff "
                      f"{mt['torch_crosscheck_max_abs_diff']:.2e}; MTP positions offset by 1 / 1000: "
                      f"{mt['position_offset_max_abs_diff']['1']:.1e} / {mt['position_offset_max_abs_diff']['1000']:.1e}; "
                      f"MTP argmax = the main model's next greedy token in {mt['argmax_agrees_with_main_total']} rows "
                      f"(random weights); MTP negative controls (max |diff| over the 40-token case's rows): "
                      + ", ".join(f"{k} {v:.3g}" for k, v in mt["negative_controls_max_abs_diff_last_case"].items())
                      + "\n")
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
               f"{meta['llama_cpp_crosscheck']['argmax_agrees']}/{meta['llama_cpp_crosscheck']['argmax_total']}"
               + (f"; against the numpy forward with the MXFP4 experts' input activations rounded to Q8_0 as ggml's CPU "
                  f"matmul does: {meta['llama_cpp_crosscheck']['vs_numpy_q8_0_activations_max_abs_diff']:.2e} (all "
                  f"positions of the three prompt + greedy sequences; against the exact numpy forward "
                  f"{meta['llama_cpp_crosscheck']['vs_numpy_exact_max_abs_diff']:.2g})"
                  if "vs_numpy_q8_0_activations_max_abs_diff" in meta["llama_cpp_crosscheck"] else "") + "\n"
               if "llama_cpp_crosscheck" in meta else "")
            + f"- eps {c['rms_norm_eps']}, tied output: {c['tie_word_embeddings']}, sliding_window: {c['sliding_window']}\n"
            f"- arch metadata: " + ", ".join(f"`{k[len(arch) + 1:]}`={md[k]!r}" for k in keys) + "\n"
            f"- non-block tensors: " + ", ".join(f"`{n}` {ne}" for n, _, ne in other) + "\n"
            f"- per-block tensors (blk.0): " + ", ".join(f"`{n[6:]}` {ne}{qt(ty)}" for n, ty, ne in blk0) + "\n"
            + extra +
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
smollm3, gemma2, qwen3moe, qwen3yarn, gptoss, lfm2 and qwen35 were added later with `--only NAME`, without the
llama.cpp run; qwen35moe, gemma4, lfm2moe and gptossmxfp4 with `--only NAME --llama-cpp-check`; gemma4e with
`--only gemma4e`, without the llama.cpp run); rerun it to regenerate everything (the GGUF bytes, reference values
and this README are deterministic for a given seed and library versions: two full runs gave byte-identical files).
Versions: {vers}.

Each `<name>/` holds:
- `model.gguf`: written by llama.cpp's own `convert_hf_to_gguf.py --outtype f32` (all tensors F32, so the
  weights are exactly the transformers weights, up to the converter's q/k row permutation for `llama`; gptossmxfp4's
  expert tensors are MXFP4, holding exactly its transformers weights too, see below).
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
  qwen35 (tied too): its zero-centred norms store w with the multiplier 1 + w, so w is drawn U(-0.5, 0.5) (the
  final norm U(0.5, 3.5)), except the Gated DeltaNet's plain `linear_attn.norm` U(0.5, 1.5); A_log = log U(0.05, 0.6),
  dt_bias N(0, 0.5), convolution taps N(0, 0.5), the DeltaNet's out_proj like o_proj; its `mtp.*` tensors (same
  scheme, numpy seed `[seed, arch_index, 11]`) are added to the saved model.safetensors before conversion.
  qwen35moe: the same scheme; router, expert and shared-expert matrices and the shared-expert gate N(0, 0.08), the
  experts' and the shared expert's down projections N(0, 0.3) like o_proj; its `mtp.*` tensors include the MoE block
  (per-expert `mtp.layers.0.mlp.experts.<e>.{{gate,up,down}}_proj.weight`, as save_pretrained and the checkpoints
  store experts; the converter stacks them).
  gemma4 (tied): token embedding N(0, 0.03) (times sqrt(64) in the model; with N(0, 0.1) greedy decoding repeats
  the fed token); its norms are plain `x * w` (Gemma4RMSNorm; the converter adds nothing), drawn like the others,
  except q_norm/k_norm U(0.25, 0.75) (with attention scale 1 the usual U(0.5, 1.5) makes the attention nearly one-hot
  and float32 transformers drift 8e-5 from float64); the per-layer token table `embed_tokens_per_layer` N(0, 0.4);
  the per-layer output scalars (`layer_scalar`, buffers, not parameters) U(0.5, 1.5), drawn after the parameters.
  gemma4e: gemma4's scheme, except q_norm/k_norm U(0.1, 0.3): its 256- and 512-dim heads (16x gemma4's) make the
  RMS-normed scores ~4x wider (sqrt(head_dim)); with U(0.125, 0.375) float32 transformers was still 3.9e-5 from
  float64, with U(0.1, 0.3) < 8e-6.
  lfm2moe (tied, LFM2's scheme: convolution taps N(0, 0.5), attention `out_proj`, conv `out_proj` and the dense `w2`
  N(0, 0.08), their names not being o_proj/down_proj): router and expert matrices N(0, 0.08), the stacked experts'
  `down_proj` N(0, 0.3) like the tied models' down_proj; the routers' selection bias `expert_bias` (a buffer, zeros in
  transformers) N(0, 0.1), drawn after the parameters (save_pretrained writes it and per-expert w1/w2/w3 tensors, as
  the LFM2-8B-A1B checkpoint stores them; the converter stacks the experts and renames the bias `exp_probs_b.bias`).
  gptossmxfp4: gptoss's draws and prompts exactly (numpy seed `[seed, 9]`, gptoss's arch index; same config), then
  every expert weight (transformers' stacked `mlp.experts.gate_up_proj` (E, in, 2 ff) and `down_proj` (E, ff, out))
  is rounded to MXFP4 before anything else: per block of 32 consecutive input-dimension values of one output row of one
  expert, gguf-py's `quants.quantize(.., MXFP4)` (ggml's `quantize_row_mxfp4_ref`: scale byte e = floor(log2(max
  |w|)) - 2 + 127, i.e. the scale 2^(e - 127) puts max |w| / scale in [4, 8); each value becomes the nearest E2M1 code
  times the scale, 6 for anything above 5 x scale), then `dequantize`; the script asserts that re-quantizing the rounded
  weights gives the same bytes and the same float32 values bit for bit. transformers runs on those float32 weights.
  For conversion the saved float32 `gate_up_proj` / `down_proj` are replaced by OpenAI's checkpoint format
  (`*_blocks` uint8 (E, out, in / 32, 16): element 2j in the low, 2j + 1 in the high nibble of byte j; `*_scales`
  uint8 (E, out, in / 32): the same E8M0 byte) and config.json gets gpt-oss's `quantization_config` (`quant_method:
  mxfp4`), as openai/gpt-oss-20b ships; transformers' own decoder (`integrations.mxfp4.convert_moe_packed_tensors`)
  is asserted to give back the float32 weights bit for bit. The converter's GptOssModel then repacks those bits into
  GGML MXFP4 tensors (`repack_mxfp4`: gate = even, up = odd rows of gate_up; nibbles reordered to ggml's layout),
  no patch needed, and writes `general.file_type` 38 (MOSTLY_MXFP4_MOE); everything else stays F32. After conversion
  the script asserts that each `ffn_{{gate,up,down}}_exps.weight` is MXFP4, that its bytes are gguf-py's quantization of
  the transformers weights and that they dequantize (gguf-py, and the script's own decoder) to those weights bit for
  bit.
- Conversion: `convert_hf_to_gguf.py` from the llama-cpp-python 0.3.36 sdist (`vendor/llama.cpp`, with its vendored
  gguf-py), run via `runpy` with two monkey-patches: `TextModel.get_vocab_base_pre` returns `"smollm"` (the
  converter does not know our tokenizer's pre-tokenizer hash), and for phi3 `Phi3MiniModel.set_vocab` is replaced by
  `_set_vocab_gpt2` (the converter otherwise requires a SentencePiece `tokenizer.model`; the GPT-2 path is the same
  branch it takes for Phi-4 checkpoints whose tokenizer_class is GPT2Tokenizer; gemma2's and gemma4's `set_vocab`
  likewise, as they expect a SentencePiece vocab: gemma4's would write `tokenizer.ggml.model = "gemma4"`). So every GGUF has
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

- LFM2 MoE (`lfm2moe`): LFM2's layers (conv layers by 0 in `attention.head_count_kv`, `shortconv.l_cache`, final norm
  `token_embd_norm`, q/k RMSNorms `attn_q_norm` / `attn_k_norm` [head_dim] before NEOX rope, attention scale
  1/sqrt(n_embd / head_count), no `attention.key_length` written) with the FFN chosen per block: the first
  `leading_dense_block_count` blocks (2; optional key, default 0) have a dense SiLU FFN (`ffn_gate`, `ffn_up` ne
  [n_embd, feed_forward_length], `ffn_down`); every later block has a router `ffn_gate_inp` ne [n_embd, n_expert], a
  selection bias `exp_probs_b.bias` ne [n_expert] (required by llama.cpp: a checkpoint with `use_expert_bias` false
  does not load) and stacked experts `ffn_gate_exps` / `ffn_up_exps` ne [n_embd, expert_feed_forward_length,
  n_expert], `ffn_down_exps` ne [expert_feed_forward_length, n_embd, n_expert]; no biases besides `exp_probs_b`. The
  file says `expert_count` (8), `expert_used_count` (3), `expert_feed_forward_length` (16), `feed_forward_length` (96:
  the dense blocks' width) and `expert_gating_func` (2 = sigmoid; written by the converter for every LFM2 MoE,
  required by llama.cpp's loader). Routing (llama.cpp build_moe_ffn; transformers Lfm2MoeTopKRouter): s =
  sigmoid(ffn_gate_inp x); the experts are the top `expert_used_count` of s + exp_probs_b; their weights are the
  UNBIASED s of the chosen experts divided by their sum; FFN(x) = sum w_e down_e(SiLU(gate_e x) * up_e x). What the
  file leaves implicit: the renormalisation (llama.cpp's lfm2 graph passes norm_w = true whatever the file says; no
  `expert_weights_norm` key; transformers' norm_topk_prob, true here and in LFM2-8B-A1B, divides by sum + 1e-6, llama.cpp
  by max(sum, 6.1e-5): a 1e-6 relative difference), the weight scale (transformers' routed_scaling_factor, 1 here and
  in LFM2-8B-A1B: the converter writes no `expert_weights_scale` and llama.cpp's lfm2moe loader would not read one:
  scale 1), SiLU experts and dense FFN, and the bias's role (selection only).

- gpt-oss (`gpt-oss`: gptoss, gptossmxfp4): llama.cpp hard-codes the clamped SwiGLU's alpha 1.702 and limit 7
  (`LLM_FFN_SWIGLU_OAI_MOE`; transformers' swiglu_limit 7 is not in the file), the routing (`SOFTMAX_WEIGHT`: the top
  `expert_used_count` router logits (+ `ffn_gate_inp.bias`), softmax over those only, no further normalisation), the
  sliding layers (swa pattern 2: even layers slide, unless the file has `attention.sliding_window_pattern`) and the
  YaRN correction dims rounded to integers (transformers' truncate = false keeps them fractional; here both give
  pair 0 extrapolated and pairs 1-7 interpolated, so no difference). MXFP4 tensors (GGML type 39; gptossmxfp4's
  `ffn_{{gate,up,down}}_exps.weight`): each row of ne0 values (the input dimension) is ne0 / 32 blocks of 17 bytes: byte 0
  an E8M0 exponent e, bytes 1-16 the 4-bit codes, element j (0-15) in the low nibble of byte 1 + j and element 16 + j
  in its high nibble; value = E2M1[code] x 2^(e - 127), E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2,
  -3, -4, -6] (ggml stores the doubled table and 2^(e - 128), the same values). The tensor ne are those of the F32
  experts ([64, 32, 8] gate/up, [32, 64, 8] down); the data is ne1 x ne2 rows of ne0 / 32 x 17 bytes.

- Qwen3.5 (`qwen35`): `block_count` counts the MTP blocks too: the main model is the first
  `block_count - nextn_predict_layers` blocks (here 4 of 5; blk.4 is the nextn block, skipped by the main pass).
  Linear-attention (Gated DeltaNet) layers: `attention.recurrent_layers` (per block, false for the nextn block),
  else `(i + 1) % full_attention_interval != 0` (llama.cpp's default interval 4); here both are written and agree.
  Dims: `ssm.state_size` = key (= value) head dim, `ssm.group_count` = key heads, `ssm.time_step_rank` = value heads,
  `ssm.inner_size` = value heads x head dim, `ssm.conv_kernel`. The converter reorders the value heads from
  grouped-by-key-head (transformers) to tiled, so GGUF v head i uses key/query head i % group_count (llama.cpp's
  ggml_repeat); it stores `ssm_a` = -exp(A_log) and `ssm_dt.bias` = dt_bias, so g = ssm_a * softplus(alpha +
  ssm_dt.bias), decay exp(g), beta = sigmoid(ssm_beta x). `attn_qkv` rows are [q (keys x dim) | k | v]; the
  depthwise convolution (`ssm_conv1d` [kernel, channels], last tap on the current position) runs over those
  channels, then SiLU; q and k are L2-normalised per head (x / sqrt(sum x^2 + eps): transformers hard-codes eps
  1e-6, llama.cpp uses the file's rms eps, also 1e-6 here, so no difference), q is scaled by 1/sqrt(state_size);
  the state S (key dim x value dim per v head, zero at the start) does S = exp(g) S; S += k (x) beta (v - S^T k);
  o = S^T q; then RMSNorm(o) x `ssm_norm` (one weight of head-dim length for all v heads; NOT zero-centred: the
  converter writes it as is) x SiLU(`attn_gate` x), then `ssm_out`. Full-attention layers: `attn_q` gives per
  head [query (head_dim) | gate (head_dim)], q/k RMSNorms, rope, softmax(q k / sqrt(head_dim)), times
  sigmoid(gate), `attn_output`. Every layer: x += mixer(attn_norm(x)); x += FFN(post_attention_norm(x)) (SiLU-gated).
  All other norm weights are already 1 + w in the file (transformers' zero-centred Qwen3_5RMSNorm).
  Rope: llama.cpp's IMROPE over `rope.dimension_count` (8 of 16) dims, NEOX pairs (i, i + 4), sections
  `rope.dimension_sections` [2, 1, 1, 0]: pair i takes its angle from stream t, h, w or e by
  sector = i % sum(sections) (interleaved: sector % 3 == 1 and < 3 s1 -> h, % 3 == 2 and < 3 s2 -> w,
  % 3 == 0 and < 3 s0 -> t, else e). For text llama.cpp feeds t = h = w = pos and e = 0; with these sections every
  pair is t, h or w, so the rope is plain NEOX with theta_i = pos * base^(-2i/8) on the first 8 dims (transformers
  agrees: all three of its streams are the text position).

- Qwen3.5 MoE (`qwen35moe`): everything above for `qwen35` (layer kinds, Gated DeltaNet, gated attention, IMROPE,
  +1 norms, nextn block), with every block's FFN a mixture of experts (the nextn block's too). The file gives
  `expert_count` (8), `expert_used_count` (2), `expert_feed_forward_length` (8, the width of each routed expert),
  `expert_shared_feed_forward_length` (16, the shared expert's width) and no `feed_forward_length`. It does NOT say
  how the router scores and weighs: llama.cpp's qwen35moe graph hard-codes softmax gating over all experts
  (`LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX`; the converter writes no `expert_gating_func`), the top
  `expert_used_count` by probability, their probabilities renormalised to sum 1 (`norm_w = true`; transformers'
  Qwen3_5MoeTopKRouter always renormalises, there is no `norm_topk_prob` in its config) and no extra scale
  (`expert_weights_scale` absent = 0 = none). FFN(x) = sum over the chosen e of w_e * down_e(SiLU(gate_e x) * up_e x)
  + sigmoid(`ffn_gate_inp_shexp` . x) * down_shexp(SiLU(gate_shexp x) * up_shexp x), x the post_attention_norm
  output; `ffn_gate_inp_shexp` is one row (ne [64, 1]: one gate logit per token, not per channel). Stacked expert
  tensors: `ffn_gate_exps` / `ffn_up_exps` ne [n_embd, n_ff_exp, n_expert], `ffn_down_exps` ne [n_ff_exp, n_embd,
  n_expert]; the router `ffn_gate_inp` ne [n_embd, n_expert]; no biases anywhere in the FFN.

- Gemma 4 (`gemma4`, text model, dense FFN; the 26B-A4B MoE variant is not exercised). What the file says:
  `attention.sliding_window_pattern` (per layer, true = sliding; llama.cpp requires the array), `sliding_window`,
  `attention.key_length` / `value_length` (full layers' head size) and `key_length_swa` / `value_length_swa`
  (sliding layers'; llama.cpp requires k = v for each), `attention.head_count_kv` (per layer: here 2 on sliding,
  1 on full layers), `rope.freq_base` (full layers) / `rope.freq_base_swa` (sliding), `rope.dimension_count` (full:
  the whole head, 32) / `rope.dimension_count_swa` (16), the non-block `rope_freqs.weight` (used by full layers
  only: 1 for the first 4 pairs, 1e30 for the other 12, so those are not rotated: transformers' "proportional"
  RoPE, theta_i = pos * base^(-2i/32) for i < 4, i.e. the exponent is over the FULL head size, not over the 8
  rotated dims), `attention.shared_kv_layers`, `embedding_length_per_layer_input`, `feed_forward_length` (per layer:
  the KV-shared layers' FFN is double wide), `final_logit_softcapping`. Per layer: `layer_output_scale` (one float).
  What llama.cpp hard-codes (the file is silent): the embedding times sqrt(n_embd) (text tokens); attention scale
  1.0 (no 1/sqrt(head_dim): `f_attention_scale = 1`); NEOX rope; q and k RMS-normed per head with
  `attn_q_norm` / `attn_k_norm` before rope; V RMS-normed per head WITHOUT a weight (`ggml_rms_norm`, the file's
  eps); a layer without `attn_v` uses the raw K projection (before k-norm and rope) as V (transformers'
  `attention_k_eq_v`, on full layers only); causal attention, sliding layers see keys t - window + 1 .. t;
  which layers keep no K/V: l >= block_count - shared_kv_layers (here 3, 4, 5), and whose K/V they read: a sliding
  one layer (block_count - shared_kv_layers - 2), a full one (block_count - shared_kv_layers - 1) (here 1 and 2;
  transformers reads the last non-shared layer of the same type, the same layers only because layer 2 is full and
  layer 1 sliding); each layer: x += post_attention_norm(attn_output(attn(attn_norm(x)))); x +=
  post_ffw_norm(ffn_down(GELU_tanh(ffn_gate h) * ffn_up h)), h = ffn_norm(x); then the per-layer input (below);
  then x *= layer_output_scale; finally output_norm, the tied output and tanh soft-capping. The per-layer inputs
  (PLE): E_pl = per_layer_token_embd[token] (n_layer x 8 values per token) times sqrt(8); P = per_layer_model_proj
  (scaled embedding) / sqrt(n_embd), RMS-normed per layer slice with `per_layer_proj_norm`; per-layer input_l =
  (P_l + E_pl_l) / sqrt(2); in layer l: x += post_norm(proj(GELU_tanh(inp_gate x) * input_l)) (tensors
  `blk.N.inp_gate` [n_embd -> 8], `blk.N.proj` [8 -> n_embd], `blk.N.post_norm`). All these sqrt scales are
  hard-coded, as is GELU. Norm weights are stored as is (no + 1). The KV-shared layers have no attn_k, attn_v,
  attn_k_norm; full layers with k = v have no attn_v.

- Gemma 4 with the E2B/E4B head sizes (`gemma4e`): the same architecture and math, with sliding heads of 256 and full
  heads of 512 dims (`key_length_swa` 256, `key_length` 512), 2 query heads over 1 KV head on every layer, layers
  [S, F, S, F] with the last 2 KV-shared (sources: layer 0 for the sliding one, layer 1 for the full one). As in the
  real E2B/E4B, `attention_k_eq_v` is off: every non-shared layer has its own `attn_v`, and
  `attention.head_count_kv` is a single number (1), not a per-layer array (the converter writes the array only when
  the full layers have their own KV-head count). `rope.dimension_count` 512 / `dimension_count_swa` 256;
  `rope_freqs.weight` has 256 entries, 1 for the first 64 pairs and 1e30 for the other 192 (theta_i = pos *
  1e6^(-2i/512) for i < 64).

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
- `mtp` (qwen35, qwen35moe): the multi-token-prediction head's truth, which transformers cannot give (it ignores the
  `mtp.*` weights): float64 numpy from the GGUF exactly as llama.cpp's `graph_mtp`. `about` states the convention:
  per case the sequence s = prompt_ids + greedy_ids; row j (j = 0 .. len(s) - 2) is fed the main model's hidden
  state h_j at position j (after `output_norm`) and the token s[j+1], and predicts s[j+2]; MTP rows attend causally
  to MTP rows 0..j at MTP position j (any constant position offset gives the same logits). Keys: `nextn_block`
  (the block index); `cases[3]` with `sequence_ids`, `n_prompt`, `top20` (per row: `position` j, `input_token`
  s[j+1], `ids`, `logits`), `argmax_ids` (per row), `main_next_ids` (per row: the main model's greedy token after
  position j+1, i.e. its own prediction of s[j+2]), `argmax_agrees_with_main`; the last case also
  `all_positions_logits` (rows j = 0..39: the 40 prompt positions' hidden states, the last one fed greedy_ids[0]);
  `argmax_agrees_with_main_total`, `position_offset_max_abs_diff`, `torch_crosscheck_max_abs_diff` (the same MTP
  built from transformers modules (Qwen3_5DecoderLayer, Qwen3_5RMSNorm, a Linear) on the HF `mtp.*` weights and the
  transformers hidden states, float32) and `negative_controls_max_abs_diff_last_case` (the token s[j] instead of
  s[j+1], the hidden state before `output_norm`, the concatenation [h; e], `output_norm` as the head norm, each
  row attending only to itself).

## Independent cross-check
`NpGGUF` in the script is a float64 numpy forward pass that reads only the GGUF (gguf-py `GGUFReader`) and
implements the llama.cpp math above (rope style by architecture, partial rope, rope_freqs, fused qkv and gate|up,
q/k norms, biases, GQA, tied output when `output.weight` is absent). It is compared with the transformers logits:
`step0` = logits_step0 of the three prompts, `all steps` = the top-20 logits of all 16 steps of all prompts
(numpy runs one full forward over prompt+greedy[:-1]), `all pos` = all_positions_logits. The script fails if a
step difference reaches 1e-4. It also records negative controls (`meta.numpy_float64_crosscheck.
negative_controls_step0_max_abs_diff_last_prompt`): the same forward with one thing deliberately wrong (other rope
style, rope_freqs ignored, rope over all head dims, q/k norms skipped, biases dropped, token_embd used as output,
no soft-capping of scores or of logits, no sliding window, RoPE on SmolLM3's NoPE layers; for qwen35: no state
decay, the state reset every token, the convolution seeing its own position only, v heads paired with k heads in
transformers' grouped order, no q/k L2 norm, no SiLU(z) output gate, no sigmoid attention gate, the q projection
read as [all queries | all gates]; for qwen35moe also: one expert more or fewer, no renormalisation of the top-k
weights, sigmoid instead of softmax router scores (same experts chosen, other weights: the smallest effect, 0.3),
no shared expert, the shared expert without its sigmoid gate; for gemma4: q/k norms skipped, no per-layer inputs,
only their token-table or only their projection half, KV-shared layers projecting their own K/V with the source
layer's weights instead of reading its K/V, KV-shared layers reading the first layer of their type, full layers'
rope ignoring rope_freqs (all 16 pairs rotated: the smallest effect, 0.2), rotating only the 8 rotated dims with
exponents over 8, with the sliding layers' 16 rope dims, or with the sliding base, no V norm, V = the normed and
roped K on the k = v layers, attention scale 1/sqrt(head_dim), embeddings not times sqrt(n_embd), no layer scalar,
no final soft-capping, no sliding window (gemma4e: the same, less the two that cannot differ there: its KV-shared
layers' sources are the first layers of their type, and it has no k = v layers); for lfm2moe: no expert selection
bias (experts from the unbiased sigmoid scores; `drop_biases` is the same control, exp_probs_b being its only
bias), the bias also in the weights (the smallest effect, 0.6), softmax instead of sigmoid scores, no
renormalisation, one expert fewer or more, the leading
dense blocks' FFN skipped; for gptossmxfp4: MXFP4 codes read in OpenAI's nibble order (elements 2j, 2j + 1 in byte
j) instead of ggml's, the E8M0 scale applied to ggml's doubled code table (2x every expert weight));
each moves the logits by O(1), so the references do pin each of these details.
`python scripts/gen-arch-refs.py --check-only` reruns just this check (and the
sha256) on the committed files.

## Real llama.cpp check
Generated with `--llama-cpp-check`: each GGUF is also run in real llama.cpp (llama-cpp-python 0.3.36 built from the
same sdist, `pip install --no-build-isolation llama_cpp_python-0.3.36.tar.gz`, CPU, 1 thread, F32 KV cache, no
flash attention); `meta.llama_cpp_crosscheck` and the per-model sections below give its max logit diffs against
the transformers values and its greedy agreement. This confirms llama.cpp loads every file and agrees with the
oracle (rope style, partial rope, rope_freqs, biases, q/k norms, fused tensors). With llama.cpp's default F16 KV
cache the diffs grow to ~5e-3. gemma4's llama.cpp diffs (~2e-3, greedy still 48/48) come from ggml's CPU GELU, which
looks the value up in a float16 table (`GGML_GELU_FP16` in ggml-cpu/vec.h: input rounded to float16, float16 result):
the same llama.cpp with that define removed (only libggml-cpu rebuilt) gives 4.3e-6 against the numpy forward on all
three cases, so the gemma4 math above is llama.cpp's exactly; an engine computing GELU in float32 should match the
transformers values here, not llama.cpp's, to ~1e-5. gptossmxfp4's llama.cpp logits are ~0.1 off the transformers
values (and the routers choose other experts at one position, step 13 of the 40-token case, in layers 1-3: all steps
~2, greedy 46/48) because ggml's CPU matmul rounds the
activations that multiply MXFP4 weights to Q8_0 (its `vec_dot_type` for MXFP4: per 32 values a float16 scale amax / 127
and int8 values); the numpy forward doing the same to the experts' inputs (`NpGGUF.q8_act`, diagnostic only) agrees with
llama.cpp to ~3e-6 at every position of the three sequences, so llama.cpp reads the MXFP4 blocks exactly as described
(and the script asserts that instead of llama.cpp's greedy agreement); an engine that dequantizes MXFP4 and multiplies in
float32 should match the transformers values to ~1e-5.

## Guidance for tests
- Logits of a float32 engine on these F32 weights: compare within ~1e-4 absolute (logits are O(1-10); numpy float64
  vs transformers float32 differ by < 1e-5, KV-cached vs no-cache by < 1e-5; up to ~3e-5 and ~5e-5 on the
  qwen3yarn / qwen35 rows, qwen35's from transformers' float32 chunked delta rule). Greedy ids: exact equality
  expected; the smallest top1-top2 margin of any step is in the table (> 100x the float32 noise).
- qwen35's and qwen35moe's MTP rows (`mtp`): numpy float64 values stored as float32; a float32 engine should match within ~1e-4
  (the torch float32 rebuild of the same MTP differs by < 5e-5).
- gptossmxfp4: the MXFP4 experts dequantize exactly to the transformers weights, so a float32 engine (dequantizing the
  blocks, float32 activations) matches within ~1e-4 like the F32 models; one that quantizes the activations (as ggml's
  CPU backend does to Q8_0) does not, and can choose other experts.
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
