"""The engine thread: the step loop over the torch-free core, its calls, forks and outcomes."""
