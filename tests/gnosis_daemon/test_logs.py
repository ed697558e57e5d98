"""Every log line names its component, whichever thread wrote it."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import threading
from gnosis_daemon.logs import configure_logging, get_logger, bind_request
configure_logging("station", "info", "json")
log = get_logger("t")
log.info("from_main")
with bind_request("req-1"):
    log.info("in_request")
thread = threading.Thread(target=lambda: log.info("from_thread"))
thread.start(); thread.join()
"""


def test_component_on_every_line_including_other_threads():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60, check=True)
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["from_main", "in_request", "from_thread"]
    assert [line["component"] for line in lines] == ["station"] * 3
    assert [line.get("request_id") for line in lines] == [None, "req-1", None]
