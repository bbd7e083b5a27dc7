#!/usr/bin/env python3
"""Drives a running `picchio serve` with the official `openai` Python client (PyPI `openai`); run
by cli/tests/serve_openai.rs, which starts the server and passes, in $PICCHIO_EXPECT (JSON), the
conversation, its rendered prompt ids (tests/fixtures/chat/qwen3_rendering.json) and the tokens and
text `picchio run --prompt-ids <those ids>` generated greedily. Checks:

- models.list() names the model; models.retrieve() returns it, and raises NotFoundError (404,
  code model_not_found) for another id;
- chat completions, whole and streamed: the greedy tokens and text equal `picchio run`'s, usage
  counts the prompt and the answer;
- repeating a request reuses all of its prompt but the last token (cached_tokens), and a request
  that extends the first conversation reuses exactly the shared prefix;
- completions with the ids as prompt, whole and streamed, give the same tokens and text;
- a client that goes away mid-stream stops its generation and frees the queue.

Exits non-zero (with a traceback) on the first failed check.
"""

import json
import os
import sys
import urllib.request

import openai

BASE = os.environ["PICCHIO_BASE_URL"]
EXPECT = json.loads(os.environ["PICCHIO_EXPECT"])
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=600)
MODEL = EXPECT["model"]
MESSAGES = EXPECT["messages"]
PROMPT_IDS = EXPECT["prompt_ids"]
TOKENS = EXPECT["tokens"]
TEXT = EXPECT["text"]
N = len(TOKENS)


def metric(name):
    with urllib.request.urlopen(BASE + "/metrics") as r:
        for line in r.read().decode().splitlines():
            parts = line.split()
            if parts and parts[0] == name:
                return float(parts[1])
    raise AssertionError(f"no {name} in /metrics")


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check(what, got, want):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")
    print(f"ok: {what}")


models = client.models.list()
check("models", [m.id for m in models.data], [MODEL])
m = client.models.retrieve(MODEL)
check("models.retrieve", (m.id, m.object, m.owned_by), (MODEL, "model", "picchio"))
try:
    client.models.retrieve("no-such-model")
    raise AssertionError("models.retrieve of an unknown id did not fail")
except openai.NotFoundError as e:
    check("models.retrieve unknown: status and code", (e.status_code, e.code), (404, "model_not_found"))

# Chat, whole: the tokens picchio run generated for the same rendered prompt.
r = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=N, extra_body={"return_token_ids": True}
)
check("chat prompt ids", r.model_extra["prompt_token_ids"], PROMPT_IDS)
check("chat tokens", r.choices[0].model_extra["token_ids"], TOKENS)
check("chat text", r.choices[0].message.content, TEXT)
check("chat finish", r.choices[0].finish_reason, "length")
check("chat usage", (r.usage.prompt_tokens, r.usage.completion_tokens), (len(PROMPT_IDS), N))
check("chat cached (first request)", r.usage.prompt_tokens_details.cached_tokens, 0)
first_kv = PROMPT_IDS + TOKENS[:-1]

# Chat, streamed: the same text in pieces; the same prompt again reuses all but its last token.
stream = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=N, stream=True, stream_options={"include_usage": True}
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
check("streamed chat text", "".join(pieces), TEXT)
check("streamed chat finish", finish, "length")
check("streamed chat cached", usage.prompt_tokens_details.cached_tokens, len(PROMPT_IDS) - 1)
check("streamed chat usage", (usage.prompt_tokens, usage.completion_tokens), (len(PROMPT_IDS), N))

# A second turn extending the conversation: the shared prefix comes from the KV cache.
more = MESSAGES + [{"role": "assistant", "content": TEXT}, {"role": "user", "content": "Tell me more."}]
r2 = client.chat.completions.create(
    model=MODEL, messages=more, temperature=0, max_tokens=4, extra_body={"return_token_ids": True}
)
p2 = r2.model_extra["prompt_token_ids"]
check("second turn starts with the first prompt", p2[: len(PROMPT_IDS)], PROMPT_IDS)
shared = common_prefix(p2, first_kv)
check("second turn cached = shared prefix", r2.usage.prompt_tokens_details.cached_tokens, shared)
if shared < len(PROMPT_IDS):
    raise AssertionError(f"only {shared} of the first prompt's {len(PROMPT_IDS)} tokens were reused")

# Completions with the rendered ids as the prompt: the same tokens again (the KV now holds turn 2,
# so this rewinds to the shared prefix).
c = client.completions.create(
    model=MODEL, prompt=PROMPT_IDS, temperature=0, max_tokens=N, extra_body={"return_token_ids": True}
)
check("completion tokens", c.choices[0].model_extra["token_ids"], TOKENS)
check("completion text", c.choices[0].text, TEXT)
check("completion usage", (c.usage.prompt_tokens, c.usage.completion_tokens), (len(PROMPT_IDS), N))
cs = client.completions.create(model=MODEL, prompt=PROMPT_IDS, temperature=0, max_tokens=N, stream=True)
check("streamed completion text", "".join(ch.choices[0].text for ch in cs if ch.choices), TEXT)

# A client that goes away mid-stream: its generation stops and the next request is served.
cancelled = metric("picchio_requests_cancelled_total")
generated = metric("picchio_completion_tokens_total")
s = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, temperature=0, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
)
got = 0
for chunk in s:
    if chunk.choices and chunk.choices[0].delta.content:
        got += 1
        if got == 2:
            break
s.close()
r3 = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=N)
check("served after a disconnect", r3.choices[0].message.content, TEXT)
check("the disconnected request was cancelled", metric("picchio_requests_cancelled_total"), cancelled + 1)
stopped_after = metric("picchio_completion_tokens_total") - generated - N
if not stopped_after < 400:
    raise AssertionError(f"the disconnected request generated all {stopped_after} tokens")
print(f"ok: the disconnected request stopped after {int(stopped_after)} of 400 tokens")
print("all openai client checks passed")
sys.exit(0)
