"""The station process's resident memory, for the figures the start log gives about a load.

A load's cost is its peak resident set (``VmHWM``) above what the process held before it
(``VmRSS`` then: torch, transformers and the station imported), set against the model
file's size: a GGUF file converted to float32 takes about 4 bytes a parameter, a mapped one
(``gguf_mapped``) about what its kept forms hold. The peak is reset at the load's start
(``/proc/self/clear_refs``), so it is the load's own, not something earlier's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Resident:
    rss: int  # bytes resident now (VmRSS), 0 where /proc is not there
    peak: int  # the most resident since the last reset (VmHWM)


def resident() -> Resident:
    """VmRSS and VmHWM of this process (zeros where /proc/self/status is not there)."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024  # kB
    except OSError:
        pass
    return Resident(fields.get("VmRSS", 0), fields.get("VmHWM", 0))


def reset_peak() -> Resident:
    """Start a new peak at what is resident now (Linux 4.0+); -> what is resident now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux: the peak stays the process's
        pass
    return resident()


def load_figures(base: Resident, file_bytes: int) -> dict[str, float]:
    """The start log's ``model_memory`` fields: MiB now, at the load's peak and before it,
    and the peak and resident growth over the file's size."""
    now = resident()
    out = {"base_rss_mib": round(base.rss / _MIB, 1), "rss_mib": round(now.rss / _MIB, 1),
           "peak_rss_mib": round(now.peak / _MIB, 1), "file_mib": round(file_bytes / _MIB, 1)}
    if file_bytes:
        out["load_peak_per_file"] = round((now.peak - base.rss) / file_bytes, 3)
        out["load_rss_per_file"] = round((now.rss - base.rss) / file_bytes, 3)
    return out
