"""gnosis-daemon: a self-healing single-host LLM inference daemon with liquid memory."""

__version__ = "0.1.0"
