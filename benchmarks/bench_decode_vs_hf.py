"""Single-rank greedy decode throughput: SPLASH's LLM vs transformers' generate, same tiny weights, same batch.

    .venv/bin/python benchmarks/bench_decode_vs_hf.py [--threads 1] [--batch 32] [--prompt-len 32] [--new 64]

A tiny random DeepSeek-V3 (hidden 256, 4 layers, 8 heads, MoE with 16 routed experts, top-4 of 2-of-4 groups)
is written with `save_pretrained` to a temp dir and loaded by both. Both run `batch` prompts of equal length
(so transformers needs no padding) for `new` greedy tokens with EOS disabled.

Decode tokens/s = batch x (new - 1) / (time(new tokens) - time(1 token)): the prefill and the first token are
timed separately (max_tokens = 1) and subtracted. Each figure is the best of `--repeats` runs. The generated
tokens of both engines are compared and the result printed.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import load_hf, make_tiny_deepseek, random_prompts  # noqa: E402

from splash.distributed.communicator import SingleRankCommunicator  # noqa: E402
from splash.engine.llm import LLM  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402

BENCH_MODEL = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32,
    qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=2048,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings":
                     512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def hf_runner(path: Path, prompts: list[list[int]]):
    model = load_hf(path)
    ids = torch.tensor(prompts, dtype=torch.long)
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = []  # never stop early (None would fall back to config.json's EOS)
    gen_cfg.pad_token_id = model.config.pad_token_id

    @torch.no_grad()
    def run(new: int) -> list[list[int]]:
        y = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg, do_sample=False,
                           max_new_tokens=new)
        return y[:, ids.shape[1]:].tolist()

    return run


def splash_runner(path: Path, prompts: list[list[int]], block_size: int):
    llm = LLM(str(path), block_size=block_size, max_num_batched_tokens=4096, max_num_seqs=len(prompts),
              kv_cache_memory_bytes=256 << 20, comm=SingleRankCommunicator())

    def run(new: int) -> list[list[int]]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs]

    return run


def measure(run, batch: int, new: int, repeats: int) -> dict:
    run(2)  # warm-up
    t_first, _ = best_of(lambda: run(1), repeats)
    t_full, toks = best_of(lambda: run(new), repeats)
    decode = t_full - t_first
    return {"tokens": toks, "e2e_s": t_full, "prefill_s": t_first, "decode_s": decode,
            "decode_tps": batch * (new - 1) / decode, "e2e_tps": batch * new / t_full}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both engines")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (greedy, EOS ignored)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_deepseek(Path(tmp) / "bench", tokenizer=False, **BENCH_MODEL)
        prompts = random_prompts([args.prompt_len] * args.batch, seed=0, vocab=BENCH_MODEL["vocab_size"])
        hf = measure(hf_runner(path, prompts), args.batch, args.new, args.repeats)
        ours = measure(splash_runner(path, prompts, args.block_size), args.batch, args.new, args.repeats)

    same = sum(a == b for a, b in zip(ours["tokens"], hf["tokens"]))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(ours["tokens"], hf["tokens"])]
    table = Table(title=f"Single-rank greedy decode: batch {args.batch} x prompt {args.prompt_len} -> "
                        f"{args.new} new tokens, {args.threads} thread(s), torch {torch.__version__}")
    for col in ("engine", "prefill+1st tok (s)", "total (s)", "decode tok/s", "end-to-end tok/s"):
        table.add_column(col, justify="right")
    for name, r in (("transformers generate", hf), ("SPLASH LLM", ours)):
        table.add_row(name, f"{r['prefill_s']:.3f}", f"{r['e2e_s']:.3f}", f"{r['decode_tps']:.0f}",
                      f"{r['e2e_tps']:.0f}")
    table.add_row("ratio SPLASH / transformers", f"{hf['prefill_s'] / ours['prefill_s']:.2f}x faster",
                  f"{hf['e2e_s'] / ours['e2e_s']:.2f}x faster", f"{ours['decode_tps'] / hf['decode_tps']:.2f}x",
                  f"{ours['e2e_tps'] / hf['e2e_tps']:.2f}x")
    console = Console()
    console.print(table)
    console.print(f"identical greedy tokens: {same}/{args.batch} requests"
                  + ("" if same == args.batch else f" (first differing step per request: {first_diff})"))


if __name__ == "__main__":
    main()
