"""A station that refuses its model, started alone (``gnosis-daemon station``, a real
process): it exits 78 and leaves the refusal file; any other load error still exits 1, and
neither leaves an earlier station's refusal behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from gnosis_daemon.refusal import REFUSED_EXIT, write_refusal
from station.forward.kv_cache import KVCacheShape
from station.model.loader import REFUSED_EXIT as LOADER_REFUSED_EXIT
from station.model.loader import ModelRefused
from tests.support.procs import REPO, child_env

STALE = {"model_type": "llama", "kind": "stale", "reason": "an earlier station's refusal",
         "message": "model type 'llama' refused: an earlier station's refusal"}


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory):
    from tests.support.refused_models import build_tiny_mamba

    return build_tiny_mamba(tmp_path_factory.mktemp("station-refused") / "tiny-mamba")


def run_station(model, runtime_dir, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gnosis_daemon.cli", "station", "--model", str(model),
         "--runtime-dir", str(runtime_dir)], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, env=child_env(GNOSIS_KV_CACHE_BYTES=str(16 << 20)))


def events(result: subprocess.CompletedProcess, name: str) -> list[dict]:
    out = []
    for raw in (result.stdout + result.stderr).splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("event") == name:
            out.append(line)
    return out


def test_one_exit_status_for_every_reader():
    assert REFUSED_EXIT == LOADER_REFUSED_EXIT == 78


def test_a_config_without_attention_heads_is_refused_not_a_crash():
    from transformers import MambaConfig

    with pytest.raises(ModelRefused) as caught:
        KVCacheShape.from_config(MambaConfig(num_hidden_layers=2), 16, torch.float32)
    assert (caught.value.model_type, caught.value.kind) == ("mamba", "non-attention layers")


def test_a_refused_model_exits_78_and_writes_the_refusal_file(mamba_dir, tmp_path):
    runtime_dir = tmp_path / "run"
    path = runtime_dir / "station-refused.json"
    write_refusal(path, STALE, model="/somewhere/else")  # overwritten, never merged
    result = run_station(mamba_dir, runtime_dir)
    assert result.returncode == REFUSED_EXIT, result.stdout + result.stderr
    logged = events(result, "model_refused")
    assert len(logged) == 1 and logged[0]["level"] == "error"
    assert logged[0]["model_type"] == "mamba" and logged[0]["kind"] and logged[0]["reason"]
    document = json.loads(path.read_text())
    assert {k: document[k] for k in ("model_type", "kind", "reason")} == \
        {k: logged[0][k] for k in ("model_type", "kind", "reason")}
    assert document["message"].startswith("model type 'mamba' refused: ")
    assert document["model"] == str(mamba_dir) and isinstance(document["pid"], int)
    assert document["at"].endswith("Z")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in runtime_dir.iterdir() if p.name.endswith(".tmp")] == []


def test_another_load_error_exits_1_and_leaves_no_refusal(tmp_path):
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    runtime_dir = tmp_path / "run"
    path = runtime_dir / "station-refused.json"
    write_refusal(path, STALE, model=str(broken))
    result = run_station(broken, runtime_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert events(result, "model_load_failed") and not events(result, "model_refused")
    assert not os.path.exists(path)  # the stale refusal does not describe this failure
