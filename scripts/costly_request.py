"""Send one costly request (a long prompt with prompt_logprobs, n samples) to a 2-rank splash-serve and measure what
it costs the server: wall time, response bytes, rank 0's peak RSS (VmHWM) and RSS afterwards, and the worst
/health latency seen while it ran (polled every 50 ms from a process of its own).

    python scripts/costly_request.py --n 16                      # starts its own server (configs/cpu.yaml)
    python scripts/costly_request.py --n 16 --copies 2           # the same request twice at once
    python scripts/costly_request.py --n 16 --server-args "--max-request-mb 64"

Prints one JSON line per request and a summary line. Loopback only; the server is always taken down.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from server_util import HealthPoller, ServerProc  # noqa: E402


def _kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--prompt-logprobs", type=int, default=20)
    ap.add_argument("--copies", type=int, default=1, help="send this many identical requests at once")
    ap.add_argument("--chat", action="store_true", help="send it to /v1/chat/completions")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--config", default="configs/cpu.yaml")
    ap.add_argument("--server-args", default="")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="splash-costly-"))
    proc = ServerProc(2, "--config", args.config, "--port", "0", "--quiet", *args.server_args.split(), workdir=work)
    try:
        url = proc.wait_ready(180)
        rank0 = proc.rank_pids()[0]
        rng = random.Random(0)
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "x"]) for _ in range(8 * args.prompt_tokens))
        body: dict = {"max_tokens": 1, "n": args.n, "prompt_logprobs": args.prompt_logprobs, "stream": args.stream}
        if args.chat:
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = [rng.randrange(1, 300) for _ in range(args.prompt_tokens)]
        path = "/v1/chat/completions" if args.chat else "/v1/completions"
        rss0 = _kb(rank0, "VmRSS")
        results: list[dict] = []

        def send() -> None:
            t0 = time.monotonic()
            size, status, text = 0, None, b""
            with httpx.stream("POST", url + path, json=body, timeout=600) as r:
                status = r.status_code
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    if status != 200:
                        text += chunk
            results.append({"status": status, "seconds": round(time.monotonic() - t0, 2), "bytes": size,
                            "error": json.loads(text)["error"]["message"][:300] if text else None})

        poller = HealthPoller(url)
        senders = [threading.Thread(target=send) for _ in range(args.copies)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        worst = [poller.stop()]
        time.sleep(1.0)
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"n": args.n, "copies": args.copies, "prompt_tokens": args.prompt_tokens,
                          "rank0_rss_before_mb": round(rss0 / 1024),
                          "rank0_peak_rss_mb": round(_kb(rank0, "VmHWM") / 1024),
                          "rank0_rss_after_mb": round(_kb(rank0, "VmRSS") / 1024),
                          "worst_health_s": round(worst[0], 3)}))
        return 0
    finally:
        proc.kill()


if __name__ == "__main__":
    sys.exit(main())
