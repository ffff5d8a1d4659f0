"""Per-token cost of structured output's grammar mask in rank 0's sampler (``splash-bench grammar``, one process).

Times ``Sampler.sample`` on a [batch, vocab] step of random logits in two samplers, step for step in turn: one with
every row under a grammar (each request's xgrammar matcher fills its bitmask row, the mask is applied, the sampled
tokens are accepted), one with no row under one.
The difference per row is what a constrained token costs on top of sampling. A row whose grammar finishes is
replaced by a fresh request, so the matchers stay busy mid-document.

The vocabulary is synthetic unless ``--tokenizer DIR`` names a tokenizer.json: the 256 bytes, then word pieces cut
from the Python standard library's source (identifiers, punctuation runs, JSON-ish fragments like ``": "``) up to
``--vocab`` tokens — a stand-in for a real BPE vocabulary of that size, which this machine cannot download.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

DEFAULT_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=32, help="rows per step (default 32)")
    p.add_argument("--vocab", type=int, default=129280, help="vocabulary size (default DeepSeek-V3's 129280)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per mode (default 60)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json (else a synthetic vocabulary)")
    p.add_argument("--schema", default=None, help="a JSON schema file (default: a 4-field object schema)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: the CPU times are "
                                                          "then this thread's own, robust on a loaded host)")
    p.add_argument("--out", default=None, help="write the numbers as JSON here")


def synthetic_vocab(size: int) -> list[str]:
    """256 byte tokens, then distinct pieces of stdlib source text (see the module docstring)."""
    vocab = [bytes([b]).decode("latin-1") for b in range(256)]
    seen = set(vocab)
    piece = re.compile(r"[A-Za-z_]+|\d{1,3}|[^\sA-Za-z_\d]{1,3}| [A-Za-z_]+|\s{2,8}")
    for path in sorted(Path(json.__file__).parent.parent.glob("*.py")):
        for tok in piece.findall(path.read_text(encoding="utf-8", errors="ignore")):
            for t in (tok, tok[:4], tok[:8]):
                if t not in seen:
                    seen.add(t)
                    vocab.append(t)
                    if len(vocab) >= size:
                        return vocab
    while len(vocab) < size:   # the source ran out: numbered filler pieces
        vocab.append(f"<unused_{len(vocab)}>")
    return vocab


def _compiled(args) -> tuple[object, int]:
    import xgrammar as xgr

    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    if args.tokenizer:
        from splash.server.structured import tokenizer_info
        from splash.tokenizer import load_tokenizer
        tok = load_tokenizer(args.tokenizer, args.vocab)
        info, eos = tokenizer_info(tok, args.vocab), tok.eos_token_id
    else:
        vocab = synthetic_vocab(args.vocab - 1) + ["</s>"]
        eos = len(vocab) - 1
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=args.vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    print(f"grammar compiled in {1e3 * (time.perf_counter() - t0):.1f} ms")
    return compiled, eos


def run(args) -> int:
    import torch

    from splash.engine.sampler import Sampler
    from splash.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    compiled, eos = _compiled(args)
    B, V = args.batch, args.vocab
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(1)) * 3
    grammar_of = {"plain": None, "grammar": compiled}
    samplers = {mode: Sampler(V, torch.Generator().manual_seed(0)) for mode in grammar_of}
    n = {"next": 0}

    def fresh(mode: str) -> str:
        rid = f"r{n['next']}"
        n["next"] += 1
        params = SamplingParams(max_tokens=1 << 20, temperature=1.0, grammar=grammar_of[mode])
        samplers[mode].add(rid, [1], params, {eos})
        return rid

    def refill(mode: str, toks: list[int]) -> None:
        """A row whose request finished (or whose grammar broke) takes a new request."""
        failed = samplers[mode].take_failed()
        for k, (rid, t) in enumerate(zip(list(rows[mode]), toks)):
            if t == eos or rid in failed:
                samplers[mode].remove(rid)
                rows[mode][k] = fresh(mode)

    rows = {mode: [fresh(mode) for _ in range(B)] for mode in grammar_of}
    results: dict[str, list[float]] = {"plain": [], "grammar": []}
    for i in range(args.warmup + args.steps):   # the modes alternate step by step: the machine's drift cancels
        for mode in grammar_of:
            t0 = clock()
            toks, _ = samplers[mode].sample(logits, rows[mode])
            dt = clock() - t0
            if i >= args.warmup:
                results[mode].append(dt)
            refill(mode, toks)
    # the grammar's own work alone: fill + apply the mask, accept the tokens (the rest of a step is sampling)
    s, rids, own = samplers["grammar"], rows["grammar"], []
    for _ in range(args.steps):
        x = logits.clone()
        t0 = clock()
        s.grammars.mask(x, rids)
        toks = x.argmax(-1).tolist()
        s.grammars.accept(rids, toks)
        own.append(clock() - t0)
        refill("grammar", toks)
    plain, gram = statistics.median(results["plain"]), statistics.median(results["grammar"])
    mask_ms = 1e3 * statistics.median(own)
    per_token_us = 1e6 * (gram - plain) / B
    out = {"batch": B, "vocab": V, "steps": args.steps, "tokenizer": args.tokenizer or "synthetic",
           "step_ms_plain": 1e3 * plain, "step_ms_grammar": 1e3 * gram, "per_token_us": per_token_us,
           "mask_accept_ms": mask_ms, "mask_accept_us_per_token": 1e3 * mask_ms / B,
           "requests_started": n["next"], "torch_threads": torch.get_num_threads(),
           "clock": "thread CPU time" if args.threads == 1 else "wall", "argv": args.argv}
    print(f"batch {B}, vocab {V}: sampler step {1e3 * plain:.2f} ms plain, {1e3 * gram:.2f} ms with a grammar "
          f"on every row -> {per_token_us:.0f} us per constrained token (median of {args.steps} steps; "
          f"{n['next'] - 2 * B} requests finished and were replaced); the grammar's own work (fill + apply the "
          f"mask, accept) {mask_ms:.1f} ms per step = {1e3 * mask_ms / B:.0f} us per token")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from splash.bench.cli import main
    sys.exit(main(["grammar", *sys.argv[1:]]))
