"""What the engine reads off vLLM's outputs: each sampled token's logprob, and which weight version produced each
token of a response when a weight update landed while it was generated.

The engine asks vLLM for one output per request, at its end (`RequestOutputKind.FINAL_ONLY`), instead of one per
token: each output costs vLLM's front end a `RequestOutput` and the waiting request a wake-up. The tokens' weight
versions then come from boundaries: when an update lands, the engine notes how many tokens each running request has
so far (`OutputCounter`); tokens before that count came from the old weights, the rest from the new ones. A vLLM
whose front end does not hold those counts gets one output per token instead (`output_counter` returns None), and
the engine labels each token with the version current when it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

OutputCounter = Callable[[str], "int | None"]
"""Tokens vLLM's front end holds for a running request (by the engine's request id); None once the request is
finished (its whole output is then on its way to the caller) or unknown."""


def output_counter(llm) -> OutputCounter | None:
    """How many tokens vLLM's front end (`AsyncLLM.output_processor`) has taken in for a request, or None when this
    vLLM keeps its request states some other way (checked on vLLM 0.32: `request_states` by internal id, and
    `external_req_ids` from the id the caller gave to its internal ones; the detokenizer counts the output tokens
    even with `detokenize=False`)."""
    processor = getattr(llm, "output_processor", None)
    states = getattr(processor, "request_states", None)
    external = getattr(processor, "external_req_ids", None)
    if not isinstance(states, dict) or not isinstance(external, dict):
        return None

    def count(request_id: str) -> int | None:
        internal = external.get(request_id)  # .get: a defaultdict, which a lookup would grow
        state = states.get(internal[0]) if internal and len(internal) == 1 else None
        detokenizer = getattr(state, "detokenizer", None)
        return None if detokenizer is None else detokenizer.num_output_tokens()

    return count


def token_versions(count: int, start: int, boundaries: Sequence[tuple[int, int]]) -> list[int]:
    """The weight version of each of a response's `count` tokens: `start` (the engine's version when the request
    was sent) until the first boundary, then each boundary's version from its token count on. `boundaries` are
    (tokens so far, new version) in the order the updates landed."""
    versions, position, version = [], 0, start
    for at, new in boundaries:
        at = min(max(at, position), count)
        versions += [version] * (at - position)
        position, version = at, new
    return versions + [version] * (count - position)


def sampled_logprob(entry, token_id: int) -> float:
    """The logprob of the sampled token from one vLLM logprobs entry (dict token -> Logprob)."""
    if entry is None:
        return float("nan")
    item = entry.get(token_id)
    return float(item.logprob if hasattr(item, "logprob") else item)
