"""Sampling settings shared by the engine, the terminal chat, the HTTP server, eval and RL: the
defaults a reply is sampled with, the limits a person may set, the one rule for what counts as
greedy and the one floor under top_p. Plain numbers, no torch, so the chat and server front ends
check a setting before any model loads."""

from __future__ import annotations

import math

# Defaults of a chat reply (terminal chat and HTTP server alike).
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_K = 50  # 0 = no top-k cut
DEFAULT_TOP_P = 1.0  # 1.0 = no nucleus cut
DEFAULT_MAX_TOKENS = 256  # new tokens in a reply
DEFAULT_SEED = 0

# The ranges a person may set in the chat and the server API (the web UI's inputs offer the same).
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 200
# torch seeds a generator with up to 64 bits, and the terminal chat adds each turn's number to
# the base seed: 63 bits leave room for any conversation.
MAX_SEED = 2**63 - 1

# The unscaled distribution, softmax(logits): the engine's default and RL's rollouts.
UNSCALED_TEMPERATURE = 1.0

# Temperatures below this sample greedily (argmax). At T = 1e-4, softmax(logits / T) already gives
# exactly zero probability to every id more than 0.0104 below the top logit (fp32 exp rounds to 0
# below about e^-104), a gap finer than bf16 resolves logits of magnitude 2 or more (spacing 0.0156):
# the draw is the argmax but for near-ties. Much lower temperatures cannot be sampled at all:
# logits / T overflows fp32 (|logit| / T > 3.4e38, e.g. a soft-capped 15 at T = 1e-40), and
# inf - inf makes NaN probabilities, which no draw can use.
GREEDY_TEMPERATURE = 1e-4

# top_p below this keeps the most likely id alone, which is what any top_p below it means anyway:
# of V ids the most likely has probability at least 1/V, and no tokenizer has 1e9 ids
# (tokenizer.vocab_size's ceiling), so the nucleus of a top_p under 1e-9 is that one id and
# raising top_p to the floor changes no draw. It keeps the value clear of fp32, where the engine
# compares probabilities: a top_p under 7e-46 (half the smallest fp32 subnormal) rounds to 0
# there, and "mass before >= 0" would drop even the top id, leaving nothing to draw.
TOP_P_FLOOR = 1e-9


def check_temperature(temperature: float) -> None:
    """Refuse a negative, infinite or NaN temperature with a ValueError."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 is greedy)")


def is_greedy(temperature: float) -> bool:
    """Whether `temperature` means argmax decoding: 0, or anything below GREEDY_TEMPERATURE. The one
    place that decides it; a temperature check_temperature refuses raises its ValueError."""
    check_temperature(temperature)
    return temperature < GREEDY_TEMPERATURE


def check_top_p(top_p: float) -> None:
    """Refuse a top_p outside (0, 1], infinite or NaN, with a ValueError."""
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p} must be a finite number in (0, 1] (1 = no nucleus cut)")


def nucleus_top_p(top_p: float | None) -> float | None:
    """The top_p to cut with: None for no cut (None or 1), else top_p raised to TOP_P_FLOOR. The
    one place that decides it; a top_p check_top_p refuses raises its ValueError."""
    if top_p is None:
        return None
    check_top_p(top_p)
    return None if top_p >= 1.0 else max(top_p, TOP_P_FLOOR)
