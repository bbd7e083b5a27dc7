#!/usr/bin/env python3
# Time to first token of two chat turns against `picchio serve` (issue 12): turn 1 sends a ~1,000-token
# system prompt and a question; turn 2 extends the conversation, so the server reuses the KV cache of
# the shared prefix (usage.prompt_tokens_details.cached_tokens). Needs the `openai` package.
# Usage: picchio serve --model DIR --port P & python3 chat_ttft.py P
import sys, time, openai
port = sys.argv[1]
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
model = c.models.list().data[0].id
words = ("storage latency expert router cache queue doorbell namespace token prefill decode block "
         "device memory bandwidth kernel page").split()
system = "You are a helpful assistant. " + " ".join(words[i % len(words)] + str(i % 7) for i in range(480))
msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the text above."}]
def turn(msgs):
    t0 = time.monotonic(); first = None; text = ""; usage = None
    s = c.chat.completions.create(model=model, messages=msgs, max_tokens=16, stream=True,
                                  stream_options={"include_usage": True})
    for ch in s:
        if ch.choices and ch.choices[0].delta.content and first is None:
            first = time.monotonic() - t0
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
        if ch.usage: usage = ch.usage
    return first, time.monotonic() - t0, text, usage
f1, w1, a1, u1 = turn(msgs)
print(f"turn 1: ttft {f1*1e3:.0f} ms, total {w1*1e3:.0f} ms, prompt {u1.prompt_tokens} tokens, cached {u1.prompt_tokens_details.cached_tokens}")
msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And in one word?"}]
f2, w2, a2, u2 = turn(msgs)
print(f"turn 2: ttft {f2*1e3:.0f} ms, total {w2*1e3:.0f} ms, prompt {u2.prompt_tokens} tokens, cached {u2.prompt_tokens_details.cached_tokens}")
