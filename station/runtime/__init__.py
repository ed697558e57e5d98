"""The station's torch side: everything that holds a tensor or runs the model.

Model loading (``model_loader``), the tokenizer codec (``tokenizing``), the preallocated KV
tensors (``kv_cache``), one packed forward per step (``model_runner``, ``linear_kernels``),
sampling (``sampling``), the engine thread that drives the torch-free core
(``engine``, ``engine_calls``) and the disk tier (``kv_store*``, ``kv_tier``).
"""
