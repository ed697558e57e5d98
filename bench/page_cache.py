"""Page-cache state of files, for figures that must read from disk (`make bench`'s disk-tier hit)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def page_cache_cold(tier_dir: Path) -> str:
    """Drop the tier's files from the page cache; -> what did it, as checked by fincore."""
    files = sorted(p for p in tier_dir.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    os.sync()
    for path in files:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    after_fadvise = resident_bytes(files)
    after_drop: int | None
    if after_fadvise == 0:  # cold already: the whole machine's page cache is left alone
        dropped, after_drop = "not needed", 0
    else:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            dropped = "ok"
        except OSError as exc:
            dropped = f"failed ({exc.strerror or exc})"
        after_drop = resident_bytes(files)
    if after_fadvise == 0:
        method = "fadvise DONTNEED"
    elif dropped == "ok" and after_drop == 0:
        method = "drop_caches"
    elif after_drop is None:
        method = "fadvise DONTNEED and drop_caches, unverified (no fincore)"
    else:
        method = f"NOT cold, {after_drop} bytes still cached"
    return (f"page-cache cold: {method} ({total / 1e6:.0f} MB of tier files; cached after "
            f"fadvise {after_fadvise} B, after drop_caches ({dropped}) {after_drop} B, by fincore)")


def resident_bytes(files: list[Path]) -> int | None:
    total = 0
    for i in range(0, len(files), 256):
        try:
            out = subprocess.run(["fincore", "--raw", "--noheadings", "--bytes", "-o", "RES",
                                  *map(str, files[i:i + 256])],
                                 capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        total += sum(int(v) for v in out.split())
    return total
