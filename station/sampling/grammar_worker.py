"""The grammar compile worker: a child process that compiles grammar specs with xgrammar
and says only whether each compiled (and how long it took), so that a compile past the
``grammar_compile_timeout_s`` bound can be ended by killing the process.

xgrammar releases the GIL while it compiles, so a compile on a thread does not stall the
station's other threads; but a thread cannot be stopped, and a compile's time grows
superlinearly with the grammar (about quadratically in a json_schema's property count).
So every grammar not already cached is first compiled here,
under the bound; only one that compiled in time is compiled again in the station (on a
thread of its own, never a tokenizer thread), which then takes about as long as it took
here. The compiled grammar itself is not sent back: xgrammar's serialized form is tens of
times larger, and slower to make and read than compiling again.

Protocol, one JSON document a line: the station writes ``{"tokenizer_info": <xgrammar
TokenizerInfo.serialize_json()>}`` first, the worker answers ``{"ready": true}``; then for
each ``{"spec": <checked grammar spec>}`` it answers ``{"ok": true, "s": seconds}`` or
``{"ok": false, "error": message}``. Torch-free: it imports only xgrammar.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def compile_spec(compiler: Any, spec: dict[str, Any]) -> Any:
    """A checked spec (``gnosis_daemon.grammar_spec``) -> xgrammar ``CompiledGrammar``."""
    kind = spec["type"]
    if kind == "json_object":
        return compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                            strict_mode=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                            strict_mode=True)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(json.dumps(spec["structural_tag"]))
    if kind == "regex":
        return compiler.compile_regex(spec["regex"])
    return compiler.compile_grammar(spec["ebnf"])


def message(exc: BaseException) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text[:500]


def _die_with_parent() -> None:
    """SIGKILL this worker when the station dies (Linux ``PR_SET_PDEATHSIG``): an orphan
    would go on compiling; elsewhere stdin's end stops it after the compile."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    import xgrammar

    stdin, stdout = sys.stdin.buffer, sys.stdout
    first = stdin.readline()
    if not first:
        return
    info = xgrammar.TokenizerInfo.deserialize_json(json.loads(first)["tokenizer_info"])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    stdout.write('{"ready": true}\n')
    stdout.flush()
    for line in stdin:
        started = time.perf_counter()
        try:
            compile_spec(compiler, json.loads(line)["spec"])
            reply: dict[str, Any] = {"ok": True, "s": round(time.perf_counter() - started, 4)}
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its C++ message
            reply = {"ok": False, "error": message(exc)}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


if __name__ == "__main__":
    main()
