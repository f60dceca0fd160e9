"""The generative handler (handlers/generate.py) on a tiny Llama: transformers' continuous batching behind the
submit/cancel/events port, OpenAI request bodies, detokenisation, stop strings, cancel, load errors."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24):
    # .ci/lowest-versions.sh runs the unit tests on serve's floor (transformers 4.56): the generate extra's is 5.24.
    pytest.skip("the generate handler needs transformers >= 5.24 (pip install 'kinference[generate]')",
                allow_module_level=True)


from kinference.errors import HandlerLoadError, InvalidInput, RequestError
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers.generate import MAX_FRUITLESS, MAX_HUNG, GenerateHandler, _held, _Sequence
from kinference.handlers.generative import SERVING, Event, Prompt, Sampling
from kinference.openai import read_chat_request, read_embeddings_request
from tests.fakes import wait_for
from tests.models import build_tiny_causal_lm


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="module")
def greedy(lm_dir: Path) -> Any:
    handler = load_handler("generate")
    handler.setup(HandlerContext(device="cpu", model=lm_dir, options={"decoding": "greedy", "max_new_tokens": 24}))
    yield handler
    handler.close()


def run(handler: GenerateHandler, prompts: dict[str, Prompt], timeout_s: float = 120.0) -> dict[str, list[Event]]:
    """Submit every prompt and collect each one's events until all have ended."""
    for request_id, prompt in prompts.items():
        handler.submit(request_id, prompt)
    events: dict[str, list[Event]] = {request_id: [] for request_id in prompts}
    ended: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(ended) < len(prompts) and time.monotonic() < deadline:
        for event in handler.events(0.2):
            events[event.request_id].append(event)
            if event.kind != "delta":
                ended.add(event.request_id)
    assert ended == set(prompts)
    return events


def test_continuous_batching_decodes_as_generate_does(greedy: GenerateHandler, lm_dir: Path) -> None:
    """Greedy tokens from the engine, many requests at once, are those of a plain generate() call per prompt; the
    deltas add up to the final text, which is the tokenizer's decoding of the tokens."""
    texts = ["the cat sat on the mat", "kafka", "a broker partition offset batch model token inference"]
    prompts = {f"r{i}": greedy.validate({"prompt": text, "max_tokens": 12}) for i, text in enumerate(texts)}
    events = run(greedy, prompts)
    model = AutoModelForCausalLM.from_pretrained(lm_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(lm_dir, local_files_only=True)
    for request_id, prompt in prompts.items():
        *deltas, final = events[request_id]
        assert final.kind == "final" and all(delta.kind == "delta" for delta in deltas)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt.token_ids]), max_new_tokens=12, do_sample=False)
        expected = out[0, len(prompt.token_ids):].tolist()
        assert final.completion_tokens == len(expected)
        assert final.finish_reason == ("stop" if expected[-1] == tokenizer.sep_token_id else "length")
        assert final.text.strip() == tokenizer.decode(expected, skip_special_tokens=True).strip()
        assert "".join(delta.text for delta in deltas) == final.text
        assert final.prompt_tokens == len(prompt.token_ids)


def test_the_host_side_validates_as_the_engine_side_does_and_loads_no_model(greedy: GenerateHandler,
                                                                          lm_dir: Path) -> None:
    """Beside a device process a worker sets the handler up as ``host``: the tokenizer and the config, to validate;
    the weights and the engine are the device process's."""
    host = load_handler("generate")
    host.setup(HandlerContext(device="cpu", model=lm_dir, options={"decoding": "greedy", "max_new_tokens": 24,
                                                                   "max_sequences": 5}, role="host"))
    assert type(host).device_process and host._engine is None and host.max_sequences == 5
    for body in ({"prompt": "the cat sat", "max_tokens": 100}, {"messages": [{"role": "user", "content": "hi"}]}):
        assert host.validate(body) == greedy.validate(body)
    with pytest.raises(InvalidInput, match="context"):
        host.validate({"prompt": "cat " * 300})
    with pytest.raises(Exception, match="runs in the device process"):
        host.submit("r", greedy.validate({"prompt": "x"}))
    host.close()


def test_chat_messages_go_through_the_template(greedy: GenerateHandler) -> None:
    prompt = greedy.validate({"messages": [{"role": "user", "content": "hello"}], "stream": True})
    text = greedy.tokenizer.decode(prompt.token_ids)
    assert text == "user : hello assistant :"  # the test template, through WordPiece
    assert prompt.stream is True


def test_max_tokens_is_capped_by_the_server_and_the_context(greedy: GenerateHandler) -> None:
    assert greedy.validate({"prompt": "the cat"}).sampling.max_tokens == 24  # the handler's max_new_tokens
    assert greedy.validate({"prompt": "the cat", "max_completion_tokens": 200}).sampling.max_tokens == 24
    with pytest.raises(InvalidInput, match="exceed the model's context of 256 tokens"):
        greedy.validate({"prompt": "the cat", "max_tokens": 300})
    with pytest.raises(InvalidInput, match="the model's context is 256"):
        greedy.validate({"prompt": "cat " * 300})


def test_stop_string_ends_the_text_before_it(greedy: GenerateHandler) -> None:
    """Generate once, pick a stop string from the middle of the text, generate again: the text ends before it,
    with finish_reason stop, and no delta ever carried any part of it."""
    first = run(greedy, {"free": greedy.validate({"prompt": "river music", "max_tokens": 20})})["free"][-1]
    words = first.text.split()
    stop = " " + words[len(words) // 2]
    expected = first.text[:first.text.index(stop)]
    events = run(greedy, {"cut": greedy.validate({"prompt": "river music", "max_tokens": 20, "stop": [stop]})})["cut"]
    final = events[-1]
    assert (final.kind, final.finish_reason, final.text) == ("final", "stop", expected)
    assert "".join(event.text for event in events[:-1]) == expected


def test_held_keeps_back_what_could_begin_a_stop_string() -> None:
    prompt = Prompt((1,), Sampling(5, stop=("END", "xy")))
    assert _held("some text E", prompt) == 1
    assert _held("some text EN", prompt) == 2
    assert _held("some text x", prompt) == 1
    assert _held("some text", prompt) == 0
    assert isinstance(_Sequence(prompt).text, str)


def test_cancel_ends_a_request_with_cancelled_and_nothing_after(greedy: GenerateHandler) -> None:
    greedy.submit("long", greedy.validate({"prompt": "the cat", "max_tokens": 24}))
    greedy.cancel("long")
    greedy.cancel("long")  # a second cancel, or one of an unknown id, does nothing
    greedy.cancel("unknown")
    seen: list[Event] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        seen += [event for event in greedy.events(0.1) if event.request_id == "long"]
    assert [event.kind for event in seen] == ["cancelled"]
    assert seen[0].finish_reason == "cancelled"


def test_sampling_honours_temperature_zero(lm_dir: Path, greedy: GenerateHandler) -> None:
    """Under decoding=sample, temperature 0 gives the greedy tokens."""
    handler = load_handler("generate")
    handler.setup(HandlerContext(device="cpu", model=lm_dir, options={"max_new_tokens": 10}))
    try:
        body = {"prompt": "blue stream broker", "max_tokens": 10, "temperature": 0}
        sampled = run(handler, {"a": handler.validate(body)})["a"][-1]
    finally:
        handler.close()
    assert sampled.text == run(greedy, {"b": greedy.validate(body)})["b"][-1].text


def test_a_seed_gives_the_same_text_whatever_runs_beside_it(lm_dir: Path) -> None:
    """OpenAI's seed under decoding=sample: the same seed and temperature > 0 give the same text, alone or among other
    requests, while other seeds (and no seed) give other texts."""
    handler = load_handler("generate")
    handler.setup(HandlerContext(device="cpu", model=lm_dir, options={"max_new_tokens": 24}))
    body = {"prompt": "a consumer group reads", "max_tokens": 24, "temperature": 1.5, "top_p": 1.0}

    def texts(bodies: dict[str, dict[str, Any]]) -> dict[str, str]:
        events = run(handler, {name: handler.validate(one) for name, one in bodies.items()})
        return {name: events[name][-1].text for name in bodies}

    try:
        alone = texts({"alone": {**body, "seed": 7}})["alone"]
        crowd = texts({"again": {**body, "seed": 7}, "other": {**body, "seed": 8}, "big": {**body, "seed": 2**40},
                       **{f"unseeded{i}": body for i in range(3)}})
    finally:
        handler.close()
    assert len(alone) > 20 and crowd["again"] == alone
    assert len({alone, crowd["other"], crowd["big"], *(crowd[f"unseeded{i}"] for i in range(3))}) == 6


def test_seeded_rows_draw_from_the_softmax_and_unseeded_rows_are_left_alone() -> None:
    """SeededSampling leaves a seeded row one token (drawn as softmax(scores) says, over many keys) and an unseeded
    row as it was."""
    from kinference.handlers.seeding import NO_SEED, SeededSampling, row_key

    sampler = SeededSampling()

    class State:
        def __init__(self, seed: int | None, position: int) -> None:
            self.logit_processor_kwargs = {} if seed is None else {"seed": seed}
            self.position_offset = position

    class Request:
        def __init__(self, seed: int | None, position: int) -> None:
            self.state = State(seed, position)

    scores = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keys = sampler.prepare_tensor_args([Request(seed, 10) for seed in range(4000)] + [Request(None, 10)])
    assert keys[-1].item() == NO_SEED and keys[0].item() == row_key(0, 10) != row_key(0, 11)
    out = sampler(scores.expand(4001, 4).clone(), keys)
    assert torch.equal(out[-1], scores)
    drawn = out[:-1].argmax(dim=-1)
    assert bool((out[:-1].isinf().sum(dim=-1) == 3).all())
    frequencies = torch.bincount(drawn, minlength=4).float() / 4000
    assert torch.allclose(frequencies, scores.exp(), atol=0.03), frequencies
    same = sampler(scores.expand(1, 4).clone(), keys[:1])
    assert same.argmax().item() == drawn[0].item()  # the same key, the same draw


def test_load_errors_name_the_fix(tmp_path: Path) -> None:
    handler = load_handler("generate")
    with pytest.raises(HandlerLoadError, match="generate needs --model DIR"):
        handler.setup(HandlerContext(device="cpu"))
    with pytest.raises(HandlerLoadError, match="lacks the tokenizer"):
        model_dir = build_tiny_causal_lm(tmp_path / "no-tokenizer")
        for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
            (model_dir / name).unlink(missing_ok=True)
        handler.setup(HandlerContext(device="cpu", model=model_dir))
    with pytest.raises(HandlerLoadError, match="neither a pad token nor an end-of-sequence token"):
        handler.setup(HandlerContext(device="cpu", model=build_tiny_causal_lm(tmp_path / "no-eos", eos=False)))
    with pytest.raises(HandlerLoadError, match="unknown handler option"):
        handler.setup(HandlerContext(device="cpu", model=tmp_path / "no-eos", options={"max_token": 3}))


def test_without_a_chat_template_only_prompts_are_served(tmp_path: Path) -> None:
    handler = load_handler("generate")
    handler.setup(HandlerContext(device="cpu", model=build_tiny_causal_lm(tmp_path / "plain", chat_template=None)))
    try:
        with pytest.raises(InvalidInput, match=re.escape('no chat template: send {"prompt"')):
            handler.validate({"messages": [{"role": "user", "content": "hi"}]})
        assert handler.validate({"prompt": "hi"}).token_ids
    finally:
        handler.close()


@pytest.mark.parametrize(("payload", "message"), [
    ("text", "expected a JSON object"),
    ({}, 'exactly one of "messages"'),
    ({"messages": [], "prompt": "x"}, 'exactly one of "messages"'),
    ({"messages": []}, "non-empty array"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 'messages\\[0\\] must be an object with "role"'),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "reads text only"),
    ({"prompt": ""}, '"prompt" must be a non-empty string'),
    ({"prompt": "x" * 11}, "more than 10"),
    ({"prompt": "x", "max_tokens": 0}, '"max_tokens" must be an integer >= 1'),
    ({"prompt": "x", "max_tokens": True}, '"max_tokens" must be an integer'),
    ({"prompt": "x", "temperature": 3}, r'"temperature" must be in \[0, 2\]'),
    ({"prompt": "x", "top_p": 0}, r'"top_p" must be in \(0, 1\]'),
    ({"prompt": "x", "stop": ["a"] * 5}, '"stop" must be'),
    ({"prompt": "x", "stream": "yes"}, '"stream" must be true or false'),
    ({"prompt": "x", "n": 2}, '"n" must be 1'),
])
def test_chat_request_refusals(payload: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        read_chat_request(payload, max_chars=10)


def test_chat_request_reads_openai_fields() -> None:
    request = read_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                 "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "stop": "END",
                                 "seed": 3, "stream": True}, max_chars=100)
    assert request.messages == ({"role": "user", "content": "hi"},)
    assert (request.max_tokens, request.temperature, request.top_p, request.stop, request.seed, request.stream) == (
        7, 0.0, 0.5, ("END",), 3, True)


def test_embeddings_request() -> None:
    assert read_embeddings_request({"input": "one"}).texts == ("one",)
    assert read_embeddings_request({"input": ["a", "b"], "encoding_format": "base64"}).encoding_format == "base64"
    for bad in ({"input": []}, {"input": [1]}, {"input": "a", "encoding_format": "int8"}):
        with pytest.raises(InvalidInput):
            read_embeddings_request(bad)


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": " "}, "no text to continue: 0 tokens"),
    ({"prompt": " \t\n\u200b "}, "no text to continue: 0 tokens"),
    ({"prompt": "[CLS] [SEP] [PAD]"}, "no text to continue: 3 tokens, none but special ones"),
    ({"messages": [{"role": "system", "content": " "}, {"role": "user", "content": "\n"}]}, "every content is blank"),
    ({"prompt": "the cat", "max_tokens": 0}, '"max_tokens" must be an integer >= 1'),
    ({"prompt": "the cat", "max_tokens": 255}, "exceed the model's context of 256 tokens"),
    ({"prompt": "cat " * 256}, "the prompt is 256 tokens; the model's context is 256"),
])
def test_a_prompt_the_engine_cannot_take_is_refused_at_validate(greedy: GenerateHandler, body: Any,
                                                               message: str) -> None:
    """Issue 36: ``{"prompt": " "}`` (no token at all) passed validate and its empty prefill step crashed the engine
    for good; a prompt of special tokens only, blank messages, and sizes past the context are refused as well."""
    with pytest.raises(InvalidInput, match=re.escape(message)):
        greedy.validate(body)
    assert greedy.validate({"prompt": "the cat", "max_tokens": 254}).sampling.max_tokens == 24


def test_a_sequence_past_the_kv_cache_is_refused_at_validate(lm_dir: Path) -> None:
    """A KV cache smaller than the context bounds one sequence: past it, the engine's scheduler stops for good."""
    host = load_handler("generate")
    host.setup(HandlerContext(device="cpu", model=lm_dir, role="host",
                              options={"kv_cache_tokens": 64, "page_size": 16, "max_new_tokens": 100}))
    assert host.validate({"prompt": "the cat", "max_tokens": 62}).sampling.max_tokens == 62
    with pytest.raises(InvalidInput, match=re.escape("exceed the KV cache (handler option kv_cache_tokens) of 64")):
        host.validate({"prompt": "the cat", "max_tokens": 63})
    assert host.validate({"prompt": "the cat"}).sampling.max_tokens == 62  # the server's cap, within the cache


class Drain:
    """``events`` of a handler on a thread of its own, as the service's drain thread calls it."""

    def __init__(self, handler: GenerateHandler) -> None:
        self.handler = handler
        self.events: dict[str, list[Event]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for event in self.handler.events(0.05):
                self.events.setdefault(event.request_id, []).append(event)

    def ended(self, request_id: str) -> Event | None:
        events = self.events.get(request_id, [])
        return events[-1] if events and events[-1].kind != "delta" else None

    def stop(self) -> None:
        self._stop = True
        self._thread.join(5)


@pytest.fixture
def faulty(lm_dir: Path) -> Any:
    from tests.faults.generate_handlers import FaultyGenerate

    handler = FaultyGenerate()
    handler.setup(HandlerContext(device="cpu", model=lm_dir, hang_s=1.0,
                                 options={"decoding": "greedy", "max_new_tokens": 8, "restart_delay_s": 0.5}))
    drain = Drain(handler)
    yield handler, drain
    handler.unwedge.set()
    drain.stop()
    handler.close()


def test_an_engine_whose_loop_dies_fails_what_it_held_and_is_replaced(faulty: Any) -> None:
    """A step that raises ends transformers' loop for good (issue 36: every later request failed): the requests it
    held end with ``error``, the engine is replaced, and the next requests are served."""
    handler, drain = faulty
    handler.submit("crash", handler.validate({"prompt": "crash the engine", "max_tokens": 8}))
    handler.submit("beside", handler.validate({"prompt": "the cat sat", "max_tokens": 8}))
    assert wait_for(lambda: drain.ended("crash") and drain.ended("beside"), 30)
    assert drain.ended("crash").kind == "error" and "a crash on cue" in drain.ended("crash").text
    # In the engine with it, it fails with it; submitted after its death, it waits for the new engine.
    assert drain.ended("beside").kind in ("error", "final")
    assert wait_for(lambda: handler.health == SERVING, 30)
    handler.submit("after", handler.validate({"prompt": "the cat sat", "max_tokens": 8}))
    assert wait_for(lambda: drain.ended("after"), 30) and drain.ended("after").kind == "final"


def test_a_hung_engine_is_replaced_after_hang_s_and_health_says_so_until_then(faulty: Any) -> None:
    """A step that never returns: after ``hang_s`` without a step, the engine is replaced; its request ends with
    ``error``; health is red (replacing, naming it) until the new engine runs, and a request submitted meanwhile
    waits for the new one and is served."""
    handler, drain = faulty
    started = time.monotonic()
    handler.submit("wedge", handler.validate({"prompt": "wedge the engine", "max_tokens": 8}))
    assert wait_for(lambda: handler.health.replacing, 30)
    # hang_s is counted from the last drain turn that saw the engine idle: up to one turn (0.05 s) before the submit.
    assert time.monotonic() - started >= 0.95 and "no decoding step for" in (handler.health.problem or "")
    handler.submit("meanwhile", handler.validate({"prompt": "the cat sat", "max_tokens": 8}))
    assert wait_for(lambda: drain.ended("meanwhile"), 30)
    assert drain.ended("meanwhile").kind == "final" and handler.health == SERVING
    assert drain.ended("wedge").kind == "error" and "no decoding step" in drain.ended("wedge").text


@pytest.mark.parametrize(("cue", "why"), [("wedge", f"{MAX_HUNG + 1} hung engines left behind"),
                                         ("crash", f"{MAX_FRUITLESS} engines in a row failed before their first step")])
def test_an_engine_that_keeps_failing_gives_up_and_says_the_process_must_go(faulty: Any, cue: str, why: str) -> None:
    """Each hung engine is left behind with its KV cache, and an engine that fails before its first step may fail
    every time (a KV cache that cannot be allocated any more): past ``MAX_HUNG`` of the first or ``MAX_FRUITLESS``
    of the second in a row, the engine gives up (health red, not replacing: the process is replaced) and refuses
    what comes, rather than pile them up or spin."""
    handler, drain = faulty
    for attempt in range(max(MAX_HUNG + 1, MAX_FRUITLESS)):
        handler.submit(f"{cue}{attempt}", handler.validate({"prompt": f"{cue} the engine", "max_tokens": 8}))
        assert wait_for(lambda attempt=attempt: drain.ended(f"{cue}{attempt}"), 30)
    assert wait_for(lambda: handler.health.problem is not None and not handler.health.replacing, 10)
    assert "gave up" in (handler.health.problem or "") and why in (handler.health.problem or "")
    with pytest.raises(RequestError, match="gave up"):
        handler.submit("after", handler.validate({"prompt": "the cat", "max_tokens": 8}))
