"""A request's worst-case cost, known from its fields before it is admitted, and the budget it must fit.

Each sequence (prompts × n) prefills its prompt and decodes up to max_tokens; a token with ``logprobs: k`` (or a
prompt token with ``prompt_logprobs: k``, or ``echo`` + ``logprobs: k``) carries k + 1 entries; prompt logprobs
are computed once per prompt (completions repeat them in each choice, chat returns them once). The response is
written choice by choice, so rank 0 holds each prompt's shared rows, every choice's own entries and one choice's
JSON at a time. The estimates are upper bounds from measured sizes (``ENTRY_*``, ``TOKEN_*``). Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

# Measured on this code (docs/benchmarks.md, "Hardening 2"): one prompt_logprobs entry is 67 bytes of JSON and
# ~600 bytes of Python objects (the engine's (token, logprob) tuple, the response dict with its float and
# decoded-token string); generated tokens cost less, and are charged the same for simplicity.
ENTRY_JSON_BYTES = 72
ENTRY_MEMORY_BYTES = 640
TOKEN_JSON_BYTES = 16          # a generated or echoed token: its text and token id in the JSON
TOKEN_MEMORY_BYTES = 100       # its id in the engine's and the choice's lists, its text, on rank 0
MB = 1 << 20


@dataclass(frozen=True)
class RequestShape:
    prompt_lens: tuple[int, ...]
    n: int
    max_tokens: int                      # per sequence
    sample_k: int | None = None          # logprobs per generated token (None: none)
    prompt_k: int | None = None          # prompt logprobs per prompt token (None: none)
    prompt_k_per_choice: bool = True     # completions repeat prompt logprobs in each choice; chat: once
    echo: bool = False                   # completions echo (with logprobs: the prompt's entries in each choice)
    echo_k: int | None = None            # echo + logprobs: entries per echoed prompt token


@dataclass(frozen=True)
class RequestCost:
    prefill_tokens: int
    decode_tokens: int
    logprob_entries: int       # in the response
    response_bytes: int
    rank0_bytes: int
    driver: str                # the field that costs the most: what to lower


def estimate(s: RequestShape) -> RequestCost:
    seqs = len(s.prompt_lens) * s.n
    prompt_total = sum(s.prompt_lens)
    longest = max(s.prompt_lens, default=0)
    decode = seqs * s.max_tokens
    sample_entries = decode * (s.sample_k + 1) if s.sample_k is not None else 0
    prompt_rows = prompt_total - len(s.prompt_lens)      # the first prompt token has no logprob
    plp_once = prompt_rows * (s.prompt_k + 1) if s.prompt_k is not None else 0
    plp_out = plp_once * (s.n if s.prompt_k_per_choice else 1)
    echo_entries = prompt_total * s.n * (s.echo_k + 1) if s.echo_k is not None else 0
    echo_tokens = prompt_total * s.n if s.echo else 0
    entries = sample_entries + plp_out + echo_entries
    response = entries * ENTRY_JSON_BYTES + (decode + echo_tokens) * TOKEN_JSON_BYTES
    # rank 0 holds the shared prompt rows once, every choice's own entries, and one choice's JSON at a time
    per_choice_json = ((s.max_tokens * ((s.sample_k or 0) + 1) + (longest * ((s.prompt_k or 0) + (s.echo_k or 0) + 2)))
                       * ENTRY_JSON_BYTES)
    rank0 = ((plp_once + sample_entries + echo_entries) * ENTRY_MEMORY_BYTES
             + (prompt_total * s.n + decode) * TOKEN_MEMORY_BYTES + per_choice_json)
    parts = {"prompt_logprobs": plp_out, "logprobs": sample_entries + echo_entries, "n": 0}
    driver = max(parts, key=parts.get) if entries else ("max_tokens" if decode >= prompt_total * s.n else "n")
    return RequestCost(prompt_total * s.n, decode, entries, response, rank0, driver)


def over_budget(cost: RequestCost, budget_mb: float, n: int = 1) -> str | None:
    """The 400 message when `cost` passes the budget, else None."""
    worst = max(cost.rank0_bytes, cost.response_bytes)
    if worst <= budget_mb * MB:
        return None
    what = "rank-0 memory" if cost.rank0_bytes >= cost.response_bytes else "response size"
    lower = f"'{cost.driver}'" if cost.driver == "n" or n == 1 else f"'{cost.driver}' or 'n'"
    return (f"the request's worst case is {worst / MB:.0f} MB of {what} ({cost.prefill_tokens} prompt and "
            f"{cost.decode_tokens} generated tokens over all sequences, {cost.logprob_entries} logprob entries), "
            f"above the server's budget of {budget_mb:g} MB per request (server.max_request_mb): lower {lower}")


def request_shape(req, prompt_lens: list[int], max_tokens: int, chat: bool) -> RequestShape:
    echo = bool(getattr(req, "echo", False))
    sample_k = req.sample_logprobs()
    return RequestShape(tuple(prompt_lens), req.n, max_tokens, sample_k, req.prompt_logprobs,
                        prompt_k_per_choice=not chat, echo=echo,
                        echo_k=sample_k if echo and sample_k is not None else None)
