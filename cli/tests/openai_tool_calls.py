#!/usr/bin/env python3
"""Tool calls through the official `openai` Python client (PyPI `openai`); run by
cli/tests/serve_openai.rs, which starts `picchio serve` with the test mock that makes the model
write a Hermes `<tool_call>` for get_weather(city="Paris") after the text "Let me look.". Checks:

- the whole answer: finish_reason "tool_calls", message.content the text, message.tool_calls one
  function call with its name and JSON arguments;
- the streamed answer, put together as the client's users do: exactly the same text, one call at index 0
  with the same name and arguments, finish_reason "tool_calls";
- the follow-up that sends the call back with the tool's result (by the call's id) is answered.

Exits non-zero (with a traceback) on the first failed check.
"""

import json
import os

import openai

client = openai.OpenAI(base_url=os.environ["PICCHIO_BASE_URL"] + "/v1", api_key="unused", max_retries=0, timeout=600)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
EXTRA = {"chat_template_kwargs": {"enable_thinking": False}}

r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=64, temperature=0, extra_body=EXTRA)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
assert choice.message.content == "Let me look.", choice.message
calls = choice.message.tool_calls
assert calls and len(calls) == 1, choice.message
call = calls[0]
assert call.type == "function" and call.function.name == "get_weather", call
assert json.loads(call.function.arguments) == {"city": "Paris"}, call.function.arguments
print("whole: ok", call.id)

text, parts, finish = "", {}, None
for chunk in client.chat.completions.create(
    model="m", messages=ASK, tools=TOOLS, max_tokens=64, temperature=0, stream=True, extra_body=EXTRA
):
    if not chunk.choices:
        continue
    c = chunk.choices[0]
    text += c.delta.content or ""
    for t in c.delta.tool_calls or []:
        p = parts.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
        p["id"] = t.id or p["id"]
        p["name"] += (t.function.name or "") if t.function else ""
        p["arguments"] += (t.function.arguments or "") if t.function else ""
    finish = c.finish_reason or finish
assert text == choice.message.content, (text, choice.message.content)
assert list(parts) == [0], parts
assert parts[0]["name"] == "get_weather" and json.loads(parts[0]["arguments"]) == {"city": "Paris"}, parts
assert parts[0]["id"] and parts[0]["id"] != call.id, parts
assert finish == "tool_calls", finish
print("streamed: ok", parts[0]["id"])

follow = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
]
r = client.chat.completions.create(model="m", messages=follow, tools=TOOLS, max_tokens=2, temperature=0, extra_body=EXTRA)
assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r
print("follow-up: ok")
