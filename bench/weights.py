"""`make bench`, weights section: the quantized path against the float path on the same file.

* quality, in process: greedy output of ``weights=auto`` (the GGUF's 4-bit blocks) against
  ``weights=float`` (the same file dequantized) for 64 tokens of 5 fixed prompts, and where
  they part, the float model's margin between its top two tokens there (the why); and top-1
  agreement over 512 teacher-forced tokens (the float model's own greedy continuation);
* speed and memory, two stations side by side (one per mode, rounds interleaved): single-
  stream decode tok/s through the socket, and each station's RSS after its first request.

    python -m bench.weights [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import trio

from bench.common import Pairs, Report, make_prompt_ids, start_station, station_decode, stop_station
from gnosis_daemon.client import open_station_client

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a binary search does, step by step.",
    "Give me three tips for learning a new language.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
)
ESSAY = "Write a detailed essay about the history of the city of Paris."


def weights_figures(report: Report, settings, rounds: int, decode_tokens: int, tmp: Path) -> None:
    quality_figures(report, settings)
    station_figures(report, settings, rounds, decode_tokens, tmp)


def quantized_mode(settings) -> str:
    """``auto`` keeps a GGUF file's blocks; a float checkpoint has none, so it is quantized."""
    model = settings.model
    return "auto" if model is None or str(model).endswith(".gguf") else "int4"


def quality_figures(report: Report, settings) -> None:
    from station.model.loader import load_model

    dense = load_model(replace(settings, weights="float"))
    quant = load_model(replace(settings, weights=quantized_mode(settings)))
    if quant.weights.count("int4") + quant.weights.count("int8") == 0:
        report.add("quantized / float greedy agreement", 0.0, "info", None,
                   f"nothing was quantized ({quant.weights.summary()}): no quality figures")
        return
    tok = dense.tokenizer
    prompts = [_chat_ids(tok, text) for text in PROMPTS]
    float_answers = [_greedy(dense.model, ids, 64) for ids in prompts]
    answers = [_greedy(quant.model, ids, 64) for ids in prompts]
    same, partings = _partings(dense.model, prompts, float_answers, answers)
    notes = [f"prompt {i + 1} parts at token {at + 1}: float {tok.decode([float_answers[i][at]])!r}, "
             f"quantized {tok.decode([answers[i][at]])!r}, where the float model's top two "
             f"logits differ by {margin:.3f}" for i, at, margin in partings]
    # Reported, with where and why each prompt parts: the int4 kernels compute in bfloat16,
    # so a token whose top two logits are closer than that rounding can go either way.
    report.add("greedy prompts whose 64 tokens are the same, quantized / float (5 prompts)", same / 5,
               "info", None, f"{same} of 5 the same for 64 tokens" + ("; " + "; ".join(notes) if notes else "")
               + f"; weights {quant.weights.mode}: {quant.weights.summary()['int4_layers']} int4 layers "
               f"({', '.join(sorted(set(quant.weights.source.values())))})")
    ids = _chat_ids(tok, ESSAY)
    text = _greedy(dense.model, ids, 512)
    full = torch.tensor([ids + text])
    with torch.inference_mode():
        want = dense.model(full).logits[0, len(ids) - 1:-1].argmax(-1)
        got = quant.model(full).logits[0, len(ids) - 1:-1].argmax(-1)
    agree = float((want == got).float().mean())
    report.add("top-1 agreement over 512 teacher-forced tokens, quantized / float", agree, ">=", 0.99,
               f"{int((want == got).sum())} of {len(text)} positions; the text is the float model's "
               f"own greedy answer to {ESSAY!r}")
    if quant.weights.step is not None:
        step_figures(report, quant, dense, ids, text, want, prompts, float_answers)


def step_figures(report: Report, quant, dense, ids: list[int], text: list[int], want: torch.Tensor,
                 prompts: list[list[int]], float_answers: list[list[int]]) -> None:
    """The C decode step (``cpu_step``), which decodes in the station where it is used: its
    top-1 agreement with the float model with every position through the step, and the
    engine's greedy output (prompts and decodes through the step) against the float model's
    (``float_answers``, to ``prompts``)."""
    tokens = ids + text
    pool = quant.weights.step.pool(quant.model, -(-len(tokens) // 16))
    step = quant.weights.step.bind(pool, max_positions=len(tokens))
    head = quant.weights.head or quant.model.get_output_embeddings()
    table = list(range(pool.num_blocks))
    with torch.inference_mode():
        hidden = torch.cat([step([t], [p], [p], [table]) for p, t in enumerate(tokens[:-1])])
        got = head(hidden[len(ids) - 1:]).argmax(-1)
    step.close()
    agree = float((want == got).float().mean())
    report.add("top-1 agreement over 512 teacher-forced tokens, C decode step / float", agree, ">=", 0.99,
               f"{int((want == got).sum())} of {len(text)} positions, every position through the step "
               f"(the station runs its prompts and decodes through it)")
    same, partings = _partings(dense.model, prompts, float_answers, _engine_greedy(quant, prompts, 64))
    notes = [f"prompt {i + 1} parts at token {at + 1} (float top-two margin {margin:.3f})"
             for i, at, margin in partings]
    report.add("greedy prompts whose 64 tokens are the same, station (C decode step) / float (5 prompts)",
               same / 5, "info", None, f"{same} of 5 the same" + ("; " + "; ".join(notes) if notes else ""))


def _partings(dense, prompts: list[list[int]], float_answers: list[list[int]],
              answers: list[list[int]]) -> tuple[int, list[tuple[int, int, float]]]:
    """(answers equal to the float model's, and per other prompt (index, first token that
    differs, the float model's margin between its top two tokens there))."""
    same, partings = 0, []
    for i, (ids, want, got) in enumerate(zip(prompts, float_answers, answers)):
        if want == got:
            same += 1
            continue
        at = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
        partings.append((i, at, _margin(dense, ids + want[:at])))
    return same, partings


def _engine_greedy(loaded, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The station's own greedy answers (its engine, in process), ``n`` tokens each."""
    import threading

    from gnosis_daemon.settings import Settings
    from station.core.requests import Failed, Finished, GenerationRequest, SamplingParams, Token
    from station.engine.loop import PagedEngine

    with tempfile.TemporaryDirectory() as run:
        engine = PagedEngine(loaded, Settings(runtime_dir=run), num_blocks=256)
        engine.start()
        try:
            answers = []
            for i, prompt in enumerate(prompts):
                tokens: list[int] = []
                done = threading.Event()

                def sink(event, tokens=tokens, done=done):
                    if isinstance(event, Token):
                        tokens.append(event.token_id)
                    elif isinstance(event, (Finished, Failed)):
                        done.set()

                engine.add_request(GenerationRequest(f"q{i}", prompt, SamplingParams(
                    max_tokens=n, min_tokens=n, temperature=0.0)), sink)
                done.wait(600)
                answers.append(tokens)
        finally:
            engine.shutdown()
    return answers


def station_figures(report: Report, settings, rounds: int, decode_tokens: int, tmp: Path) -> None:
    procs = {}
    try:
        for mode in ("auto", "float"):  # "auto": the quantized side (int4 for a float checkpoint)
            run = tmp / f"weights-{mode}"
            weights = quantized_mode(settings) if mode == "auto" else mode
            procs[mode] = (start_station(replace(settings, weights=weights), run, tmp / f"station-{mode}.log"),
                           run / "station.sock")
        decode, rss = trio.run(_decode_rounds, {m: s for m, (_, s) in procs.items()},
                               {m: p.pid for m, (p, _) in procs.items()}, rounds, decode_tokens)
    finally:
        for proc, _ in procs.values():
            stop_station(proc)
    report.add("station single-stream decode, quantized weights / float", decode.ratio, ">=", 1.0,
               f"{quantized_mode(settings)} {decode.median(0):.1f} tok/s, float {decode.median(1):.1f} "
               f"tok/s; {decode.spread()}")
    report.add("station RSS after one request, quantized weights / float", rss["auto"] / rss["float"],
               "<=", 1.0, f"{quantized_mode(settings)} {rss['auto'] / 2**20:.0f} MiB, float "
               f"{rss['float'] / 2**20:.0f} MiB (VmRSS of the station process)")


async def _decode_rounds(sockets: dict, pids: dict, rounds: int, decode_tokens: int):
    decode, rss = Pairs(), {}
    async with open_station_client(sockets["auto"]) as auto, open_station_client(sockets["float"]) as dense:
        vocab = auto.hello["model"]["vocab_size"]
        short = make_prompt_ids(vocab, 32, seed=2)
        for mode, conn in (("auto", auto), ("float", dense)):
            await station_decode(conn, [short], 8)  # the first request (and warm-up)
            rss[mode] = _rss(pids[mode])
        for r in range(rounds):
            order = [auto, dense] if r % 2 == 0 else [dense, auto]
            tps = {id(conn): await station_decode(conn, [short], decode_tokens) for conn in order}
            decode.add(tps[id(auto)], tps[id(dense)])
    return decode, rss


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _chat_ids(tok, text: str) -> list[int]:
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                     add_generation_prompt=True)
    return tok.encode(prompt, add_special_tokens=False)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(ids):].tolist()


def _margin(model, ids: list[int]) -> float:
    with torch.inference_mode():
        top = model(torch.tensor([ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def main(argv: list[str] | None = None) -> int:
    from gnosis_daemon.settings import load_settings

    parser = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    settings = load_settings(cli={"model": args.model})
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gnosis-bench-weights-") as tmp:
        weights_figures(report, settings, args.rounds, args.decode_tokens, Path(tmp))
    report.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
