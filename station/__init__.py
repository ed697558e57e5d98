"""The station: the worker that holds the model weights and the paged KV cache.

* ``station.core``: the torch-free KV cache manager, block pool, sessions, scheduler.
* ``station.model``: loading the model, its GGUF weights, the tokenizer codec.
* ``station.kernels``: the linear forms (dense, quantized) and the C kernels.
* ``station.forward``: one packed forward a step over the paged KV tensors.
* ``station.plan``: the decode plan chosen at load, and the start check that proves it.
* ``station.sampling``: logits to tokens: sampling, processors, grammars, logprobs.
* ``station.tier``: the disk tier (write-behind, read-back, its I/O process, the store).
* ``station.engine``: the engine thread that drives the core and the forward.
* ``station.serving``: the msgpack Unix socket: connections, op registry, streams.
* ``station.main``: the process entry that wires them.
"""
