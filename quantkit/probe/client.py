"""The probe's HTTP side, on httpx: what a user expects of a client that talks to someone else's server.

The API key comes from an environment variable (never a flag, so it stays out of shell history and
process lists); every request has a timeout; 429 and 5xx are retried with exponential backoff
(honouring Retry-After), anything else is reported at once; at most `concurrency` requests are in
flight. Every failure is one line naming the URL, what came back and what to do (ProbeError).
Nothing is sent but the recorded prompts (and one GET /models to check the server first).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError

RETRY_STATUS = {429, 500, 502, 503, 504}


class ProbeError(QuantkitError):
    """The endpoint is unreachable, refuses the model, or does not speak the OpenAI API. `status`: the
    HTTP status that came back (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Reply:
    """One prompt's answer, as the server gave it."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None  # usage.prompt_tokens: how many tokens the server made of the prompt
    tokens: list[str] | None = None  # per generated token, when logprobs came back
    top: list[dict[str, float]] | None = None  # per generated token: {token: logprob} of the top-k
    raw_model: str | None = None


MODELS_TIMEOUT = 10.0  # seconds for GET /models, the first request: a listing answers at once even under load


@dataclass
class Endpoint:
    url: str  # the base URL, ending in /v1
    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = 60.0
    retries: int = 4
    backoff: float = 0.5  # seconds before the first retry; doubles each time
    concurrency: int = 4
    logprobs: bool = True  # ask for top logprobs (dropped if the server refuses the field)
    _client: object = field(default=None, repr=False)

    def __post_init__(self):
        u = self.url.rstrip("/")
        if not u.startswith(("http://", "https://")):
            raise ProbeError(f"{self.url}: not an http(s) URL; pass the server's base, e.g. http://127.0.0.1:8000/v1")
        self.url = u if u.endswith("/v1") else u + "/v1"

    # ---- transport -------------------------------------------------------------------------------
    def client(self):
        import httpx

        if self._client is None:
            key = os.environ.get(self.api_key_env)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            self._client = httpx.Client(timeout=self.timeout, headers=headers, trust_env=False,
                                        limits=httpx.Limits(max_connections=self.concurrency))
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def request(self, method: str, path: str, body: dict | None = None, retries: int | None = None,
                timeout: float | None = None) -> dict:
        """The JSON answer of one request, retried on 429/5xx and dropped connections; a request that
        gets no answer within `timeout` (default: the endpoint's) is not retried: a server that accepts
        and never answers would otherwise hold the probe for (retries + 1) timeouts, silently."""
        import httpx

        url = self.url + path
        retries = self.retries if retries is None else retries
        timeout = self.timeout if timeout is None else timeout
        for attempt in range(retries + 1):
            r = None
            try:
                r = self.client().request(method, url, json=body, timeout=timeout)
            except httpx.TimeoutException:
                fix = ("raise --timeout, or check the server's load" if timeout >= self.timeout else
                       "a live server lists its models at once, and --timeout does not lengthen this wait: check "
                       "that the server has finished starting and that the URL is the server meant")
                raise ProbeError(f"{url}: no answer within {timeout:g} s ({fix})") from None
            except httpx.TransportError as e:
                problem = f"cannot connect ({type(e).__name__}: {e}); is the server running and is the URL right?"
            else:
                if r.status_code not in RETRY_STATUS:
                    return self._decode(r, method, path)
                problem = f"{r.status_code} {_message(r)} after {attempt + 1} tries"
            if attempt < retries:
                time.sleep(_retry_after(r) or self.backoff * 2 ** attempt)
        raise ProbeError(f"{url}: {problem}", None if r is None else r.status_code)

    def _decode(self, r, method: str, path: str) -> dict:
        where = f"{self.url + path}"
        if r.status_code == 401 or r.status_code == 403:
            raise ProbeError(f"{where}: {r.status_code} {_message(r)}; put the API key in ${self.api_key_env} "
                             "(or name another variable with --api-key-env)", r.status_code)
        if r.status_code == 404 and "model" not in _message(r).lower():
            raise ProbeError(f"{where}: 404 on {method} {path}; not an OpenAI-compatible server "
                             "(pass the base URL, e.g. http://host:8000/v1)", 404)
        if r.status_code >= 400:
            raise ProbeError(f"{where}: {r.status_code} {_message(r)}" + (
                f"; check --model (the server's name for the model; GET {self.url}/models lists them)"
                if "model" in _message(r).lower() else ""), r.status_code)
        try:
            d = r.json()
        except (json.JSONDecodeError, ValueError):
            raise ProbeError(f"{where}: the server answered {method} {path} with malformed JSON "
                             f"({r.text[:80]!r}); not an OpenAI-compatible server") from None
        if not isinstance(d, dict):
            raise ProbeError(f"{where}: the server answered {method} {path} with {type(d).__name__}, not a JSON object; "
                             "not an OpenAI-compatible server")
        return d

    # ---- the API ----------------------------------------------------------------------------------
    def models(self, retries: int | None = None) -> list[str]:
        """The server's model ids (GET /models); also the reachability check before anything is computed."""
        d = self.request("GET", "/models", retries=retries, timeout=min(self.timeout, MODELS_TIMEOUT))
        data = d.get("data")
        if not isinstance(data, list):
            raise ProbeError(f"{self.url}/models: no `data` list in the answer; not an OpenAI-compatible server")
        return [m.get("id") for m in data if isinstance(m, dict)]

    def complete(self, prompt, max_tokens: int, top_logprobs: int) -> Reply:
        """One greedy request: `prompt` is a prompts.Prompt (completion text or chat messages)."""
        chat = prompt.kind == "chat"
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "n": 1, "stream": False}
        body.update({"messages": prompt.body} if chat else {"prompt": prompt.body})
        if self.logprobs:
            body.update({"logprobs": True, "top_logprobs": top_logprobs} if chat else {"logprobs": top_logprobs})
        d = self.request("POST", "/chat/completions" if chat else "/completions", body)
        return parse_reply(d, chat, self.url)

    def chat_tools(self, prompt, max_tokens: int) -> ToolReply:
        """One greedy chat request with the prompt's `tools=` (a quantkit.validation.toolcalls.ToolPrompt).
        A 4xx answer to it (the main prompts having been answered) means the server takes no tools."""
        body = {"model": self.model, "messages": prompt.messages, "tools": prompt.tools, "tool_choice": "auto",
                "max_tokens": max_tokens, "temperature": 0, "n": 1, "stream": False}
        try:
            d = self.request("POST", "/chat/completions", body)
        except ProbeError as e:
            if e.status is None or not 400 <= e.status < 500 or e.status in (401, 403, 429):
                raise
            raise ProbeError(f"{self.url}/chat/completions: {e.status} to a request with tools= (prompt {prompt.id}: "
                             f"{str(e).split(': ', 1)[-1][:120]}); the endpoint has no tool support (vLLM/SGLang: start it "
                             "with a --tool-call-parser for the model; vLLM also --enable-auto-tool-choice)", e.status) from None
        return parse_tool_reply(d, self.url)

    def complete_all(self, prompts, max_tokens: int, top_logprobs: int) -> list[Reply]:
        """Every prompt, at most `concurrency` in flight; the first prompt alone first, so a server that
        refuses the model (or the request) fails once, not once per prompt."""
        first = self.complete(prompts[0], max_tokens, top_logprobs)
        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            rest = list(pool.map(lambda p: self.complete(p, max_tokens, top_logprobs), prompts[1:]))
        return [first, *rest]


@dataclass
class ToolReply:
    """One tool prompt's answer: finish_reason, the message's content and tool_calls (name, arguments text)."""

    finish_reason: str | None
    text: str
    calls: list[tuple[str, str]]
    prompt_tokens: int | None


def parse_tool_reply(d: dict, url: str) -> ToolReply:
    """An OpenAI chat answer's finish_reason, content and `message.tool_calls`."""
    choices = d.get("choices")
    c = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    msg = (c or {}).get("message")
    if not isinstance(msg, dict):
        raise ProbeError(f"{url}: the answer has no choices[0].message; not an OpenAI-compatible server")
    calls = []
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            calls.append((str(fn.get("name")), args if isinstance(args, str) else json.dumps(args)))
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else {}
    return ToolReply(c.get("finish_reason"), msg.get("content") or "", calls, usage.get("prompt_tokens"))


def parse_reply(d: dict, chat: bool, url: str) -> Reply:
    """The text and, where present, per-token logprobs of one OpenAI-format answer (chat or legacy completions)."""
    choices = d.get("choices")
    c = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    text = (c.get("message") or {}).get("content") if c and chat else (c or {}).get("text")
    if not isinstance(text, str):
        field_name = "choices[0].message.content" if chat else "choices[0].text"
        raise ProbeError(f"{url}: the answer has no {field_name}; not an OpenAI-compatible server")
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else {}
    reply = Reply(text, c.get("finish_reason"), usage.get("prompt_tokens"), raw_model=d.get("model"))
    lp = c.get("logprobs")
    if isinstance(lp, dict) and chat and isinstance(lp.get("content"), list):
        reply.tokens = [t.get("token") for t in lp["content"]]
        reply.top = [{x["token"]: float(x["logprob"]) for x in t.get("top_logprobs") or []} for t in lp["content"]]
    elif isinstance(lp, dict) and not chat and isinstance(lp.get("tokens"), list):
        reply.tokens = list(lp["tokens"])
        reply.top = [{k: float(v) for k, v in (t or {}).items()} for t in lp.get("top_logprobs") or []]
    return reply


def _message(r) -> str:
    """The server's error message, one line."""
    try:
        d = r.json()
        m = d.get("error", d.get("detail", d)) if isinstance(d, dict) else d
        m = m.get("message", m) if isinstance(m, dict) else m
    except ValueError:
        m = r.text
    return " ".join(str(m).split())[:200]


def _retry_after(r) -> float | None:
    try:
        return min(float(r.headers.get("retry-after")), 30.0) if r is not None else None
    except (TypeError, ValueError):
        return None
