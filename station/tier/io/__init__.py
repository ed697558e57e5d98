"""The disk tier's I/O process: its start and pipe on the station's side, and the worker that runs in it."""
