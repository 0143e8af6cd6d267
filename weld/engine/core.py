"""EngineCore: requests in, outputs out. `step()` = schedule, run, postprocess.

It owns the scheduler (pure Python: which sequences run, page bookkeeping), the model runner
(the device) and the output processor (ids -> text, logprobs, finish reasons). It checks each
request when it arrives, drafts on the host for grammar-constrained sequences under speculative
decoding (every other row drafts on the device) and counts acceptance. A request added with
stream=True has its outputs handed to `on_stream` as its tokens are sampled, while the device
call runs (every `stream_interval` tokens: the runner's), besides `step()`'s return at its end.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import numpy as np

from weld.engine.block_manager import BlockManager
from weld.engine.output_processor import Completion, OutputProcessor, Request
from weld.engine.outputs import RequestOutput
from weld.engine.runner import ModelRunner, StepResult
from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import Scheduler, SchedulerOutput
from weld.engine.sequence import Sequence
from weld.engine.spec.policy import WidthPolicy
from weld.engine.structured import GrammarCompiler, bitmask_width
from weld.tokenizer import IncrementalDetokenizer, Tokenizer
from weld.utils.errors import InvalidInputError


class EngineCore:
    """proposer: speculative decoding's host-side proposer (`.propose(token_ids) -> drafts`,
    n-gram lookup) for the rows the device drafter cannot draft for: grammar-constrained ones,
    whose masks along the drafts only the host can compute. Without a device drafter (the
    runner's), it drafts for every row."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, scheduler: Scheduler, *,
                 max_model_len: int, eos_token_ids: tuple[int, ...], proposer: Any = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.vocab_size = runner.cfg.vocab_size
        self.outputs = OutputProcessor(tokenizer, max_model_len)
        self.grammars = GrammarCompiler(tokenizer, tuple(eos_token_ids))
        self.proposer = proposer
        # Called with the outputs of streaming requests a call in flight has advanced (on another
        # thread, while step() waits for that call); None: not streamed.
        self.on_stream: Callable[[list[RequestOutput]], None] | None = None
        # how many drafts per round each speculative call verifies, from the throughput measured
        self.width_policy = WidthPolicy(runner.spec_widths or (scheduler.num_spec_tokens,))
        k = scheduler.num_spec_tokens
        self.spec_steps = 0  # row-steps that verified at least one draft
        self.spec_drafted_per_position = [0] * k  # drafts sent in slot j
        self.spec_accepted_per_position = [0] * k  # of which accepted

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def requests(self) -> dict[str, Request]:
        return self.outputs.requests

    # ----- requests -----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, stream: bool = False) -> None:
        if request_id in self.requests:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidInputError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        bad_bias = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad_bias:
            raise InvalidInputError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(
                f"the prompt has {len(ids)} tokens, but the model's context (max_model_len) is "
                f"{self.max_model_len}: it must leave room for at least one new token")
        need = self.block_manager.pages_for(self.max_model_len if params.max_tokens is None
                                            else min(self.max_model_len, len(ids) + params.max_tokens))
        have = self.block_manager.full_context_pages  # a window's pool is sized for its window, never the context
        if have is not None and need > have:
            raise InvalidInputError(
                f"this request may need {need} KV pages but the cache has {have}; "
                f"lower max_tokens or give the KV cache more memory")
        spec = params.structured_outputs
        matchers = [self.grammars.matcher(spec) if spec is not None else None for _ in range(params.n)]
        base_seed = params.seed if params.seed is not None else random.getrandbits(63)
        completions = []
        for index in range(params.n):
            seed = base_seed if index == 0 else hash((base_seed, index)) & ((1 << 63) - 1)
            seq = Sequence(request_id, ids, params, index=index, seed=seed)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                           skip_special_tokens=params.skip_special_tokens)
            completions.append(Completion(seq, detok, logprobs=[] if params.logprobs is not None else None,
                                          matcher=matchers[index]))
        self.outputs.add(Request(request_id, prompt, ids, params, completions,
                                 prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                                 stream=stream))
        for c in completions:
            if params.max_tokens == 0 and params.prompt_logprobs is None:
                self.scheduler.finish(c.seq, "length")
                c.matcher = None
            else:
                self.scheduler.add(c.seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is and frees its pages and state slots."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for c in request.completions:
            if not c.seq.is_finished:
                self.scheduler.finish(c.seq, "abort")
            c.matcher = None
        return self.outputs.pop_if_finished(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Runs one model call; returns the current output of every request it touched."""
        finished = self.outputs.collect_finished()
        if self.scheduler.num_spec_tokens:
            self.scheduler.spec_width = self.width_policy.choose(len(self.scheduler.running))
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler is stuck: {self.stats()} waiting={list(self.scheduler.waiting)}")
            return finished
        compiles, start = self.runner.num_compiles, time.perf_counter()
        taken: dict[int, int] = {}  # seq_id -> tokens taken from this call while it ran (streamed)
        result, with_prompt_logprobs = self._run(plan, taken)
        seconds = time.perf_counter() - start
        outputs = self._postprocess(plan, result, with_prompt_logprobs, taken)
        if plan.kind in ("decode", "verify") and self.runner.num_compiles == compiles:  # a compile is no measure
            self.width_policy.record(len(plan.entries), plan.spec_width, int(np.sum(result.token_ids >= 0)), seconds)
        return finished + outputs

    def _run(self, plan: SchedulerOutput, taken: dict[int, int]) -> tuple[StepResult, bool]:
        """The device call of a plan, with what its requests ask for (logprobs, grammar masks,
        host drafts, tokens streamed while it runs)."""
        owners = [self.outputs.owner(e.seq) for e in plan.entries]
        want_lp = any(r.params.logprobs is not None for r in owners)
        want_prompt_lp = any(
            r.prompt_logprobs is not None and e.seq.index == 0 and e.seq.num_output_tokens == 0
            for r, e in zip(owners[:plan.num_prefill], plan.entries[:plan.num_prefill]))
        if plan.kind == "verify":
            drafts, num_drafts, host_drafted, bitmask = self._propose(plan, owners)
        else:
            drafts = num_drafts = host_drafted = None
            bitmask = self._token_bitmask(plan, owners)
        on_tokens = None
        if self.on_stream is not None and plan.kind in ("decode", "verify") and any(r.stream for r in owners):
            on_tokens = lambda partial: self._stream(plan, partial, taken)  # noqa: E731
        result = self.runner.execute(plan, want_logprobs=want_lp, want_prompt_logprobs=want_prompt_lp,
                                     token_bitmask=bitmask, drafts=drafts, num_drafts=num_drafts,
                                     host_drafted=host_drafted, on_tokens=on_tokens)
        return result, want_prompt_lp

    def _stream(self, plan: SchedulerOutput, partial: StepResult, taken: dict[int, int]) -> None:
        """A call in flight handed over its outputs so far: take them, and send on the outputs
        of the streaming requests they advanced."""
        touched = self.outputs.process_partial(plan, partial, taken)
        if touched and self.on_stream is not None:
            self.on_stream([self.outputs.snapshot(r) for r in touched])

    def _postprocess(self, plan: SchedulerOutput, result: StepResult, with_prompt_logprobs: bool,
                     taken: dict[int, int]) -> list[RequestOutput]:
        if result.num_drafts is not None:
            self._count_acceptance(result)
        appended, touched = self.outputs.process(plan, result, with_prompt_logprobs, taken)
        self.scheduler.update_from_output(plan, appended)
        return self.outputs.outputs(touched)

    def _propose(self, plan: SchedulerOutput, owners: list[Request]):
        """A verification's host side: (drafts [n, k] padded with -1, how many each entry may send
        [n], which entries send the host's drafts [n], per-slot grammar masks [n, k + 1, words]
        or None). Sequences with penalties send none (their next logits depend on each accepted
        token): they take a plain decode step in each round. The device drafter drafts for the
        rest, except grammar-constrained sequences: the host drafts for them (n-gram lookup), as
        far as the grammar accepts the drafts, with the mask of every drafted position; they
        verify one round per call."""
        k = plan.spec_width  # this call's drafts per round (adaptive: at most num_spec_tokens)
        n = len(plan.entries)
        drafts = np.full((n, k), -1, np.int32)
        num_drafts = np.zeros(n, np.int32)
        host_drafted = np.zeros(n, bool)
        bitmask = None
        eos = set(self.grammars.eos_token_ids)
        for i, (entry, request) in enumerate(zip(plan.entries, owners)):
            seq = entry.seq
            matcher = request.completion(seq).matcher
            on_host = matcher is not None or self.runner.drafter is None
            if not on_host:
                num_drafts[i] = 0 if seq.params.penalized else k
                continue
            host_drafted[i] = True
            proposal = [] if seq.params.penalized else self.proposer.propose(seq.token_ids())[:k]
            proposal = proposal[:next((j for j, t in enumerate(proposal) if t in eos), len(proposal))]
            if matcher is not None:  # drafts as far as the grammar takes them, and each slot's mask
                if bitmask is None:
                    bitmask = np.full((n, k + 1, bitmask_width(self.vocab_size)), -1, np.int32)
                proposal = proposal[:matcher.draft_bitmasks(proposal, bitmask[i])]
            drafts[i, :len(proposal)] = proposal
            num_drafts[i] = len(proposal)
        return drafts, num_drafts, host_drafted, bitmask

    def _count_acceptance(self, result: StepResult) -> None:
        for sent, accepted in zip(result.num_drafts.reshape(-1), result.num_accepted.reshape(-1)):
            if sent <= 0:
                continue
            self.spec_steps += 1
            for j in range(int(sent)):
                self.spec_drafted_per_position[j] += 1
                self.spec_accepted_per_position[j] += bool(j < accepted)

    def _token_bitmask(self, plan: SchedulerOutput, owners: list[Request]) -> np.ndarray | None:
        """int32 [entries, ceil(vocab / 32)]: each constrained entry's allowed next tokens, all
        bits set elsewhere; None when no entry that samples this step is constrained."""
        constrained = [(i, request.completion(e.seq).matcher) for i, (e, request) in enumerate(zip(plan.entries, owners))
                       if e.sample and request.completion(e.seq).matcher is not None]
        if not constrained:
            return None
        bitmask = np.full((len(plan.entries), bitmask_width(self.vocab_size)), -1, np.int32)
        for i, matcher in constrained:
            matcher.fill_bitmask(bitmask[i])
        return bitmask

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {"num_pages": bm.num_pages, "num_free_pages": bm.num_free_pages,
                "num_state_slots": bm.num_slots, "num_free_state_slots": bm.num_free_slots,
                "num_state_snapshots": bm.num_snapshots,
                "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions, "num_compiles": self.runner.num_compiles,
                "num_grammar_matchers": sum(c.matcher is not None for r in self.requests.values()
                                            for c in r.completions),
                **self.spec_stats()}

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding counters (vLLM's names): drafts sent and accepted, per position,
        and the mean acceptance length (tokens emitted per verified row-step, bonus included)."""
        if not self.scheduler.num_spec_tokens:
            return {}
        drafted, accepted = sum(self.spec_drafted_per_position), sum(self.spec_accepted_per_position)
        return {"spec_num_drafts": self.spec_steps, "spec_num_draft_tokens": drafted,
                "spec_num_accepted_tokens": accepted,
                "spec_accepted_per_position": list(self.spec_accepted_per_position),
                "spec_drafted_per_position": list(self.spec_drafted_per_position),
                "spec_mean_acceptance_length": 1 + accepted / self.spec_steps if self.spec_steps else None,
                "spec_width_rates": self.width_policy.table()}
