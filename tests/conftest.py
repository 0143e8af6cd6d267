"""Shared test fixtures: tiny HF models (the numerical oracle) saved to disk for weld to load."""

from __future__ import annotations

import os

os.environ.setdefault("WELD_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pathlib

import pytest

try:  # torch is the test-only oracle; one thread keeps it from fighting jax for the 2 cores
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}
# variant name ("model_type" or "model_type:tag") -> extra HF config fields; each exercises switches
# of a family (the architecture notes list them).
TINY_VARIANTS = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),
    "mistral": dict(sliding_window=6, tie_word_embeddings=False),
    # Qwen3-MoE: a dense first layer (mlp_only_layers), softmax top-2 of 8 without renormalising ...
    "qwen3_moe": dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False),
    # ... and renormalised, sparse every second layer
    "qwen3_moe:norm": dict(num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    # DeepSeek-V3 / Kimi K2: q and kv LoRA, interleaved YaRN RoPE with mscale, sigmoid group-limited routing
    # with a correction bias, a dense first layer and a shared expert
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=32,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, tie_word_embeddings=False),
    # DeepSeek-V2(-Lite): no q LoRA, softmax group-limited greedy routing, two shared experts
    "deepseek_v2": dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                        first_k_dense_replace=1, n_shared_experts=2, moe_intermediate_size=32,
                        routed_scaling_factor=2.0, tie_word_embeddings=False),
    # Gemma 3: five sliding layers and a full one, query_pre_attn_scalar != head_dim, local and global RoPE
    # (the global one linearly scaled), soft-capped logits, tied head
    "gemma3_text": dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                        final_logit_softcapping=30.0, tie_word_embeddings=True,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
    # Qwen3-Next: Gated DeltaNet layers (2 key heads serving 4 value heads, conv width 4) between gated
    # full-attention layers with partial RoPE, MoE with a gated shared expert on every layer
    "qwen3_next": dict(num_hidden_layers=4, head_dim=16, full_attention_interval=2, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       tie_word_embeddings=False),
    # Qwen3.5: flat linear projections, three linear layers to one full one, dense MLPs ...
    "qwen3_5_text": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=12, tie_word_embeddings=True),
    # ... and its MoE, with one key head per value head
    "qwen3_5_moe_text": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,  # ignored: always renormalised
                             tie_word_embeddings=False),
    # Kimi Linear: KDA layers (per-channel decay, q/k/v convs) and NoPE MLA layers, a dense first
    # layer then DeepSeek-V3 routing (sigmoid, correction bias, 2 groups) with a shared expert
    "kimi_linear": dict(num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, num_local_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                        n_shared_experts=1, linear_head_dim=8, linear_num_heads=4, first_k_dense_replace=1,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                        tie_word_embeddings=False),
    # gpt-oss: sinks, biases, alternating sliding / full layers, YaRN without truncation, clamped SwiGLU experts
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                    rope_parameters={**YARN, "factor": 32.0, "original_max_position_embeddings": 16, "truncate": False}),
}
FAMILY_VARIANTS = sorted(TINY_VARIANTS)
# The variants engine-level tests run (each builds engines and compiles their programs). The
# Qwen3.5 ones are Qwen3-Next's layers in another layout and routing, checked against
# transformers and llama.cpp's GGUFs at the model level; through the engine only with -m slow.
SLOW_ENGINE_VARIANTS = {"qwen3_5_text", "qwen3_5_moe_text"}
ENGINE_VARIANTS = [pytest.param(v, marks=pytest.mark.slow) if v in SLOW_ENGINE_VARIANTS else v
                   for v in FAMILY_VARIANTS]


def make_tiny_hf_model(variant: str, directory: pathlib.Path, seed: int = 0, **overrides):
    """Builds a tiny random HF model, perturbs every weight (norms, biases, sinks, router biases too:
    defaults of 0 or 1 would hide bugs), saves it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    model_type = variant.split(":")[0]
    kwargs = {**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **TINY_VARIANTS.get(variant, {}),
              **overrides}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer that checkpoints store
                b.add_(0.1 * torch.randn_like(b))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def keep_programs():
    """keep(runner): the runner keeps its compiled programs (for the life of the runner, which
    the test or fixture owns). A test worker that has run many tests holds many memory mappings,
    and past MAP_BUDGET the runner drops every program before making a new one
    (`ModelRunner._make_room`); their reloads count in `num_compiles`, so a test asserting that
    no new program shape appeared would fail for other tests' mappings."""
    def keep(runner):
        runner._make_room = lambda: None
    return keep


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function family -> (directory, HF torch model), built once per session per family."""
    cache: dict[str, tuple[pathlib.Path, object]] = {}

    def get(variant: str):
        if variant not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{variant.replace(':', '-')}")
            cache[variant] = (d, make_tiny_hf_model(variant, d))
        return cache[variant]

    return get


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 42 1000. "
    "Once upon a time there was a small model that wrote tests. "
) * 20


def make_tiny_tokenizer(directory: pathlib.Path, vocab_size: int = 384) -> int:
    """Trains a byte-level BPE on a small corpus and saves tokenizer.json + tokenizer_config.json.

    Returns the vocabulary size (the tiny model's embedding must match it).
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A complete tiny random llama model directory (weights + tokenizer + chat template).

    Returns (directory, HF torch model). Its EOS is <|im_end|> (id 2).
    """
    d = tmp_path_factory.mktemp("tiny-llama-full")
    vocab = make_tiny_tokenizer(d)
    model = make_tiny_hf_model("llama", d, seed=3, vocab_size=vocab, bos_token_id=None, eos_token_id=2,
                               pad_token_id=0, max_position_embeddings=256)
    return d, model


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory):
    """A function variant -> (directory, HF torch model): a tiny random model of any family with
    tiny_llama_dir's tokenizer and chat template (EOS <|im_end|>, id 2), for runs through the engine."""
    cache: dict[str, tuple[pathlib.Path, object]] = {}

    def get(variant: str):
        if variant not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{variant.replace(':', '-')}-full")
            vocab = make_tiny_tokenizer(d)
            cache[variant] = (d, make_tiny_hf_model(variant, d, seed=5, vocab_size=vocab, bos_token_id=None,
                                                    eos_token_id=2, pad_token_id=0, max_position_embeddings=256))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def nan_token_model(tiny_llama_dir, tmp_path_factory):
    """(directory, P): tiny_llama_dir's model with token P's embedding row NaN, a fault planted in
    the weights. A row that reads P (in its prompt, or sampled and fed back) computes NaN from
    there on; other rows never touch it (the LM head is not tied to the embedding)."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    src, _ = tiny_llama_dir
    d = tmp_path_factory.mktemp("tiny-llama-nan")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    weights = load_file(str(src / "model.safetensors"))
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    poison = weights[name].shape[0] - 1
    weights[name] = weights[name].copy()
    weights[name][poison] = np.nan
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, poison


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_llama_dir):
    """A one-layer random llama with tiny_llama_dir's tokenizer and vocabulary: a draft model for it."""
    import shutil

    target, hf = tiny_llama_dir
    d = tmp_path_factory.mktemp("tiny-llama-draft")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, d / name)
    make_tiny_hf_model("llama", d, seed=11, vocab_size=hf.config.vocab_size, bos_token_id=None, eos_token_id=2,
                       pad_token_id=0, max_position_embeddings=256, num_hidden_layers=1)
    return d


# ----- the default suite's budget -----
# `make test` (CI: 2 cores) should take ~15 minutes. These variants add little over their siblings
# that stay in it (each feature and family keeps at least one default test), so they run with
# `make test-slow` only. Listed here, in one place, by node id (tests/test_suite_layout.py checks
# that each still names a test function).
_FAMILIES = ("deepseek_v2", "deepseek_v3", "gemma3_text", "gpt_oss", "kimi_linear", "llama", "mistral", "mixtral",
             "qwen2", "qwen3", "qwen3_moe:norm", "qwen3_moe", "qwen3_next")
_QUANTIZED = "tests/engine/test_quantized_engine.py::test_every_family_quantizes"
SLOW_VARIANTS = frozenset({
    "tests/engine/test_smollm2_vs_hf.py::test_greedy_32_tokens_equal_hf",
    "tests/spec/test_train.py::test_features_and_teacher_are_the_targets_own_per_answer",
    "tests/spec/test_train.py::test_a_draft_vocabulary_scores_its_own_tokens_and_equals_the_full_loss_when_whole",
    "tests/engine/test_gemma3_gguf.py::test_ids_and_decoding_equal_hf",
    "tests/engine/test_gemma3_gguf.py::test_kept_blocks_score_text_as_the_dequantized_model",
    "tests/engine/test_gemma3_gguf.py::test_tokenizer_facts",
    "tests/weights/test_convert.py::test_cli_convert_and_generate",
    "tests/weights/test_convert.py::test_every_family_converts_quantized[deepseek_v2]",
    "tests/spec/test_shipped_drafter.py::test_shipped_drafter_is_accepted_on_held_out_prompts",
    "tests/engine/test_quantized_engine.py::test_quantization_of_a_gguf[int4-0.05]",
    "tests/engine/test_quantized_engine.py::test_quantization_of_a_gguf[int4_g128-0.08]",
    "tests/cli/test_interrupts.py::test_interactive_chat_ctrl_c_stops_the_reply_then_leaves_at_the_prompt",
    "tests/cli/test_interrupts.py::test_piped_chat_terminated_while_waiting_for_input",
    "tests/cli/test_interrupts.py::test_generate_interrupted_while_decoding_keeps_the_text_so_far",
    "tests/parallel/test_sharded_engine.py::test_layouts_match_one_device[qwen3_next]",
    "tests/parallel/test_sharded_engine.py::test_layouts_match_one_device[qwen3_moe]",
    "tests/parallel/test_multihost.py::test_data_parallel_over_two_hosts_answers_as_one_process",
    "tests/engine/test_speculative.py::test_dspark_paged_drafts_match_dense_reference[False]",
    "tests/engine/test_families_engine.py::test_ngram_speculation_equals_plain[qwen3_next]",
    "tests/engine/test_families_engine.py::test_ngram_speculation_equals_plain[kimi_linear]",
    "tests/engine/test_families_engine.py::test_ngram_speculation_equals_plain[qwen3_moe:norm]",
    "tests/engine/test_families_engine.py::test_prefix_cache_hits_and_chunked_prefill_keep_outputs[kimi_linear]",
    "tests/engine/test_families_engine.py::test_prefix_cache_hits_and_chunked_prefill_keep_outputs[qwen3_moe:norm]",
    "tests/weights/test_memory.py::test_peak_rss_of_loading_a_weld_checkpoint",
    "tests/cli/test_bench.py::test_speculative_run_reports_both_engines_and_the_engine_acceptance",
    "tests/kernels/test_megakernel_decode.py::test_int8_weights_match_xla_on_dequantized_weights[qwen-tied]",
    "tests/kernels/test_megakernel_moe.py::test_hidden_states_out_equal_xla_capture",
    "tests/kernels/test_megakernel_moe.py::test_int8_expert_stacks_match_xla_on_dequantized_weights",
    # the engine test runs Kimi Linear's verify block and DeepSeek-V3's stack at batch 4 with padding
    "tests/kernels/test_megakernel_linear.py::test_kimi_linear_verify_block_matches_steps_and_xla",
    "tests/kernels/test_megakernel_mla.py::test_v3_stack_batch4_with_padding_matches_xla",
    "tests/server/test_server_families.py::test_completions_equal_hf_greedy[qwen3_moe]",
    "tests/server/test_server_families.py::test_completions_equal_hf_greedy[gpt_oss]",
    # int8 for every family; the other modes on llama only
    *(f"{_QUANTIZED}[{m}-{f}]" for m in ("int4", "int4_g128", "int8_channel") for f in _FAMILIES if f != "llama"),
    # the seeds' MoE mix (int4 experts) on Qwen3-MoE only
    *(f"{_QUANTIZED}[int8_channel_int4_experts-{f}]" for f in _FAMILIES if f != "qwen3_moe"),
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
