"""Finding (or installing) the peer, and the peer section of docs/benchmarks.md.

The peer is llama-cpp-python's server extra, an optional dependency (``pip install -e
'.[peer]'``; it compiles llama.cpp, about ten minutes on two cores). The bench never imports
it: a child process does (``llama_worker``), so a broken build shows as a skip reason, not a
crash. When the peer cannot run, the reason is printed and written where the rows would be.

The section sits between two markers, so ``python -m bench --only peer`` can rewrite it in
place and leave the rest of docs/benchmarks.md (the other rows) as the last full run wrote it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.common import Report, table_lines

PEER_REQUIREMENT = "llama-cpp-python[server]"  # the `peer` extra in pyproject.toml
BEGIN = "<!-- peer section: begin (written by `make bench` or `python -m bench --peer-only`) -->"
END = "<!-- peer section: end -->"

METHOD = """\
The daemon beside [llama.cpp](https://github.com/ggml-org/llama.cpp) (through
llama-cpp-python, the `peer` extra) in the same run, on the same GGUF file. Both sides get
the same text prompts through the same OpenAI `/v1/completions` client, greedy
(temperature 0), and decode exactly the same number of tokens: the daemon is sent
`ignore_eos`, llama.cpp a `logit_bias` of -100 on every end-of-generation token, and every
completion's count is checked from its response (`usage`, else `finish_reason: "length"`);
a count that differs voids the run. llama.cpp runs in child processes of its own with
`n_threads` = the CPU count, paused (SIGSTOP) whenever it is not the side being measured, so
it takes no CPU from the daemon's rounds. Its server runs with llama.cpp's fused attention
(`flash_attn=True`, its CLI's `-fa`), which evaluates a 2,000-token prompt about 9% faster
here. Its single-stream figure is the better of two measurements, both listed: that server,
and the library generating on its own main thread (`create_completion(stream=True)` in a
child process, without flash attention; on a small machine the server, whose OpenMP threads
are driven from a worker thread, is slower and less steady). Its TTFT figures are the
better of two servers, both listed: that one, and one without flash attention, which is
5-6% faster on one token at a 2,000-token context (a prefix hit's last token); the plots'
llama.cpp lines are the server's with flash attention. Rounds
interleave the sides (alternating which goes first); a row is the median of the per-round
ratios daemon / llama.cpp, every round listed. Single-stream decode rate: tokens after the
first over the time from the first streamed chunk to the finish. Aggregate rate at N
streams: every completion token over the time from the first send to the last finish
(llama-cpp-python's server serves one completion at a time; the daemon batches them).
TTFT: send to first streamed chunk of a one-token completion, first of a prompt neither side
has seen (miss), then of the same prompt again (prefix hit: the daemon's liquid memory,
llama.cpp's reuse of the prompt it evaluated last). Every request of both sides goes through
one keep-alive `httpx.Client` (`bench.common.http_client`): a new client per request loads
the CA store, about 33 ms on this machine, three times a hit's whole time."""


def llama_cpp_missing() -> str | None:
    """Why the peer cannot be imported, or None. Checked in a child process, so the bench
    process never loads llama.cpp (nor dies of a build that cannot run on this CPU)."""
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp, llama_cpp.server.app, uvicorn; "
                           "print(llama_cpp.__version__)"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
    return f"llama-cpp-python[server] is not importable ({last})"


def llama_cpp_version() -> str:
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True, timeout=300)
    return proc.stdout.strip() or "unknown"


def install_peer() -> str | None:
    """pip-installs the peer extra's requirement into this interpreter; None, or why not."""
    env = dict(os.environ)
    env.setdefault("CMAKE_ARGS", "-DGGML_NATIVE=ON")
    print(f"peer: installing {PEER_REQUIREMENT} (compiles llama.cpp from source: about ten "
          f"minutes on two cores; CMAKE_ARGS={env['CMAKE_ARGS']!r}) ...", flush=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                               PEER_REQUIREMENT], env=env, capture_output=True, text=True,
                              timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"installing {PEER_REQUIREMENT} failed ({exc})"
    if proc.returncode != 0:
        tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        return f"installing {PEER_REQUIREMENT} failed (pip exit {proc.returncode}: {tail})"
    return None


def skip_reason(mode: str, model_path: Path | None) -> str | None:
    """None when the peer can run; else why its rows are skipped. ``mode``: ``off``,
    ``auto`` (run it when importable) or ``install`` (install it when it is not)."""
    if mode == "off":
        return "the peer is off (--peer off; `make bench PEER=0`)"
    if model_path is None or model_path.suffix != ".gguf" or not model_path.is_file():
        return f"llama.cpp reads a GGUF file and the model is {model_path} (not one)"
    missing = llama_cpp_missing()
    if missing is None:
        return None
    if mode != "install":
        return f"{missing}; `make bench` installs it, or `pip install -e '.[peer]'`"
    failed = install_peer()
    if failed:
        return f"{missing}, and {failed}"
    missing = llama_cpp_missing()
    return f"installed, yet {missing}" if missing else None


def render(report: Report, *, skipped: str | None, facts: list[str], images: list[tuple[str, str]],
           notes: list[str]) -> str:
    lines = [BEGIN, "", "## Beside llama.cpp", "", METHOD, ""]
    if skipped:
        lines += [f"**Peer rows skipped:** {skipped}.", ""]
    else:
        lines += [f"- {fact}" for fact in facts] + [""]
        lines += table_lines(report.rows) + [""]
    for title, rel in images:
        lines += [f"![{title}]({rel})", ""]
    lines += [f"{note}" for note in notes] + ([""] if notes else [])
    lines.append(END)
    return "\n".join(lines) + "\n"


def splice(path: Path, section: str, begin: str = BEGIN, end: str = END,
           after: str | None = None) -> None:
    """Put ``section`` in ``path`` in place of the one between ``begin`` and ``end`` (the
    peer section's markers unless told); where there is none yet, right after the marker
    ``after`` when the file has it, else at the end."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + (("\n" + tail) if tail else "")
    elif after and after in text:
        head, tail = text.split(after, 1)
        text = head + after + "\n\n" + section + (("\n" + tail.lstrip("\n")) if tail.strip() else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
