"""Host drafts of a known continuation, for tests of speculative verification: the engine's
`proposer` drafts for every row when the runner's device drafter is set aside
(`monkeypatch.setattr(llm.engine.runner, "drafter", None)`)."""

from __future__ import annotations


class ReferenceProposer:
    """Drafts the reference continuation of each prompt, its third draft wrong: verification keeps
    two drafts and the bonus token, and the state must be recomputed over those three."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], vocab: int):
        self.references = [(prompt, prompt + out) for prompt, out in zip(prompts, outputs)]
        self.vocab = vocab

    def propose(self, token_ids: list[int]) -> list[int]:
        for prompt, full in self.references:
            if list(token_ids[:len(prompt)]) == prompt:
                drafts = full[len(token_ids):len(token_ids) + 3]
                if len(drafts) == 3:
                    drafts[2] = (drafts[2] + 1) % self.vocab
                return drafts
        return []
