"""``kinference drain``'s pure parts: where a profile sample goes, the targets, the Markdown."""

from __future__ import annotations

import pytest

from kinference.loadgen.bench import drain
from kinference.loadgen.bench.drain import (
    PARTS,
    Profile,
    cpu_by_role,
    evaluate_targets,
    markdown,
    parts,
    read_raw_profile,
    sim_name,
    stage_of,
)

ROOT = "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)"


def test_a_sample_goes_to_its_innermost_known_stage():
    poll = f"{ROOT};Source._run (consumer/path/source.py:123);Source._intake (consumer/path/source.py:169)"
    decode = f"{poll};Source._take (consumer/path/source.py:176);RequestDecoder.decode (consumer/path/request.py:139)"
    assert stage_of(decode.split(";")) == "poll: decode"
    admission = f"{poll};Service._route (consumer/service.py:1);admit (consumer/path/admission.py:20)"
    assert stage_of(f"{admission};TextHandler.validate (handlers/text.py:160)".split(";")) == "poll: tokenise"
    assert stage_of(admission.split(";")) == "poll: admission"
    waiting = (f"{ROOT};StagePool._run (consumer/path/stages.py:171);Queue.get (queue.py:171);"
               "Condition.wait (threading.py:327)")
    assert stage_of(waiting.split(";")) == "waiting"
    inference = (f"{ROOT};StagePool._process (consumer/path/stages.py:186);"
                 "Pipeline._inference (consumer/path/stages.py:305)")
    assert stage_of(f"{inference};Module._call_impl (torch/nn/modules/module.py:1)".split(";")) == "inference"
    assert stage_of([ROOT, "something (elsewhere.py:1)"]) == "other"
    report = (f"{ROOT};Publisher._run (consumer/delivery/publisher.py:1);"
              "Publisher._on_delivery (consumer/delivery/publisher.py:2)")
    assert stage_of(f"{report};AtLeastOnce._settle (consumer/delivery/at_least_once.py:3)".split(";")) \
        == "publish: delivery reports"
    assert stage_of(f"{poll};OffsetCommits.turn (consumer/ledger/commits.py:4)".split(";")) == "commit"
    publisher = f"{ROOT};Publisher._run (consumer/delivery/publisher.py:290)"
    assert stage_of(publisher.split(";")) == "publish: delivery reports"  # librdkafka serving them, in poll()
    assert stage_of(f"{publisher};Publisher._send (consumer/delivery/publisher.py:374)".split(";")) \
        == "publish: produce"


def test_a_device_link_waits_for_the_other_process_and_its_own_work_is_its_part():
    call = (f"{ROOT};Pipeline._inference (consumer/path/stages.py:305);DeviceInference.infer "
            "(consumer/accelerator/worker_link.py:98);DeviceLink.infer (consumer/accelerator/worker_link.py:72)")
    assert stage_of(f"{call};_receive (consumer/accelerator/wire.py:160)".split(";")) == "waiting"
    assert stage_of(f"{call};_receive (consumer/accelerator/wire.py:160);_without_fds (consumer/accelerator/wire.py:"
                    "155)".split(";")) == "waiting"
    assert stage_of(f"{call};Arena.write_inputs (consumer/accelerator/arena.py:60)".split(";")) == "device link"
    batch = (f"{ROOT};DeviceServer._run_batch (consumer/accelerator/device_server.py:330);DeviceServer._infer "
             "(consumer/accelerator/device_server.py:350);TextHandler.inference (handlers/text.py:461)")
    assert stage_of(f"{batch};SimulatedAccelerator.forward_rows (handlers/sim.py:71)".split(";")) == "waiting"
    assert stage_of(f"{batch};SimulatedAccelerator.forward_rows (handlers/sim.py:71);SharedDevice.queue "
                    "(handlers/sim.py:130)".split(";")) == "inference"
    assert stage_of(f"{batch};TextHandler.merge (handlers/text.py:420)".split(";")) == "device link"
    assert parts({"device link": 2.5})["device link"] == 2.5


def test_each_kind_of_process_is_charged_what_it_spent_in_the_window(monkeypatch: pytest.MonkeyPatch):
    before = {1: 10.0, 2: 5.0}
    after = {1: 10.5, 2: 6.0, 3: 0.25}  # 3 started in the window: all it spent was in it
    monkeypatch.setattr(drain, "process_role", {1: "main", 2: "device", 3: "worker"}.__getitem__)
    assert cpu_by_role(before, after) == {"main": 0.5, "device": 1.0, "worker": 0.25}


def test_a_profile_sums_samples_per_stage_and_leaves_waiting_out():
    raw = (f"{ROOT};Pipeline._inference (consumer/path/stages.py:305) 30\n"
           f"{ROOT};StagePool._run (consumer/path/stages.py:171);Queue.get (queue.py:171) 50\n"
           f"{ROOT};Publisher._send (consumer/delivery/publisher.py:200) 10\n")
    profile = Profile(read_raw_profile(raw), rate_hz=100)
    summary = profile.summary(messages=1000)
    # 30 samples at 100 Hz over 1,000 messages: 300 thread-microseconds per message.
    assert summary == {"us_per_msg": {"inference": 300.0, "publish: produce": 100.0}, "samples": 40}
    assert Profile(note="py-spy is not installed").summary(10) == {"note": "py-spy is not installed"}


def report(echo: float, relay: float, busy: dict[str, float], embedding: float, ceiling: float) -> dict:
    rows = [{"contender": "relay", "msgs_per_s": relay}, {"contender": "kinference-echo", "msgs_per_s": echo},
            {"contender": "kinference-embedding", "msgs_per_s": embedding}]
    rows += [{"contender": name, "msgs_per_s": 1.0, "device_busy": value} for name, value in busy.items()]
    return {"drains": rows, "embedding_ceiling": {"best_items_per_s": ceiling}}


def test_targets_are_ratios_of_one_run():
    met = evaluate_targets(report(600, 1000, {"kinference-sim@0.5x-echo": 0.97, "kinference-sim@1x-echo": 0.91},
                                  95, 100))
    assert [t["met"] for t in met] == [True, True, True]
    cpu = report(600, 1000, {}, 95, 100)
    for row, us in zip(cpu["drains"], (10.0, 49.0, 120.0), strict=True):
        row["cpu_us_per_msg"] = us
    ratios = {t["target"]: (t["value"], t["met"]) for t in evaluate_targets(cpu) if "CPU" in t["target"]}
    assert ratios == {"echo contender <= 5 x the relay's CPU per message": (4.9, True)}
    missed = evaluate_targets(report(400, 1000, {"kinference-sim@1x-echo": 0.6}, 80, 100))
    assert [(t["value"], t["met"]) for t in missed] == [(0.4, False), ({"kinference-sim@1x-echo": 0.6}, False),
                                                       (0.8, False)]


def test_each_inference_thread_count_gets_its_own_verdict():
    busy = {sim_name(0.5, 1): 0.8, sim_name(1.0, 1): 0.5, sim_name(0.5, 2): 0.95, sim_name(1.0, 2): 0.92}
    targets = evaluate_targets(report(600, 1000, busy, 95, 100))
    verdicts = {t["target"]: t["met"] for t in targets if "GPU" in t["target"]}
    assert verdicts == {"simulated GPU >= 90% busy at every capacity up to the echo drain rate (inference=1)": False,
                        "simulated GPU >= 90% busy at every capacity up to the echo drain rate (inference=2)": True}
    assert sim_name(0.5, 2) == "kinference-sim@0.5x-echo,inference=2"


def test_markdown_has_a_row_per_drain_and_the_targets():
    data = report(600, 1000, {}, 95, 100)
    for row in data["drains"]:
        row.update(requests=1000, cpu_us_per_msg=12.5, profile={"us_per_msg": {"poll: decode": 3.0}})
    data["embedding_ceiling"].update(best_batch_size=32)
    data["targets"] = evaluate_targets(data)
    text = markdown(data)
    assert "| kinference-echo | 1,000 | 600 | 12.5 |  |  | poll: decode 3 |" in text
    assert "| echo drain >= 0.5 x relay drain | 0.6 | yes |" in text
    assert "| kinference-echo | 0 | 3 | 0 |" in text  # the per-stage table: consume, decode, admission...


def test_parts_sum_the_stages_into_the_way_of_a_message():
    split = parts({"poll: decode": 2.0, "poll: track": 1.0, "publish: delivery reports": 3.5, "poll: tokenise": 1.0,
                   "poll: admission": 0.5, "postprocess + encode": 1.0, "publish: build records": 2.0, "lag": 0.25,
                   "other": 1.0})
    assert list(split) == list(PARTS)
    assert (split["decode"], split["delivery/ledger"], split["admission/tokenise"], split["reply encoding"],
            split["other"]) == (2.0, 4.5, 1.5, 3.0, 1.25)
    assert sum(split.values()) == 12.25
