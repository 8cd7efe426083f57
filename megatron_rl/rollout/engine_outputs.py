"""What the engine reads off vLLM's outputs: each sampled token's logprob, and which weight version produced each
token of a response when weight updates landed while it was generated.

The engine asks vLLM for one output per request, at its end (`RequestOutputKind.FINAL_ONLY`), instead of one per
token: each output costs vLLM's front end a `RequestOutput` and the waiting request a wake-up. The tokens' weight
versions come from vLLM itself: the engine tells vLLM each version it loads (`AsyncLLM.update_weight_version`,
while generation is paused), vLLM's engine core stamps every step's outputs with it, and the final output carries
the spans of tokens each version sampled (`CompletionOutput.weight_versions`, vLLM 0.32). A vLLM without that gets
one output per token instead (`has_weight_versions`), and the engine labels each token with the version current
when it arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence


def has_weight_versions(llm) -> bool:
    """Whether this vLLM labels its outputs with the weight versions the engine gives it."""
    return callable(getattr(llm, "update_weight_version", None))


async def label_versions(llm, version: int, timeout_s: float) -> None:
    """Have vLLM label the outputs of every step from now on with weight `version` (TimeoutError past `timeout_s`)."""
    await asyncio.wait_for(llm.update_weight_version(str(version)), timeout_s)


def span_versions(spans: Sequence | None, count: int) -> list[int] | None:
    """The weight version of each of a response's `count` tokens from vLLM's spans (`WeightVersionSpan`: version
    as the engine gave it, tokens `[start, end)`), or None when the spans do not cover exactly those tokens."""
    if not count:
        return []
    versions: list[int] = []
    for span in spans or ():
        if span.start != len(versions) or span.end < span.start or not str(span.version).isdigit():
            return None  # a gap, an overlap, or tokens vLLM labelled with something other than our version
        versions += [int(span.version)] * (span.end - span.start)
    return versions if len(versions) == count else None


def sampled_logprob(entry, token_id: int) -> float:
    """The logprob of the sampled token from one vLLM logprobs entry (dict token -> Logprob)."""
    if entry is None:
        return float("nan")
    item = entry.get(token_id)
    return float(item.logprob if hasattr(item, "logprob") else item)
