"""Tries another tenant's stored response with the official `openai` client, and a tenant's
stored-response reads past its request limit.

    python tenant_boundary.py ROUTER_URL OWNER_KEY OTHER_KEY LIMITED_KEY

ROUTER_URL is like http://127.0.0.1:8080 (no /v1). OWNER_KEY stores a response; OTHER_KEY
(another tenant) must find it nowhere: retrieve, delete and previous_response_id are 404
`response_not_found`. LIMITED_KEY's tenant allows 2 requests a minute: it stores a response,
reads it once, and the next read is a 429 with Retry-After. Prints "ok <check>" per check and
exits non-zero with a message on the first failed check.
"""

import sys
import traceback

import openai

import report
from report import check


def client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def refused(call, error):
    """The error `call` raised, if it is an `error`; None if it answered."""
    try:
        call()
    except error as e:
        return e
    return None


def cross_tenant(url, owner_key, other_key):
    owner, other = client(url, owner_key), client(url, other_key)
    stored = owner.responses.create(model="auto", input="Say hello in French.")
    check("owner stores a response", stored.id, stored)
    attempts = {
        "retrieve": lambda: other.responses.retrieve(stored.id),
        "delete": lambda: other.responses.delete(stored.id),
        "continue": lambda: other.responses.create(
            model="auto", input="And in German?", previous_response_id=stored.id
        ),
    }
    for name, call in attempts.items():
        error = refused(call, openai.NotFoundError)
        check(f"another tenant's {name} is not found", error is not None and error.code == "response_not_found",
              getattr(error, "body", None))
    again = owner.responses.retrieve(stored.id)
    check("the owner still reads it", again.id == stored.id, again)


def limited_reads(url, limited_key):
    limited = client(url, limited_key)
    stored = limited.responses.create(model="auto", input="Say hello in French.")
    read = limited.responses.with_raw_response.retrieve(stored.id)
    check("the first read is counted", read.headers.get("x-ratelimit-remaining-requests") == "0", dict(read.headers))
    error = refused(lambda: limited.responses.retrieve(stored.id), openai.RateLimitError)
    check("the read past the limit is refused", error is not None and error.code == "rate_limit_exceeded",
          getattr(error, "body", None))
    check("the refusal says when to retry", error.response.headers.get("retry-after"), dict(error.response.headers))


def main():
    url, owner_key, other_key, limited_key = sys.argv[1:5]
    try:
        cross_tenant(url, owner_key, other_key)
        limited_reads(url, limited_key)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print(f"{report.passed} checks passed")


if __name__ == "__main__":
    main()
