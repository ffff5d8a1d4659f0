"""Sampling parameters (vLLM's names and semantics).

The batch sampler that applies them to every row of a step (and `sample`, one row) is `splash.engine.sampler`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20        # OpenAI's limit for top_logprobs / completions logprobs
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): 1/T would overflow the logits
F32_TINY = 2.0 ** -126   # float32's smallest normal: the sampler computes in float32, smaller magnitudes vanish
MAX_REPETITION_PENALTY = 100.0
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY   # logits / penalty must stay finite in float32


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    # vLLM sampling parameters (neutral defaults: a request that sets none samples exactly as before)
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0     # > 0; on prompt and output tokens (divides positive logits)
    presence_penalty: float = 0.0       # [-2, 2]; on output tokens
    frequency_penalty: float = 0.0      # [-2, 2]; on output tokens, times their count
    min_tokens: int = 0                 # EOS and stop_token_ids are masked until this many tokens
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)   # (token id, bias in [-100, 100])
    logprobs: int | None = None         # None: none; k >= 0: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the top k
    # detokenisation (used by the server; the engine ignores them)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: an xgrammar CompiledGrammar the output must match (splash.server.structured compiles it;
    # rank 0's sampler masks every step with it, splash.engine.grammar). None: unconstrained.
    grammar: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2 ** 63:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty!r}")
        for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v != 0 and abs(v) < F32_TINY:   # it would become 0 in float32: top_p 1e-46 masked every token
                raise ValueError(f"{name} = {v!r} underflows float32 (the sampler's precision): give 0 or a "
                                 f"magnitude of at least {F32_TINY:.4g}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple((int(t), float(b)) for t, b in bias)
        if any(not -100 <= b <= 100 for _, b in bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

