"""Sampled ids -> text, logprobs and finish reasons, per request (vLLM's OutputProcessor).

After each call the processor appends every row's new tokens to its sequence, detokenizes them
incrementally, records logprobs, and ends a sequence where it must: where the device says its
last token was a stop (EOS or a stop id, `programs.stop_hit`), at a stop string (checked here,
on the host; text past it is dropped), when its grammar is complete, or at its token limit. It
only records the reason (`Sequence.stop`); the scheduler frees the pages afterwards.
A streaming call hands over its outputs so far from inside the loop (`process_partial`): they are
taken the same way then, and the call's end takes only what came after.
Structured outputs: each constrained sequence has a grammar matcher that writes its row of the
token bitmask before a call and accepts each token after.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from weld.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from weld.engine.programs import NONFINITE
from weld.engine.runner import StepResult
from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import ScheduledSeq, SchedulerOutput
from weld.engine.sequence import Sequence
from weld.engine.structured import GrammarMatcher, StructuredOutputError
from weld.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("weld.engine")
# The stop_reason of a completion ended because its logits were not finite (finish_reason "error").
NONFINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request"


@dataclasses.dataclass
class Completion:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    stop_checked_upto: int = 0  # text offset before which no stop string can still start
    matcher: GrammarMatcher | None = None  # structured outputs; dropped when the sequence finishes


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stream: bool = False  # its outputs go out as each token is sampled (else after each call)

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def completion(self, seq: Sequence) -> Completion:
        return self.completions[seq.index]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self._owner: dict[int, Request] = {}  # seq_id -> its request

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for c in request.completions:
            self._owner[c.seq.seq_id] = request

    def owner(self, seq: Sequence) -> Request:
        return self._owner[seq.seq_id]

    def process(self, plan: SchedulerOutput, result: StepResult, with_prompt_logprobs: bool,
                taken: dict[int, int] | None = None) -> tuple[list[int], list[Request]]:
        """Appends the call's tokens (past those `process_partial` took with the same `taken`);
        returns how many each entry took in the call and the requests touched."""
        taken = {} if taken is None else taken
        appended, touched = [], {}
        for i, entry in enumerate(plan.entries):
            request = self.owner(entry.seq)
            touched[request.request_id] = request
            if (with_prompt_logprobs and i < plan.num_prefill and request.prompt_logprobs is not None
                    and entry.seq.index == 0):
                self._record_prompt_logprobs(request, entry, result, i)
            appended.append(self._take_tokens(request, entry, result, i, taken))
        return appended, list(touched.values())

    def process_partial(self, plan: SchedulerOutput, result: StepResult, taken: dict[int, int]) -> list[Request]:
        """Appends what a call in flight has produced so far for its streaming requests (rows
        filled as far as its loop got), counting in `taken` (seq_id -> tokens taken from this
        call); returns the requests that changed."""
        touched = {}
        for i, entry in enumerate(plan.entries):
            request, seq = self.owner(entry.seq), entry.seq
            if not request.stream or seq.stopping:
                continue
            before = taken.get(seq.seq_id, 0)
            if self._take_tokens(request, entry, result, i, taken) > before or seq.stopping:
                touched[request.request_id] = request
        return list(touched.values())

    def _take_tokens(self, request: Request, entry: ScheduledSeq, result: StepResult, i: int,
                     taken: dict[int, int]) -> int:
        """Appends row i's tokens past the ones already taken from this call; returns how many
        the call has given the sequence in all."""
        seq = entry.seq
        if not entry.sample:
            return 0
        if seq.params.max_tokens == 0:  # ran only for its prompt logprobs
            seq.stop("length")
            return 0
        emitted = int(np.sum(result.token_ids[i] >= 0))
        count = taken.get(seq.seq_id, 0)
        for k in range(count, emitted):
            if seq.stopping:
                break
            self._append_token(request, seq, result, i, k, device_stop=bool(result.stopped[i]) and k == emitted - 1)
            count += 1
        taken[seq.seq_id] = count
        if not seq.stopping and np.any(result.token_ids[i] == NONFINITE):
            logger.error("request %s: the model's logits held NaN or inf; ending it with an error", request.request_id)
            self._finish(request.completion(seq), "error", NONFINITE_LOGITS)
        if seq.stopping:
            request.completion(seq).matcher = None
        return count

    def _record_prompt_logprobs(self, request: Request, entry: ScheduledSeq, result: StepResult, i: int):
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
        decode = lambda t: self.tokenizer.decode([int(t)], skip_special_tokens=False)  # noqa: E731
        entry: PositionLogprobs = {int(token): Logprob(float(lp), int(rank), decode(token))}
        for r, (tid, tlp) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1):
            if int(tid) not in entry:
                entry[int(tid)] = Logprob(float(tlp), r, decode(tid))
        return entry

    def _append_token(self, request: Request, seq: Sequence, result: StepResult, i: int, k: int,
                      device_stop: bool) -> None:
        params = seq.params
        token = int(result.token_ids[i, k])
        seq.output_token_ids.append(token)
        completion = request.completion(seq)
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
                self._finish(completion, "abort", "structured output error")
                return
        if device_stop:  # EOS or a stop id, once min_tokens were out (the device's rule)
            self._finish(completion, "stop", token if token in params.stop_token_ids else None)
            return
        if params.stop and seq.num_output_tokens > params.min_tokens and self._check_stop_strings(completion):
            return
        if completion.matcher is not None and completion.matcher.is_terminated():
            self._finish(completion, "stop")  # the grammar is complete: nothing but EOS could follow
            return
        if seq.num_tokens >= seq.token_limit(self.max_model_len):
            self._finish(completion, "length")

    def _finish(self, completion: Completion, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends the sequence, taking any text the detokenizer held back (an incomplete character)."""
        completion.text += completion.detok.flush()
        completion.seq.stop(reason, stop_reason)

    def _check_stop_strings(self, completion: Completion) -> bool:
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
        completion.seq.stop("stop", stop)
        return True

    # ----- outputs -----

    def snapshot(self, request: Request) -> RequestOutput:
        outs = [CompletionOutput(
            index=c.seq.index, text=c.text, token_ids=list(c.seq.output_token_ids),
            cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.seq.finish_reason, stop_reason=c.seq.stop_reason)
            for c in request.completions]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
                             outs, finished=request.finished,
                             num_cached_tokens=request.completions[0].seq.num_cached_tokens or 0)

    def pop_if_finished(self, request: Request) -> RequestOutput | None:
        if not request.finished:
            return None
        self.requests.pop(request.request_id, None)
        for c in request.completions:
            self._owner.pop(c.seq.seq_id, None)
            c.matcher = None
        return self.snapshot(request)

    def outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The current output of each request; finished ones are returned for the last time."""
        return [self.pop_if_finished(r) if r.finished else self.snapshot(r) for r in requests]

    def collect_finished(self) -> list[RequestOutput]:
        """Requests that finished outside a step (max_tokens 0, aborted), returned once."""
        return [self.pop_if_finished(r) for r in list(self.requests.values()) if r.finished]
