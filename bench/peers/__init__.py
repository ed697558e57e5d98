"""The peer rows of `make bench`: the daemon beside llama.cpp (llama-cpp-python) in one run.

- ``llama_worker``: the peer's child process (llama.cpp's OpenAI server, or the library
  generating on its own main thread);
- ``http_side``: the OpenAI-API client both sides are measured with;
- ``figures``: the interleaved rounds, the rows and the plots' figures;
- ``plots``: the PNG plots; ``section``: finding or installing the peer, the markdown section.
"""
