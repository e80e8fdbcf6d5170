"""Streams chat or completion requests through a running quantrouter with the official
`openai` Python client, one after another, and prints what the client saw of each as one
JSON line.

    OPENAI_API_KEY=KEY python stream_resume.py BASE_URL < requests.jsonl

Each input line is {"api": "chat" | "completions", "body": {... create() arguments ...}}.
Each output line is {"text", "finish_reasons", "ids", "indexes", "usage", "chunks",
"error"}: `error` is the message of an error the client raised while reading (null when
none); what it read before that is in the other fields.
"""

import json
import sys

import openai
from openai import OpenAI


def stream(client, api, body):
    seen = {"text": "", "finish_reasons": [], "ids": [], "indexes": [], "usage": None,
            "chunks": 0, "error": None}
    create = client.chat.completions.create if api == "chat" else client.completions.create
    try:
        for chunk in create(stream=True, **body):
            seen["chunks"] += 1
            if chunk.id not in seen["ids"]:
                seen["ids"].append(chunk.id)
            if chunk.usage is not None:
                seen["usage"] = chunk.usage.model_dump(exclude_none=True)
            for choice in chunk.choices:
                if choice.index not in seen["indexes"]:
                    seen["indexes"].append(choice.index)
                text = choice.delta.content if api == "chat" else choice.text
                seen["text"] += text or ""
                if choice.finish_reason is not None:
                    seen["finish_reasons"].append(choice.finish_reason)
    except openai.APIError as error:
        seen["error"] = str(error)
    return seen


def main():
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BASE_URL < requests.jsonl", file=sys.stderr)
        sys.exit(2)
    client = OpenAI(base_url=sys.argv[1], max_retries=0, timeout=60)
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            print(json.dumps(stream(client, request["api"], request["body"])), flush=True)


if __name__ == "__main__":
    main()
