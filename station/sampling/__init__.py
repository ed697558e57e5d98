"""Turning logits into tokens: sampling, logits processors, grammars and logprobs."""
