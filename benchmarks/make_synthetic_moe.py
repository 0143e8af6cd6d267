"""A synthetic mixture-of-experts checkpoint of realistic proportions, for `weld bench --vs hf`.

No real MoE weights can be downloaded here, so this writes a random Qwen3-MoE (transformers'
`qwen3_moe`, saved with `save_pretrained`) shaped like a scaled-down Qwen3-30B-A3B: 64 experts,
top-8, every layer sparse, so a decode step at batch 1 must read about a fifth of the weights.
Random weights are enough: decode speed does not depend on their values (greedy ids are what
both engines compare), and routing over random logits is close to uniform, which is what the
bench's floor assumes. A word-level tokenizer covers the vocabulary (the bench feeds token ids).

    python benchmarks/make_synthetic_moe.py /tmp/synthetic-moe
    weld bench --model /tmp/synthetic-moe --vs hf --batch-sizes 1,16 --runs 3 --vs-runs 2
"""

from __future__ import annotations

import argparse
import json
import pathlib

SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, intermediate_size=2048, moe_intermediate_size=384, num_experts=64, num_experts_per_tok=8,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
             rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = AutoConfig.for_model("qwen3_moe", **SHAPE)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():  # transformers' init leaves norms at 1: perturb so nothing is a default
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": None}))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"wrote {args.out}: {total / 1e6:.0f}M parameters, {experts / 1e6:.0f}M in experts "
          f"({SHAPE['num_experts']} per layer, top {SHAPE['num_experts_per_tok']})")


if __name__ == "__main__":
    main()
