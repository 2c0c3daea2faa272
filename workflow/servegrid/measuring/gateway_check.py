"""What the gateway changes, checked at a proxied cell's first request instead of assumed.

Before a cell measures through the gateway, the same small requests (a completion with a token-id prompt,
and a chat turn: multi-turn's template path) go once straight to the server and once through the gateway,
unmeasured, greedy, with the exact-count fields servegrid always sends (``min_tokens``, ``ignore_eos``,
``max_tokens``, ``stream_options``). A field the gateway drops or alters in a way that would change what
the cell measures is a :class:`~servegrid.errors.GatewayError` naming it. What it changes that servegrid
can measure around is recorded in the cell file and shown in the report:

- ``per_chunk_usage``: whether the stream still carries vLLM's running token count
  (``stream_options.continuous_usage_stats``). LiteLLM 1.106 keeps only the final usage; servegrid then
  counts tokens by chunk (servegrid.measuring.client.decode_counted_by_chunk).
- ``chunks_direct`` / ``chunks_proxy``: events with text for the same output, both ways: whether the
  gateway re-frames the stream (merges or splits chunks), which would change per-chunk timing.
- ``same_text``: whether the greedy output came back unchanged.
"""

from __future__ import annotations

from typing import Any

import httpx

from servegrid.control_http import control_client
from servegrid.engines import Engine
from servegrid.errors import GatewayError
from servegrid.measuring.client import choice_text, stream_events
from servegrid.records.request import RequestRecord

PROBE_TOKENS = 16
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. " * 4


def _stream(client: httpx.Client, url: str, headers: dict[str, str], payload: dict[str, Any]) -> dict[str, Any]:
    """One streamed request, reduced to what the checks compare."""
    response = client.post(url, json=payload, headers=headers)
    seen: dict[str, Any] = {"status": response.status_code, "body": response.text[:500]}
    if response.status_code != 200:
        return seen
    text, chunks, counted, usage = [], 0, 0, None
    failed = RequestRecord("gateway-check", 0, 0, "probe", 1, 0, 0)  # where a stream error event lands
    for _, event in stream_events(response.content, failed):
        event_usage = event.get("usage")
        for choice in event.get("choices") or ():
            if piece := choice_text(choice):
                text.append(piece)
                chunks += 1
                counted += bool(event_usage)
        usage = event_usage or usage
    if failed.error:
        return seen | {"status": "stream error", "body": failed.error}
    return seen | {"text": "".join(text), "chunks": chunks, "counted_chunks": counted, "usage": usage or {}}


def check(
    engine: Engine,
    server_url: str,
    server_headers: dict[str, str],
    served_name: str,
    gateway_url: str,
    gateway_headers: dict[str, str],
    gateway_model: str,
    chat: bool,
) -> dict[str, Any]:
    """Compare the server's and the gateway's answers to the same requests; raise where the gateway would make
    a cell measure something else, return the findings otherwise. ``chat``: check the chat path too."""
    findings: dict[str, Any] = {"per_chunk_usage": True, "same_text": True}
    with control_client(120.0, server_headers) as client:  # the gateway's key per request
        prompt = engine.tokenize(client, server_url, served_name, PROBE_TEXT)
        requests = [
            (
                "completion",
                engine.completions_path,
                lambda model: engine.completion_payload(model, prompt, PROBE_TOKENS, 0.0),
            )
        ]
        if chat:
            messages = [{"role": "user", "content": PROBE_TEXT}]
            requests.append(
                ("chat", engine.chat_path, lambda model: engine.chat_payload(model, messages, PROBE_TOKENS, 0.0))
            )
        for kind, path, payload in requests:
            direct = _stream(client, server_url + path, server_headers, payload(served_name))
            if direct["status"] != 200:
                raise GatewayError(f"the gateway check's {kind} request failed on the server itself: {direct['body']}")
            proxied = _stream(client, gateway_url + path, gateway_headers, payload(gateway_model))
            _judge(kind, payload(gateway_model), direct, proxied, gateway_url)
            findings[f"{kind}_chunks_direct"] = direct["chunks"]
            findings[f"{kind}_chunks_proxy"] = proxied["chunks"]
            findings["per_chunk_usage"] &= proxied["counted_chunks"] == proxied["chunks"]
            findings["same_text"] &= proxied["text"] == direct["text"]
    findings["chunks_direct"] = findings["completion_chunks_direct"]
    findings["chunks_proxy"] = findings["completion_chunks_proxy"]
    return findings


def _judge(kind: str, payload: dict[str, Any], direct: dict[str, Any], proxied: dict[str, Any], url: str) -> None:
    where = f"the gateway at {url}"
    if proxied["status"] != 200:
        prompt = "its prompt as token ids ('prompt')" if kind == "completion" else "its messages"
        raise GatewayError(
            f"{where} refused a streamed {kind} request that the server accepts ({proxied['status']}: "
            f"{proxied['body'][:300]}). servegrid sends {prompt}, {sorted(payload)}; a LiteLLM model must use "
            "the openai/ provider (hosted_vllm/ refuses token-id prompts)"
        )
    usage, wanted = proxied["usage"], direct["usage"]
    problems = []
    if not usage:
        problems.append("no usage at all: 'stream_options.include_usage' was dropped")
    else:
        if usage.get("prompt_tokens") != wanted.get("prompt_tokens"):
            field = "'prompt' (token ids)" if kind == "completion" else "'messages' (the chat template path)"
            problems.append(
                f"usage.prompt_tokens {usage.get('prompt_tokens')} where the server counts "
                f"{wanted.get('prompt_tokens')}: {field} did not reach the server as sent, or the usage is the "
                "gateway's own count ('stream_options' dropped)"
            )
        if usage.get("completion_tokens") != PROBE_TOKENS:
            # The fields the engine's payload uses to ask for an exact count (servegrid.engines), by name.
            exact = [
                k
                for k in payload
                if k not in ("model", "prompt", "messages", "stream", "stream_options", "temperature")
            ]
            problems.append(
                f"usage.completion_tokens {usage.get('completion_tokens')} where exactly {PROBE_TOKENS} were asked "
                f"for: one of {exact} was dropped or changed, or the usage is the gateway's own count "
                "('stream_options' dropped)"
            )
    if problems:
        raise GatewayError(
            f"{where} changes what a {kind} request asks for, so a cell through it would measure something else: "
            + "; ".join(problems)
            + ". Check proxy.model_params (e.g. additional_drop_params) and the gateway's own settings"
        )
