"""The peer rows' logic on cheap inputs: no llama.cpp, no model (`make test` builds neither).

What the real run adds (llama.cpp beside the daemon) is `python -m bench --peer-only`;
here: the skip path and its written reason, the bookkeeping of rounds and ratios, the count
check that voids a figure, the section splice, and that the plots are valid PNGs.
"""

from __future__ import annotations

import struct
import tomllib
from types import SimpleNamespace

import pytest

from bench.common import REPO
from bench.peers import figures, section
from bench.peers.http_side import CountMismatch, _verified_count, aggregate, text_prompt


def _args(**over):
    base = dict(peer="auto", decode_tokens=8, prompt_tokens=64, streams=2, rounds=1,
                plot_rounds=1, peer_streams="1,2", peer_prompts="16,32")
    return SimpleNamespace(**{**base, **over})


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_skip_when_llama_cpp_is_not_importable_says_why(monkeypatch, tmp_path, gguf, capsys):
    monkeypatch.setattr(section, "llama_cpp_missing",
                        lambda: "llama-cpp-python[server] is not importable (No module named x)")
    settings = SimpleNamespace(model=str(gguf))
    result = figures.peer_figures(settings, _args(), tmp_path, tmp_path / "benchmarks.md")
    assert "No module named x" in result.skipped and "make bench" in result.skipped
    assert "peer rows skipped: llama-cpp-python[server] is not importable" in capsys.readouterr().out
    text = result.markdown()
    assert f"**Peer rows skipped:** {result.skipped}." in text
    assert text.startswith(section.BEGIN) and text.rstrip().endswith(section.END)
    assert not result.report.rows


def test_skip_reasons_for_off_a_failed_install_and_a_non_gguf_model(monkeypatch, tmp_path, gguf):
    monkeypatch.setattr(section, "llama_cpp_missing", lambda: "not importable (boom)")
    monkeypatch.setattr(section, "install_peer", lambda: "installing it failed (pip exit 1: no cmake)")
    assert "--peer off" in section.skip_reason("off", gguf)
    assert section.skip_reason("install", gguf) == (
        "not importable (boom), and installing it failed (pip exit 1: no cmake)")
    assert "not one" in section.skip_reason("auto", tmp_path)  # an HF directory
    monkeypatch.setattr(section, "llama_cpp_missing", lambda: None)
    assert section.skip_reason("auto", gguf) is None


def test_the_peer_extra_is_what_the_bench_installs():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["peer"] == [section.PEER_REQUIREMENT]
    assert any(req.startswith("matplotlib") for req in extras["bench"])


def test_single_stream_takes_the_better_peer_figure_per_round():
    rounds = [{"daemon": 20.0, "llama.cpp server": 40.0, "llama.cpp in-process": 50.0},
              {"daemon": 30.0, "llama.cpp server": 60.0, "llama.cpp in-process": 20.0},
              {"daemon": 10.0, "llama.cpp server": 10.0, "llama.cpp in-process": 5.0}]
    single = figures.single_stream(rounds)
    assert single.pairs.ratios == [0.4, 0.5, 1.0]
    assert single.pairs.ratio == 0.5  # the median of the per-round ratios
    detail = single.detail(64)
    assert "server 40.0, in-process 20.0" in detail  # both peer figures, their medians
    assert "20.0/40.0/50.0 30.0/60.0/20.0 10.0/10.0/5.0" in detail  # every round's values
    assert "per round 0.400 0.500 1.000" in detail


def test_ttft_rows_take_the_faster_peer_side_per_round_miss_and_hit_apart():
    def c(ttft_s):
        return SimpleNamespace(ttft_s=ttft_s)

    rows = figures.TTFTRows()
    plain = figures.PLAIN
    # round 1: the server with flash attention has the faster miss, the one without the
    # faster hit; round 2 the other way round
    rows.add({"daemon": [c(2.0), c(1.0)], "llama.cpp server": [c(8.0), c(2.0)],
              plain: [c(10.0), c(1.25)]}, "daemon", "llama.cpp server", plain)
    rows.add({"daemon": [c(3.0), c(1.0)], "llama.cpp server": [c(12.0), c(2.0)],
              plain: [c(10.0), c(2.5)]}, "daemon", "llama.cpp server", plain)
    assert rows.miss.ratios == [0.25, 0.3]
    assert rows.hit.ratios == [0.8, 0.5]
    # each server's median miss, then hit
    assert rows.ms(0, 0) == "server 10000, server without flash attention 10000"
    assert rows.ms(1, 1) == "server 2000.0, server without flash attention 1875.0"
    assert rows.seen["daemon"][0].ttft_s == 3.0  # the last round's completions


class _FakePeer:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def pause(self):
        self.log.append(f"pause {self.name}")

    def resume(self):
        self.log.append(f"resume {self.name}")


def test_rounds_interleave_and_pause_every_peer_but_the_measured_one():
    log = []
    server, inproc = _FakePeer(log, "server"), _FakePeer(log, "inproc")
    sides = [figures.Side("daemon", None), figures.Side("server", None, server),
             figures.Side("inproc", None, inproc)]
    bench = figures.PeerBench(_args(), [server, inproc], *sides, figures.PeerResult())

    def measure(side, r):
        log.append(f"measure {side.name}")
        return r

    got = bench.interleaved(sides, 2, measure)
    assert got == [{"daemon": 0, "server": 0, "inproc": 0}, {"inproc": 1, "server": 1, "daemon": 1}]
    measured = [entry.split()[1] for entry in log if entry.startswith("measure")]
    assert measured == ["daemon", "server", "inproc", "inproc", "server", "daemon"]
    # while the daemon is measured, both peers have been paused
    first = log.index("measure daemon")
    assert {"pause server", "pause inproc"} <= set(log[:first])
    i = log.index("measure server")
    assert log[i - 1] == "resume server" and log[i + 1] == "pause server"


def test_a_completion_that_decoded_another_count_voids_the_figure():
    assert _verified_count("x", {"completion_tokens": 64}, "length", 64) == 64
    assert _verified_count("x", None, "length", 64) == 64  # stopped at max_tokens
    with pytest.raises(CountMismatch, match="decoded 12 tokens, asked for 64"):
        _verified_count("x", {"completion_tokens": 12}, "stop", 64)
    with pytest.raises(CountMismatch, match="token count unknown"):
        _verified_count("x", None, "stop", 64)


def test_aggregate_counts_every_token_over_first_send_to_last_finish():
    from bench.peers.http_side import Completion

    class Clock:
        def complete(self, prompt, max_tokens):
            import time

            start = time.perf_counter()
            time.sleep(0.05)
            return Completion(start, start + 0.01, time.perf_counter(), max_tokens)

    tps, done = aggregate(Clock(), ["a", "b", "c"], 10)
    assert len(done) == 3 and 30 / 0.2 < tps <= 30 / 0.05
    assert text_prompt(50, 1) != text_prompt(50, 2) and text_prompt(50, 1) == text_prompt(50, 1)


def test_splice_replaces_only_the_peer_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n| a | 1.000 |\n")
    section.splice(out, section.BEGIN + "\nfirst\n" + section.END + "\n")
    section.splice(out, section.BEGIN + "\nsecond\n" + section.END + "\n")
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\n| a | 1.000 |\n")
    assert "second" in text and "first" not in text and text.count(section.BEGIN) == 1


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_on_synthetic_figures_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.peers import plots

    decode = plots.plot_decode_by_concurrency(
        [1, 2, 4, 8, 16], {"daemon": [20, 38, 70, 140, 200], "llama.cpp server": [60, 61, 60, 59, 60],
                           "llama.cpp in-process": [80, None, None, None, None]},
        tmp_path / "img" / "decode.png", "synthetic")
    ttft = plots.plot_ttft_by_prompt(
        [250, 500, 1000, 2000], {"daemon miss": [500, 1000, 2000, 4000], "daemon hit": [40, 50, 70, 110],
                                 "llama.cpp server miss": [300, 600, 1300, 2700],
                                 "llama.cpp server hit": [30, 30, 31, 33]},
        tmp_path / "img" / "ttft.png", "synthetic")
    for path in (decode, ttft):
        width, height = _png_size(path)
        assert width >= 600 and height >= 400 and path.stat().st_size > 10_000
    table = figures.plot_table([1, 2], {"daemon": [20.0, 38.0], "peer": [60.0, None]},
                               [250], {"daemon miss": [500.0]})
    assert "| 2 | 38.0 | - |" in table and "| ~250 | 500.0 |" in table


class _Scripted:
    """A side whose completions take the times it is told: ``miss_s`` to the first chunk of
    a prompt it has not seen, ``hit_s`` of one it has, one token a ``token_s`` after that;
    its prompt tokens: the prompt's words."""

    def __init__(self, miss_s, hit_s, token_s=0.01):
        self.miss_s, self.hit_s, self.token_s, self.seen = miss_s, hit_s, token_s, set()

    def complete(self, prompt, max_tokens):
        from bench.peers.http_side import Completion

        first = self.hit_s if prompt in self.seen else self.miss_s
        self.seen.add(prompt)
        return Completion(0.0, first, first + self.token_s * (max_tokens - 1), max_tokens,
                          len(prompt.split()))


def _bench(args, daemon, server, inproc, plain=None):
    sides = [figures.Side("daemon", daemon), figures.Side("llama.cpp server", server),
             figures.Side("llama.cpp in-process", inproc)]
    return figures.PeerBench(args, [], *sides, figures.PeerResult(),
                             None if plain is None else figures.Side(figures.PLAIN, plain))


def test_the_ttft_rows_have_goals_for_the_default_model_only():
    daemon, server = _Scripted(miss_s=1.0, hit_s=0.05), _Scripted(miss_s=5.0, hit_s=0.04)
    # the server without flash attention has the faster miss here; the in-process child's
    # TTFT (no HTTP: not a served request) is never the peer's figure
    plain, inproc = _Scripted(miss_s=4.0, hit_s=0.08), _Scripted(0.5, 0.001)
    bench = _bench(_args(), daemon, server, inproc, plain)
    bench.rows()
    rows = {row.name: row for row in bench.result.report.rows}
    miss = rows["long-prompt TTFT (miss), daemon / llama.cpp server (the faster of with and "
                "without flash attention; ~64 tokens)"]
    hit = rows["prefix-hit TTFT (the same prompt again), daemon / llama.cpp server (the faster "
               "of with and without flash attention)"]
    assert (miss.value, miss.op, miss.bar, miss.met) == (0.25, "<=", 0.25, True)
    assert (hit.value, hit.op, hit.bar, hit.met) == (1.25, "<=", 1.0, False)
    other = _bench(_args(), _Scripted(1.0, 0.05), _Scripted(5.0, 0.04), _Scripted(9.0, 9.0))
    other.rows(goals=False)  # a model the issues set no bars for: every row reported only
    assert {row.op for row in other.result.report.rows} == {"info"}


def test_the_plots_keep_llama_cpps_prefill_rate_for_the_prefill_plot(tmp_path):
    pytest.importorskip("matplotlib")
    server = _Scripted(miss_s=2.0, hit_s=0.04)
    bench = _bench(_args(peer_prompts="100,400"), _Scripted(1.0, 0.05), server, _Scripted(1.0, 1.0))
    bench.plots(tmp_path / "img")
    # its prompt tokens (the words of a prompt sized in tokens) over its miss TTFT
    from bench.peers.http_side import text_prompt_tokens

    words = [len(text_prompt_tokens(n, seed=0).split()) for n in (100, 400)]
    assert bench.result.prefill_lengths == [100, 400]
    assert bench.result.prefill == {"llama.cpp server (miss)": [words[0] / 2.0, words[1] / 2.0]}
    # 97 and 387 words asked for (tokens / TOKENS_PER_WORD): the head "Note 0:" and the rest
    assert words == [96, 386]
