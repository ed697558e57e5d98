"""Run in a process of its own by ``test_gguf_mapped``: load a GGUF file through the station's
``load_model`` and report, as JSON, what the load cost in memory and what the model answers.

The process's base is measured after torch, transformers, the Llama model code and the
station's loader are imported, so the peak above it is the load's own. After the figures are
taken: 16 greedy tokens through the paged engine, a second start (the cache must serve the
config and tokenizer, and the fingerprint must not move), then transformers' own dequantized
model of the file as the reference: its greedy tokens, each quantized layer's output against
``F.linear`` over the reference's weight, and every float tensor against the reference's.

Usage: ``python -m tests.support.mapped_load FILE WEIGHTS CACHE_DIR OUT_JSON``
"""

from __future__ import annotations

import json
import sys

PROMPT = [104, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]  # "hello there"
NEW_TOKENS = 16


def main(path: str, weights: str, cache: str, out: str) -> None:
    import torch
    import torch.nn.functional as F
    import transformers  # noqa: F401 - part of the base
    import transformers.models.llama.modeling_llama  # noqa: F401 - part of the base
    import accelerate  # noqa: F401 - code the load imports: part of the base, as torch is
    import gguf  # noqa: F401

    import station.model.gguf_mapped  # noqa: F401
    import station.model.weights  # noqa: F401

    from gnosis_daemon.settings import Settings
    from station.model.loader import load_model
    from station.model.memory import reset_peak, resident

    torch.set_num_threads(2)
    base = reset_peak()
    settings = Settings(model=path, model_cache_dir=cache, weights=weights, cpu_decode_step="off")
    loaded = load_model(settings)
    after = resident()

    from tests.station.engine.test_paged_engine import engine_for, submit

    with engine_for(loaded) as engine:
        answer = submit(engine, "mapped", PROMPT, NEW_TOKENS).wait().tokens
    second = load_model(settings)
    same_second = second.fingerprint == loaded.fingerprint and second.mapped
    del second

    from tests.support.gguf_files import reference_model

    ref = reference_model(path)
    prompt = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                            do_sample=False)[0, len(PROMPT):].tolist()
    ref_params = dict(ref.named_parameters())
    modules = dict(loaded.model.named_modules())
    errors = {}
    x = torch.randn(3, ref.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for name in loaded.weights.forms:
        weight = ref_params[f"{name}.weight"].detach()
        inputs = x if weight.shape[1] == x.shape[1] else torch.randn(
            3, weight.shape[1], generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            got, exact = modules[name](inputs), F.linear(inputs, weight)
        errors[name] = float((got - exact).abs().max() / exact.abs().max())
    ref_state = ref.state_dict()
    state = loaded.model.state_dict()
    floats = [n for n in state if loaded.weights.forms.get(n.rsplit(".", 1)[0], "float") == "float"]
    mismatched = [n for n in floats if n not in ref_state or not torch.equal(state[n], ref_state[n])]
    result = {"base": base.rss, "peak": after.peak, "rss": after.rss, "mapped": loaded.mapped,
              "forms": {f: loaded.weights.count(f) for f in ("int4", "int8", "float")},
              "answer": answer, "want": want, "second_start_same": same_second,
              "layer_errors": errors, "floats": len(floats), "float_mismatches": mismatched}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
