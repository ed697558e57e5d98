"""/metrics text parsed with prometheus-client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(text: str) -> Samples:
    """/metrics text as {(sample name, sorted labels): value}."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (KeyError when /metrics does not have it)."""
    return samples[(name, tuple(sorted(labels.items())))]
