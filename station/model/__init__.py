"""The model: loading, GGUF weights, tables and groups, and the tokenizer codec."""
