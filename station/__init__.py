"""The station: the worker that holds the model weights and the paged KV cache.

* ``station.core``: the torch-free KV cache manager, block pool, sessions, scheduler.
* ``station.runtime``: torch: model, KV tensors, forward, sampling, engine thread, disk tier.
* ``station.serving``: the msgpack Unix socket: connections, op registry, streams.
* ``station.main``: the process entry that wires the three.
"""
