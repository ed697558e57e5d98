"""The engine thread: the step loop over the torch-free core, the calls it answers, and sequence forks."""
