"""A KV disk tier as a torn write leaves it, for the real-process tests of bad tiers."""

from __future__ import annotations

import io
import json
from pathlib import Path


def write_torn_tier(model_dir: Path, tier: Path, block_size: int) -> None:
    """Write at ``tier`` a tier of this model's exact layout (so it is read, not ignored as
    foreign) whose ``kv.pt`` holds only the first half of its bytes."""
    import torch

    from gnosis_daemon.settings import Settings
    from station.runtime.kv_cache import KVCacheShape
    from station.runtime.model_loader import load_model

    loaded = load_model(Settings(model=str(model_dir), runtime_dir=str(tier.parent / "unused")))
    shape = KVCacheShape.from_config(loaded.model.config, block_size, loaded.dtype)
    kv = torch.zeros(shape.num_layers, 2, 1, block_size, shape.num_kv_heads, shape.head_dim,
                     dtype=loaded.dtype)
    buffer = io.BytesIO()
    torch.save(kv, buffer)
    tier.mkdir(parents=True)
    (tier / "kv.pt").write_bytes(buffer.getvalue()[:len(buffer.getvalue()) // 2])
    manifest = {"format": 1, "fingerprint": loaded.fingerprint, "block_size": block_size,
                "dtype": str(loaded.dtype),
                "kv_shape": [shape.num_layers, 2, block_size, shape.num_kv_heads, shape.head_dim],
                "sessions": [{"session_id": "s", "tenant": "", "token_ids": list(range(block_size)),
                              "blocks": [0]}]}
    (tier / "manifest.json").write_text(json.dumps(manifest))
