#!/usr/bin/env python3
"""Load generator for `markbase serve` (or any OpenAI-compatible server), with the official
`openai` client: N concurrent streams, each sending requests back to back, for a fixed number
of requests. Reports aggregate generated tokens per second, time to first token (p50/p99) and
each stream's decode rate.

  tools/serve_load.py --url http://127.0.0.1:8080/v1 --streams 1,4,16 --requests 32 --max-tokens 128

Only loopback or your own servers: the request count bounds the traffic.
"""

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The history of the printing press begins",
    "In the middle of the night, the old lighthouse keeper",
    "Photosynthesis is the process by which",
    "The recipe for a good loaf of bread starts with",
    "When the first settlers arrived in the valley,",
    "A short guide to the planets of the solar system:",
    "The train left the station at dawn, and",
]


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def one(client, model, i, max_tokens, chat):
    """One streamed request: (ttft, decode seconds, completion tokens)."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    kw = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    prompt = PROMPTS[i % len(PROMPTS)]
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = client.completions.create(prompt=prompt, **kw)
    for chunk in stream:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            now = time.perf_counter()
            first = first or now
            last = now
    return (first or t0) - t0, (last or t0) - (first or t0), tokens


def run(client, model, streams, requests, max_tokens, chat):
    lock = threading.Lock()
    results = []
    counter = iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = one(client, model, i, max_tokens, chat)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        for f in [pool.submit(worker) for _ in range(streams)]:
            f.result()
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    ttft = [r[0] for r in results]
    rates = [(r[2] - 1) / r[1] for r in results if r[1] > 0 and r[2] > 1]
    return {
        "streams": streams,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "agg_tok_s": tokens / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "stream_tok_s": statistics.median(rates) if rates else float("nan"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--streams", default="1,4,16", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 per stream)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chat", action="store_true", help="chat completions instead of completions")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url, api_key=a.api_key, max_retries=0, timeout=600)
    model = a.model or client.models.list().data[0].id
    print(f"{'streams':>7} {'requests':>8} {'tokens':>7} {'wall s':>7} {'agg tok/s':>9} {'ttft p50':>8} {'ttft p99':>8} {'stream tok/s':>12}")
    for n in [int(x) for x in a.streams.split(",") if x.strip()]:
        r = run(client, model, n, a.requests or 2 * n, a.max_tokens, a.chat)
        print(
            f"{r['streams']:>7} {r['requests']:>8} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['agg_tok_s']:>9.1f} "
            f"{r['ttft_p50_s']:>8.3f} {r['ttft_p99_s']:>8.3f} {r['stream_tok_s']:>12.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
