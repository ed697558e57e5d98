"""``station.core`` holds the engine's policy and must import without torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import station.core

REPO = Path(__file__).resolve().parents[3]

# Any import of torch (or one of its submodules) fails, as on a host without it.
_SCRIPT = """
import importlib, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is unimportable in this test")
        return None

sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    importlib.import_module(name)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch got imported"
print("ok", len(sys.argv) - 1)
"""


def test_every_core_module_imports_without_torch():
    names = ["station.core"] + [f"station.core.{m.name}"
                                for m in pkgutil.iter_modules(station.core.__path__)]
    assert {"station.core.block_pool", "station.core.scheduler", "station.core.sequence",
            "station.core.sessions"} <= set(names)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *names], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", str(len(names))]


def test_the_guard_really_blocks_torch():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "station.forward.kv_cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "torch is unimportable" in proc.stderr
