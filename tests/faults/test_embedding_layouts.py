"""``kinference serve --handler embedding --model DIR`` on sentence-transformers models, over Kafka, against
``SentenceTransformer(DIR).encode``: the cls layout (bge), the decoder layout (left padding, last-token pooling, an
instruction prompt: Qwen3-Embedding), the latter also through a device process (``--device-process on --workers 1``:
on the CPU it stands in for a GPU's).

Every request is produced before the service starts, so its first polls hold them all: texts of very different
lengths, with and without prompts, OpenAI bodies beside plain ones, share batches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# The reference: the `reference` extra, 6.2 (the lowest-versions run has 5.7, which the bundled MiniLM brings, on an
# older transformers: a tiny model initialises otherwise there, and these tests are for the reference they name).
pytest.importorskip("sentence_transformers", minversion="6.2",
                    reason="sentence-transformers 6.2 (pip install 'kinference[reference]') is the reference these "
                    "tests compare with")
from sentence_transformers import SentenceTransformer

from kinference.consumer.brokers.broker import free_port
from tests.faults.harness import Member, client_for
from tests.faults.test_workers import get, wait_until
from tests.models import varied_texts

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.model, pytest.mark.slow]

AGREE = 0.9999
TEXTS = [*varied_texts(5, seed=7, max_words=100), "a", "Kafka!"]
LONG = " ".join(["partition"] * 300)


@contextlib.contextmanager
def serving(settings: Any, model: Path, *extra: str) -> Iterator[Member]:
    """``kinference serve --handler embedding --model model``, ready (``/readyz``); killed at the end."""
    port = free_port()
    args = [arg for arg in settings.args() if arg != "--no-metrics"]
    args[args.index("--handler") + 1] = "embedding"
    member = Member("embedding", [*args, "--model", str(model), "--metrics-host", "127.0.0.1", "--metrics-port",
                                  str(port), *extra])
    try:
        wait_until(lambda: get(port, "/readyz")[0] == 200, 120, "the embedding service ready", member)
        yield member
    finally:
        member.kill()


def cosines(ours: list[Any], theirs: np.ndarray) -> np.ndarray:
    mine = np.array(ours, dtype=np.float32)
    return (mine * theirs).sum(axis=1) / (np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("layout", "extra"), [
    ("cls", ()),
    ("lasttoken", ()),
    ("lasttoken", ("--device-process", "on", "--workers", "1")),
], ids=["cls", "lasttoken-prompts", "lasttoken-device-process"])
def test_the_service_answers_what_sentence_transformers_computes(fault_settings: Any, st_model: Any, layout: str,
                                                                  extra: tuple[str, ...]) -> None:
    model = st_model(layout)
    st = SentenceTransformer(str(model), device="cpu")
    prompt = {"prompt_name": "query"} if layout == "lasttoken" else {"prompt": "Represent this sentence: "}
    settings = fault_settings(partitions=1)
    client = client_for(settings).start()
    try:
        send = [client.send({"text": text, **(prompt if index % 2 else {})}, key=str(index), timeout_s=180)
                for index, text in enumerate(TEXTS)]
        openai = client.send({"input": TEXTS[:3], **prompt, "dimensions": 16}, key="openai", timeout_s=180)
        too_long = client.send({"text": LONG}, key="long", timeout_s=180)
        cut = client.send({"text": LONG, "truncate": True}, key="cut", timeout_s=180)
        with serving(settings, model, *extra):
            replies = [future.result(180) for future in send]
            openai_reply, too_long_reply, cut_reply = (future.result(180) for future in (openai, too_long, cut))
    finally:
        client.close()

    assert all(reply.ok for reply in replies), [reply.json() for reply in replies if not reply.ok]
    plain = [index for index in range(len(TEXTS)) if index % 2 == 0]
    prompted = [index for index in range(len(TEXTS)) if index % 2]
    for rows, ask in ((plain, {}), (prompted, prompt)):
        worst = cosines([replies[row].result()["embedding"] for row in rows],
                        st.encode([TEXTS[row] for row in rows], **ask)).min()
        assert worst >= AGREE, f"{layout} {ask}: worst cosine {worst:.6f}"

    body = openai_reply.result()
    theirs = st.encode(TEXTS[:3], truncate_dim=16, normalize_embeddings=True, **prompt)
    assert cosines([row["embedding"] for row in body["data"]], theirs).min() >= AGREE
    prompt_text = prompt.get("prompt") or st.prompts[prompt["prompt_name"]]
    tokens = int(st.preprocess([prompt_text + text for text in TEXTS[:3]])["attention_mask"].sum())
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    assert too_long_reply.error_code == "input_too_long"
    assert "302 tokens, more than the limit of 128" in too_long_reply.json()["error"]["message"]
    assert cosines([cut_reply.result()["embedding"]], st.encode([LONG])).min() >= AGREE
