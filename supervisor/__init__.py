"""The supervisor: starts the station and the host, watches their health and restarts them."""
