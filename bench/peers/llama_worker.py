"""The peer's child process: llama.cpp (llama-cpp-python) on the daemon's own GGUF file.

    python -m bench.peers.llama_worker server --model F.gguf --threads 2 --port P [--flash-attn]
    python -m bench.peers.llama_worker inproc --model F.gguf --threads 2 [--flash-attn]

``server``: llama-cpp-python's OpenAI server (its FastAPI app on uvicorn), built around a
``Llama`` constructed here, so that the load options the server's CLI does not take
(``use_extra_bufts=False``: llama.cpp's AMX path dies with SIGILL on some CPUs) still apply,
and with ``interrupt_requests`` off (the server otherwise cancels a streaming completion
when the next request arrives, so concurrent streams would not all decode their tokens).

``inproc``: the same library generating on this process's main thread, which on a small
machine decodes faster than the server (whose OpenMP threads are driven from a worker
thread). Reads one JSON request a line on stdin (``{"prompt": str, "max_tokens": N}``),
answers one JSON line on stdout (first-token and end times from the call, tokens counted by
a logits processor, which runs once per sampled token). A request with ``prompt_ids``
instead (``{"prompt_ids": [int], "max_tokens": N, "suppress": [int]}``) is answered with
the greedy continuation's token ids (``{"token_ids": [...]}``: the prompt's tokens as given,
no BOS added, ``suppress``, else the end-of-generation tokens, never chosen): what the
bench compares with transformers' ``generate``.

In both, end-of-generation tokens are suppressed (the logits processor here, ``logit_bias``
in the server's requests), so a greedy completion decodes exactly ``max_tokens`` tokens.
Prints one JSON line ``{"ready": ..., "eog": [...]}`` once loaded.

``--flash-attn``: llama.cpp's fused attention (``flash_attn=True``, its CLI's ``-fa``; off
by default in llama-cpp-python 0.3). On the default model and 2 cores here it made a
2,000-token prompt's evaluation 9% faster (median 8.02 s against 8.88 s, six alternating
rounds in one process) and a token at that context 5-6% slower (decode 14.7 against
13.8 ms, a prefix hit's last token 14.6 against 13.9 ms): the bench runs a server with it
and one without, and each TTFT row takes the faster (``bench.peers.figures``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def load(model: str, threads: int, n_ctx: int, flash_attn: bool = False):
    """``Llama`` with llama.cpp's extra buffer types (its AMX path) off. Where ``Llama`` does
    not take ``use_extra_bufts`` (0.3.36 does not), the model parameters it starts from
    (``llama_model_default_params``) are given it."""
    import inspect

    import llama_cpp
    import llama_cpp.llama_cpp as low

    kwargs = dict(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                  n_batch=512, flash_attn=flash_attn, verbose=False)
    if "use_extra_bufts" in inspect.signature(llama_cpp.Llama.__init__).parameters:
        return llama_cpp.Llama(**kwargs, use_extra_bufts=False)
    if any(name == "use_extra_bufts" for name, *_ in low.llama_model_params._fields_):
        defaults = low.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = without_extra_bufts
    return llama_cpp.Llama(**kwargs)


def eog_tokens(llm) -> list[int]:
    """Every end-of-generation token of the model's vocabulary (EOS, <|im_end|>, ...)."""
    import llama_cpp

    n_vocab = llm.n_vocab()
    model = llm.model
    vocab = getattr(llama_cpp, "llama_model_get_vocab", None)
    if vocab is not None and hasattr(llama_cpp, "llama_vocab_is_eog"):
        handle = vocab(model)
        found = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(handle, t)]
    else:
        found = [t for t in range(n_vocab) if llama_cpp.llama_token_is_eog(model, t)]
    return found or [llm.token_eos()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.llama_worker")
    parser.add_argument("mode", choices=("server", "inproc"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    # the default model's whole context: the prefill plot's longest prompt is ~8,000 tokens
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's fused attention")
    args = parser.parse_args(argv)
    llm = load(args.model, args.threads, args.ctx, args.flash_attn)
    eog = eog_tokens(llm)
    if args.mode == "server":
        return serve(llm, args, eog)
    _say({"ready": True, "eog": eog, "mode": "inproc", "flash_attn": args.flash_attn})
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            _say(greedy_ids(llm, request, eog) if "prompt_ids" in request
                 else generate(llm, request, eog))
    return 0


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def generate(llm, request: dict, eog: list[int]) -> dict:
    import numpy as np
    from llama_cpp import LogitsProcessorList

    counted = [0]

    def no_eog(_input_ids, scores):
        counted[0] += 1
        scores[eog] = -np.inf
        return scores

    start = time.perf_counter()
    first = None
    for _chunk in llm.create_completion(request["prompt"], max_tokens=request["max_tokens"],
                                        temperature=0.0, stream=True,
                                        logits_processor=LogitsProcessorList([no_eog])):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    prompt_tokens = len(llm.tokenize(request["prompt"].encode(), add_bos=True, special=False))
    return {"ttft_s": first - start, "decode_s": end - first, "tokens": counted[0],
            "prompt_tokens": prompt_tokens}


def greedy_ids(llm, request: dict, eog: list[int]) -> dict:
    """The greedy continuation of a token-id prompt, ``max_tokens`` ids (llama.cpp's own
    sampler at temperature 0: the arg max of each step's logits)."""
    import numpy as np
    from llama_cpp import LogitsProcessorList

    suppress = list(request.get("suppress") or eog)

    def no_eog(_input_ids, scores):
        scores[suppress] = -np.inf
        return scores

    out: list[int] = []
    for token in llm.generate(request["prompt_ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0, reset=True,
                              logits_processor=LogitsProcessorList([no_eog])):
        out.append(int(token))
        if len(out) >= request["max_tokens"]:
            break
    return {"token_ids": out}


def serve(llm, args, eog: list[int]) -> int:
    import uvicorn
    from llama_cpp.server import app as server_app
    from llama_cpp.server import model as server_model
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    # The proxy loads its models from settings; hand it the one constructed above instead
    # (through an Any: where llama-cpp-python is installed, mypy reads its types, which forbid
    # assigning a method)
    proxy: Any = server_model.LlamaProxy
    proxy.load_llama_from_model_settings = staticmethod(lambda _settings: llm)
    settings = ServerSettings(host="127.0.0.1", port=args.port, interrupt_requests=False)
    model_settings = ModelSettings(model=args.model, n_threads=args.threads,
                                   n_threads_batch=args.threads, n_ctx=args.ctx, verbose=False)
    app = server_app.create_app(server_settings=settings, model_settings=[model_settings])
    _say({"ready": True, "eog": eog, "mode": "server", "port": args.port,
          "flash_attn": args.flash_attn})
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
