"""Single-rank greedy decode throughput: SPLASH's LLM vs transformers' generate, same tiny weights, same batch.

    .venv/bin/python benchmarks/bench_decode_vs_hf.py [--threads 1] [--batch 32] [--prompt-len 32] [--new 64]
        [--dtype float32|bfloat16|fp32|bf16] [--attention-backend torch|triton] [--json FILE]

A tiny random DeepSeek-V3 (hidden 256, 4 layers, 8 heads, MoE with 16 routed experts, top-4 of 2-of-4 groups)
is written with `save_pretrained` to a temp dir and loaded by both, in `--dtype` (bfloat16: weights, activations
and SPLASH's KV cache in bf16; transformers' cache follows its model dtype; on a CPU without bf16 units SPLASH
multiplies bf16 operands in fp32, see splash.models.linear.bf16_units). Both run `batch` prompts of equal
length (so transformers needs no padding) for `new` greedy tokens with EOS disabled.

Decode tokens/s = batch x (new - 1) / (time(new tokens) - time(1 token)): the prefill and the first token are
timed separately (max_tokens = 1) and subtracted. The engines run interleaved (HF, SPLASH, HF, ...) and each
figure is the best of `--repeats` runs, on the wall clock and on process CPU time (with one thread, the CPU
time is what the process actually got — robust when other jobs share the cores). The generated tokens of both
engines are compared; a request that diverges is reported with HF's top-2 logit gap at that step.
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

from splash.bench import results as R  # noqa: E402
from splash.bench.tables import TableSpec, print_tables  # noqa: E402
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


def hf_runner(path: Path, prompts: list[list[int]], dtype: str = "float32"):
    model = load_hf(path, getattr(torch, dtype))
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


def splash_runner(path: Path, prompts: list[list[int]], block_size: int, dtype: str = "float32",
                  attention_backend: str = "torch"):
    llm = LLM(str(path), block_size=block_size, max_num_batched_tokens=4096, max_num_seqs=len(prompts),
              dtype=dtype, kv_cache_dtype=dtype, attention_backend=attention_backend,
              kv_cache_memory_bytes=256 << 20, comm=SingleRankCommunicator())

    def run(new: int) -> list[list[int]]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs]

    return run


def measure(runs: dict, batch: int, new: int, repeats: int) -> dict[str, dict]:
    """Interleave the engines (A B A B ...) so load from other processes hits both alike; keep each one's best.
    Each repeat times max_tokens=1 then max_tokens=new back to back; decode time is their difference within the
    same repeat (best over repeats). Clocks: wall and process CPU time (one thread: the CPU this process got)."""
    times = {name: {"wall": [], "cpu": []} for name in runs}
    tokens = {}
    for name, run in runs.items():
        run(2)  # warm-up
    for _ in range(repeats):
        for name, run in runs.items():
            pair = {"wall": [], "cpu": []}
            for n in (1, new):
                w0, c0 = time.perf_counter(), time.process_time()
                out = run(n)
                pair["wall"].append(time.perf_counter() - w0)
                pair["cpu"].append(time.process_time() - c0)
            tokens[name] = out
            for kind in pair:
                times[name][kind].append(tuple(pair[kind]))
    res = {}
    for name in runs:
        r = {"tokens": tokens[name]}
        for kind, pairs in times[name].items():
            first = min(a for a, _ in pairs)
            full = min(b for _, b in pairs)
            decode = min(b - a for a, b in pairs)
            r[kind] = {"prefill_s": first, "total_s": full, "decode_tps": batch * (new - 1) / decode,
                       "e2e_tps": batch * new / full}
        res[name] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both engines")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (greedy, EOS ignored)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "fp32", "bf16"),
                    help="weights, activations and KV cache of both engines (fp32 / bf16: the same)")
    ap.add_argument("--attention-backend", default="torch", choices=("torch", "triton"))
    ap.add_argument("--json", metavar="FILE", help="write the result as a splash-bench JSON (kind 'vs-hf')")
    args = ap.parse_args()
    args.dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(args.dtype, args.dtype)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from rich.console import Console

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_deepseek(Path(tmp) / "bench", tokenizer=False, **BENCH_MODEL)
        prompts = random_prompts([args.prompt_len] * args.batch, seed=0, vocab=BENCH_MODEL["vocab_size"])
        res = measure({"hf": hf_runner(path, prompts, args.dtype),
                       "splash": splash_runner(path, prompts, args.block_size, args.dtype, args.attention_backend)},
                      args.batch, args.new, args.repeats)
        hf, ours = res["hf"], res["splash"]
        same = [a == b for a, b in zip(ours["tokens"], hf["tokens"])]
        diverged = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
                    for i, (a, b) in enumerate(zip(ours["tokens"], hf["tokens"])) if a != b]
        gaps = [near_tie_gap(path, prompts[i], hf["tokens"][i][:j]) for i, j in diverged]

    table = TableSpec(f"Single-rank greedy decode: batch {args.batch} x prompt {args.prompt_len} -> "
                      f"{args.new} new tokens, {args.dtype}, {args.threads} thread(s), torch {torch.__version__}, "
                      f"best of {args.repeats} interleaved runs",
                      ["engine", "clock", "prefill + 1st token (s)", "total (s)", "decode tok/s", "end-to-end tok/s"])
    for kind in ("wall", "cpu"):
        for name, r in (("transformers generate", hf), ("SPLASH LLM", ours)):
            x = r[kind]
            table.add_row([name, kind, f"{x['prefill_s']:.3f}", f"{x['total_s']:.3f}", f"{x['decode_tps']:.0f}",
                           f"{x['e2e_tps']:.0f}"])
        a, b = hf[kind], ours[kind]
        table.add_row(["SPLASH / transformers", kind, f"{a['prefill_s'] / b['prefill_s']:.2f}x",
                       f"{a['total_s'] / b['total_s']:.2f}x", f"{b['decode_tps'] / a['decode_tps']:.2f}x",
                       f"{b['e2e_tps'] / a['e2e_tps']:.2f}x"], bold_cols=(0, 4), end_section=True)
    if args.json:
        write_result(args, res, sum(same))
    console = Console(width=130)
    print_tables([table], console)
    console.print(f"identical greedy tokens: {sum(same)}/{args.batch} requests")
    for (i, j), gap in zip(diverged, gaps):
        console.print(f"  request {i} diverges at new token {j} (HF's top-2 logit gap there: {gap:.2e}); with "
                      "MoE an fp32-level near-tie in expert routing upstream can also flip a token")


def write_result(args, res: dict, identical: int) -> None:
    """One run per engine (mode 'hf' / 'splash'), decode tokens/s on the CPU clock as output_tokens_per_s."""
    env = R.environment(backend="cpu", ranks=1, model={"name": "bench tiny deepseek_v3", "dtype": args.dtype,
                                                       "kv_cache_dtype": args.dtype, **BENCH_MODEL})
    config = {k: getattr(args, k) for k in ("threads", "batch", "prompt_len", "new", "block_size", "repeats")}
    runs = [{"mode": name, "output_tokens_per_s": r["cpu"]["decode_tps"], "clocks": {k: r[k] for k in ("wall", "cpu")}}
            for name, r in res.items()]
    R.write_runs(args.json, "vs-hf", env, config, None, runs, identical_requests=identical)


@torch.no_grad()
def near_tie_gap(path: Path, prompt: list[int], prefix: list[int]) -> float:
    """HF's top-1 minus top-2 logit after prompt + prefix (full forward, no cache)."""
    model = load_hf(path)
    top = model(torch.tensor([prompt + prefix]), use_cache=False).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


if __name__ == "__main__":
    main()
