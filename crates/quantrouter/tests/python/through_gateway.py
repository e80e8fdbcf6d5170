"""Sends requests through a Gateway (Envoy with quantrouter as its endpoint picker) with the
official `openai` Python client and prints what the client saw, one JSON line per request.

    python through_gateway.py BASE_URL API_KEY KIND PROMPT

KIND: `chat`, `stream` (a streamed chat) or `completion`. Prints {"status", "headers"
(x-quantrouter-*), "model", "text", "usage_chunks"}; a refusal prints {"status", "error"}
with the error body the client parsed. Exits non-zero on anything else the client raises.
"""

import json
import sys

import openai
from openai import OpenAI


def main():
    if len(sys.argv) != 5:
        print(f"usage: {sys.argv[0]} BASE_URL API_KEY KIND PROMPT", file=sys.stderr)
        sys.exit(2)
    base_url, api_key, kind, prompt = sys.argv[1:5]
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
    try:
        print(json.dumps(send(client, kind, prompt)), flush=True)
    except openai.APIStatusError as error:
        print(json.dumps({"status": error.status_code, "error": error.body}), flush=True)


def send(client, kind, prompt):
    if kind == "completion":
        raw = client.completions.with_raw_response.create(
            model="auto", prompt=prompt, max_tokens=8
        )
        answer = raw.parse()
        return seen(raw, answer.model, answer.choices[0].text, 0)
    messages = [{"role": "user", "content": prompt}]
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=messages, max_tokens=8
        )
        answer = raw.parse()
        return seen(raw, answer.model, answer.choices[0].message.content, 0)
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=messages, max_tokens=8, stream=True
    )
    text, model, usage_chunks = "", None, 0
    for chunk in raw.parse():
        model = chunk.model
        if chunk.usage is not None:
            usage_chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return seen(raw, model, text, usage_chunks)


def seen(raw, model, text, usage_chunks):
    headers = {k: v for k, v in raw.headers.items() if k.startswith("x-quantrouter-")}
    return {
        "status": raw.status_code,
        "headers": headers,
        "model": model,
        "text": text,
        "usage_chunks": usage_chunks,
    }


if __name__ == "__main__":
    main()
