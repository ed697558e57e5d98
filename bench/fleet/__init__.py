"""`make fleet-bench`: a fleet of daemon replicas behind vllm-router on loopback.

- ``cluster``: the replicas (`gnosis-daemon run` each) and the router;
- ``drill``: conversations through the router with the official `openai` client;
- ``report``: the figures, the verdicts, the docs/benchmarks.md section.
"""
