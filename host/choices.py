"""The choices of one completion request: ``n`` per prompt, several prompts,
and their logprobs in OpenAI's shapes.

One station ``generate`` per prompt (``n`` choices each, forked from one prefill in the
station); choice ``index = prompt_index * n + i`` (OpenAI's and vLLM's order). The station's
``tokens`` events carry ``index`` (absent: 0) and, when asked, ``logprobs`` entries
``{token_id, token, bytes, logprob, top_logprobs: [{token_id, token, bytes, logprob}]}``;
its ``prefill`` event carries ``prompt_logprobs`` (the first entry's logprob is null).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gnosis_daemon.wire import ChoiceResult, GenerateEvent, GenerateResult, LogprobEntry, PrefillEvent
from host.openai_api import CHAT


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or one chunk's share of it)."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                           "bytes": t["bytes"]} for t in e["top_logprobs"]]}
                        for e in entries], "refusal": None}


def text_logprobs(entries: list[LogprobEntry], offset: int) -> dict[str, Any]:
    """``choice.logprobs`` of a text completion: ``offset`` is where the first token's
    text starts in the choice's text (the echoed prompt counts)."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(e["token"])
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["logprob"] is None else
                             {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


@dataclass
class Choice:
    index: int
    entries: list[LogprobEntry] = field(default_factory=list)  # the completion's logprobs
    offset: int = 0  # text offset of the next token (text completions)
    tokens: int = 0

    def logprobs(self, kind: str, entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
        """The logprobs of ``entries`` (the next tokens of this choice), None when not asked."""
        if entries is None:
            return None
        if kind == CHAT:
            return chat_logprobs(entries)
        out = text_logprobs(entries, self.offset)
        self.offset += sum(len(e["token"]) for e in entries)
        return out


class PromptChoices:
    """The ``n`` choices of one prompt, and its echo (text completions)."""

    def __init__(self, prompt_index: int, n: int, echo_text: str | None = None) -> None:
        self.n = n
        self.choices = [Choice(prompt_index * n + i) for i in range(n)]
        self.echo_text = echo_text
        self.prompt_entries: list[LogprobEntry] | None = None

    def on_event(self, event: GenerateEvent) -> tuple[Choice, list[LogprobEntry] | None]:
        """A station event -> (its choice, its logprob entries or None)."""
        if isinstance(event, PrefillEvent):
            lps = event.prompt_logprobs
            self.prompt_entries = None if lps is None else list(lps)
            return self.choices[0], None
        choice = self.choices[min(event.choice, self.n - 1)]
        choice.tokens += len(event.token_ids)
        if event.logprobs is None:
            return choice, None
        entries = list(event.logprobs)
        choice.entries.extend(entries)
        return choice, entries

    def echo(self, kind: str, choice: Choice) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt of ``choice``: (text, its logprobs when asked); sets the
        choice's text offset past it."""
        text = self.echo_text or ""
        lps = None
        if self.prompt_entries is not None:
            lps = text_logprobs(self.prompt_entries, 0)
        choice.offset = len(text)
        return text, lps

    def results(self, result: GenerateResult) -> tuple[ChoiceResult, ...]:
        """Each choice's part of the station's result: text, finish_reason, tokens."""
        return result.each
