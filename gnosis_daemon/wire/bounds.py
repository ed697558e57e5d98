"""The bounds of ``generate``'s arguments that both the host and the station enforce.

Each is the one definition: the host refuses past them with OpenAI's error shapes
(``host.sampling_fields``, ``host.choice_fields``, ``host.openai_api``), the station with
``bad_request`` (``gnosis_daemon.wire.generate``).
"""

from __future__ import annotations

from typing import Final

# OpenAI's bounds of the sampling controls: penalties in [-PENALTY_MAX, PENALTY_MAX], a
# logit bias in [-BIAS_MAX, BIAS_MAX] on at most MAX_LOGIT_BIAS tokens.
PENALTY_MAX: Final = 2.0
BIAS_MAX: Final = 100.0
MAX_LOGIT_BIAS: Final = 300
# Stop strings are matched on the station's socket thread after every token, at a cost that
# grows with their number and with the square of their length: both are bounded.
MAX_STOP_STRINGS: Final = 16
MAX_STOP_CHARS: Final = 512
MAX_CHOICES: Final = 16  # n: choices forked from one prefill (station.engine.forks)
MAX_LOGPROBS: Final = 20  # top alternatives per token (OpenAI's top_logprobs bound)
MAX_TOOLS: Final = 128  # tools the chat template renders
# A seed is an int64 or a uint64 (what msgpack carries); the generator takes its 64 bits,
# so a negative seed is the same as that seed plus 2**64.
SEED_MIN: Final = -(2**63)
SEED_END: Final = 2**64
# TTL pins (gnosis_daemon.wire.pins): at most MAX_PINS per generate, each kept at most
# PIN_TTL_MAX_S (30 days) past its last hit.
MAX_PINS: Final = 8
PIN_TTL_MAX_S: Final = 2_592_000
