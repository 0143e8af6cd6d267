"""The engines `weld bench` runs side by side: weld (through its public API), HF transformers and
llama.cpp. Each takes lists of token ids and returns `max_tokens` greedy ids per row (exactly,
unless a weld engine was told to stop at EOS), and states what a decode step of it must read:
`weight_bytes` (in its own storage format) and `kv_bytes_per_token` (from weld's cache spec of
the model, in the engine's KV dtype). The heavy imports (jax, torch, llama_cpp) happen when an
engine is built.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
from typing import Any

import numpy as np

from weld.bench.roofline import WeightBytes
from weld.config import EngineConfig
from weld.utils.errors import WeldError

SPEC_ENGINE = "weld-spec"  # the name of the speculative weld engine in results


class WeldEngine:
    """weld through its public API. `speculative_config` makes it the speculative engine;
    `ignore_eos=False` (text prompts) lets rows stop at EOS, so they may return fewer tokens."""

    def __init__(self, model: str, dtype: str, max_batch: int, max_model_len: int, decode_len: int | None = None,
                 speculative_config: dict[str, Any] | None = None, ignore_eos: bool = True,
                 **options: Any):
        import jax

        from weld.engine.llm import LLM
        from weld.engine.sampling_params import SamplingParams
        from weld.models.common.quant import is_quantized
        from weld.models.family import output_matrix

        page_size = 16
        # Every row of the largest batch at its full length (decode_len: prompt + new tokens), or
        # the one long prefill prompt, plus a page per row of slack for pages the fused decode
        # allocates ahead. No prefix caching: the same prompts repeat across runs and must be
        # recomputed each time. (Attention reads only the pages in context, so the pool's size
        # costs memory, not time.)
        pages = lambda tokens: -(-tokens // page_size) + 1  # noqa: E731
        num_pages = max(max_batch * pages(decode_len or max_model_len), pages(max_model_len))
        config = EngineConfig.create(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_batch,
                                     page_size=page_size, num_pages=num_pages, enable_prefix_caching=False,
                                     speculative_config=speculative_config, **options)
        self.llm = LLM(engine_config=config)
        self._params = lambda n: SamplingParams(max_tokens=n, ignore_eos=ignore_eos, temperature=0)
        self.ignore_eos = ignore_eos
        self.cfg = self.llm.cfg
        self.max_model_len = self.llm.max_model_len
        dtype_name = np.dtype(self.llm.dtype).name
        weights = self.llm.model.weights
        formats = sorted({leaf.fmt for leaf in jax.tree_util.tree_leaves(weights, is_leaf=is_quantized)
                          if is_quantized(leaf)})
        self.name, self.label = "weld", f"weld {dtype_name}" + "".join(f" {f}" for f in formats)
        spec = config.speculative
        if spec.method is not None:
            self.name = SPEC_ENGINE
            self.label = f"{self.label} {spec.method.removesuffix('_model')}" + (f" k{spec.k}" if spec.k else "")

        embed = weights.get("embed")
        untied = embed is not None and output_matrix(weights) is not embed
        moe = self.cfg.moe
        routed = [x for lw in weights["layers"] for name, x in lw.get("moe", {}).items()
                  if name not in ("router", "router_bias", "score_bias", "shared")]  # the stacked experts
        self.weight_bytes = WeightBytes(total=sum(x.nbytes for x in jax.tree_util.tree_leaves(weights)),
                                        untied_embedding=embed.nbytes if untied else 0,
                                        embedding_row=embed.nbytes // embed.shape[0] if embed is not None else 0,
                                        experts=sum(x.nbytes for x in routed),
                                        top_k=moe.top_k if moe else 0, num_experts=moe.num_experts if moe else 0)
        self.cache_spec = self.llm.model.family.cache_spec(self.cfg)  # what the other engines' KV is counted from
        self.kv_bytes_per_token = self.cache_spec.bytes_per_token(self.llm.kv_dtype)
        self.info = {"dtype": dtype_name, "backend": jax.default_backend(), "batching": "continuous batching",
                     "kv_dtype": np.dtype(self.llm.kv_dtype).name, "max_model_len": self.max_model_len, "page_size": page_size,
                     "num_pages": num_pages, "ignore_eos": ignore_eos, "speculative_config": speculative_config,
                     "quantization": options.get("quantization"), "quantized_formats": formats}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._params(max_tokens),
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def spec_counters(self) -> dict[str, Any]:
        """The engine's cumulative speculative counters ({} without speculation)."""
        return self.llm.engine.spec_stats()

    def num_compiles(self) -> int:
        return self.llm.engine.stats()["num_compiles"]


class HFEngine:
    """transformers on torch (CPU), f32: a GGUF is dequantized by transformers itself. `cache_spec`
    is weld's of the same model (`WeldEngine.cache_spec`); the KV is counted from it in f32."""

    name = "hf"

    def __init__(self, source, threads: int, cache_spec, moe=None):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(threads)  # a benchmark, not a test: all the cores
        self.torch = torch
        if source.kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                         dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
        self.model = model.eval()
        cfg = model.config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else 0
        self.eos = eos if isinstance(eos, int) else list(eos)[0]
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.eos
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        untied = head is not None and head.weight.data_ptr() != embed.data_ptr()
        routed = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                     if ".experts." in name and "shared" not in name)
        self.weight_bytes = WeightBytes(
            total=sum(p.numel() * p.element_size() for p in model.parameters()),  # tied shared once
            untied_embedding=embed.numel() * embed.element_size() if untied else 0,
            embedding_row=embed.shape[1] * embed.element_size(), experts=routed,
            top_k=moe.top_k if moe else 0, num_experts=moe.num_experts if moe else 0)
        self.kv_bytes_per_token = cache_spec.bytes_per_token(np.float32)  # the cache is in the model's dtype
        self.label = "HF f32"
        self.info = {"dtype": "float32", "torch_threads": threads, "batching": "padded batch (left padding, "
                     "attention mask)", "kv_dtype": "float32", "transformers": transformers.__version__,
                     "torch": torch.__version__}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from transformers import GenerationConfig

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        gen = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               pad_token_id=self.pad, eos_token_id=self.eos)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=gen)
        return out[:, width:].tolist()


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: one llama_batch holds a token of every
    sequence (one sequence id per row, each with its own KV cells), so batch B decodes B rows per
    call, at every B (batch 1 included). Greedy is an argmax over the returned logits. The KV is
    counted from weld's `cache_spec` of the same model, in f16 (llama.cpp's default K/V type)."""

    name = "llamacpp"

    def __init__(self, path: pathlib.Path, max_batch: int, max_model_len: int, threads: int, cache_spec, moe=None):
        import logging

        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load log goes to stderr
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise WeldError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        self.n_batch = 2048
        params.n_ctx = max_batch * -(-max_model_len // 256) * 256  # llama.cpp pads each sequence's cells to 256
        params.n_batch = self.n_batch
        params.n_ubatch = 512
        params.n_seq_max = max_batch
        # Per-sequence KV cells: a unified cache would make every row attend over (masked) cells
        # of all rows, which llama.h advises against when sequences share no prefix.
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise WeldError(f"llama.cpp could not create a context of {params.n_ctx} tokens x {max_batch} sequences")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.weight_bytes = gguf_weight_bytes(path, moe)
        self.kv_bytes_per_token = cache_spec.bytes_per_token(np.float16)  # llama.cpp's default K/V type
        file_type = path.stem.rsplit(".", 1)[-1] if "." in path.stem else "GGUF"
        self.label = f"llama.cpp {file_type}"
        self.info = {"dtype": file_type, "threads": threads, "kv_dtype": "float16",
                     "batching": "llama_batch API (one batch of all sequences per step)",
                     "llama_cpp_python": importlib.metadata.version("llama_cpp_python")}

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax_outputs(self, n: int) -> list[int]:
        """Greedy tokens of the n rows that asked for logits in the last decode, in batch order."""
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n * self.n_vocab,))
        return logits.reshape(n, self.n_vocab).argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        # Prefill: all prompts' tokens packed into batches of n_batch; the last token of each
        # prompt asks for logits, read right after the batch that holds it.
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        outs: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            self._decode(chunk)
            seqs = [seq for _, _, seq, logits in chunk if logits]
            for seq, token in zip(seqs, self._argmax_outputs(len(seqs))):
                outs[seq].append(token)
        for step in range(1, max_tokens):
            self._decode([(outs[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s, token in enumerate(self._argmax_outputs(len(prompts))):
                outs[s].append(token)
        return outs


def gguf_weight_bytes(path: pathlib.Path, moe=None) -> WeightBytes:
    """Tensor bytes of a GGUF as stored (quantized blocks included)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    embed = tensors.get("token_embd.weight")
    untied = embed is not None and "output.weight" in tensors
    rows = int(embed.shape[-1]) if embed is not None else 1  # GGUF lists dims innermost first
    return WeightBytes(total=sum(int(t.n_bytes) for t in tensors.values()),
                       untied_embedding=int(embed.n_bytes) if untied else 0,
                       embedding_row=int(embed.n_bytes) // rows if embed is not None else 0,
                       experts=sum(int(t.n_bytes) for name, t in tensors.items() if "_exps." in name),
                       top_k=moe.top_k if moe else 0, num_experts=moe.num_experts if moe else 0)
