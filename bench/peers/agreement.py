"""Greedy agreement with transformers' ``generate`` on the second model's file (the rows of
``bench.peers.second_model``): the prompts, the reference model, each side's greedy tokens
and where they part from ``generate``'s, and how near a tie the parting was."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.common import start_station, stop_station
from bench.liquid import start_host
from bench.peers.http_side import _verified_count

SHORT_PROMPTS = (
    "The history of the city of Paris begins more than two thousand years ago, when a Celtic "
    "tribe settled on an island in the",
    "Here is a simple Python function that returns the n-th Fibonacci number:\n\ndef fibonacci(n):",
)
SUBJECTS = ("the keeper", "the harbor master", "a fisherman", "the old captain", "a young sailor",
            "the ferry pilot", "the baker's daughter", "the schoolteacher")
VERBS = ("watched", "repaired", "painted", "counted", "carried", "described", "found", "moved")
OBJECTS = ("the lantern", "the copper signal", "the north bridge", "a cedar boat", "the winter nets",
           "the stone pier", "the marble steps", "a silver candle")
ENDINGS = ("before the storm reached the island", "while the tide was turning",
           "as the bells rang in the town", "after the last ferry had left", "under a violet sky",
           "in the quiet hour before dawn", "when the wind came from the north",
           "while the children slept")


def long_text(seed: int, tokenizer, tokens: int) -> str:
    """Plain sentences (numbered days, so what comes next depends on what came long
    before) until the text is ``tokens`` tokens long, ending mid-sentence."""
    rng = random.Random(seed)
    parts: list[str] = []
    day = 1
    while True:
        parts.append(f"On day {day}, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                     f"{rng.choice(OBJECTS)} {rng.choice(ENDINGS)}.")
        day += rng.choice((1, 1, 2))
        text = " ".join(parts) + f" On day {day},"
        if len(tokenizer(text).input_ids) >= tokens:
            return text


def agreement_prompts(tokenizer, long_tokens: int) -> list[tuple[str, list[int]]]:
    """(label, token ids with the tokenizer's BOS) for two short and two long prompts."""
    texts = [(f"short {i + 1}", text) for i, text in enumerate(SHORT_PROMPTS)]
    texts += [(f"long {i + 1}", long_text(100 + i, tokenizer, long_tokens)) for i in range(2)]
    return [(label, tokenizer(text).input_ids) for label, text in texts]


def matched_prefix(want: list, got: list) -> int:
    """How many leading items are equal (the tokens up to the first divergence)."""
    n = 0
    for a, b in zip(want, got):
        if a != b:
            break
        n += 1
    return n


@dataclass
class Parting:
    label: str
    prompt_tokens: int
    matched: int  # tokens equal to generate's before the first that differs
    total: int
    margin: float | None = None  # generate's top-two logit margin where they part
    want: str | None = None  # generate's token there, and the side's
    got: str | None = None


@dataclass
class Agreement:
    side: str
    prompts: list[Parting]
    notes: list[str] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return sum(p.matched for p in self.prompts)

    @property
    def total(self) -> int:
        return sum(p.total for p in self.prompts)

    @property
    def fraction(self) -> float:
        return self.matched / self.total if self.total else 0.0

    @property
    def full(self) -> int:
        return sum(p.matched == p.total for p in self.prompts)

    def name(self, tokens: int) -> str:
        return (f"greedy tokens equal to generate's up to the first divergence, {self.side} "
                f"({len(self.prompts)} prompts x {tokens})")

    def detail(self) -> str:
        parts = []
        for p in self.prompts:
            if p.matched == p.total:
                continue
            where = f"{p.label} ({p.prompt_tokens} prompt tokens) parts at token {p.matched + 1}"
            if p.want is not None:
                where += f": generate {p.want!r}, {self.side} {p.got!r}"
            if p.margin is not None:
                where += f", where generate's top two logits differ by {p.margin:.3f}"
            parts.append(where)
        return "; ".join([f"{self.matched} of {self.total} tokens; {self.full} of "
                          f"{len(self.prompts)} prompts the same throughout "
                          f"({', '.join(f'{p.label} {p.prompt_tokens}' for p in self.prompts)} "
                          "prompt tokens)"] + parts + self.notes)


class Reference:
    """transformers' own model of the GGUF file (float32) and its tokenizer."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        started = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - started
        self._texts: Any = None  # station.serving.token_text.TokenTexts, made at first use

    def greedy(self, ids: list[int], n: int, suppress: list[int]) -> list[int]:
        torch = self.torch
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, suppress_tokens=suppress)
        return out[0, len(ids):].tolist()

    def margin(self, ids: list[int]) -> float:
        torch = self.torch
        with torch.inference_mode():
            top = self.model(torch.tensor([ids])).logits[0, -1].topk(2).values
        return float(top[0] - top[1])

    def texts(self):
        """The station's text of a token (``TokenTexts``: what /v1/completions' logprobs call
        ``tokens``) on this tokenizer."""
        if self._texts is None:
            from station.serving.token_text import TokenTexts

            self._texts = TokenTexts(self.tokenizer)
        return self._texts

    def shared_texts(self) -> set[str]:
        """Texts that more than one token id has (where comparing by text is not exact)."""
        texts = self.texts()
        counts = Counter(texts.of(i)[0] for i in range(len(self.tokenizer)))
        return {text for text, n in counts.items() if n > 1}


def daemon_greedy(port: int, ids: list[int], n: int, suppress: list[int]) -> tuple[list[str], int]:
    """The daemon's greedy continuation of a token-id prompt through /v1/completions: (its
    tokens' texts, from ``logprobs``; the prompt tokens its prefix cache served)."""
    body = {"prompt": list(ids), "max_tokens": n, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "logit_bias": {str(t): -100 for t in suppress}}
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=900)
    resp.raise_for_status()
    answer = resp.json()
    choice = answer["choices"][0]
    _verified_count("daemon", answer.get("usage"), choice.get("finish_reason"), n)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(choice["logprobs"]["tokens"]), int(details.get("cached_tokens") or 0)


def compare(side: str, prompts, answers: list[list[int]], got: list[list], reference: Reference,
            as_text: bool) -> Agreement:
    """``got[i]`` (ids, or the station's token texts when ``as_text``) against ``answers[i]``
    (generate's ids to ``prompts[i]``)."""
    texts = reference.texts()
    partings = []
    for (label, ids), want, have in zip(prompts, answers, got):
        want_cmp = [texts.of(t)[0] for t in want] if as_text else want
        at = matched_prefix(want_cmp, have)
        parting = Parting(label, len(ids), at, len(want))
        if at < len(want):
            parting.margin = reference.margin(ids + want[:at])
            parting.want = texts.of(want[at])[0]
            parting.got = have[at] if as_text else (texts.of(have[at])[0] if at < len(have) else None)
        partings.append(parting)
    return Agreement(side, partings)


def greedy_through(port: int, prompts, n: int, suppress: list[int]):
    """The daemon's answers to ``prompts``, and for each long prompt its answer again (a
    prefix hit): (answers, [(label, cached tokens, the same tokens)])."""
    answers, again = [], []
    for label, ids in prompts:
        tokens, _ = daemon_greedy(port, ids, n, suppress)
        answers.append(tokens)
        if label.startswith("long"):
            second, cached = daemon_greedy(port, ids, n, suppress)
            again.append((label, cached, second == tokens))
    return answers, again


def float_greedy(settings, tmp: Path, prompts, n: int, suppress: list[int]):
    """The daemon with ``weights=float`` (the file dequantized) on the same prompts."""
    run = tmp / "gemma-float-run"
    station = start_station(replace(settings, weights="float"), run, tmp / "gemma-float-station.log")
    procs = [station]
    try:
        from bench.common import free_port

        port = free_port()
        procs.append(start_host(replace(settings, weights="float"), run, port,
                                tmp / "gemma-float-host.log", liquid=True))
        return greedy_through(port, prompts, n, suppress)
    finally:
        for proc in reversed(procs):
            stop_station(proc)


def hit_note(hits: list[tuple[str, int, bool]], prompts: list[Parting]) -> str:
    sizes = {p.label: p.prompt_tokens for p in prompts}
    return "again on a prefix hit: " + ", ".join(
        f"{label} cached {cached} of {sizes.get(label)}, "
        + ("the same tokens" if same else "OTHER TOKENS")
        for label, cached, same in hits)
