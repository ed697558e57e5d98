"""The station's torch-free core: block pool, prefix cache, KV sessions, KV cache manager,
sequences and the scheduler.

Nothing under ``station.core`` imports torch (``tests/station/core/test_core_torch_free.py``
checks it), so the policy that decides which KV lives where is tested like vLLM's
``test_prefix_caching.py``: pure Python, exact block ids, no model.
"""
