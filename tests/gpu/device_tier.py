"""The KV disk tier on a GPU (a device check, not a pytest test; run by
tests/gpu/device_check.sh on a GPU host).

    python3 tests/gpu/device_tier.py [--allow-cpu] [--device auto] [--sessions 30]

The tier's write-behind thread copies pool blocks to the CPU
(``kv_tensor[:, :, block].to("cpu")``) and its loader thread copies them back
(``kv_tensor[:, :, block].copy_(data)``): on CUDA both cross devices from threads that are
not the engine's. On the tiny llama model, with a pool of 24 blocks of 4 tokens (at most 4
of the saved sessions fit) and the tier in a temp state dir, each pass (float32, then
bfloat16):

1. saves N sessions (distinct 23-token prompts: 5 full blocks each), waiting after each
   until the write-behind made it durable, and snapshots its 5 pool blocks (CPU copy);
2. asks each prompt again with ``match_session``: a session hit (most of them from disk),
   the KV the loader put back byte-identical to the snapshot, the same greedy tokens as the
   first answer; each disk hit is asked once more (now a pool hit, the same KV and the
   same computation): the same tokens again;
3. restarts (shutdown, a new engine, ``open_tier`` on the same state dir): the tier finds
   the N sessions without loading them; a few come back from disk, exact as above;
4. flips a byte in one block file of a session not yet asked after the restart, then
   restarts again: that prompt is a miss with ``session_error`` "quarantined" and the
   first answer's tokens; the file is in quarantine/ (reason "checksum").

Exactness: the KV bytes are compared exactly in both dtypes (what the tier must keep).
Token identity with the first answer is exact in float32; in bfloat16 a hit prefills 3
tokens on 20 cached ones where the first answer prefilled 23, another kernel shape, so a
differing token there is a WARN when the KV bytes and the pool-hit replay agree, and a
FAIL otherwise.

Every check prints a PASS/FAIL line; the last line is a summary. Exit status 1 on any FAIL
(0 without CUDA unless --allow-cpu: nothing is checked then). Every wait has a timeout.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import torch  # noqa: E402

BS = 4
NUM_BLOCKS = 24  # 96 tokens of KV: at most 4 of the 5-block sessions stay in the pool
PROMPT_LEN = 23  # 5 full blocks saved per session
SESSION_TOKENS = 20
NEW_TOKENS = 4
REQUEST_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 60.0


class Report:
    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []
        self.warned: list[str] = []
        self.hung = False  # a wait timed out: a thread may still run, exit hard

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        line = f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else "")
        print(line, flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)
        return ok

    def warn(self, name: str, detail: str) -> None:
        print(f"WARN {name}: {detail}", flush=True)
        self.warned.append(name)

    def info(self, line: str) -> None:
        print(f"     {line}", flush=True)


R = Report()


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


class Collector:
    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        from station.core.requests import Failed, Finished

        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    def wait(self, what: str) -> Collector:
        if not self.done.wait(REQUEST_TIMEOUT_S):
            R.hung = True
            raise TimeoutError(f"{what}: no end within {REQUEST_TIMEOUT_S:.0f} s")
        from station.core.requests import Failed

        failed = [e for e in self.events if isinstance(e, Failed)]
        if failed:
            raise RuntimeError(f"{what}: request failed: {failed[0]!r}")
        return self

    @property
    def tokens(self) -> list[int]:
        from station.core.requests import Token

        return [e.token_id for e in self.events if isinstance(e, Token)]

    def prefill(self):
        from station.core.requests import Prefill

        found = [e for e in self.events if isinstance(e, Prefill)]
        if len(found) != 1:
            raise RuntimeError(f"{len(found)} Prefill events: {self.events!r}")
        return found[0]


def call_with_timeout(fn, timeout: float, what: str) -> None:
    box: dict = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            box["exc"] = exc

    thread = threading.Thread(target=run, name=f"timeout-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        R.hung = True
        raise TimeoutError(f"{what}: not done within {timeout:.0f} s")
    if "exc" in box:
        raise box["exc"]


class TierEngine:
    """A ``PagedEngine`` with the disk tier, opened as the station opens it."""

    def __init__(self, loaded, settings, num_blocks: int | None = NUM_BLOCKS) -> None:
        """``num_blocks``: the pool's size (None: the settings' budget, as a station sizes it)."""
        from station.engine.loop import PagedEngine
        from station.tier.start import open_tier

        self.engine = PagedEngine(loaded, settings, num_blocks=num_blocks)
        self.report = open_tier(self.engine, settings)
        self.n = 0
        self.expected_writes = 0
        self.engine.start()

    def generate(self, prompt: list[int], n: int = NEW_TOKENS, **kwargs) -> Collector:
        from station.core.requests import GenerationRequest, SamplingParams, Sessions

        self.n += 1
        collector = Collector()
        self.engine.add_request(GenerationRequest(
            f"r{self.n}", list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
            Sessions(tenant="alice", **kwargs)), collector)
        return collector.wait(f"request r{self.n}")

    def settle(self) -> None:
        """Until the ``expected_writes``-th session write is answered, and nothing queued."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats["write_behind_queued"] == 0 and not self.engine.kv.to_write and \
                    self.engine.tier.figures.writes >= self.expected_writes:
                return
            if self.engine.tier.figures.write_errors:
                raise RuntimeError(f"write-behind errors: {self.engine.tier.stats()}")
            time.sleep(0.01)
        R.hung = True
        raise TimeoutError(f"write-behind did not settle in {SETTLE_TIMEOUT_S:.0f} s: "
                           f"{self.engine.stats()}")

    def session_kv(self, session_id: str) -> torch.Tensor | None:
        """A CPU copy of the resident session's blocks ([L, 2, n, bs, H, D]); None if it is
        not in the pool. Read on this thread while the engine is idle."""
        session = self.engine.kv.sessions.get(session_id)
        if session is None:
            return None
        ids = [b.block_id for b in session.blocks]
        kv = self.engine.kv_cache.kv
        return kv[:, :, torch.tensor(ids, device=kv.device)].to("cpu", copy=True)

    def close(self) -> None:
        if R.hung:  # a wait timed out: a thread may hold the engine, and shutdown joins it
            R.info("engine left running: an earlier wait timed out")
            return

        def stop() -> None:
            self.engine.shutdown()

        call_with_timeout(stop, SHUTDOWN_TIMEOUT_S, "engine shutdown")


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_pass(model_path: Path, work: Path, device: str, dtype: str, n_sessions: int) -> None:
    from gnosis_daemon.settings import Settings
    from station.tier.start import tier_root
    from station.model.loader import load_model
    from tests.support.kv_tier import flip_byte, session_files

    tag = f"[{dtype}]"
    exact_tokens = dtype == "float32"
    state = work / f"state-{dtype}"
    settings = Settings(model=str(model_path), runtime_dir=str(work / f"rt-{dtype}"),
                        state_dir=str(state), kv_block_size=BS, device=device, dtype=dtype)
    t0 = time.perf_counter()
    loaded = load_model(settings)
    R.info(f"{tag} model on {loaded.device} {loaded.dtype}, loaded in "
           f"{time.perf_counter() - t0:.1f} s")
    root = tier_root(settings.effective_state_dir, loaded.fingerprint)
    prompts = [prompt_of(700 + i, PROMPT_LEN) for i in range(n_sessions)]
    sid = [f"alice.p.{i}" for i in range(n_sessions)]

    def compare_tokens(name: str, got: list[int], want: list[int], kv_ok: bool,
                       replay_ok: bool | None) -> None:
        ok = got == want
        if ok or exact_tokens or not (kv_ok and replay_ok is not False):
            R.check(name, ok, "" if ok else f"{got} != first answer {want} "
                    f"(kv bytes identical: {kv_ok}, pool-hit replay agrees: {replay_ok})")
        else:
            R.warn(name, f"{got} != first answer {want}, but the KV bytes are identical and "
                         f"the pool-hit replay agrees: {dtype} kernel-shape numerics")

    # -- 1. save N sessions, each made durable before the next
    t = TierEngine(loaded, settings)
    try:
        R.check(f"{tag} tier opened", t.report.get("error") is None and
                t.report.get("start_sessions") == 0 and t.engine.tier is not None,
                f"report {t.report}")
        first: list[list[int]] = []
        snapshot: list[torch.Tensor | None] = []
        saved_ok = 0
        t1 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            out = t.generate(prompt, save_session=sid[i], match_session=True)
            first.append(out.tokens)
            saved_ok += bool(out.prefill().saved) and len(out.tokens) == NEW_TOKENS
            snapshot.append(t.session_kv(sid[i]))  # still resident: just saved
            t.expected_writes = i + 1
            t.settle()
        stats = t.engine.stats()
        R.info(f"{tag} {n_sessions} sessions saved and durable in {time.perf_counter() - t1:.1f} s;"
               f" write-behind lag p50/p99 {stats.get('write_behind_lag_ms_p50')}/"
               f"{stats.get('write_behind_lag_ms_p99')} ms")
        R.check(f"{tag} {n_sessions} sessions saved", saved_ok == n_sessions,
                f"{saved_ok} saved with {NEW_TOKENS} tokens")
        R.check(f"{tag} snapshots of the saved KV taken",
                all(s is not None and s.shape[2] == SESSION_TOKENS // BS for s in snapshot))
        R.check(f"{tag} write-behind: all durable, none lost",
                stats["write_behind_done"] == n_sessions and stats["write_behind_errors"] == 0
                and stats["kv_sessions_lost"] == 0 and stats["kv_sessions_offloaded"] > 0
                and stats["kv_disk_sessions"] + stats["kv_sessions"] == n_sessions
                and stats["disk_sessions"] == n_sessions,
                f"done {stats['write_behind_done']}, errors {stats['write_behind_errors']}, "
                f"lost {stats['kv_sessions_lost']}, offloaded {stats['kv_sessions_offloaded']}, "
                f"pool {stats['kv_sessions']} + disk-only {stats['kv_disk_sessions']}, "
                f"disk {stats['disk_sessions']}")

        # -- 2. every prompt again: a hit, exact
        tiers, kv_bad, replay_bad = [], [], []
        t1 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            again = t.generate(prompt, match_session=True)
            pre = again.prefill()
            tiers.append(pre.session_tier)
            hit = (pre.session_loaded, pre.session_id, pre.session_tokens) == (True, sid[i], SESSION_TOKENS)
            kv_ok = same_bytes(t.session_kv(sid[i]), snapshot[i])
            replay_ok = None
            if pre.session_tier == "disk":
                replay = t.generate(prompt, match_session=True)
                replay_ok = replay.prefill().session_tier == "pool" and replay.tokens == again.tokens
                if not replay_ok:
                    replay_bad.append(i)
            if not kv_ok:
                kv_bad.append(i)
            if not hit:
                R.check(f"{tag} p{i} session hit", False,
                        f"loaded {pre.session_loaded}, id {pre.session_id}, tokens "
                        f"{pre.session_tokens}, error {pre.session_error}")
            compare_tokens(f"{tag} p{i} ({pre.session_tier}) tokens", again.tokens, first[i],
                           kv_ok, replay_ok)
        stats = t.engine.stats()
        n_disk = tiers.count("disk")
        R.info(f"{tag} {n_sessions} asked again in {time.perf_counter() - t1:.1f} s: {n_disk} from "
               f"disk, read-back p50/p99 {stats.get('read_back_ms_p50')}/"
               f"{stats.get('read_back_ms_p99')} ms")
        R.check(f"{tag} every prompt a session hit", tiers.count(None) == 0 and
                all(x in ("pool", "disk") for x in tiers), f"tiers {tiers}")
        R.check(f"{tag} most hits from disk", n_disk >= n_sessions - 6,
                f"{n_disk} of {n_sessions} (the pool holds at most 4)")
        R.check(f"{tag} KV read back from disk byte-identical", not kv_bad,
                f"differs for {kv_bad}" if kv_bad else f"{n_sessions} sessions x 5 blocks")
        R.check(f"{tag} disk hit == pool-hit replay", not replay_bad,
                f"differs for {replay_bad}" if replay_bad else f"{n_disk} replays")
        R.check(f"{tag} read-back counts", stats["kv_disk_loads"] == n_disk and
                stats["read_back_failures"] == 0 and stats["disk_quarantined_total"] == 0,
                f"kv_disk_loads {stats['kv_disk_loads']}, read_back_failures "
                f"{stats['read_back_failures']}, quarantined {stats['disk_quarantined_total']}")
    finally:
        t.close()

    # -- 3. restart: the sessions are found without loading them; some come back exact
    asked = sorted({0, n_sessions // 3, (2 * n_sessions) // 3, n_sessions - 1})
    t = TierEngine(loaded, settings)
    try:
        R.check(f"{tag} restart finds the sessions",
                t.report.get("error") is None and t.report.get("start_sessions") == n_sessions
                and t.report.get("start_quarantined") == 0 and t.engine.kv.pool.num_held_blocks == 0
                and len(t.engine.kv.disk) == n_sessions, f"report {t.report}")
        for i in asked:
            again = t.generate(prompts[i], match_session=True)
            pre = again.prefill()
            kv_ok = same_bytes(t.session_kv(sid[i]), snapshot[i])
            R.check(f"{tag} after restart p{i} disk hit",
                    (pre.session_loaded, pre.session_id, pre.session_tier, pre.session_tokens)
                    == (True, sid[i], "disk", SESSION_TOKENS) and kv_ok,
                    f"loaded {pre.session_loaded}, tier {pre.session_tier}, tokens "
                    f"{pre.session_tokens}, error {pre.session_error}, kv bytes identical {kv_ok}")
            compare_tokens(f"{tag} after restart p{i} tokens", again.tokens, first[i], kv_ok, None)
    finally:
        t.close()

    # -- 4. a flipped byte in a block file: quarantined, the request a miss
    k = next(i for i in range(n_sessions) if i not in asked)
    blocks = session_files(root, sid[k]).blocks
    damaged = flip_byte(blocks[2])
    t = TierEngine(loaded, settings)
    try:
        miss = t.generate(prompts[k], match_session=True)
        pre = miss.prefill()
        R.check(f"{tag} damaged p{k} is a quarantined miss",
                (pre.session_loaded, pre.session_error, pre.cached_tokens) == (False, "quarantined", 0),
                f"loaded {pre.session_loaded}, error {pre.session_error}, cached {pre.cached_tokens}")
        # A miss prefills all 23 tokens like the first answer did: exact in both dtypes.
        R.check(f"{tag} damaged p{k} tokens", miss.tokens == first[k],
                f"{miss.tokens} vs first answer {first[k]}")
        stats = t.engine.stats()
        quarantine = sorted((root / "quarantine").iterdir()) if (root / "quarantine").exists() else []
        R.check(f"{tag} damaged file quarantined",
                stats["kv_disk_quarantined_loads"] == 1 and stats["disk_quarantined"] == {"checksum": 1}
                and len(quarantine) == 1 and quarantine[0].read_bytes() == damaged,
                f"quarantined loads {stats['kv_disk_quarantined_loads']}, reasons "
                f"{stats['disk_quarantined']}, files {[p.name for p in quarantine]}")
        other = next(i for i in range(n_sessions) if i not in asked and i != k)
        again = t.generate(prompts[other], match_session=True)
        pre = again.prefill()
        kv_ok = same_bytes(t.session_kv(sid[other]), snapshot[other])
        R.check(f"{tag} another session still a disk hit",
                (pre.session_loaded, pre.session_tier) == (True, "disk") and kv_ok,
                f"p{other}: loaded {pre.session_loaded}, tier {pre.session_tier}, error "
                f"{pre.session_error}, kv bytes identical {kv_ok}")
        compare_tokens(f"{tag} another session p{other} tokens", again.tokens, first[other], kv_ok, None)
    finally:
        t.close()
    del loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU where CUDA is not")
    parser.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    if args.sessions < 8:
        parser.error("--sessions: at least 8")
    try:
        from gnosis_daemon.logs import configure_logging

        configure_logging("device-tier", level="warning", fmt="console")
    except Exception as exc:  # noqa: BLE001
        print(f"logging not configured: {exc!r}", flush=True)
    cuda = torch.cuda.is_available()
    print(f"== device_tier {time.strftime('%Y-%m-%d %H:%M:%S')}: torch {torch.__version__}, cuda "
          f"{cuda}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""), flush=True)
    if not cuda and not args.allow_cpu and args.device == "auto":
        print("no CUDA here: nothing checked (pass --allow-cpu to run on CPU)", flush=True)
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gnosis-tier-") as tmp:
        work = Path(tmp)
        try:
            from tests.support.tiny_models import build_tiny_model

            model_path = build_tiny_model(work / "llama", "llama")
        except Exception:  # noqa: BLE001
            R.check("tiny model built", False, traceback.format_exc())
            model_path = None
        for dtype in [d for d in args.dtypes.split(",") if d] if model_path else []:
            t0 = time.perf_counter()
            try:
                run_pass(model_path, work, args.device, dtype, args.sessions)
            except Exception:  # noqa: BLE001
                R.check(f"[{dtype}] pass ran to its end", False, traceback.format_exc())
            R.info(f"[{dtype}] pass took {time.perf_counter() - t0:.1f} s")
            if R.hung:
                break  # a thread may still hold the engine: stop here
    verdict = "FAIL" if R.failed else "PASS"
    print(f"== device_tier {verdict}: {R.passed} passed, {len(R.failed)} failed, "
          f"{len(R.warned)} warned in {time.perf_counter() - start:.1f} s"
          + (f"; failed: {', '.join(R.failed)}" if R.failed else "")
          + (f"; warned: {', '.join(R.warned)}" if R.warned else ""), flush=True)
    return 1 if R.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if R.hung:
        os._exit(code or 1)
    sys.exit(code)
