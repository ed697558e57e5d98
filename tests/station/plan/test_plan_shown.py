"""The decode plan where an operator sees it: a real station's start log (``decode_plan``)
and its ``hello`` over the socket, the start check's record, and the host's ``/health``."""

from __future__ import annotations

import json

from tests.host.conftest import spawn
from tests.station.conftest import start_station
from tests.support.procs import free_port, http_json, stop_process, wait_for
from tests.support.tiny_models import build_tiny_model


def test_hello_health_and_the_start_log_show_the_plan_of_a_gemma2_station(tmp_path):
    path = build_tiny_model(tmp_path / "gemma2", "gemma2")
    runtime = tmp_path / "run"
    station = start_station(path, runtime)
    host = None
    try:
        model = station.hello["model"]
        plan = model["decode_plan"]
        assert (plan["forward"], plan["decode_steps"], plan["head"]) == (
            "transformers", "forward-body", ["model-forward"])
        forward = {c["name"]: (c["used"], c["why"]) for c in plan["candidates"]["forward"]}
        assert forward == {
            "c-step": (False, "not every layer attends causally to its whole context "
                              "(windows, soft-capping or sinks)"),
            "lean": (False, "not a Llama-family model"),
            "transformers": (True, "the model's own forward")}
        assert {c["name"]: c["why"] for c in plan["candidates"]["decode_steps"]}["cuda-graphs"] == "no CUDA device"
        # the start check proved this plan's path, and its record names it
        assert model["start_check"]["passed"] and model["start_check"]["plan"] == {
            key: plan[key] for key in ("forward", "decode_steps", "linears", "head")}
        logged = [line for line in map(_json, station.log().splitlines()) if line.get("event") == "decode_plan"]
        assert len(logged) == 1 and logged[0]["candidates"] == plan["candidates"]

        port = free_port()
        host = spawn("host", runtime, tmp_path / "host.log", "--port", str(port))

        def served():
            status, body = http_json(f"http://127.0.0.1:{port}/health")
            return body if status == 200 else None

        health = wait_for(served, 60, "host /health 200", host)
        assert health["station_decode_plan"] == plan
    finally:
        if host is not None:
            stop_process(host)
        station.stop()


def _json(line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError:
        return {}
