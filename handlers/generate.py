"""``--handler generate --model DIR``: a causal language model from a local directory, served by transformers'
continuous batching (``ContinuousBatchingManager``, from ``model.init_continuous_batching``).

The engine runs one decoding step at a time over every running sequence, and admits new prompts between steps:
a sequence that ends frees its place at once, and a new one does not wait for a batch to fill. Its paged KV cache
is sized here, from the options (transformers sizes it from free GPU memory otherwise, which on a CPU host is
not what is free for it).

Requests are OpenAI chat-completions bodies or ``{"prompt": ...}`` (``kinference.openai``), turned into token ids
in ``validate`` (the model's chat template for ``messages``). Text comes out of the engine one token at a time and
is detokenised incrementally (``tokenizers``' ``DecodeStream``: a character split over several byte-level tokens is
held until it is whole), with stop strings cut out of the text (the tail that could still begin one is held back).

Options (``--handler-options key=value``):
- ``max_new_tokens`` (256): the server's cap on ``max_tokens``; also bounded by the context length;
- ``max_sequences`` (32): the sequences decoded together in one step;
- ``max_batch_tokens`` (512): the tokens of one step (prompts are prefilled in pieces of at most this);
- ``kv_cache_tokens`` (0 = ``max_sequences`` x the context length): the KV cache's size, in tokens. On a CPU a
  decoding step's cost grows with it (a tiny model at 1 stream: 10.5 ms a token with 2,048, 21 ms with 16,384), so
  size it to the workload (the running sequences' prompt and answer tokens), not to the worst case;
- ``page_size`` (64): tokens per KV-cache page;
- ``decoding`` (``sample``): ``sample`` honours each request's ``temperature`` and ``top_p`` (a temperature of 0
  picks the likeliest token: it is taken as 1e-4, since the engine either samples every sequence or none);
  ``greedy`` always picks the likeliest token and ignores both;
- ``max_chars`` (32768): the most characters of prompt text;
- ``dtype`` (float32, float16 or bfloat16);
- ``chat_template``: a Jinja file to use when the tokenizer has none.

``seed`` (``decoding=sample``): the request's tokens are drawn from noise of its seed and their positions
(``seeding.SeededSampling``), so the same prompt, seed and settings give the same text whatever runs beside it.

``validate`` refuses alone what the engine cannot take: a prompt with no text to continue (blank, or only special
tokens: the engine's step crashes on an empty one), and a prompt or ``max_tokens`` past the context or the KV cache.

The engine is supervised here, by the thread that drains its events (``events``): an engine whose loop thread died
(a step raised) or that made no step for ``hang_s`` (``--device-hang-s``) while it had work is replaced by a new one
on the same weights. The requests it held end with ``error`` (the service answers them ``handler_error``); those
submitted while it is replaced wait and go to the new one; ``health`` is red, naming the fault, until the new one
runs. A hung step's thread cannot be stopped: it is left behind (a daemon thread, so it cannot hold the process at
exit), with its KV cache; after ``MAX_HUNG`` of those, ``MAX_FRUITLESS`` engines in a row that fail before their
first step, or when a new engine cannot be built, the engine gives up and its health says the process must be
replaced.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers.decoders import DecodeStream
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kinference.errors import HandlerLoadError, InvalidInput, RequestError

try:
    from transformers import ContinuousBatchingConfig
except ImportError as exc:  # an older transformers: say which one this handler needs
    raise HandlerLoadError(f"--handler generate needs transformers' continuous batching: pip install "
                           f"'kinference[generate]' ({exc})") from exc
from kinference.handlers.base import HandlerContext
from kinference.handlers.generative import SERVING, EngineHealth, Event, GenerativeHandler, Prompt, Sampling
from kinference.handlers.options import one_of, positive_int, with_defaults
from kinference.handlers.seeding import add_seeded_sampling
from kinference.handlers.text import DTYPES, check_model_dir
from kinference.openai import ChatRequest, read_chat_request
from kinference.protocol import ErrorCode

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-4
"""What a temperature of 0 becomes when the engine samples: logits scaled by 10^4 leave only the likeliest token."""
_DEFAULT_TEMPERATURE = 0.7
_DEFAULT_TOP_P = 0.95
"""The engine's own defaults under ``decoding=sample``: neither may be 1.0, or transformers builds no per-request
temperature or top-p step at all."""
MAX_HUNG = 2
"""Hung engines left behind (their step never returned, their KV cache held) before the engine gives up, and the
process must be replaced: past it, replacing them in the process only piles up what they hold."""
MAX_FRUITLESS = 3
"""Engines in a row replaced before they made a single step (a KV cache that cannot be allocated any more, a device
that fails every step) before the engine gives up: replacing them would only spin."""


@dataclass(slots=True)
class _Sequence:
    """One running request, as the drain thread sees it: its detokeniser and the text so far."""

    prompt: Prompt
    decoder: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=True))
    seen: int = 0
    """Generated tokens fed to the detokeniser so far."""
    text: str = ""
    sent: int = 0
    """Characters of ``text`` already sent in deltas."""
    in_engine: bool = False
    """Handed to the current engine; False while it waits for one (submitted while the engine was replaced)."""


class GenerateHandler(GenerativeHandler):
    name = "generate"
    device_process = True
    """With a device process, the engine (the weights, the KV cache, detokenisation) runs there once, for every
    worker; a worker (role ``host``) loads only the tokenizer and the config, to validate."""
    defaults: dict[str, Any] = {
        "max_new_tokens": 256,
        "max_sequences": 32,
        "max_batch_tokens": 512,
        "kv_cache_tokens": 0,
        "page_size": 64,
        "decoding": "sample",
        "max_chars": 32_768,
        "dtype": "float32",
        "chat_template": None,
    }

    def setup(self, context: HandlerContext) -> None:
        options = with_defaults(self.name, self.defaults, context.options)
        if context.model is None:
            raise HandlerLoadError("generate needs --model DIR: a local directory with a causal LM (config.json, the "
                                   "weights, the tokenizer), as model.save_pretrained(DIR) writes it")
        self.max_new_tokens = positive_int(self.name, "max_new_tokens", options["max_new_tokens"])
        self.max_chars = positive_int(self.name, "max_chars", options["max_chars"])
        self.greedy = one_of(self.name, "decoding", options["decoding"], ("sample", "greedy")) == "greedy"
        self.max_sequences = positive_int(self.name, "max_sequences", options["max_sequences"])
        dtype = DTYPES[one_of(self.name, "dtype", options["dtype"], DTYPES)]
        self.model_name = context.model.resolve().name
        self.tokenizer = _load_tokenizer(context.model)
        self._template = _chat_template(self.tokenizer, context.model, options["chat_template"])
        self.context_length = _context_length(context.model)
        self._special = frozenset(self.tokenizer.all_special_ids)
        self._options = options
        self.kv_cache_tokens = self._kv_pages() * self._page_size
        """What one sequence may hold, its prompt and answer together: the KV cache's pages (and the context)."""
        self._engine: _Engine | None = None
        self._lock = threading.Lock()
        self._health = SERVING
        if context.role == "host":  # a worker beside a device process: it validates, the device process generates
            return
        self._model = _load_model(context.model, dtype, context.device)
        self.eos = _eos(self.tokenizer, self._model, context.model)
        self._backend = self.tokenizer.backend_tokenizer
        self._hang_s = context.hang_s
        self._running: dict[str, _Sequence] = {}
        self._ended: list[Event] = []
        """Cancelled requests' events, waiting for the next ``events`` call."""
        self._hung: list[_Engine] = []
        """Engines replaced while a step of theirs hung: left behind."""
        self._fruitless = 0
        """Engines replaced in a row before they made a step."""
        self._engine = self._start_engine()
        self._progress = (self._engine.steps, time.monotonic())
        """The engine's step count when it last changed, and when."""

    def _start_engine(self) -> _Engine:
        """A new engine on the model's weights; ``HandlerLoadError`` when it cannot be built."""
        return _Engine.start(self._model, self._engine_config(), self._generation_config())

    @property
    def _page_size(self) -> int:
        return positive_int(self.name, "page_size", self._options["page_size"])

    def _kv_pages(self) -> int:
        tokens = self._options["kv_cache_tokens"] or self.max_sequences * self.context_length
        return math.ceil(positive_int(self.name, "kv_cache_tokens", tokens) / self._page_size)

    def _engine_config(self) -> ContinuousBatchingConfig:
        """A new one for each engine: transformers fills it in when it builds the engine."""
        return ContinuousBatchingConfig(
            num_blocks=self._kv_pages(), page_size=self._page_size,
            max_batch_tokens=positive_int(self.name, "max_batch_tokens", self._options["max_batch_tokens"]),
            max_requests_per_batch=self.max_sequences, use_cuda_graph=False, allow_block_sharing=False,
            per_request_processors=not self.greedy)

    def _generation_config(self) -> GenerationConfig:
        if self.greedy:
            return GenerationConfig(do_sample=False, eos_token_id=list(self.eos), max_new_tokens=self.max_new_tokens)
        return GenerationConfig(do_sample=True, temperature=_DEFAULT_TEMPERATURE, top_p=_DEFAULT_TOP_P, top_k=0,
                                eos_token_id=list(self.eos), max_new_tokens=self.max_new_tokens)

    # --- the poll thread

    def validate(self, payload: Any) -> Prompt:
        request = read_chat_request(payload, self.max_chars)
        if request.messages is not None and not any(message["content"].strip() for message in request.messages):
            raise InvalidInput("the messages have no text: every content is blank")
        token_ids = self._tokens(request)
        if all(token in self._special for token in token_ids):
            raise InvalidInput(f"the prompt has no text to continue: {len(token_ids)} tokens, none but special ones "
                               "(a blank or whitespace-only prompt has none at all)")
        limit, what = self._limit()
        room = limit - len(token_ids)
        if room < 1:
            raise InvalidInput(f"the prompt is {len(token_ids)} tokens; {what} is {limit}")
        wanted = request.max_tokens or self.max_new_tokens
        if request.max_tokens is not None and request.max_tokens > room:
            raise InvalidInput(f"max_tokens={request.max_tokens} and the prompt's {len(token_ids)} tokens exceed "
                               f"{what} of {limit} tokens")
        sampling = Sampling(min(wanted, self.max_new_tokens, room), request.temperature, request.top_p, request.stop,
                            request.seed)
        return Prompt(tuple(token_ids), sampling, request.stream)

    def _limit(self) -> tuple[int, str]:
        """The most tokens of one sequence, and what sets it: the context, or a KV cache smaller than it (a sequence
        that outgrows the cache stops the engine's scheduler for good)."""
        if self.kv_cache_tokens < self.context_length:
            return self.kv_cache_tokens, "the KV cache (handler option kv_cache_tokens)"
        return self.context_length, "the model's context"

    def _tokens(self, request: ChatRequest) -> list[int]:
        if request.prompt is not None:
            ids: list[int] = self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            return ids
        if self._template is None:
            raise InvalidInput('this model has no chat template: send {"prompt": "..."} instead of "messages"')
        # read_chat_request gives a request its prompt or its messages: here, its messages.
        ids = self.tokenizer.apply_chat_template(list(request.messages or ()), chat_template=self._template,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        return ids

    def submit(self, request_id: str, prompt: Prompt) -> None:
        """To the engine; while it is being replaced (or found dead here), the request waits for the next one."""
        with self._lock:
            engine = self._live_engine  # the current one: a replacement swaps it under this lock
            if self._health.problem is not None and not self._health.replacing:
                raise RequestError(self._health.problem, ErrorCode.HANDLER_ERROR)
            if request_id in self._running:
                raise RequestError(f"request {request_id} is already generating", ErrorCode.INTERNAL_ERROR)
            sequence = self._running[request_id] = _Sequence(prompt)
            if not self._health.replacing:
                self._hand(engine, request_id, sequence)

    def _hand(self, engine: _Engine, request_id: str, sequence: _Sequence) -> None:
        """(Under the lock.) Give the sequence to ``engine``; one that does not run keeps it waiting for the next."""
        sampling = sequence.prompt.sampling
        extra: dict[str, float | int] = {} if self.greedy else {
            "temperature": max(sampling.temperature, MIN_TEMPERATURE), "top_p": sampling.top_p}
        if not self.greedy and sampling.seed is not None:
            extra["seed"] = sampling.seed
        sequence.in_engine = engine.add(request_id, list(sequence.prompt.token_ids), sampling.max_tokens, extra)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            sequence = self._running.pop(request_id, None)
            if sequence is None:
                return
            self._ended.append(Event(request_id, "cancelled", sequence.text, sequence.seen,
                                     len(sequence.prompt.token_ids), "cancelled"))
        if sequence.in_engine:
            self._live_engine.cancel(request_id)

    # --- the drain thread

    def events(self, timeout_s: float) -> list[Event]:
        """The engine's events; and its supervision: a dead or hung engine is replaced here."""
        engine = self._live_engine
        outputs = engine.outputs(0.0 if self._ended else timeout_s)
        with self._lock:
            events, self._ended = self._ended, []
            events += self._read(outputs)
            fault = self._fault(engine)
        if fault is not None:
            events += self._replace(engine, fault)
        return events

    def _read(self, outputs: list[Any]) -> list[Event]:
        """(Under the lock.) The events of the engine's outputs; one that cannot be read fails its request alone."""
        events: list[Event] = []
        for output in outputs:
            sequence = self._running.get(output.request_id)
            if sequence is None:  # cancelled, or ended by a stop string: what follows is stale
                continue
            try:
                events += self._advance(output, sequence)
            except Exception as exc:  # a detokeniser's or a stop string's fault is this request's alone
                log.exception("model %s: request %s: its output cannot be read", self.model_name, output.request_id)
                self._running.pop(output.request_id, None)
                self._live_engine.cancel(output.request_id)
                events.append(Event(output.request_id, "error", f"its output cannot be read: {exc!r}", sequence.seen,
                                    len(sequence.prompt.token_ids)))
        return events

    def _fault(self, engine: _Engine) -> str | None:
        """(Under the lock.) Why ``engine`` must be replaced: its loop ended, or it has work and made no step for
        ``hang_s``; None while it serves."""
        if self._health.problem is not None:  # already replaced or given up: nothing more to do here
            return None
        now, steps = time.monotonic(), engine.steps
        busy = any(sequence.in_engine for sequence in self._running.values())
        if steps != self._progress[0] or not busy:
            self._progress = (steps, now)
        if not engine.alive:
            return f"its loop ended: {engine.error}" if engine.error else "its loop ended"
        if self._hang_s is not None and now - self._progress[1] > self._hang_s:
            return f"no decoding step for {now - self._progress[1]:.1f} s (--device-hang-s {self._hang_s:g})"
        return None

    def _replace(self, old: _Engine, fault: str) -> list[Event]:
        """A new engine for ``old``: what ``old`` held ends with ``error``; what waits goes to the new one."""
        log.error("model %s: the generation engine is replaced: %s", self.model_name, fault)
        with self._lock:
            self._health = EngineHealth(f"model {self.model_name}: the generation engine is being replaced: {fault}",
                                        replacing=True)
            events = self._read(old.outputs(0.0))  # a dead engine's last outputs: its requests' own errors
            events += self._fail(lambda sequence: sequence.in_engine, f"the engine failed: {fault}")
        why_not = self._no_replacement(old)
        old.abandon()
        engine = None if why_not else self._try_start()
        with self._lock:
            if engine is None:
                self._health = EngineHealth(f"model {self.model_name}: the generation engine gave up after {fault}: "
                                            f"{why_not or 'no new one could be built'}")
                return events + self._fail(lambda sequence: True, self._health.problem or "")
            self._engine = engine
            for request_id, sequence in self._running.items():
                self._hand(engine, request_id, sequence)
            self._progress = (engine.steps, time.monotonic())
            self._health = SERVING
        log.warning("model %s: a new generation engine serves", self.model_name)
        return events

    def _no_replacement(self, old: _Engine) -> str | None:
        """Why ``old`` must not be replaced in this process (too many hung or fruitless engines); None: it may."""
        if old.alive:
            self._hung = [engine for engine in self._hung if engine.alive] + [old]
        self._fruitless = self._fruitless + 1 if old.steps == 0 else 0
        if len(self._hung) > MAX_HUNG:
            return f"{len(self._hung)} hung engines left behind"
        if self._fruitless >= MAX_FRUITLESS:
            return f"{self._fruitless} engines in a row failed before their first step"
        return None

    def _try_start(self) -> _Engine | None:
        try:
            return self._start_engine()
        except HandlerLoadError:
            log.exception("model %s: no new generation engine could be built", self.model_name)
            return None

    def _fail(self, which: Callable[[_Sequence], bool], reason: str) -> list[Event]:
        """(Under the lock.) End the sequences ``which`` picks with an ``error`` event each."""
        failed = [(request_id, sequence) for request_id, sequence in self._running.items() if which(sequence)]
        for request_id, _ in failed:
            del self._running[request_id]
        return [Event(request_id, "error", reason, sequence.seen, len(sequence.prompt.token_ids))
                for request_id, sequence in failed]

    @property
    def health(self) -> EngineHealth:
        return self._health

    def _advance(self, output: Any, sequence: _Sequence) -> list[Event]:
        """The events of one engine output (the request's tokens so far)."""
        request_id, prompt_tokens = output.request_id, len(sequence.prompt.token_ids)
        if output.error is not None:
            del self._running[request_id]
            return [Event(request_id, "error", f"the engine failed: {output.error}", sequence.seen, prompt_tokens)]
        tokens = output.generated_tokens
        for token in tokens[sequence.seen:]:
            sequence.text += self._piece(sequence.decoder, token)
        sequence.seen = len(tokens)
        stopped = _cut_at_stop(sequence)
        finished = stopped or output.is_finished()
        events = []
        safe = len(sequence.text) if finished else len(sequence.text) - _held(sequence.text, sequence.prompt)
        if safe > sequence.sent:
            events.append(Event(request_id, "delta", sequence.text[sequence.sent:safe], sequence.seen, prompt_tokens))
            sequence.sent = safe
        if finished:
            del self._running[request_id]
            if stopped:
                self._live_engine.cancel(request_id)
            reason = "stop" if stopped or (tokens and tokens[-1] in self.eos) else "length"
            events.append(Event(request_id, "final", sequence.text, sequence.seen, prompt_tokens, reason))
        return events

    def _piece(self, decoder: DecodeStream, token: int) -> str:
        if token in self.eos:
            return ""
        return decoder.step(self._backend, token) or ""

    @property
    def kv_cache_use(self) -> float | None:
        return None if self._engine is None else self._engine.cache_use()

    @property
    def _live_engine(self) -> _Engine:
        if self._engine is None:
            raise RequestError("this worker's generate handler validates only: its engine runs in the device process",
                               ErrorCode.INTERNAL_ERROR)
        return self._engine

    def describe(self) -> dict[str, str]:
        return {"handler": self.name, "model": self.model_name, "engine": "transformers-continuous-batching",
                "decoding": "greedy" if self.greedy else "sample"}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()


def _load_tokenizer(model_dir: Path) -> Any:
    check_model_dir(GenerateHandler.name, model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # whatever fails while loading, the service cannot start
        raise HandlerLoadError(f"generate: cannot load the tokenizer of {model_dir}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise HandlerLoadError(f"generate: the tokenizer in {model_dir} has no fast (Rust) version, which "
                               "incremental detokenisation needs: save its tokenizer.json")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise HandlerLoadError(f"generate: the tokenizer in {model_dir} has neither a pad token nor an end-of-sequence "
                               "token: set them and save it (tokenizer.eos_token = ...; tokenizer.pad_token = "
                               "tokenizer.eos_token; tokenizer.save_pretrained(DIR))")
    return tokenizer


def _context_length(model_dir: Path) -> int:
    try:
        return int(AutoConfig.from_pretrained(model_dir, local_files_only=True).max_position_embeddings)
    except Exception as exc:  # a config without a context length cannot bound a prompt
        raise HandlerLoadError(f"generate: cannot read the context length from {model_dir}/config.json: "
                               f"{exc}") from exc


def _load_model(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    except Exception as exc:  # whatever fails while loading, the service cannot start
        raise HandlerLoadError(f"generate: cannot load a causal LM from {model_dir}: {exc}") from exc
    return model.eval().to(device)


def _chat_template(tokenizer: Any, model_dir: Path, path: str | None) -> str | None:
    """The template for ``messages``: the option's file, else the tokenizer's; None (``prompt`` only) when neither."""
    if path is not None:
        try:
            return Path(path).expanduser().read_text()
        except OSError as exc:
            raise HandlerLoadError(f"generate: cannot read the chat_template file {path}: {exc}") from exc
    if tokenizer.chat_template is None:
        log.warning("the tokenizer in %s has no chat template: requests with \"messages\" are refused, {\"prompt\": "
                    "...} served (set one with --handler-options chat_template=FILE.jinja)", model_dir)
    template: str | None = tokenizer.chat_template
    return template


def _eos(tokenizer: Any, model: Any, model_dir: Path) -> frozenset[int]:
    """Every token that ends a sequence: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids.update(source if isinstance(source, list) else [] if source is None else [source])
    if not ids:
        raise HandlerLoadError(f"generate: neither the tokenizer nor the generation config in {model_dir} names an "
                               "end-of-sequence token, so every answer would run to max_tokens: set "
                               "tokenizer.eos_token and save it (tokenizer.save_pretrained(DIR))")
    return frozenset(ids)


def _cut_at_stop(sequence: _Sequence) -> bool:
    """Cut the text before the first stop string in it; True when there was one. Only the new text (and the tail
    that could have begun a stop before it) is searched."""
    stops = sequence.prompt.sampling.stop
    if not stops:
        return False
    start = max(0, sequence.sent - max(map(len, stops)))
    found = [i for i in (sequence.text.find(stop, start) for stop in stops) if i >= 0]
    if not found:
        return False
    sequence.text = sequence.text[:min(found)]
    return True


def _held(text: str, prompt: Prompt) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string: not sent yet."""
    held = 0
    for stop in prompt.sampling.stop:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held


class _Engine:
    """transformers' ``ContinuousBatchingManager`` behind four calls; it runs its own decoding thread."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._outputs: queue.Queue[Any] = manager.output_router.output_queue

    @classmethod
    def start(cls, model: Any, config: ContinuousBatchingConfig, generation: GenerationConfig) -> _Engine:
        try:
            manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
            if config.per_request_processors:  # sampling: each request's own seed
                add_seeded_sampling(manager)
            # The engine's thread is a daemon when a daemon thread starts it (threads inherit it): a step that
            # hangs then cannot hold the process at exit.
            starter = threading.Thread(target=manager.start, name="kinference-engine-start", daemon=True)
            starter.start()
            starter.join()
            if not manager.is_running():
                raise RuntimeError("its thread did not start")
        except Exception as exc:
            raise HandlerLoadError(f"generate: transformers' continuous batching cannot serve this model: "
                                   f"{exc}") from exc
        return cls(manager)

    def add(self, request_id: str, token_ids: list[int], max_tokens: int, sampling: dict[str, float | int]) -> bool:
        """False when the engine does not take requests (stopped, or its thread died)."""
        if not self._manager.is_running():
            return False
        added = self._manager.add_request(token_ids, request_id=request_id, max_new_tokens=max_tokens,
                                          streaming=True, **sampling)
        return added is not None

    def cancel(self, request_id: str) -> None:
        self._manager.cancel_request(request_id)

    def outputs(self, timeout_s: float) -> list[Any]:
        """Every output waiting, after up to ``timeout_s`` for the first."""
        return _drain(self._outputs.get, timeout_s)

    def cache_use(self) -> float | None:
        cache = getattr(self._manager.batch_processor, "cache", None)
        if cache is None or not cache.num_sectors:
            return None
        use: float = 1.0 - cache.pool.num_free_sectors / cache.num_sectors
        return use

    @property
    def alive(self) -> bool:
        running: bool = self._manager.is_running()
        return running

    @property
    def steps(self) -> int:
        """Decoding steps made so far: the engine's heartbeat of work done."""
        steps: int = getattr(self._manager, "current_batch", 0)
        return steps

    @property
    def error(self) -> str | None:
        """What ended its loop, if a step raised."""
        error = self._manager.background_thread_status.fatal_error
        return None if error is None else repr(error)

    def abandon(self) -> None:
        """Ask its loop to stop, without waiting: a hung step never returns. What it still held is not read. Never
        raises: the engine is being replaced whatever this one does."""
        try:
            self._manager.stop(block=False, hard_stop=True)
        except Exception:  # a replacement must not be held up by the engine it replaces
            log.exception("the replaced generation engine did not take its stop")

    def stop(self) -> None:
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=10.0)


def _drain(get: Callable[..., Any], timeout_s: float) -> list[Any]:
    items = []
    try:
        items.append(get(timeout=timeout_s) if timeout_s > 0 else get(block=False))
        while True:
            items.append(get(block=False))
    except queue.Empty:
        return items
