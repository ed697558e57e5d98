"""The disk tier: KV sessions written behind to disk and read back (the engine side, its I/O process, the store and its file format)."""
