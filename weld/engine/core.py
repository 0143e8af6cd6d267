"""EngineCore: requests in, outputs out. `step()` = schedule, run, postprocess.

It owns the scheduler (pure Python), the model runner (the device) and the tokenizer, and
turns sampled ids into text, logprobs and finish reasons. Stop strings are checked here, on
the host, after each step; text past a stop string is dropped. Structured outputs: each
constrained sequence has a grammar matcher that writes its row of the token bitmask before a
call and accepts each token after; when its grammar is complete, the sequence stops ("stop").
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import numpy as np

from weld.engine.block_manager import BlockManager
from weld.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from weld.engine.runner import ModelRunner, StepResult
from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import Scheduler, ScheduledSeq
from weld.engine.sequence import Sequence
from weld.engine.structured import GrammarCompiler, GrammarMatcher, StructuredOutputError, bitmask_width
from weld.tokenizer import IncrementalDetokenizer, Tokenizer
from weld.utils.errors import InvalidInputError

logger = logging.getLogger("weld.engine")


@dataclasses.dataclass
class _Completion:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    stop_checked_upto: int = 0  # text offset before which no stop string can still start
    matcher: GrammarMatcher | None = None  # structured outputs; dropped when the sequence finishes


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class EngineCore:
    """proposer: speculative decoding's host-side proposer (`.propose(token_ids) -> drafts`, e.g.
    n-gram lookup), or None: then, when the scheduler speculates (num_spec_tokens > 0), the
    runner's device drafter (a draft model or the DSpark drafter) drafts."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, scheduler: Scheduler, *,
                 max_model_len: int, eos_token_ids: tuple[int, ...], proposer: Any = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = runner.cfg.vocab_size
        self.requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, _Request] = {}
        self.grammars = GrammarCompiler(tokenizer, tuple(eos_token_ids))
        self.proposer = proposer
        k = scheduler.num_spec_tokens
        self.spec_steps = 0  # row-steps that verified at least one draft
        self.spec_drafted_per_position = [0] * k  # drafts sent in slot j
        self.spec_accepted_per_position = [0] * k  # of which accepted

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    # ----- requests -----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
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
        if need > self.block_manager.num_pages:
            raise InvalidInputError(
                f"this request may need {need} KV pages but the cache has {self.block_manager.num_pages}; "
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
            completions.append(_Completion(seq, detok, logprobs=[] if params.logprobs is not None else None,
                                           matcher=matchers[index]))
        request = _Request(request_id, prompt, ids, params, completions,
                           prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.requests[request_id] = request
        for c in completions:
            self._seq_owner[c.seq.seq_id] = request
            if params.max_tokens == 0 and params.prompt_logprobs is None:
                self.scheduler.finish(c.seq, "length")
                c.matcher = None
            else:
                self.scheduler.add(c.seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is and frees its pages."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for c in request.completions:
            if not c.seq.is_finished:
                self.scheduler.finish(c.seq, "abort")
            c.matcher = None
        return self._pop_if_finished(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Runs one model call; returns the current output of every request it touched."""
        outputs = [self._pop_if_finished(r) for r in list(self.requests.values()) if r.finished]
        plan = self.scheduler.schedule()
        if plan is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler is stuck: {self.stats()} waiting={list(self.scheduler.waiting)}")
            return [o for o in outputs if o is not None]
        owners = [self._seq_owner[e.seq.seq_id] for e in plan.entries]
        want_lp = any(r.params.logprobs is not None for r in owners)
        want_prompt_lp = any(
            r.prompt_logprobs is not None and e.seq.index == 0 and e.seq.num_output_tokens == 0
            for r, e in zip(owners[:plan.num_prefill], plan.entries[:plan.num_prefill]))
        drafts, num_drafts = self._propose(plan, owners) if plan.kind == "verify" else (None, None)
        result = self.runner.execute(plan, want_logprobs=want_lp, want_prompt_logprobs=want_prompt_lp,
                                     token_bitmask=self._token_bitmask(plan, owners), drafts=drafts,
                                     num_drafts=num_drafts)
        if result.num_drafts is not None:
            self._count_acceptance(result)
        touched: dict[str, _Request] = {}
        for i, (entry, request) in enumerate(zip(plan.entries, owners)):
            touched[request.request_id] = request
            if (want_prompt_lp and i < plan.num_prefill and request.prompt_logprobs is not None
                    and entry.seq.index == 0):
                self._record_prompt_logprobs(request, entry, result, i)
            entry.seq.num_computed_tokens = entry.start + entry.num_tokens
            if entry.sample and entry.seq.params.max_tokens == 0:
                self.scheduler.finish(entry.seq, "length")  # ran only for its prompt logprobs
            elif entry.sample:
                for k in range(result.token_ids.shape[1]):
                    if result.token_ids[i, k] < 0 or entry.seq.is_finished:
                        break
                    if k:  # each token sampled after the first was fed back, so its KV is written
                        entry.seq.num_computed_tokens += 1
                    self._append_token(request, entry.seq, result, i, k)
            if not entry.seq.is_finished:
                if plan.kind == "verify":  # give back the slots of rejected drafts
                    self.block_manager.trim(entry.seq, entry.seq.num_tokens)
                self.block_manager.cache_full_pages(entry.seq)
            else:
                request.completions[entry.seq.index].matcher = None
        for request in touched.values():
            out = self._pop_if_finished(request) if request.finished else self._snapshot(request)
            outputs.append(out)
        return [o for o in outputs if o is not None]

    def _propose(self, plan, owners: list[_Request]) -> tuple[np.ndarray, np.ndarray]:
        """Drafts [n, k] (padded with -1) and how many each entry sends. Sequences with penalties
        or a grammar send none (their next logits depend on each accepted token): they take a
        plain decode step inside the verification."""
        k = self.scheduler.num_spec_tokens
        drafts = np.full((len(plan.entries), k), -1, np.int32)
        num_drafts = np.zeros(len(plan.entries), np.int32)
        for i, (entry, request) in enumerate(zip(plan.entries, owners)):
            seq = entry.seq
            if seq.params.penalized or request.completions[seq.index].matcher is not None:
                continue
            if self.proposer is None:  # the device drafter drafts (and may send fewer)
                num_drafts[i] = k
                continue
            proposal = self.proposer.propose(seq.token_ids())[:k]
            drafts[i, :len(proposal)] = proposal
            num_drafts[i] = len(proposal)
        return drafts, num_drafts

    def _count_acceptance(self, result: StepResult) -> None:
        for sent, accepted in zip(result.num_drafts.reshape(-1), result.num_accepted.reshape(-1)):
            if sent <= 0:
                continue
            self.spec_steps += 1
            for j in range(int(sent)):
                self.spec_drafted_per_position[j] += 1
                self.spec_accepted_per_position[j] += bool(j < accepted)

    def _token_bitmask(self, plan, owners: list[_Request]) -> np.ndarray | None:
        """int32 [entries, ceil(vocab / 32)]: each constrained entry's allowed next tokens, all
        bits set elsewhere; None when no entry that samples this step is constrained."""
        constrained = [(i, request.completions[e.seq.index].matcher)
                       for i, (e, request) in enumerate(zip(plan.entries, owners))
                       if e.sample and request.completions[e.seq.index].matcher is not None]
        if not constrained:
            return None
        bitmask = np.full((len(plan.entries), bitmask_width(self.vocab_size)), -1, np.int32)
        for i, matcher in constrained:
            matcher.fill_bitmask(bitmask[i])
        return bitmask

    def _record_prompt_logprobs(self, request: _Request, entry: ScheduledSeq, result: StepResult, i: int):
        num_prompt = len(request.prompt_token_ids)
        k = request.params.prompt_logprobs
        for j in range(entry.num_tokens):
            target_pos = entry.start + j + 1
            if target_pos >= num_prompt or target_pos < len(request.prompt_logprobs):
                continue
            token = request.prompt_token_ids[target_pos]
            request.prompt_logprobs.append(self._position_logprobs(
                token, result.prompt_logprobs[i, j], result.prompt_ranks[i, j],
                result.prompt_top_ids[i, j], result.prompt_top_logprobs[i, j], k))

    def _position_logprobs(self, token: int, lp: float, rank: int, top_ids, top_lps, k: int) -> PositionLogprobs:
        entry: PositionLogprobs = {int(token): Logprob(float(lp), int(rank), self.tokenizer.decode([int(token)], skip_special_tokens=False))}
        for r, (tid, tlp) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1):
            if int(tid) not in entry:
                entry[int(tid)] = Logprob(float(tlp), r, self.tokenizer.decode([int(tid)], skip_special_tokens=False))
        return entry

    def _append_token(self, request: _Request, seq: Sequence, result: StepResult, i: int, k: int) -> None:
        params = seq.params
        token = int(result.token_ids[i, k])
        seq.output_token_ids.append(token)
        completion = request.completions[seq.index]
        if result.logprobs is not None:
            completion.cumulative_logprob += float(result.logprobs[i, k])
            if completion.logprobs is not None:
                completion.logprobs.append(self._position_logprobs(
                    token, result.logprobs[i, k], result.ranks[i, k], result.top_ids[i, k],
                    result.top_logprobs[i, k], params.logprobs))
        completion.text += completion.detok.add([token])
        if completion.matcher is not None:
            try:
                completion.matcher.accept(token)
            except StructuredOutputError:  # a bug, but one request's: end it, keep serving the rest
                logger.exception("request %s: structured output broken, aborting it", request.request_id)
                self._finish_text(completion)
                self.scheduler.finish(seq, "abort", "structured output error")
                return
        n_out = seq.num_output_tokens
        if n_out > params.min_tokens:  # min_tokens came before this token (the sampler banned stops until then)
            if not params.ignore_eos and token in self.eos_token_ids:
                self._finish_text(completion)
                self.scheduler.finish(seq, "stop", None)
                return
            if token in params.stop_token_ids:
                self._finish_text(completion)
                self.scheduler.finish(seq, "stop", token)
                return
            if params.stop and self._check_stop_strings(completion):
                return
        if completion.matcher is not None and completion.matcher.is_terminated():
            self._finish_text(completion)  # the grammar is complete: nothing but EOS could follow
            self.scheduler.finish(seq, "stop", None)
            return
        if (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish_text(completion)
            self.scheduler.finish(seq, "length")

    def _finish_text(self, completion: _Completion) -> None:
        """Takes any text the detokenizer held back (an incomplete character) at the end."""
        completion.text += completion.detok.flush()

    def _check_stop_strings(self, completion: _Completion) -> bool:
        params = completion.seq.params
        text = completion.text
        start = completion.stop_checked_upto
        hits = [(text.find(s, start), s) for s in params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        longest = max(len(s) for s in params.stop)
        completion.stop_checked_upto = max(0, len(text) - longest + 1)
        if not hits:
            return False
        pos, stop = min(hits)
        completion.text = text[:pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
        self.scheduler.finish(completion.seq, "stop", stop)
        return True

    # ----- outputs -----

    def _snapshot(self, request: _Request) -> RequestOutput:
        outs = [CompletionOutput(
            index=c.seq.index, text=c.text, token_ids=list(c.seq.output_token_ids),
            cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.seq.finish_reason, stop_reason=c.seq.stop_reason)
            for c in request.completions]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
                             outs, finished=request.finished)

    def _pop_if_finished(self, request: _Request) -> RequestOutput | None:
        if not request.finished:
            return None
        self.requests.pop(request.request_id, None)
        for c in request.completions:
            self._seq_owner.pop(c.seq.seq_id, None)
        return self._snapshot(request)

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {"num_pages": bm.num_pages, "num_free_pages": bm.num_free_pages,
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
                "spec_mean_acceptance_length": 1 + accepted / self.spec_steps if self.spec_steps else None}
