"""One packed forward a step: the runner, paged attention, the lean decoder, decode graphs and the KV tensors."""
