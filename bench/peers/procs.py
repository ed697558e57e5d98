"""The peer's child processes, seen from the bench: started, paused between their rounds
(SIGSTOP, so an idle peer takes no CPU from the daemon's rounds: no OpenMP spin, no poll),
resumed for them, stopped at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.common import REPO
from bench.peers.http_side import Completion, CountMismatch, peer_endpoint


class PeerProc:
    def __init__(self, mode: str, model: Path, threads: int, log_path: Path, port: int = 0,
                 flash_attn: bool = False) -> None:
        self.mode = mode
        self.flash_attn = flash_attn
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "bench.peers.llama_worker", mode, "--model", str(model),
               "--threads", str(threads)] + (["--port", str(port)] if port else []) \
            + (["--flash-attn"] if flash_attn else [])
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.hello = self._read(timeout=600)
        if not self.hello.get("ready"):
            raise SystemExit(f"peer {mode} did not start: {self.hello}")
        self.eog: list[int] = self.hello["eog"]
        self.paused = False

    def _read(self, timeout: float) -> dict:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            self.stop()
            raise SystemExit(f"peer {self.mode} gave no answer in {timeout:.0f} s (exit "
                             f"{self.proc.poll()}); see {self.log_path}:\n"
                             + self.log_path.read_text(errors="replace")[-2000:])
        return json.loads(box[0])

    def pause(self) -> None:
        if not self.paused and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False
            time.sleep(0.05)  # let it be scheduled again before it is timed

    def stop(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class InprocPeer(PeerProc):
    """llama.cpp generating on its child's main thread; ``complete`` as an Endpoint's."""

    name = "llama.cpp in-process"

    def __init__(self, model: Path, threads: int, log_path: Path) -> None:
        super().__init__("inproc", model, threads, log_path)

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        start = time.perf_counter()
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout=900)
        if answer["tokens"] != max_tokens:
            raise CountMismatch(f"{self.name}: decoded {answer['tokens']} tokens, asked for "
                                f"{max_tokens}")
        first = start + answer["ttft_s"]
        return Completion(start, first, first + answer["decode_s"], answer["tokens"],
                          answer["prompt_tokens"])

    def greedy_ids(self, prompt_ids: list[int], max_tokens: int, suppress: list[int]) -> list[int]:
        """llama.cpp's greedy continuation of a token-id prompt (``suppress`` never chosen)."""
        self.proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens,
                                          "suppress": list(suppress)}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout=900)["token_ids"]


class ServerPeer(PeerProc):
    """llama-cpp-python's OpenAI server; ``endpoint`` is what its requests go through."""

    def __init__(self, model: Path, threads: int, log_path: Path, port: int,
                 flash_attn: bool = False) -> None:
        super().__init__("server", model, threads, log_path, port, flash_attn)
        deadline = time.monotonic() + 120
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                break
            except (httpx.HTTPError, ValueError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"llama.cpp server did not answer on port {port}; see "
                                     f"{log_path}") from None
                time.sleep(0.2)
        self.endpoint = peer_endpoint(port, self.eog)
        self.endpoint.model = models["data"][0]["id"]


@contextmanager
def measuring(peers: list[PeerProc], active: PeerProc | None):
    """Every peer paused but ``active`` (None: the daemon's turn) for the block."""
    for peer in peers:
        if peer is not active:
            peer.pause()
    if active is not None:
        active.resume()
    try:
        yield
    finally:
        if active is not None:
            active.pause()
