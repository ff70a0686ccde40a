"""The python-backend models of specc.triton, driven in-process with a fake triton_python_backend_utils
(tests/triton_fakes.py): batching of concurrent requests, greedy and seeded outputs equal to
specc's own generate, error responses, cancellation, the split layout's BLS calls. The same
models under a real tritonserver: tests/test_triton_server.py."""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest

import specc
import triton_fakes
from specc.triton import write_repository

PROMPTS = ["hello", "def f(x):", "abc abc abc", "import os\n", "x = 1", "the cat sat", "(((", "zq", "return a + b", "w"]


@pytest.fixture(autouse=True)
def fake_pb_utils(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", triton_fakes)
    triton_fakes.MODELS.clear()
    yield triton_fakes
    triton_fakes.MODELS.clear()


def triton_args(repo, name: str) -> dict:
    """What Triton passes to initialize: the parsed config.pbtxt as JSON, paths, version."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((repo / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {"model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
            "model_repository": str(repo / name), "model_version": "1", "model_name": name}


def start(repo, name: str, cls):
    model = cls()
    model.initialize(triton_args(repo, name))
    return model


@pytest.fixture(scope="module")
def reference(bundles):
    return specc.load(bundles["draft"])


@pytest.fixture
def in_process(bundles, tmp_path):
    from specc.triton.serving import InProcessModel

    write_repository(bundles["draft"], tmp_path / "repo", name="spec")
    model = start(tmp_path / "repo", "spec", InProcessModel)
    yield model
    model.finalize()


@pytest.fixture
def split(bundles, tmp_path):
    """The split layout with python engines; BLS calls go to the engine models registered in the fake."""
    from specc.triton.serving import EngineModel, SplitModel

    repo = tmp_path / "repo"
    write_repository(bundles["draft"], repo, name="spec", layout="split", engines="python")
    for role in ("target", "draft"):
        triton_fakes.MODELS[f"spec_{role}"] = start(repo, f"spec_{role}", EngineModel)
    model = start(repo, "spec", SplitModel)
    yield model
    model.finalize()


def request(prompt: str, requested: tuple[str, ...] = (), **settings) -> triton_fakes.Request:
    types = {"max_tokens": np.int32, "top_k": np.int32, "seed": np.uint64, "temperature": np.float32,
             "top_p": np.float32, "stream": np.bool_, "chat": np.bool_}
    inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
    for name, value in settings.items():
        if name == "stop":
            inputs["stop"] = np.array([s.encode() for s in value], dtype=np.object_)
        else:
            inputs[name] = np.array([value], dtype=types[name])
    return triton_fakes.Request(inputs, requested)


def wait(requests, timeout: float = 120.0) -> None:
    for r in requests:
        assert r.sender.done.wait(timeout), "no final response"
        assert r.sender.after_final == 0, "responses after the final one"


def final(sender, name: str):
    values = sender.outputs(name)
    assert len(values) == 1, f"{name} should be on the last response only"
    return values[0][0]


def check_matches(requests, completions) -> None:
    for r, c in zip(requests, completions):
        assert r.sender.error is None, r.sender.error.message()
        assert (r.sender.text, r.sender.ids) == (c.text, c.token_ids)
        assert final(r.sender, "finish_reason").decode() == c.finish_reason
        assert final(r.sender, "num_output_tokens") == len(c.token_ids)


def test_concurrent_requests_are_batched_and_equal_generate(in_process, reference):
    scheduler, batch_sizes = in_process.orchestrator.scheduler, []
    step = scheduler.step

    def recording_step():
        events = step()
        batch_sizes.append(len(scheduler.batch.seqs) if scheduler.batch else 0)
        return events

    scheduler.step = recording_step
    first = [request(p, max_tokens=24) for p in PROMPTS[:8]]
    bad = [request("hi", max_tokens=-3), request(""), request("x" * 300, max_tokens=8), request("hi", temperature=-1.0)]
    in_process.execute(first[:4] + bad[:2] + first[4:] + bad[2:])
    time.sleep(0.05)
    late = [request(p, max_tokens=24) for p in PROMPTS[8:]]  # join the running batch between rounds
    in_process.execute(late)
    wait(first + bad + late)
    check_matches(first + late, reference.generate(PROMPTS, max_new_tokens=24))
    assert max(batch_sizes) == 4  # the bundle's max_batch: requests in flight share the rounds
    for r, prompt in zip(first + late, PROMPTS):
        assert len(r.sender.responses) > 1 or len(r.sender.ids) <= 1  # streamed: a response per round
        stats = json.loads(final(r.sender, "speculation_stats"))
        assert stats["drafted"] == final(r.sender, "num_draft_tokens")
        assert stats["drafted"] > 0 or len(r.sender.ids) <= 1
        assert stats["accepted"] == final(r.sender, "num_accepted_tokens")
        assert final(r.sender, "num_input_tokens") == len(reference.encode([prompt])[0])
    messages = [r.sender.error.message() for r in bad]
    assert all(r.sender.error.code() == "INVALID_ARG" for r in bad)
    assert messages[0] == "max_tokens must be >= 1, got -3"
    assert messages[1] == "text_input is empty; send a prompt of at least one character"
    assert "above this bundle's max_context 256" in messages[2]
    assert "temperature" in messages[3]


def test_sampling_settings_seed_and_stop_per_request(in_process, reference):
    sampled = request(PROMPTS[1], max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    stopped = request(PROMPTS[2], max_tokens=20, stop=["a"])
    greedy = request(PROMPTS[3], max_tokens=20)
    in_process.execute([sampled, stopped, greedy])
    wait([sampled, stopped, greedy])
    check_matches([sampled], reference.generate([PROMPTS[1]], max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=7))
    check_matches([stopped], reference.generate([PROMPTS[2]], max_new_tokens=20, stop=["a"]))
    check_matches([greedy], reference.generate([PROMPTS[3]], max_new_tokens=20))


def test_stream_false_and_requested_outputs(in_process, reference):
    whole = request(PROMPTS[0], max_tokens=16, stream=False)
    text_only = request(PROMPTS[0], requested=("text_output",), max_tokens=16)
    in_process.execute([whole, text_only])
    wait([whole, text_only])
    expected = reference.generate([PROMPTS[0]], max_new_tokens=16)[0].text
    assert len(whole.sender.responses) == 1 and whole.sender.text == expected
    assert {t.name() for r in text_only.sender.responses for t in r.output_tensors()} == {"text_output"}
    assert text_only.sender.text == expected


def test_cancelled_request_gets_cancelled_error_and_others_finish(in_process, reference):
    class CancelAfterFirst(triton_fakes.Sender):
        def send(self, response=None, flags=0):
            super().send(response, flags)
            self.cancelled = True

    doomed = request(PROMPTS[0], max_tokens=200)
    doomed.sender = CancelAfterFirst()
    other = request(PROMPTS[1], max_tokens=24)
    in_process.execute([doomed, other])
    wait([doomed, other])
    assert doomed.sender.error.code() == "CANCELLED"
    check_matches([other], reference.generate([PROMPTS[1]], max_new_tokens=24))


def test_split_layout_calls_engines_with_bls(split, reference):
    requests = [request(p, max_tokens=24) for p in PROMPTS]
    split.execute(requests)
    wait(requests)
    check_matches(requests, reference.generate(PROMPTS, max_new_tokens=24))


def test_engine_failure_fails_the_batch_and_the_model_recovers(split, reference):
    target = triton_fakes.MODELS.pop("spec_target")  # the target model is gone: BLS answers with an error
    doomed = [request(p, max_tokens=8) for p in PROMPTS[:3]]
    split.execute(doomed)
    wait(doomed)
    for r in doomed:
        assert r.sender.error.code() == "INTERNAL"
        assert "reference " in r.sender.error.message()  # the cause is in the log, under that reference
    assert any("a speculative round failed" in m and "model spec_target is not loaded" in m for m in triton_fakes.LOG)
    triton_fakes.MODELS["spec_target"] = target
    again = [request(PROMPTS[0], max_tokens=8)]
    split.execute(again)
    wait(again)
    check_matches(again, reference.generate([PROMPTS[0]], max_new_tokens=8))


def test_an_engine_that_raises_answers_with_a_reference_to_its_logged_traceback(split, reference):
    engine = triton_fakes.MODELS["spec_target"]
    runner = engine.runner

    def broken(*inputs):
        raise RuntimeError("secret of another request")

    engine.runner = broken
    doomed = [request(p, max_tokens=8) for p in PROMPTS[:2]]
    split.execute(doomed)
    wait(doomed)
    engine.runner = runner
    assert all(r.sender.error.code() == "INTERNAL" and "secret" not in r.sender.error.message() for r in doomed)
    engine_lines = [m for m in triton_fakes.LOG if m.startswith("specc: engine 'target' failed (reference ")]
    assert engine_lines and "secret of another request" in engine_lines[0]
    # the orchestrator's own log line carries the engine's answer: its reference, not its text
    engine_ref = engine_lines[0].split("reference ")[1].split(")")[0]
    assert any("a speculative round failed" in m and engine_ref in m for m in triton_fakes.LOG)
    again = [request(PROMPTS[0], max_tokens=8)]
    split.execute(again)
    wait(again)
    check_matches(again, reference.generate([PROMPTS[0]], max_new_tokens=8))


def test_finalize_answers_every_open_request(bundles, tmp_path):
    from specc.triton.serving import InProcessModel

    write_repository(bundles["draft"], tmp_path / "repo", name="spec")
    model = start(tmp_path / "repo", "spec", InProcessModel)
    requests = [request(p, max_tokens=200) for p in PROMPTS]
    model.execute(requests)
    model.finalize()
    wait(requests, timeout=5)
    assert not model.orchestrator.thread.is_alive()
    assert any(r.sender.error is not None and r.sender.error.code() == "UNAVAILABLE" for r in requests)


def test_chat_template_and_a_request_that_fails_to_prepare(in_process, reference, monkeypatch):
    model = in_process.orchestrator.model
    encode = model.encode

    def fragile_encode(prompts, chat=False):
        if prompts == ["boom"]:
            raise ValueError("template exploded")
        return encode(prompts, chat)

    monkeypatch.setattr(model, "encode", fragile_encode)
    boom, chat = request("boom", max_tokens=8), request(PROMPTS[4], max_tokens=16, chat=True)
    in_process.execute([boom, chat])
    wait([boom, chat])
    assert boom.sender.error.code() == "INTERNAL"
    message = boom.sender.error.message()
    assert message.startswith("could not prepare the request (reference ") and "exploded" not in message
    check_matches([chat], reference.generate([PROMPTS[4]], max_new_tokens=16, chat=True))
    assert in_process.orchestrator.thread.is_alive()


def test_a_failed_round_answers_its_requests_with_a_reference_and_the_model_goes_on(in_process, reference, monkeypatch):
    """A round that raises: every request in it gets INTERNAL with a reference to the logged traceback (not the
    exception's text, which may carry another request's data), and a fresh scheduler serves the next ones."""
    orchestrator = in_process.orchestrator
    logged = []
    monkeypatch.setattr(orchestrator, "log", logged.append)
    step = type(orchestrator.scheduler).step

    def exploding(self):
        raise RuntimeError("secret \x1b[31m of another request")

    monkeypatch.setattr(type(orchestrator.scheduler), "step", exploding)
    doomed = [request(p, max_tokens=8) for p in PROMPTS[:3]]
    in_process.execute(doomed)
    wait(doomed)
    monkeypatch.setattr(type(orchestrator.scheduler), "step", step)
    for r in doomed:
        assert r.sender.error.code() == "INTERNAL"
        message = r.sender.error.message()
        assert "reference " in message and "secret" not in message
    reference_id = doomed[0].sender.error.message().split("reference ")[1].split(" ")[0]
    assert any(reference_id in line and "secret \\x1b[31m" in line for line in logged)  # escaped in the log
    after = request(PROMPTS[4], max_tokens=8)
    in_process.execute([after])
    wait([after])
    check_matches([after], reference.generate([PROMPTS[4]], max_new_tokens=8))
