"""The faults, one at a time, and the probe sessions saved before each and asked after it."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import trio

from bench.soak.daemon import Daemon, kill_quietly
from bench.soak.measures import Fault, Record
from gnosis_daemon.api_keys import tenant_key
from gnosis_daemon.client import open_station_client
from host.session_names import save_ids

PROBE_KEY = "soak-probe-key"
PROBE_SESSIONS = 2
WRITE_BEHIND_WAIT_S = 2.0  # kv_write_behind_s (1 s by default) and a margin


class Faults:
    """Station SIGKILL, station SIGSTOP, host SIGKILL, spaced over ``--duration``; each is
    waited out (replacement, then a successful request from the load) before the next."""

    def __init__(self, daemon: Daemon, http: httpx.AsyncClient, args: argparse.Namespace,
                 records: list[Record], now: Callable[[], float], warm_s: float) -> None:
        self.daemon = daemon
        self.http = http
        self.args = args
        self.records = records  # the load's, appended to as it runs
        self.now = now
        self.warm_s = warm_s
        self.faults: list[Fault] = []

    async def run(self) -> None:
        plan = [("station SIGKILL", "station", signal.SIGKILL),
                ("station SIGSTOP (hung)", "station", signal.SIGSTOP),
                ("host SIGKILL", "host", signal.SIGKILL)]
        gap = max(1.0, self.args.duration / (len(plan) + 1))
        for name, child, sig in plan:
            await trio.sleep(max(self.warm_s, gap * (len(self.faults) + 1) - self.now()))
            fault = Fault(name, child)
            probes = await self._save_probes(len(self.faults))
            # Past the write-behind bound the probes should be on disk, and a station fault
            # keeps them. Under a load that saves faster than the disk writes, the queue runs
            # behind, so the fault waits until the station lists both probes as durable (the
            # wait past the bound is reported: the write-behind's lag under this load).
            await trio.sleep(WRITE_BEHIND_WAIT_S)
            fault.durable_wait_s = await self._await_durable(
                [save_ids(tenant_key(PROBE_KEY), None, p["id"]).save_session for p in probes])
            fault.old_pid = self.daemon.pids().get(child)
            fault.at, wall_at = self.now(), time.time()
            os.kill(fault.old_pid, sig)
            self.faults.append(fault)
            wait = ("the probes were not durable 120 s after the bound" if fault.durable_wait_s is None
                    else f"the probes were durable {fault.durable_wait_s:.1f} s after the bound")
            print(f"  {fault.at:6.1f} s  {name} (pid {fault.old_pid}; {wait})", flush=True)
            try:
                await self._await_replacement(fault, wall_at)
                await self._await_recovery(fault)
            finally:
                if sig == signal.SIGSTOP:
                    kill_quietly(fault.old_pid)  # never leave a stopped process behind
            fault.cut = sum(1 for r in self.records if r.start < fault.at <= r.end and not r.ok)
            fault.sessions = await self._check_probes(probes)
            rec = f"{fault.recovery_s:.1f} s" if fault.recovery_s is not None else "none"
            print(f"  {self.now():6.1f} s  recovered from {name} after {rec}; sessions: "
                  + ", ".join(f"{s['after']}" for s in fault.sessions), flush=True)

    async def _await_replacement(self, fault: Fault, wall_at: float) -> None:
        deadline = self.now() + 120
        while self.now() < deadline:
            try:
                child = self.daemon.status()["children"][fault.child]
            except (OSError, ValueError, KeyError):
                child = {}
            if child.get("pid") and child["pid"] != fault.old_pid:
                fault.new_pid = child["pid"]
                last = child.get("last_exit") or {}
                fault.exit_reason = last.get("reason") or last.get("signal_name")
                if fault.name.startswith("station SIGSTOP") and last.get("at"):
                    fault.detected_s = max(0.0, last["at"] - wall_at)
                return
            await trio.sleep(0.1)

    async def _await_recovery(self, fault: Fault) -> None:
        deadline = self.now() + 180
        while self.now() < deadline:
            after = [r for r in self.records if r.start >= fault.at]
            ok = [r for r in after if r.ok]
            if ok:
                first = min(ok, key=lambda r: r.end)
                fault.recovery_s = first.end - fault.at
                fault.failed_during = sum(1 for r in after if not r.ok and r.start < first.end)
                return
            await trio.sleep(0.1)

    async def _await_durable(self, session_ids: list[str], limit_s: float = 120.0) -> float | None:
        """Wait until the station lists every one of ``session_ids`` (the station's ids of
        the probes' named sessions) as durable -> seconds
        (None: not within ``limit_s``; the fault goes ahead and the report says so)."""
        start = self.now()
        while self.now() - start < limit_s:
            try:
                async with open_station_client(self.daemon.station_socket) as conn:
                    listed = (await conn.request("kv_session.list", {}))["sessions"]
            except Exception:  # noqa: BLE001 - a busy or restarting station: asked again
                listed = []
            durable = {s["session_id"] for s in listed if s.get("durable")}
            if all(sid in durable for sid in session_ids):
                return self.now() - start
            await trio.sleep(0.25)
        return None

    # -- probe sessions: saved before a fault, asked again after it
    def _probe_body(self, tag: int, i: int) -> dict[str, Any]:
        # Each probe's prompt differs from its first token on, so a hit can only come from
        # that probe's own session (never from another probe's or a load client's).
        system = f"{tag}-{i}: logbook. " + ("You keep the logbook of a lighthouse. Every entry "
                                           "names the weather, the ships that passed and the "
                                           "state of the lamp. ") * 3
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Read me entry {i}."}],
                "max_tokens": 4, "temperature": 0, "session_id": f"probe-{tag}-{i}"}

    async def _probe(self, body: dict[str, Any]) -> dict[str, Any] | None:
        deadline = self.now() + 2 * self.args.hang_s
        while self.now() < deadline:
            try:
                with trio.move_on_after(self.args.hang_s):
                    response = await self.http.post("/v1/chat/completions", json=body,
                                                    headers={"Authorization": f"Bearer {PROBE_KEY}"})
                    if response.status_code == 200:
                        return response.json().get("_gnosis") or {}
            except httpx.HTTPError:
                pass
            await trio.sleep(0.25)
        return None

    async def _save_probes(self, tag: int) -> list[dict[str, Any]]:
        probes = [{"id": f"probe-{tag}-{i}", "tag": tag, "i": i} for i in range(PROBE_SESSIONS)]

        async def save(probe: dict[str, Any]) -> None:
            gnosis = await self._probe(self._probe_body(tag, probe["i"]))
            probe["saved"] = bool(gnosis and gnosis.get("liquid_kv_saved"))

        async with trio.open_nursery() as nursery:  # in parallel: each waits its turn in the queue
            for probe in probes:
                nursery.start_soon(save, probe)
        return probes

    async def _check_probes(self, probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        async with trio.open_nursery() as nursery:
            for probe in probes:
                nursery.start_soon(self._check_probe, probe)
        return probes

    async def _check_probe(self, probe: dict[str, Any]) -> None:
        gnosis = await self._probe(self._probe_body(probe["tag"], probe["i"]))
        if gnosis is None:
            probe["after"] = "no answer"
            return
        cached, prompt = gnosis.get("cached_tokens") or 0, gnosis.get("prompt_tokens") or 0
        # kept: a hit that served most of the prompt (its own session), not a block or two
        # shared with some other session of the tenant
        kept = gnosis.get("liquid_memory") == "hit" and cached >= prompt // 2
        probe["after"] = "hit" if kept else (gnosis.get("liquid_memory") or "?")
        probe["reason"] = gnosis.get("liquid_miss_reason") if not kept else None
        probe["cached"] = f"{cached}/{prompt} cached"
