"""How engine tests compare what two runs generated: the same greedy (or seeded) tokens, and the
chosen tokens' logprobs within a tolerance (bf16 sums in another order move them slightly)."""

from __future__ import annotations

LOGPROB_TOLERANCE = 0.03
# The models' attention, 6x sharper than the random weights' (`tiny_models._sharpen_attention`): random
# weights attend almost evenly, so one wrong block of a long prompt can move a logprob less than the
# tolerance. Sharpened, one host block zeroed before its load, or two swapped, parts the tokens (the
# tests' controls: logprobs moved 0.08-0.33), while clean loads still move none (0.0 on these models).
SHARP_ATTENTION = 6.0


def tokens(round_: list[dict]) -> list[list[int]]:
    return [c["tokens"] for c in round_]


def logprob_gaps(round_a: list[dict], round_b: list[dict]) -> list[float]:
    """The largest logprob difference of each completion pair (0 for an empty completion)."""
    return [max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)
            for a, b in zip(round_a, round_b)]


def assert_same_outputs(round_a: list[dict], round_b: list[dict]) -> None:
    """Equal tokens, a logprob for every token, and every logprob within the tolerance."""
    assert tokens(round_a) == tokens(round_b)
    for a, b in zip(round_a, round_b):
        assert len(a["logprobs"]) == len(b["logprobs"]) == len(a["tokens"])
    gaps = logprob_gaps(round_a, round_b)
    assert max(gaps, default=0.0) <= LOGPROB_TOLERANCE, gaps


def outputs_moved(round_a: list[dict], round_b: list[dict]) -> bool:
    """True when the rounds differ beyond the tolerance: other tokens, or a logprob past it."""
    return tokens(round_a) != tokens(round_b) or max(logprob_gaps(round_a, round_b), default=0.0) > LOGPROB_TOLERANCE
