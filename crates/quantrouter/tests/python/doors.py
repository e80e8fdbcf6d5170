"""Sends requests with the official `openai` and `anthropic` clients, one per line of
standard input, and prints what the client saw, one JSON line each (for tests/doors.rs).

    python doors.py < requests.jsonl

Each request: {"base_url", "api_key" (sent as `x-api-key` by the anthropic client, a bearer
token by the openai one), "client": "openai" | "anthropic", "kind": "chat" |
"stream" | "completion" | "responses" | "messages" | "count_tokens", "headers": {...}, "body": {...}}; `body`
holds the create call's arguments. Prints {"status", "headers" (x-quantrouter-* and
x-ratelimit-*), "text", "id"} for an answer (a token count: "text" is the count), {"status", "headers", "error"} (the error body
the client parsed) for a refusal. Exits non-zero on anything else the client raises.
"""

import json
import sys

import anthropic
import openai


def main():
    for line in sys.stdin:
        request = json.loads(line)
        try:
            seen = send(request)
        except (openai.APIStatusError, anthropic.APIStatusError) as error:
            seen = {
                "status": error.status_code,
                "headers": ours(error.response.headers),
                "error": error.body,
            }
        print(json.dumps(seen), flush=True)


def send(request):
    headers = request.get("headers", {})
    body = request["body"]
    kind = request["kind"]
    if request["client"] == "anthropic":
        # The key as Anthropic's API takes it, and Claude Code sends it: `x-api-key`, not a
        # bearer token.
        client = anthropic.Anthropic(
            base_url=request["base_url"],
            api_key=None,
            default_headers={"x-api-key": request["api_key"]},
            max_retries=0,
            timeout=60,
        )
        if kind == "count_tokens":
            body = {k: v for k, v in body.items() if k != "max_tokens"}
            raw = client.messages.with_raw_response.count_tokens(**body, extra_headers=headers)
            return seen(raw, str(raw.parse().input_tokens), None)
        raw = client.messages.with_raw_response.create(**body, extra_headers=headers)
        message = raw.parse()
        text = "".join(block.text for block in message.content if block.type == "text")
        return seen(raw, text, message.id)
    client = openai.OpenAI(
        base_url=request["base_url"] + "/v1", api_key=request["api_key"], max_retries=0, timeout=60
    )
    if kind == "completion":
        raw = client.completions.with_raw_response.create(**body, extra_headers=headers)
        answer = raw.parse()
        return seen(raw, answer.choices[0].text, answer.id)
    if kind == "responses":
        raw = client.responses.with_raw_response.create(**body, extra_headers=headers)
        answer = raw.parse()
        return seen(raw, answer.output_text, answer.id)
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(**body, extra_headers=headers)
        answer = raw.parse()
        return seen(raw, answer.choices[0].message.content, answer.id)
    raw = client.chat.completions.with_raw_response.create(
        **body, stream=True, extra_headers=headers
    )
    text, id = "", None
    for chunk in raw.parse():
        id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return seen(raw, text, id)


def ours(headers):
    return {
        k.lower(): v
        for k, v in headers.items()
        if k.lower().startswith(("x-quantrouter-", "x-ratelimit-"))
    }


def seen(raw, text, id):
    return {"status": raw.status_code, "headers": ours(raw.headers), "text": text, "id": id}


if __name__ == "__main__":
    main()
