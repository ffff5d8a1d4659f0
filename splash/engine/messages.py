"""The records that cross the engine's boundaries (pure data, no torch), one per boundary: `EngineRequest` (API ->
engine), `StepMessage` / `StopMessage` (rank 0 -> every rank, each step; every rank acts on it in the same order, so
a step's collectives line up; its `StepItem`s go to the step batch as they are, splash.attention.batch.StepPiece),
`TokenEvent` and `RequestFailure` (engine -> API). The scheduler's `Request` stays inside the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from splash.switching.block_plan import CachedBlock
from splash.switching.manifest import ReqState

if TYPE_CHECKING:
    from splash.engine.sampler import TokenLogprobs
    from splash.engine.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One sequence for the engine: `params` are validated (SamplingParams checks them) and carry the compiled
    grammar, if any; the engine adds the model's EOS ids to the stop ids unless `ignore_eos`."""
    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))


@dataclass
class TokenEvent:
    """One sampled token of one request, as the engine hands it back (its last carries `finish_reason`)."""
    req_id: str
    token: int
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None                  # when the request asked for `logprobs`
    prompt_logprobs: list[TokenLogprobs] | None = None     # prompt tokens 1.. (first event, `prompt_logprobs`)
    cached_tokens: int = 0                                 # prompt tokens its first admission found cached


class RequestFailure(NamedTuple):
    """Request `req_id` failed alone with `error` (its row could not be sampled, or its grammar failed)."""
    req_id: str
    error: Exception


@dataclass(frozen=True)
class StepItem:
    """One request's piece of the step: `tokens` at positions `start_pos`…; `sample` its last row; its owner
    rank (DP-attn/DOP owner, CP anchor)."""
    req_id: str
    start_pos: int
    tokens: tuple[int, ...]
    sample: bool
    owner: int

    @property
    def num_new(self) -> int:
        return len(self.tokens)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)


class BlockHash(NamedTuple):
    """Full block `block` of request `req_id`, named by its prefix hash `hash` (the tokens up to its end)."""
    req_id: str
    block: int
    hash: int


class CacheHit(NamedTuple):
    """Request `req_id` starts on cached blocks: its leading blocks named by `hashes`, held where `owner` (its
    DP-attn/DOP owner, CP anchor) puts them."""
    req_id: str
    owner: int
    hashes: tuple[int, ...]


PerRank = tuple[tuple[int, ...], ...]   # one tuple of block / snapshot hashes per rank, rank 0 first


@dataclass(frozen=True)
class SwitchPlan:
    """A layout switch handed off at this step's boundary: per request its ReqState (KV tokens, src/dst owners,
    hashes of its shared cached blocks); the idle cached blocks (oldest first) with each rank's cap for them and whether they may be sent (splash.switching.block_plan): every rank plans the same manifest."""
    dst: str
    mode: str
    reqs: dict[str, ReqState] = field(default_factory=dict)
    cached: tuple[CachedBlock, ...] = ()
    cached_cap: tuple[int, ...] = ()
    move_cached: bool = False


@dataclass(frozen=True)
class StepMessage:
    items: tuple[StepItem, ...]
    release: tuple[str, ...] = ()            # requests whose KV every rank frees before the step
    switch: SwitchPlan | None = None
    logits: tuple[int, ...] = ()             # items whose prompt rows' logits come back (prompt logprobs)
    # prefix cache (splash.engine.ledger decides; every rank applies, in this order, before the step):
    register: tuple[BlockHash, ...] = ()     # blocks the last step filled, cached now
    evict: PerRank = ()                      # cached blocks to free
    attach: tuple[CacheHit, ...] = ()        # requests starting on cached blocks
    # KDA state snapshots of a hybrid model (splash.engine.state_snapshots): dropped per rank after the attaches,
    # taken during the step (a request's state at the end of its block, named by that block's hash)
    unsnap: PerRank = ()                     # snapshots to drop
    snapshot: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class ReloadWeights:
    """Every rank loads `model_path`'s weights into its current layout's (Engine.update_weights), between steps."""
    model_path: str


@dataclass(frozen=True)
class StopMessage:
    """Followers leave their step loop."""
