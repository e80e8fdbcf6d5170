"""Streams one chat completion through a running quantrouter with the official `openai`
Python client and prints what the client saw, as one JSON line.

    python stream_once.py BASE_URL MODEL PROMPT MAX_TOKENS

Prints {"headers": {...x-quantrouter-* headers}, "text": ..., "chunks": N}; exits non-zero
when the client raises.
"""

import json
import sys

from openai import OpenAI


def main():
    if len(sys.argv) != 5:
        print(f"usage: {sys.argv[0]} BASE_URL MODEL PROMPT MAX_TOKENS", file=sys.stderr)
        sys.exit(2)
    base_url, model, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
    max_tokens = int(sys.argv[4])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
    )
    headers = {k: v for k, v in raw.headers.items() if k.startswith("x-quantrouter-")}
    text, chunks = "", 0
    for chunk in raw.parse():
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    print(json.dumps({"headers": headers, "text": text, "chunks": chunks}), flush=True)


if __name__ == "__main__":
    main()
