"""Sharded decode, measured on this CPU with 8 virtual devices: step time, bytes per device and
the collectives GSPMD placed, for each parallel layout against one device.

    python benchmarks/sharding.py [--runs 3] [--models smollm2,dense,moe] [--out-dir benchmarks/results]

XLA_FLAGS=--xla_force_host_platform_device_count=8 is set before JAX starts: 8 CPU "devices"
that share this machine's cores (2 here). They run one after another on the same cores, so
sharding cannot make anything faster here: what this measures is the cost the layout adds (the
collectives, the re-layouts GSPMD inserts, the loss of the native one-device kernels), as a
ratio against one device. It is not a speed-up measurement.

Models (all f32):
- smollm2: the bundled SmolLM2-135M-Instruct GGUF. Over a mesh its Q4_1 blocks are dequantized
  to f32, so one device runs `quantization="none"` too (both read f32; one device then uses the
  native packed f32 CPU kernels, which a mesh turns off). Its 9 heads (3 KV heads) divide over
  tp 3 only: tp 2, 4 and 8 are refused by `check_layout` (the table says so);
- dense: SmolLM2's layer reshaped to divide over 8 devices (d 576, 8 heads of 72, 4 KV heads,
  SwiGLU 1536), 16 of them (not 30: compiling for 8 devices takes most of the run); random
  weights from tests/conftest.py's `make_tiny_hf_model`, its tokenizer's 380-token vocabulary;
- moe: a Qwen3-MoE from `make_tiny_hf_model` with larger dims (6 layers, d 512, 8 heads of 64,
  4 KV heads, 16 experts of 256, top 4).

Per layout and batch size (1 and 8 rows of 32 random prompt tokens, greedy, EOS ignored), the
decode step time is the median over `--runs` generations of every full fused decode call
(`steps_per_call` steps in one device program), divided by its steps. Every layout's engine is
built and warmed up first; then each run times every layout once in turn. One device is run
twice: as weld runs it (the native CPU kernels: packed f32 matmuls, paged attention) and with
the kernels off (WELD_CPU_KERNELS=0 while it compiles), the XLA code a mesh runs; the second is
the baseline of a layout's own cost. Bytes per device: the
addressable shards on device 0 of the weights and the cache. The compiled decode programs are
dumped (`--xla_dump_to`) and their collectives counted by while-loop depth: depth 1 runs once
per decode step, depth 2 inside a loop of the step (attention's page tiles, the experts' tiles),
depth 0 once per call (before the step loop).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

DUMP = pathlib.Path(tempfile.mkdtemp(prefix="weld-sharding-hlo-"))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_module_re=jit_decode").strip()
os.environ["WELD_CACHE_DIR"] = "0"  # compile afresh: a persistent-cache hit would dump no program

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # conftest's tiny-model builders

PROMPT_LEN = 32
STEPS = 8  # steps per fused decode call
CALLS = 3  # full decode calls per generation
LAYOUTS = {  # name -> LLM keywords
    "1 device": {},
    "1 device (XLA only)": {},  # the native CPU kernels off (WELD_CPU_KERNELS=0 while it compiles), as on a mesh
    "TP2": {"tensor_parallel_size": 2},
    "TP3": {"tensor_parallel_size": 3},
    "TP4": {"tensor_parallel_size": 4},
    "TP8": {"tensor_parallel_size": 8},
    "DP2": {"data_parallel_size": 2},
    "TP2 x DP2": {"tensor_parallel_size": 2, "data_parallel_size": 2},
    "TP3 x DP2": {"tensor_parallel_size": 3, "data_parallel_size": 2},
    "TP2 + EP": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "TP8 + EP": {"tensor_parallel_size": 8, "enable_expert_parallel": True},
    "TP8 + EP (expert TP2)": {"tensor_parallel_size": 8, "enable_expert_parallel": True,
                             "expert_tensor_parallel_size": 2},
}
PLAN = {  # model -> layouts run
    "smollm2": ["1 device", "1 device (XLA only)", "TP2", "TP4", "TP8", "TP3", "TP3 x DP2"],
    "dense": ["1 device", "1 device (XLA only)", "TP2", "TP4", "TP8", "DP2", "TP2 x DP2"],
    "moe": ["1 device", "1 device (XLA only)", "TP2", "TP2 + EP", "TP8 + EP", "TP2 x DP2"],
}
DENSE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
             num_key_value_heads=4, head_dim=72, tie_word_embeddings=True, max_position_embeddings=512)
MOE = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
           num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[],
           decoder_sparse_step=1, max_position_embeddings=512)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


# ----- the compiled programs' collectives -----

def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    cur = entry = None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and line.strip():
            comps[cur].append(line.strip())
    return comps, entry


def collectives(text: str) -> list[dict]:
    """The collectives of an optimized HLO module: (while-loop depth of the computation holding
    it, op, result shape) with their count. A while's body and condition are one level deeper
    than the computation running the while; fusions, calls and reductions keep its level."""
    comps, entry = _computations(text)
    depth = {entry: 0}
    todo = [entry]
    while todo:
        name = todo.pop()
        for ins in comps.get(name, []):
            loop = re.search(r"\swhile\(", ins) is not None
            for key, names in re.findall(r"(condition|body|calls|to_apply|branch_computations)=(\{[^}]*\}|%[\w.-]+)",
                                         ins):
                for callee in re.findall(r"%([\w.-]+)", names):
                    d = depth[name] + (loop and key in ("body", "condition"))
                    if depth.get(callee, -1) < d:
                        depth[callee] = d
                        todo.append(callee)
    found: collections.Counter = collections.Counter()
    ops = "|".join(COLLECTIVES)
    for name, body in comps.items():
        for ins in body:
            m = re.match(rf"%\S+ = (.+?) ({ops})(?:-start)?\(", ins)
            if m:
                found[(depth.get(name, -1), m.group(2), re.sub(r"\{[^}]*\}", "", m.group(1)))] += 1
    return [{"depth": d, "op": op, "shape": shape, "count": n} for (d, op, shape), n in sorted(found.items())]


def decode_programs() -> list[dict]:
    """The collectives and the number of custom calls (the native CPU kernels) of each decode
    program compiled since the last call, in compile order."""
    files = sorted(DUMP.glob("*jit_decode*after_optimizations.txt"),  # module ids count up in compile order
                   key=lambda f: int(re.match(r"module_(\d+)", f.name).group(1)))
    out = [{"collectives": collectives(f.read_text()), "custom_calls": f.read_text().count(" custom-call(")}
           for f in files]
    for f in DUMP.iterdir():
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink()
    return out


# ----- models -----

def model_path(name: str, work: pathlib.Path) -> str | None:
    """The model argument of LLM() for a benchmark model (None: the bundled SmolLM2)."""
    if name == "smollm2":
        return None
    from conftest import make_tiny_hf_model, make_tiny_tokenizer

    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(d)
    common = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    if name == "dense":
        make_tiny_hf_model("llama", d, seed=1, **common, **DENSE)
    else:
        make_tiny_hf_model("qwen3_moe", d, seed=2, **common, **MOE)
    return str(d)


def device_bytes(tree) -> int:
    """Bytes of tree's arrays held on device 0 (its addressable shards there)."""
    dev = jax.devices()[0]
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
        elif hasattr(x, "nbytes"):
            total += int(x.nbytes)
    return total


class Case:
    """One engine of a model over one layout, warmed up (its programs compiled), timing its
    fused decode calls."""

    def __init__(self, model: str | None, layout: dict, kernels: bool = True):
        from weld.engine.llm import LLM

        os.environ["WELD_CPU_KERNELS"] = "1" if kernels else "0"  # read while tracing: compiled in the warm-up

        extra = {"quantization": "none"} if not layout else {}
        self.llm = LLM(model, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, steps_per_call=STEPS,
                       enable_prefix_caching=False, progress=False, **extra, **layout)
        runner = self.llm.engine.runner
        self.calls: list[tuple[int, float, int]] = []  # (rows, seconds, most new tokens a row got)
        execute = runner.execute

        def timed(plan, *args, **kwargs):
            start = time.perf_counter()
            result = execute(plan, *args, **kwargs)  # synchronous: it copies the new tokens to the host
            if plan.kind == "decode":
                self.calls.append((len(plan.entries), time.perf_counter() - start,
                                   int((result.token_ids >= 0).sum(1).max())))
            return result

        runner.execute = timed
        rng = np.random.default_rng(0)
        vocab = self.llm.cfg.vocab_size
        self.prompts = {b: [{"prompt_token_ids": rng.integers(3, vocab, PROMPT_LEN).tolist()} for _ in range(b)]
                        for b in (1, 8)}
        self.steps: dict[int, list[float]] = {1: [], 8: []}
        mesh = runner.mesh
        self.info: dict = {"mesh": None if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes)),
                           "weights_bytes_device0": device_bytes(runner.weights),
                           "cache_bytes_device0": device_bytes(runner.cache)}
        for b in (1, 8):  # warm-up: compiles this batch's prefill and decode programs
            start = time.perf_counter()
            self.generate(b)
            self.info[f"compile_s_batch_{b}"] = time.perf_counter() - start
        os.environ["WELD_CPU_KERNELS"] = "1"
        for b, program in zip((1, 8), decode_programs()):
            self.info[f"program_batch_{b}"] = program
        if mesh is not None:  # what benchmarks/sharding_layouts.py's rules predict per decode step
            import sharding_layouts

            predicted = sharding_layouts.figures(self.llm.model.family, self.llm.cfg, mesh)["collectives"]
            self.info["predicted_per_step"] = {b: predicted[f"batch_{b}"]["count"] for b in (1, 8)}
        self.steps = {1: [], 8: []}

    def generate(self, batch: int) -> None:
        from weld.engine.sampling_params import SamplingParams

        self.calls.clear()
        self.llm.generate(self.prompts[batch], SamplingParams(max_tokens=1 + STEPS * CALLS, temperature=0,
                                                              ignore_eos=True))
        self.steps[batch] += [sec / n for rows, sec, n in self.calls if n == STEPS and rows == batch]

    def result(self) -> dict:
        out = dict(self.info)
        for b, steps in self.steps.items():
            out[f"batch_{b}"] = {"step_ms": 1e3 * float(np.median(steps)), "steps_ms": [1e3 * s for s in steps],
                                 "tok_s": b / float(np.median(steps)), **out.pop(f"program_batch_{b}")}
        return out


def run_model(name: str, path: str | None, layouts: list[str], runs: int) -> dict:
    """Every layout's engine built and warmed up, then `runs` rounds that time each layout once in
    turn at each batch size (the machine's drift then falls on all of them alike)."""
    from weld.utils.errors import InvalidInputError

    cases, out = {}, {}
    for layout in layouts:
        decode_programs()  # drop what earlier programs dumped
        try:
            cases[layout] = Case(path, LAYOUTS[layout], kernels="XLA only" not in layout)
        except InvalidInputError as err:
            os.environ["WELD_CPU_KERNELS"] = "1"
            out[layout] = {"refused": str(err)}
            print(f"{name:8s} {layout:22s} refused: {err}", flush=True)
            continue
        info = cases[layout].info
        print(f"{name:8s} {layout:22s} compiled ({info['compile_s_batch_1'] + info['compile_s_batch_8']:.0f} s)",
              flush=True)
    for _ in range(runs):
        for batch in (1, 8):
            for case in cases.values():
                case.generate(batch)
    for layout in layouts:
        if layout in cases:
            out[layout] = cases[layout].result()
            print(f"{name:8s} {layout:22s} B=1 {out[layout]['batch_1']['step_ms']:7.1f} ms  B=8 "
                  f"{out[layout]['batch_8']['step_ms']:7.1f} ms  weights/dev0 "
                  f"{out[layout]['weights_bytes_device0'] / 2**20:6.0f} MiB", flush=True)
    del cases
    gc.collect()
    return out


def machine() -> dict:
    flags, model = [], ""
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags") and not flags:
            wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
            flags = [f for f in line.split() if f in wanted]
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    return {"platform": platform.platform(), "cpu": model, "cpus": os.cpu_count(), "cpu_flags": flags,
            "jax": jax.__version__, "devices": len(jax.devices()), "load_average": os.getloadavg()}


def summary(ops: list[dict]) -> str:
    """'depth: count op shape, ...' of a program's collectives, per depth."""
    parts = []
    for depth in sorted({o["depth"] for o in ops}):
        items = [f"{o['count']}x {o['op']} {o['shape']}" for o in ops if o["depth"] == depth]
        parts.append(f"d{depth}: " + ", ".join(items))
    return "; ".join(parts) or "none"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Sharded decode on 8 virtual CPU devices ({result['date'][:10]})", "",
             f"`benchmarks/sharding.py`, one run: {m['cpu']}, {m['cpus']} cores ({', '.join(m['cpu_flags'])}), "
             f"JAX {m['jax']}, {m['devices']} virtual devices, load average at start {m['load_average'][0]:.2f}. "
             f"Decode step = median of every full {STEPS}-step fused decode call over {result['runs']} generations "
             f"of {CALLS} calls, prompts of {PROMPT_LEN} tokens; f32 weights and cache.", "",
             "The 8 devices share the machine's cores and run their shards one after another: this measures what a "
             "layout costs (collectives, re-layouts, the native one-device kernels turned off), not a speed-up.", "",
             "`x 1 dev` divides by one device with its native CPU kernels (packed f32 matmuls, paged attention), "
             "`x XLA` by one device running the same XLA code a mesh runs (kernels off): the cost of the layout "
             "itself.", "",
             "| model | layout | mesh | weights on dev 0 | cache on dev 0 | step ms B=1 | x 1 dev | x XLA "
             "| step ms B=8 | x 1 dev | x XLA |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, cases in result["models"].items():
        bases = [cases.get("1 device", {}), cases.get("1 device (XLA only)", {})]
        for name, c in cases.items():
            if "refused" in c:
                lines.append(f"| {model} | {name} | - | refused: {c['refused']} ||||||||")
                continue
            mesh = " x ".join(f"{k}{v}" for k, v in (c["mesh"] or {}).items()) or "-"
            cells = []
            for b in (1, 8):
                ms = c[f"batch_{b}"]["step_ms"]
                cells.append(f"{ms:.1f}")
                for base in bases:
                    cells.append(f"{ms / base[f'batch_{b}']['step_ms']:.2f}" if f"batch_{b}" in base else "-")
            lines.append(f"| {model} | {name} | {mesh} | {c['weights_bytes_device0'] / 2**20:.0f} MiB "
                         f"| {c['cache_bytes_device0'] / 2**20:.0f} MiB | " + " | ".join(cells) + " |")
    lines += ["", "## Collectives in the compiled decode programs", "",
              "By while-loop depth: d0 once per call (before the step loop), d1 once per decode step, d2 inside a "
              "loop of the step (attention's page tiles, the experts' tiles: once per tile).", "",
              "`predicted` is the count per decode step that `benchmarks/sharding_layouts.py`'s rules give for "
              "the same model and mesh.", "",
              "| model | layout | predicted per step (B=1 / B=8) | batch 1 | batch 8 |", "|---|---|---:|---|---|"]
    for model, cases in result["models"].items():
        for name, c in cases.items():
            if "refused" in c or not c["mesh"]:
                continue
            predicted = c.get("predicted_per_step", {})
            lines.append(f"| {model} | {name} | {predicted.get(1, '?')} / {predicted.get(8, '?')} "
                         f"| {summary(c['batch_1']['collectives'])} "
                         f"| {summary(c['batch_8']['collectives'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--models", default="smollm2,dense,moe")
    p.add_argument("--layouts", default=None, help="comma-separated layout names to run (default: each model's plan)")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--date", default=str(datetime.date.today()))
    args = p.parse_args()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "runs": args.runs,
              "steps_per_call": STEPS, "prompt_len": PROMPT_LEN, "shapes": {"dense": DENSE, "moe": MOE}, "models": {}}
    work = pathlib.Path(tempfile.mkdtemp(prefix="weld-sharding-models-"))
    start = time.perf_counter()
    try:
        for name in args.models.split(","):
            path = model_path(name, work)
            layouts = [x for x in PLAN[name] if args.layouts is None or x in args.layouts.split(",")]
            result["models"][name] = run_model(name, path, layouts, args.runs)
            print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(DUMP, ignore_errors=True)
    result["machine"]["load_average_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - start
    out = pathlib.Path(args.out_dir)
    stem = out / f"sharding_{args.date}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print("wrote", stem.with_suffix(".md"), "and .json", f"({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
