"""The official `openai` Python client against a running `markbase serve`.

Run by tests/server.rs, which starts the server and sets MARKBASE_URL (the /v1 base URL),
MARKBASE_KEY and MARKBASE_MODEL. Checks chat and completions, whole and streamed, errors as
the client raises them, and a load test: concurrent greedy streams, each equal to the same
request run alone, then the server's metrics. With MARKBASE_MM_IMAGE (a vision and audio
checkpoint's server), the multimodal checks instead: an image and an audio clip in chat
content parts, whole and streamed, each answer equal to the library's (MARKBASE_MM_*_REPLY),
and bad media refused. Exits non-zero on the first failure.
"""

import base64
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


def mm_chat(content):
    """A greedy chat turn of `content` parts, whole and streamed: its text."""
    tokens = int(os.environ["MARKBASE_MM_TOKENS"])
    msgs = [{"role": "user", "content": content}]
    args = dict(model=MODEL, messages=msgs, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**args)
    text = r.choices[0].message.content
    check(r.usage.completion_tokens == tokens, f"usage {r.usage}")
    parts = []
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
    check("".join(parts) == text, f"streamed {''.join(parts)!r} != whole {text!r}")
    return text


def b64(path):
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode()


def multimodal():
    text = os.environ["MARKBASE_MM_TEXT"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(os.environ["MARKBASE_MM_IMAGE"])}}
    audio = {"type": "input_audio", "input_audio": {"data": b64(os.environ["MARKBASE_MM_AUDIO"]), "format": "wav"}}
    got = mm_chat([image, {"type": "text", "text": text}])
    want = os.environ["MARKBASE_MM_IMAGE_REPLY"]
    check(got == want, f"image: the server's {got!r} != the library's {want!r}")
    got = mm_chat([{"type": "text", "text": text}, audio])
    want = os.environ["MARKBASE_MM_AUDIO_REPLY"]
    check(got == want, f"audio: the server's {got!r} != the library's {want!r}")
    bad = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "not fetched"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "not a PNG"),
        ({"type": "input_audio", "input_audio": {"data": audio["input_audio"]["data"], "format": "aiff"}}, "unsupported audio format"),
        ({"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}}, "base64"),
    ]
    for part, words in bad:
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=2)
            check(False, f"accepted: {part}")
        except openai.BadRequestError as e:
            check(words in str(e), f"400 message {e} lacks {words!r}")


if __name__ == "__main__":
    checks = (models, multimodal) if os.environ.get("MARKBASE_MM_IMAGE") else (models, completions, chat, errors, load)
    for f in checks:
        t = time.time()
        f()
        print(f"{f.__name__}: ok ({time.time() - t:.1f}s)", flush=True)
    print("all OpenAI client checks passed", flush=True)
