"""Any agent, unchanged: an OpenAI-compatible endpoint in front of mrl's generate handle.

An agent written against an OpenAI client points its base_url at
`http://host:port/episodes/<episode_id>/v1`; each call's exact prompt ids, completion ids, log-probs
and weight versions are recorded under that episode (call_log.py) and `assemble` turns them into
trajectories. Token-in/token-out: when a chat call's messages are the previous call's messages,
the reply this endpoint gave, and new messages (tool results, user turns), its prompt is the
previous prompt + completion + the chat template's tokens for the new messages only; anything else
is rendered afresh and the episode stops being linear. One choice per call, no streaming. Calls of
one episode run one at a time, in arrival order; episodes run concurrently. For training, an episode
is opened with its own sampling settings and limits (`open_episode`, `close_episode`). See docs/agents.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mrl.agent.call_log import CallLog, CallRecord, EndpointTrajectory
from mrl.agent.chat import TOKENIZER_LOCK, ChatRenderer
from mrl.agent.loop import Generate
from mrl.agent.openai_format import (
    BadRequest, ChatContext, EpisodeNotOpen, appended_messages, assistant_reply, chat_response, completion_response,
    refuse_unsupported, template_messages,
)
from mrl.agent.tool_calls import parse_tool_calls
from mrl.rollout.engine import Generation, SamplingSettings, _mix



@dataclass
class EpisodeSettings:
    """An open episode's own settings (OpenAIEndpoint.open_episode). The policy's sampling is the
    rollout's: `sampling`'s temperature, top_p, top_k and seed stream (seed, call index) win over a
    request's (an agent that asks for temperature 0 or a fixed seed would make every sample of a
    group the same), and its max_tokens caps each call's. A call past `max_calls`, or whose prompt
    leaves no room in `max_context` tokens, is refused and the episode marked `truncated`."""

    sampling: SamplingSettings
    max_calls: int | None = None
    max_context: int | None = None
    truncated: str = ""  # the refusal that cut the episode short ("" when none)


class OpenAIEndpoint:
    """The FastAPI app (`.app`) and the calls it recorded (`.log`, `assemble`).

    `defaults` are the rollout's sampling settings; a request's fields override them. When the
    request gives no seed and defaults.seed is set, each call gets a seed of its own from
    (defaults.seed, episode id, call index), so calls never share their random numbers. An open
    episode (`open_episode`) uses its own settings instead; `open_only`: calls of episodes that are
    not open (ended, timed out) are refused (HTTP 404) and never recorded."""

    def __init__(self, generate: Generate, tokenizer: Any, defaults: SamplingSettings | None = None,
                 renderer: Any = None, model_name: str = "mrl-policy", generate_timeout_s: float = 600.0,
                 open_only: bool = False):
        self.generate, self.tokenizer = generate, tokenizer
        self.renderer = renderer or ChatRenderer(tokenizer)
        self.defaults = defaults or SamplingSettings()
        self.model_name, self.generate_timeout_s, self.open_only = model_name, generate_timeout_s, open_only
        self.family: str = getattr(self.renderer, "family", None) or "qwen"
        self.log = CallLog()
        self._gates: dict[str, tuple[asyncio.Lock, int]] = {}
        self._episodes: dict[str, EpisodeSettings] = {}
        self._episodes_lock = threading.Lock()  # open/close (any thread) against recording (the server's)
        self.app = self._build_app()

    def open_episode(self, episode_id: str, sampling: SamplingSettings, max_calls: int | None = None,
                     max_context: int | None = None) -> EpisodeSettings:
        """Start an episode with its own settings (see EpisodeSettings); the id must be new."""
        with self._episodes_lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} is already open: give each episode an id of its own")
            self._episodes[episode_id] = EpisodeSettings(sampling, max_calls, max_context)
            return self._episodes[episode_id]

    def close_episode(self, episode_id: str) -> list[CallRecord]:
        """End an episode: its calls, forgotten here ([] when it made none). A call of it still
        running when it ends is refused, not recorded."""
        with self._episodes_lock:
            self._episodes.pop(episode_id, None)
            try:
                return self.log.pop(episode_id)
            except KeyError:
                return []

    def assemble(self, episode_id: str, pop: bool = False) -> list[EndpointTrajectory]:
        """The episode's trajectories: one when it was linear (see call_log.assemble)."""
        return self.log.assemble(episode_id, pop=pop)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="mrl OpenAI-compatible endpoint")
        prefix = "/episodes/{episode_id:path}/v1"  # :path: an episode id may hold "/"
        app.add_api_route(prefix + "/models", self._models, methods=["GET"])
        app.add_api_route(prefix + "/chat/completions", self._chat, methods=["POST"])
        app.add_api_route(prefix + "/completions", self._completions, methods=["POST"])
        app.add_exception_handler(BadRequest, _bad_request)
        app.add_exception_handler(EpisodeNotOpen, _not_open)
        app.add_exception_handler(Exception, _server_error)
        return app

    async def _models(self, episode_id: str) -> dict:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "mrl"}
        return {"object": "list", "data": [model]}

    async def _chat(self, episode_id: str, request: Request) -> JSONResponse:
        body = await _json_body(request)
        refuse_unsupported(body, chat=True)
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': ...}")
        async with self._gate(episode_id):
            self._check_open(episode_id)
            index, last = self.log.last(episode_id)
            prompt, appended, note = await self._chat_prompt(index, last, messages, tools)
            generation, seconds = await self._generate(episode_id, index, prompt, body, chat=True)
            parse = tools is not None and body.get("tool_choice") != "none"
            calls, errors = parse_tool_calls(generation.text, self.family, id_prefix=f"call_{index}_") \
                if parse else ([], [])
            reply = assistant_reply(generation.text, calls, self.family)
            record = _record("chat", generation, prompt, seconds, appended, note, errors,
                             ChatContext(messages, tools, reply))
            self._record(episode_id, record)
        return JSONResponse(chat_response(self, episode_id, index, record, reply, _wants_logprobs(body, chat=True)))

    async def _completions(self, episode_id: str, request: Request) -> JSONResponse:
        body = await _json_body(request)
        refuse_unsupported(body, chat=False)
        async with self._gate(episode_id):
            self._check_open(episode_id)
            index, last = self.log.last(episode_id)
            prompt, appended, note = await self._completion_prompt(index, last, body.get("prompt"))
            generation, seconds = await self._generate(episode_id, index, prompt, body, chat=False)
            text = body["prompt"] if isinstance(body["prompt"], str) else None
            record = _record("completion", generation, prompt, seconds, appended, note, [], text)
            self._record(episode_id, record)
        return JSONResponse(completion_response(self, episode_id, index, record, _wants_logprobs(body, chat=False)))

    def _check_open(self, episode_id: str) -> None:
        if self.open_only and episode_id not in self._episodes:
            raise EpisodeNotOpen(f"episode {episode_id!r} is not open (it ended, timed out or never began): an "
                                 "agent must call the base_url of its own episode while the episode runs")

    def _record(self, episode_id: str, record: CallRecord) -> None:
        with self._episodes_lock:  # not into an episode that closed while its call ran
            self._check_open(episode_id)
            self.log.record(episode_id, record)

    async def _chat_prompt(self, index: int, last: CallRecord | None, messages: list[dict],
                           tools: list[dict] | None) -> tuple[list[int], int | None, str]:
        """(prompt ids, tokens appended after the previous completion or None, why rendered afresh)."""
        note = ""
        if last is not None:
            new, note = appended_messages(last, messages, tools, index)
            if new is not None:
                # A turn cut by max_tokens or a stop string lacks its end-of-turn token: the delta adds it.
                end = self.renderer.end_of_turn_ids()
                try:
                    ids = await self.renderer.append_ids_async(template_messages(new), tools,
                                                               truncated=last.completion_ids[-len(end):] != end)
                    return last.prompt_ids + last.completion_ids + ids, len(ids), ""
                except ValueError as e:  # a template that re-renders earlier turns for these roles
                    note = f"call {index}'s messages cannot be appended as tokens: {e}"
        ids = await self.renderer.prompt_ids_async(template_messages(messages), tools)
        return list(ids), None, note

    async def _completion_prompt(self, index: int, last: CallRecord | None,
                                 prompt: Any) -> tuple[list[int], int | None, str]:
        """Token ids given are used as they are; a text that starts with the previous call's prompt
        text + completion text continues that call's tokens, only the rest tokenised."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt), None, ""
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be one string or one list of token ids; send a batch as separate calls")
        if last is not None and last.kind == "completion" and isinstance(last.context, str):
            head = last.context + last.text
            if prompt.startswith(head):
                ids = await asyncio.to_thread(self._encode, prompt[len(head):], False)
                return last.prompt_ids + last.completion_ids + ids, len(ids), ""
        note = "" if last is None else f"call {index}'s prompt does not start with call {index - 1}'s prompt + text"
        return await asyncio.to_thread(self._encode, prompt, True), None, note

    def _encode(self, text: str, special_tokens: bool) -> list[int]:
        with TOKENIZER_LOCK:  # one Rust tokenizer used from two threads at once raises "Already borrowed"
            return list(self.tokenizer.encode(text, add_special_tokens=special_tokens))

    def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's text (the log-probs of a response name their tokens)."""
        with TOKENIZER_LOCK:
            return self.tokenizer.batch_decode([[t] for t in token_ids])

    async def _generate(self, episode_id: str, index: int, prompt: list[int],
                        body: dict, chat: bool) -> tuple[Generation, float]:
        sampling = self._sampling(body, episode_id, index, len(prompt))
        if chat:  # a chat turn ends at the template's end of turn, whatever the model's EOS
            ends = dict.fromkeys((*sampling.stop_token_ids, *self.renderer.end_of_turn_ids()))
            sampling = replace(sampling, stop_token_ids=tuple(ends))
        start = time.perf_counter()
        try:
            generation = await asyncio.wait_for(self.generate(prompt, sampling), self.generate_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the OpenAI endpoint waited {self.generate_timeout_s:.0f} s for the generate handle "
                               f"on call {index} of episode {episode_id!r}; raise generate_timeout_s or check "
                               "the engine") from None
        if len(generation.logprobs) != len(generation.token_ids):
            raise ValueError(f"the generate handle returned {len(generation.token_ids)} tokens but "
                             f"{len(generation.logprobs)} log-probs; it must return one log-prob per token")
        return generation, time.perf_counter() - start

    def _sampling(self, body: dict, episode_id: str, index: int, prompt_tokens: int) -> SamplingSettings:
        episode = self._episodes.get(episode_id)
        d = self.defaults if episode is None else episode.sampling
        stop = _given(body, "stop", d.stop)
        seed = _given(body, "seed", None)
        if seed is None and d.seed is not None:
            digest = hashlib.blake2b(f"{d.seed}|{episode_id}|{index}".encode(), digest_size=7).digest()
            seed = int.from_bytes(digest, "big")
        try:
            sampling = replace(
                d, temperature=float(_given(body, "temperature", d.temperature)),
                top_p=float(_given(body, "top_p", d.top_p)), top_k=int(_given(body, "top_k", d.top_k)),
                max_tokens=int(_given(body, "max_completion_tokens", _given(body, "max_tokens", d.max_tokens))),
                stop=(stop,) if isinstance(stop, str) else tuple(stop), seed=seed, n=1)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"a sampling setting has the wrong type ({e}): temperature, top_p are numbers, "
                             "max_tokens, top_k, seed integers, stop a string or a list of strings") from None
        if sampling.max_tokens < 1:
            raise BadRequest(f"max_tokens={sampling.max_tokens}: ask for at least 1 token")
        return sampling if episode is None else _episode_sampling(episode, sampling, episode_id, index, prompt_tokens)

    @contextlib.asynccontextmanager
    async def _gate(self, episode_id: str) -> AsyncIterator[None]:
        """One call of an episode at a time (the next call extends the last one); the lock is
        dropped once no call of the episode waits for it."""
        lock, users = self._gates.get(episode_id, (asyncio.Lock(), 0))
        self._gates[episode_id] = (lock, users + 1)
        try:
            await asyncio.wait_for(lock.acquire(), self.generate_timeout_s)
        except asyncio.TimeoutError:
            self._release_gate(episode_id)
            raise TimeoutError(f"a call of episode {episode_id!r} waited {self.generate_timeout_s:.0f} s for the "
                               "episode's previous call to finish") from None
        try:
            yield
        finally:
            lock.release()
            self._release_gate(episode_id)

    def _release_gate(self, episode_id: str) -> None:
        lock, users = self._gates[episode_id]
        if users == 1:
            del self._gates[episode_id]
        else:
            self._gates[episode_id] = (lock, users - 1)


def _episode_sampling(episode: EpisodeSettings, sampling: SamplingSettings, episode_id: str, index: int,
                      prompt_tokens: int) -> SamplingSettings:
    """A call's settings within its open episode's (see EpisodeSettings); refuses a call past its limits."""
    room = sampling.max_tokens if episode.max_context is None else episode.max_context - prompt_tokens
    if episode.max_calls is not None and index >= episode.max_calls:
        episode.truncated = f"episode {episode_id!r} may make {episode.max_calls} calls (agent.max_turns)"
    elif room < 1:
        episode.truncated = (f"call {index}'s prompt of {prompt_tokens} tokens leaves no room in episode "
                             f"{episode_id!r}'s context budget of {episode.max_context} tokens (agent.max_tokens)")
    if episode.truncated:
        raise BadRequest(f"call {index} refused: {episode.truncated}; end the episode")
    own = episode.sampling
    return replace(sampling, temperature=own.temperature, top_p=own.top_p, top_k=own.top_k,
                   seed=None if own.seed is None else _mix(own.seed, index),
                   max_tokens=min(sampling.max_tokens, own.max_tokens, room))


def _record(kind: str, generation: Generation, prompt: list[int], seconds: float, appended: int | None,
            note: str, errors: list[str], context: Any) -> CallRecord:
    if generation.finish_reason is None:
        raise ValueError("the generate handle returned an unfinished generation (finish_reason None); "
                         "it must continue an interrupted one before returning it")
    known = generation.token_versions is not None or generation.weight_version is not None
    return CallRecord(kind, list(prompt), list(generation.token_ids), list(generation.logprobs),
                      generation.versions() if known else None, generation.finish_reason, generation.text,
                      seconds, appended, note, tuple(errors), context, generation.routed_experts)


def _given(body: dict, key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _wants_logprobs(body: dict, chat: bool) -> bool:
    return bool(body.get("logprobs")) if chat else body.get("logprobs") is not None


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise BadRequest(f"the request body is not JSON ({e}); send the OpenAI request object") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object (the OpenAI request)")
    return body


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    return _error(400, str(exc), "invalid_request_error")


async def _not_open(request: Request, exc: Exception) -> JSONResponse:
    return _error(404, str(exc), "not_found_error")


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(500, f"{type(exc).__name__}: {exc}", "server_error")


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, made with proto IPPROTO_TCP: asyncio sets TCP_NODELAY only
    on connections whose socket says so, and socket.create_server's say proto 0. Without it uvicorn's
    reply (headers, then body) waits for the client's delayed ACK: 44 ms a call on a kept-alive
    connection, measured (benchmarks/agent_endpoint.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


class LocalServer:
    """An app served by uvicorn from a thread of its own on host:port (port 0: a free one, bound
    before the thread starts, so `port` is known at once). Use as a context manager. `threads`:
    the server loop's worker threads (each running generate call of a thread-based handle holds
    one; asyncio's default, CPUs + 4, would cap how many episodes' calls reach the engine at once)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 threads: int = 256):
        import uvicorn

        self._socket = _listening_socket(host, port)
        self.host, self.port = host, self._socket.getsockname()[1]
        self.timeout_s, self.threads = timeout_s, threads
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=int(timeout_s))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name=f"openai-endpoint:{self.port}",
                                        daemon=True)

    async def _serve(self) -> None:
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"openai-endpoint:{self.port}")
        asyncio.get_running_loop().set_default_executor(pool)
        await self._server.serve(sockets=[self._socket])

    def base_url(self, episode_id: str) -> str:
        """What an agent's OpenAI client takes as base_url for this episode."""
        return f"http://{self.host}:{self.port}/episodes/{urllib.parse.quote(episode_id, safe='')}/v1"

    def start(self) -> LocalServer:
        self._thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                raise TimeoutError(f"waited {self.timeout_s:.0f} s for uvicorn to serve the OpenAI endpoint on "
                                   f"{self.host}:{self.port} (alive: {self._thread.is_alive()}); see its log above")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(self.timeout_s)
        self._socket.close()
        if self._thread.is_alive():
            raise TimeoutError(f"waited {self.timeout_s:.0f} s for the OpenAI endpoint on {self.host}:{self.port} "
                               "to stop; a call still running keeps it up")

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
