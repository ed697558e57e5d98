"""The wire messages of ``generate``, defined once and torch-free: its arguments, its events and their bounds.

The host and the station both import this package (``gnosis_daemon.protocol`` holds the
framing and the error codes); docs/protocol.md describes the same fields.
"""

from gnosis_daemon.wire.bounds import (BIAS_MAX, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                       MAX_PINS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOOLS,
                                       PENALTY_MAX, PIN_TTL_MAX_S, SEED_END, SEED_MIN)
from gnosis_daemon.wire.events import (ChoiceResult, GenerateEvent, GenerateResult, LogprobEntry,
                                       PrefillEvent, PrefillReport, TokensEvent, TopLogprob,
                                       event_from_wire)
from gnosis_daemon.wire.generate import Choices, GenerateArgs, Sampling, Sessions
from gnosis_daemon.wire.pins import Pin, PinReport

__all__ = [
    "BIAS_MAX", "MAX_CHOICES", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_PINS", "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS", "MAX_TOOLS", "PENALTY_MAX", "PIN_TTL_MAX_S", "SEED_END", "SEED_MIN",
    "ChoiceResult", "Choices", "GenerateArgs", "GenerateEvent", "GenerateResult",
    "LogprobEntry", "Pin", "PinReport", "PrefillEvent", "PrefillReport", "Sampling", "Sessions", "TokensEvent",
    "TopLogprob", "event_from_wire",
]
