"""The official `openai` Python client against a running `markbase serve`.

Run by tests/server.rs, which starts the server and sets MARKBASE_URL (the /v1 base URL),
MARKBASE_KEY and MARKBASE_MODEL. Checks chat and completions, whole and streamed, errors as
the client raises them, and a load test: concurrent greedy streams, each equal to the same
request run alone, then the server's metrics. Exits non-zero on the first failure.
"""

import os
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

URL = os.environ["MARKBASE_URL"]
KEY = os.environ["MARKBASE_KEY"]
MODEL = os.environ["MARKBASE_MODEL"]
STREAMS = int(os.environ.get("MARKBASE_STREAMS", "16"))

client = openai.OpenAI(base_url=URL, api_key=KEY, max_retries=0, timeout=120)


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", flush=True)
        sys.exit(1)


def models():
    ids = [m.id for m in client.models.list().data]
    check(ids == [MODEL], f"models: {ids}")


def completions():
    r = client.completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=6, temperature=0)
    text = r.choices[0].text
    check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, f"usage {r.usage}")
    parts, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            parts.append(c.text or "")
            finish = c.finish_reason or finish
    check("".join(parts) == text, f"streamed completion {''.join(parts)!r} != {text!r}")
    check(finish == r.choices[0].finish_reason, f"streamed finish {finish}")
    # exactly max_tokens tokens when the stop tokens are ignored
    r = client.completions.create(model=MODEL, prompt=[2, 5, 9], max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    check(r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length", f"ignore_eos: {r}")


def chat():
    msgs = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, seed=3)
    reply = r.choices[0].message.content
    check(r.choices[0].message.role == "assistant", f"role {r.choices[0].message.role}")
    check(r.object == "chat.completion", f"object {r.object}")
    parts, usage = [], None
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, seed=3, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
    check("".join(parts) == reply, f"streamed chat {''.join(parts)!r} != {reply!r}")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage} vs {r.usage}")
    # sampling with a seed repeats itself
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    check(a.choices[0].message.content == b.choices[0].message.content, "seeded sampling differs between runs")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    lps = r.choices[0].logprobs.content
    check(len(lps) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lps), f"logprobs {lps}")


def errors():
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        check(False, "an unknown model was accepted")
    except openai.NotFoundError as e:
        check("does not exist" in str(e), f"404 message: {e}")
    try:
        client.completions.create(model=MODEL, prompt="w1", temperature=-1)
        check(False, "a negative temperature was accepted")
    except openai.BadRequestError as e:
        check("temperature" in str(e), f"400 message: {e}")
    bad = openai.OpenAI(base_url=URL, api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        check(False, "a wrong API key was accepted")
    except openai.AuthenticationError:
        pass


def one_stream(i):
    """A greedy stream: its text and token count."""
    prompt = [2, 5 + i % 7, 9 + i, 11 + 2 * i]
    parts, usage = [], None
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12 + i % 5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.text or "")
    return "".join(parts), usage.completion_tokens


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    check(False, f"metric {name} missing")


def load():
    base = URL[: -len("/v1")]
    before = metric(urllib.request.urlopen(base + "/metrics").read().decode(), "markbase_generation_tokens_total")
    t0 = time.time()
    alone = [one_stream(i) for i in range(STREAMS)]
    t_alone = time.time() - t0
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=STREAMS) as pool:
        together = list(pool.map(one_stream, range(STREAMS)))
    t_together = time.time() - t0
    for i, (a, b) in enumerate(zip(alone, together)):
        check(a == b, f"stream {i}: concurrent {b!r} != alone {a!r}")
    tokens = sum(n for _, n in together)
    m = urllib.request.urlopen(base + "/metrics").read().decode()
    after = metric(m, "markbase_generation_tokens_total")
    check(after - before == 2 * tokens, f"generated tokens {after - before} != {2 * tokens}")
    check(metric(m, "markbase_num_requests_running") == 0, "sequences still running")
    check(metric(m, "markbase_time_to_first_token_seconds_count") >= 2 * STREAMS, "TTFT histogram")
    print(
        f"load: {STREAMS} greedy streams, {tokens} tokens: one at a time {tokens / t_alone:.1f} tok/s, "
        f"concurrent {tokens / t_together:.1f} tok/s; outputs identical",
        flush=True,
    )


if __name__ == "__main__":
    for f in (models, completions, chat, errors, load):
        t = time.time()
        f()
        print(f"{f.__name__}: ok ({time.time() - t:.1f}s)", flush=True)
    print("all OpenAI client checks passed", flush=True)
