"""A workload file and the requests it stands for — what `splash-bench workload` sends to real servers and
`splash-sim --trace` replays on a predicted clock, so both serve the same requests. Pure: no torch.

A workload is request groups ``{"groups": [{"at_s", "count", "input_len", "output_len"}]}`` (JSON or YAML): at
``at_s`` seconds after the start, ``count`` requests with random token-id prompts of ``input_len`` tokens ask for
``output_len`` greedy tokens with EOS ignored. Optional per group: ``prefix_len`` (the group's prompts start with
the same that many tokens: a system prompt), ``samples`` (each prompt sent that many times: an RL rollout's n
samples), ``stagger_s`` (request k of the group starts k x that many seconds after ``at_s``) and ``turns`` (each
request is a conversation: turn k+1 is sent when turn k has answered, its prompt the whole conversation so far
plus ``input_len`` new tokens: a multi-turn agent).
"""
from __future__ import annotations

import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_WORKLOAD = {"groups": [
    {"at_s": 0.0, "count": 2, "input_len": 64, "output_len": 256},      # interactive: few, short
    {"at_s": 2.0, "count": 30, "input_len": 512, "output_len": 64},     # rollout burst: many requests ...
    {"at_s": 2.0, "count": 2, "input_len": 2048, "output_len": 768},    # ... that ends as a few long ones
]}
VOCAB = 256   # prompt token ids are drawn below this (splash-bench workload --vocab)
SEED = 0      # ... from a generator seeded so (--seed)


class Group(BaseModel):
    """One request group of a workload (see the module docstring); the last four keys are optional."""
    model_config = ConfigDict(strict=True, extra="forbid")
    at_s: float = Field(ge=0)
    count: int = Field(ge=1)
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    prefix_len: int = Field(0, ge=0)
    samples: int = Field(1, ge=1)
    turns: int = Field(1, ge=1)
    stagger_s: float = Field(0.0, ge=0)


class Workload(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    groups: list[Group] = Field(min_length=1)


def load_workload(path: str | None) -> dict:
    """The workload file (JSON or YAML; default: the built-in one), checked, with every optional key filled in."""
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text()) if path is not None else DEFAULT_WORKLOAD
        return Workload.model_validate(data).model_dump()
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the workload: {e}") from None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise ValueError(f"{path}: {'.'.join(map(str, err['loc'])) or 'the workload'}: {err['msg']}") from None


def make_requests(workload: dict, vocab: int = VOCAB, seed: int = SEED) -> list[tuple[float, list[list[int]], int]]:
    """(start offset, the prompt's parts per turn, max_tokens) per request, the same for every run with the same
    seed: part 0 is the first prompt (the group's shared prefix, then its own tokens), part k the tokens a
    conversation adds before turn k + 1."""
    rng = random.Random(seed)
    draw = (lambda n: [rng.randrange(vocab) for _ in range(n)])
    out = []
    for g in workload["groups"]:
        prefix = draw(g["prefix_len"])
        for k in range(g["count"]):
            parts = [prefix + draw(g["input_len"])] + [draw(g["input_len"]) for _ in range(g["turns"] - 1)]
            out += [(float(g["at_s"]) + k * g["stagger_s"], parts, g["output_len"])] * g["samples"]
    return out
