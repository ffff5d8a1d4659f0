"""The batch sampler (rank 0 only): every sampling parameter applied to all rows of a step at once.

Order (vLLM v1's), in fp32: grammar mask (splash.engine.grammar) → logit_bias → min_tokens (EOS and stop ids
masked; not on grammar rows, whose grammar says where the output may end) → penalties (repetition on prompt + output
tokens, then frequency and presence on output tokens) → greedy rows take the argmax; random rows: temperature → min_p
→ top_k → top_p (on the top_k survivors) → one exponential race (argmax of p / q, q ~ Exp(1), drawn from the
request's own generator when it is seeded, else from the sampler's shared one).

Every step costs a fixed number of tensor ops over [rows, vocab]; Python loops only over requests, never over the
vocabulary. A request's penalty state is its output-token counts ([vocab]) and, with a repetition penalty, a mask
of its prompt tokens.

Logprobs are of the distribution the token was sampled from: after bias, min_tokens and penalties, and for
random rows after temperature and the min_p/top_k/top_p masks (vLLM's "processed" logprobs; -inf is reported
as -9999.0, as vLLM does). Prompt logprobs (`prompt_logprobs`) are the model's raw log-softmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splash.engine.grammar import GrammarRows
from splash.engine.sampling import SamplingParams

NEG_INF_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprob and 1-based rank of one token, and the top-k (token id, logprob) of its distribution."""
    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class _State:
    params: SamplingParams
    gen: torch.Generator | None
    stop_ids: torch.Tensor                  # masked while fewer than min_tokens tokens were generated
    bias_ids: torch.Tensor | None
    bias_vals: torch.Tensor | None
    prompt_mask: torch.Tensor | None        # [V] bool, with a repetition penalty
    counts: torch.Tensor | None             # [V] fp32 output-token counts, with any penalty
    num_out: int = 0


def _clean(v: float) -> float:
    return v if v > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def logprob_rows(lp: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """TokenLogprobs of `tokens` [n] under log-probabilities `lp` [n, V], with the top ks[i] of row i."""
    chosen = lp.gather(1, tokens[:, None])
    rank = ((lp > chosen).sum(-1) + 1).tolist()
    top_v, top_i = (t.tolist() for t in lp.topk(max(ks, default=0), -1))
    out = []
    for i, (t, v) in enumerate(zip(tokens.tolist(), chosen[:, 0].tolist())):
        top = tuple((top_i[i][j], _clean(top_v[i][j])) for j in range(ks[i]))
        out.append(TokenLogprobs(t, _clean(v), rank[i], top))
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Raw log-softmax logprobs of `targets` (the next prompt tokens) under logits [n, V]."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), -1)
    return logprob_rows(lp, torch.tensor(targets, dtype=torch.long, device=lp.device), [k] * len(targets))


class Sampler:
    def __init__(self, vocab_size: int, shared: torch.Generator | None = None, device="cpu") -> None:
        """`device`: where the logits arrive (the engine's device); per-request state and generators live there."""
        self.vocab, self.device = vocab_size, torch.device(device)
        self.states: dict[str, _State] = {}
        if shared is None:
            shared = torch.Generator(device=self.device)
            shared.seed()
        self.shared = shared
        self.grammars = GrammarRows(vocab_size)

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, stop_ids) -> None:
        """Register a request (ValueError for a logit_bias token outside the vocabulary)."""
        V, dev = self.vocab, self.device
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {V})")
        bias_ids = bias_vals = prompt_mask = counts = None
        if params.logit_bias:
            bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=dev)
            bias_vals = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=dev)
        if params.repetition_penalty != 1:
            prompt_mask = torch.zeros(V, dtype=torch.bool, device=dev)
            prompt_mask[torch.tensor([t for t in prompt if 0 <= t < V], dtype=torch.long, device=dev)] = True
        if params.penalised:
            counts = torch.zeros(V, dtype=torch.float32, device=dev)
        stops = sorted(t for t in stop_ids if 0 <= t < V)
        if len(stops) == V:   # masking them all would leave nothing to sample; the scheduler keeps min_tokens
            stops = []
        stops = torch.tensor(stops, dtype=torch.long, device=dev)
        if params.grammar is not None:
            self.grammars.add(req_id, params.grammar, stop_ids)
        # a seeded random request draws from its own generator, the others from the shared one
        gen = None if params.greedy or params.seed is None else torch.Generator(device=dev).manual_seed(params.seed)
        self.states[req_id] = _State(params, gen, stops, bias_ids, bias_vals, prompt_mask, counts)

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.grammars.remove(req_id)

    def take_failed(self) -> dict[str, Exception]:
        """Requests whose grammar failed in the last ``sample`` calls (their tokens there must be dropped)."""
        return self.grammars.take_failed()

    def processed(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """The logits each row samples from [B, V]: bias, min_tokens and penalties on every row; temperature and
        the min_p/top_k/top_p masks on random rows (greedy rows take the argmax of theirs)."""
        st = [self.states[r] for r in req_ids]
        x = logits.float().clone()
        self.grammars.mask(x, req_ids)
        self._bias(x, st)
        self._min_tokens(x, st)
        self._penalties(x, st)
        rand = [i for i, s in enumerate(st) if not s.params.greedy]   # temperature < SAMPLING_EPS: greedy
        if rand:
            rows = torch.tensor(rand, dtype=torch.long, device=x.device)
            temps = torch.tensor([st[i].params.temperature for i in rand], dtype=torch.float32, device=x.device)
            x[rows] = self._truncate(x[rows] / temps[:, None], [st[i] for i in rand])
        return x

    def sample(self, logits: torch.Tensor, req_ids: list[str]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of logits [B, V] (row i belongs to req_ids[i]); and its logprobs where asked."""
        if not req_ids:
            return [], []
        st = [self.states[r] for r in req_ids]
        x = self.processed(logits, req_ids)
        tokens = x.argmax(-1)
        rand = [i for i, s in enumerate(st) if not s.params.greedy]
        if rand:
            rows = torch.tensor(rand, dtype=torch.long, device=x.device)
            tokens[rows] = self._race(torch.softmax(x[rows], -1), [st[i] for i in rand])
        want = [i for i, s in enumerate(st) if s.params.logprobs is not None]
        lps: list[TokenLogprobs | None] = [None] * len(st)
        if want:
            rows = torch.tensor(want, dtype=torch.long, device=x.device)
            got = logprob_rows(torch.log_softmax(x[rows], -1), tokens[rows], [st[i].params.logprobs for i in want])
            for i, t in zip(want, got):
                lps[i] = t
        out = tokens.tolist()
        self.grammars.accept(req_ids, out)
        for s, t in zip(st, out):
            s.num_out += 1
            if s.counts is not None:
                s.counts[t] += 1
        return out, lps

    # ---- the steps, each one op over the rows that need it ----------------------------------------------
    @staticmethod
    def _bias(x: torch.Tensor, st: list[_State]) -> None:
        rows = [i for i, s in enumerate(st) if s.bias_ids is not None]
        if not rows:
            return
        r = torch.cat([torch.full_like(st[i].bias_ids, i) for i in rows])
        x.index_put_((r, torch.cat([st[i].bias_ids for i in rows])),
                     torch.cat([st[i].bias_vals for i in rows]), accumulate=True)

    @staticmethod
    def _min_tokens(x: torch.Tensor, st: list[_State]) -> None:
        rows = [i for i, s in enumerate(st) if s.num_out < s.params.min_tokens and s.stop_ids.numel()
                and s.params.grammar is None]
        if rows:
            r = torch.cat([torch.full_like(st[i].stop_ids, i) for i in rows])
            x[r, torch.cat([st[i].stop_ids for i in rows])] = float("-inf")

    def _penalties(self, x: torch.Tensor, st: list[_State]) -> None:
        idx = [i for i, s in enumerate(st) if s.counts is not None]
        if not idx:
            return
        rows = torch.tensor(idx, dtype=torch.long, device=x.device)
        ps = [st[i].params for i in idx]
        counts = torch.stack([st[i].counts for i in idx])
        seen = counts > 0
        xs = x[rows]
        if any(p.repetition_penalty != 1 for p in ps):
            none = torch.zeros(self.vocab, dtype=torch.bool, device=x.device)
            prompt = torch.stack([st[i].prompt_mask if st[i].prompt_mask is not None else none for i in idx])
            rep = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=x.device)[:, None]
            pen = torch.where(prompt | seen, rep, torch.ones((), device=x.device))
            xs = torch.where(xs > 0, xs / pen, xs * pen)
        freq = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=x.device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=x.device)[:, None]
        x[rows] = xs - freq * counts - pres * seen

    @staticmethod
    def _truncate(x: torch.Tensor, st: list[_State]) -> torch.Tensor:
        """min_p, then top_k, then top_p (renormalised after top_k): masked logits become -inf."""
        n, V = x.shape
        min_p = torch.tensor([s.params.min_p for s in st], dtype=torch.float32, device=x.device)
        if bool((min_p > 0).any()):
            probs = torch.softmax(x, -1)
            x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
        k = torch.tensor([s.params.top_k if s.params.top_k > 0 else V for s in st], dtype=torch.long, device=x.device)
        top_p = torch.tensor([s.params.top_p for s in st], dtype=torch.float32, device=x.device)
        if not bool((k < V).any() or (top_p < 1).any()):
            return x
        sx, idx = x.sort(-1, descending=True)
        sx = sx.masked_fill(torch.arange(V, device=x.device)[None, :] >= k[:, None], float("-inf"))
        sp = torch.softmax(sx, -1)
        before = sp.cumsum(-1) - sp           # mass of the better tokens: the first token always stays
        sx = sx.masked_fill((before >= top_p[:, None]) & (top_p < 1)[:, None], float("-inf"))
        return torch.empty_like(x).scatter_(-1, idx, sx)

    def _race(self, probs: torch.Tensor, st: list[_State]) -> torch.Tensor:
        """argmax(p / q), q ~ Exp(1) per element: a sample from p. Seeded requests draw their own q."""
        q = torch.empty_like(probs).exponential_(generator=self.shared)
        for i, s in enumerate(st):
            if s.gen is not None:
                q[i].exponential_(generator=s.gen)
        return (probs / q.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)
