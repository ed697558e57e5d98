"""The station's torch-free core: the KV cache manager and its pool, sessions, sequences, scheduler.

Nothing under ``station.core`` imports torch (``tests/station/core/test_core_torch_free.py``
checks it), so the policy that decides which KV lives where is tested like vLLM's
``test_prefix_caching.py``: pure Python, exact block ids, no model.
"""
