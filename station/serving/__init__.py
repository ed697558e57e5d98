"""The station's socket side: connections, the op registry and its handlers, streams.

Runs on trio (plus two tokenizer worker threads); it never runs a torch op. Engine work is
queued to ``station.engine.loop`` through the op registry (``op_registry``).
"""
