"""The host: the OpenAI-compatible HTTP API (Quart), answered through the station's socket."""
