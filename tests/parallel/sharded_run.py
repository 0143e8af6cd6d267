"""Runs one tiny model on one device and under device layouts, in a process of its own with
8 virtual CPU devices (the device count is fixed when JAX starts, and the test process has one).

    python tests/parallel/sharded_run.py MODEL_DIR '[{"tensor_parallel_size": 2}, ...]'

Each layout (a dict of `LLM` keywords, "backend": "megakernel" included; "spec": true turns
n-gram speculation on) runs the same
greedy batch twice (the second, without prompt logprobs, hits the prefix cache) and reports, as one JSON line, its
tokens, their logprobs, the prompt logprobs, the prefix-cache hits, whether every page was freed,
and the share of the weight bytes that device 0 holds. The test compares them with the
one-device run of the same kind.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("WELD_PROGRESS", "0")

ENGINE = dict(dtype="float32", max_model_len=96, page_size=4, kv_cache_memory_gb=0.004, max_num_seqs=4,
              steps_per_call=4)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n\ndef add(a, b):",
           "Paris is the capital of France. Paris is"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": False}


def device0_share(tree) -> float:
    """Bytes of tree's arrays held by device 0 over their logical bytes."""
    import jax

    held = total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        total += leaf.size * leaf.dtype.itemsize
        held += sum(s.data.size * s.data.dtype.itemsize for s in leaf.addressable_shards if s.device.id == 0)
    return held / total


def watch_ranks(llm) -> set[int]:
    """The data-parallel ranks sequences get placed on from now on (empty: one rank)."""
    ranks: set[int] = set()
    bm = llm.engine.block_manager
    if hasattr(bm, "ranks"):
        place = bm._place

        def placed(seq) -> int:
            rank = place(seq)
            ranks.add(rank)
            return rank

        bm._place = placed
    return ranks


def count_sharded_kernel_traces() -> list:
    """A list that grows by one each time the tensor-parallel megakernel is traced."""
    from weld.models import megakernel

    traced, sharded = [], megakernel.sharded_forward

    def counted(*args, **kwargs):
        traced.append(1)
        return sharded(*args, **kwargs)

    megakernel.sharded_forward = counted
    return traced


def run(model: str, layout: dict) -> dict:
    from weld import LLM, SamplingParams

    layout = dict(layout)
    spec = layout.pop("spec", False)
    kernel_traces = count_sharded_kernel_traces()
    llm = LLM(model, **ENGINE, **layout, speculative_config=NGRAM if spec else None)
    ranks = watch_ranks(llm)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    first = llm.generate(PROMPTS, params)
    hits = llm.engine.block_manager.prefix_hits
    # Prompt logprobs need every prompt position computed: the second run asks for none, so its
    # prompts' full pages come from the prefix cache.
    again = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1))
    bm = llm.engine.block_manager
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in first],
        "again": [list(o.outputs[0].token_ids) for o in again],
        "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in first],
        "prompt_logprobs": [[next(iter(x.values())).logprob for x in o.prompt_logprobs[1:]] for o in first],
        "again_logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                           for o in again],
        "prefix_hits": bm.prefix_hits - hits,
        "pages_freed": (bm.num_free_pages == bm.num_pages and bm.num_free_slots == bm.num_slots
                        and not llm.engine.requests),
        "weight_share": device0_share(llm.engine.runner.weights),
        # every pool: pages (K/V, MLA latent) and recurrent-state slots
        "pool_share": device0_share(llm.engine.runner.cache),
        "ranks_used": sorted(ranks),
        "num_prompts": len(PROMPTS),
        "verified": any(key[0] == "verify" for key in llm.engine.runner._programs),
        "sharded_kernel_traces": len(kernel_traces),
    }


def main(argv: list[str]) -> None:
    model, layouts = argv[0], json.loads(argv[1])
    for layout in layouts:
        print(json.dumps({"layout": layout, **run(model, layout)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
