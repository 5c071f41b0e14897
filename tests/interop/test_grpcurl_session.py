"""A scripted grpcurl session against both services, through server reflection only.

No .proto file is given to grpcurl: every step below works from what the servers
describe about themselves, as it would for someone holding only an address.
"""

from __future__ import annotations

import json
import shlex

import pytest

from tests.grpcurl import run_grpcurl
from tests.interop.jsonstream import json_objects, stop_candidate

GENERATE = "tandem.generate.v1.GenerateService"
ENGINE = "tandem.engine.v1.EngineService"
GREEDY = {"temperature": 0, "ignore_eos": True}


class Session:
    """Runs grpcurl commands against one address and keeps a transcript for failure messages."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lines: list[str] = []

    def run(self, *args: str, data: object | None = None, stdin: str | None = None, flags: tuple[str, ...] = ()):
        argv = ["-plaintext", "-max-time", "60", *flags]
        if data is not None:
            argv += ["-d", json.dumps(data)]
        elif stdin is not None:
            argv += ["-d", "@"]
        argv += [self.address, *args]
        result = run_grpcurl(*argv, stdin=stdin)
        self.lines.append(f"$ grpcurl {shlex.join(argv)}\n{result.stdout}{result.stderr}[exit {result.returncode}]")
        return result

    def ok(self, *args: str, **kw) -> str:
        result = self.run(*args, **kw)
        assert result.returncode == 0, self.transcript()
        return result.stdout

    def call(self, method: str, data: object | None = None) -> list[dict]:
        return json_objects(self.ok(method, data=data if data is not None else {}))

    def transcript(self) -> str:
        return "\n".join(self.lines)


def _common_steps(s: Session, service: str) -> None:
    listed = s.ok("list").split()
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", service} <= set(listed), s.transcript()
    described = s.ok("describe", service)
    assert f"service {service.rsplit('.', 1)[1]} {{" in described, s.transcript()
    for name in ("", service):
        assert s.call("grpc.health.v1.Health/Check", {"service": name}) == [{"status": "SERVING"}], s.transcript()
    # An unknown service is a clean NOT_FOUND from the health service, not a hang.
    missing = s.run("grpc.health.v1.Health/Check", data={"service": "no.such.Service"})
    assert missing.returncode != 0 and "NotFound" in missing.stderr, s.transcript()


def test_grpcurl_session_against_the_frontend(services):
    _, frontend = services
    s = Session(frontend.address)
    _common_steps(s, GENERATE)
    methods = s.ok("list", GENERATE).split()
    assert methods == [f"{GENERATE}.{m}" for m in ("Detokenize", "Generate", "GetModelInfo", "Tokenize")]
    assert (
        "rpc Generate ( .tandem.generate.v1.GenerateRequest ) returns ( stream .tandem.generate.v1.GenerateResponse );"
    ) in s.ok("describe", GENERATE), s.transcript()
    params = s.ok("describe", "tandem.generate.v1.SamplingParams")
    assert "optional uint32 max_tokens = 1;" in params and "repeated string stop = 11;" in params, s.transcript()

    [info] = s.call(f"{GENERATE}/GetModelInfo")
    assert info["model_name"] == "demo-model" and info["num_engines"] == 1, s.transcript()

    [tokenized] = s.call(f"{GENERATE}/Tokenize", {"text": "Hello world", "add_special_tokens": False})
    assert len(tokenized["token_ids"]) == len(tokenized["tokens"]) > 0
    assert "".join(tokenized["tokens"]) == "Hello world", s.transcript()
    [detokenized] = s.call(f"{GENERATE}/Detokenize", {"token_ids": tokenized["token_ids"]})
    assert detokenized == {"text": "Hello world"}, s.transcript()

    # A streaming Generate, then the same with a stop string taken from its text.
    request = {"text": "The weather today", "sampling_params": {"max_tokens": 24, **GREEDY}}
    pieces = s.call(f"{GENERATE}/Generate", request)
    base = "".join(p.get("text", "") for p in pieces)
    assert len(pieces) > 1 and pieces[-1]["finish_reason"] == "FINISH_REASON_LENGTH", s.transcript()
    assert pieces[-1]["usage"]["completion_tokens"] == 24, s.transcript()
    stop = stop_candidate(base)
    if stop is None:
        pytest.skip(f"the demo model wrote no usable stop string: {base!r}")
    request["sampling_params"]["stop"] = [stop, "never-generated-stop"]
    stopped = s.call(f"{GENERATE}/Generate", request)
    last = stopped[-1]
    assert "".join(p.get("text", "") for p in stopped) == base[: base.find(stop)], s.transcript()
    assert last["finish_reason"] == "FINISH_REASON_STOP" and last["stop_str"] == stop, s.transcript()
    assert last["usage"]["completion_tokens"] < 24, s.transcript()

    # An invalid request: grpcurl shows the code and the message naming the field.
    bad = s.run(f"{GENERATE}/Generate", data={"text": "hi", "sampling_params": {"top_p": 2}})
    assert bad.returncode != 0 and bad.stdout == "", s.transcript()
    assert "Code: InvalidArgument" in bad.stderr, s.transcript()
    assert "Message: sampling_params.top_p: must be in (0, 1], got 2.0" in bad.stderr, s.transcript()
    bad_json = s.run(f"{GENERATE}/Tokenize", data={}, flags=("-format-error",))
    assert json.loads(bad_json.stderr) == {"code": 3, "message": "input: set text or messages"}, s.transcript()


def test_grpcurl_session_against_the_engine(services):
    engine, _ = services
    s = Session(engine.address)
    _common_steps(s, ENGINE)
    assert (
        "rpc Stream ( stream .tandem.engine.v1.StreamRequest ) returns ( stream .tandem.engine.v1.StreamResponse );"
    ) in s.ok("describe", ENGINE), s.transcript()
    [info] = s.call(f"{ENGINE}/GetModelInfo")
    assert info["architecture"] == "LlamaForCausalLM" and info["vocab_size"] == 2048, s.transcript()

    # One stream: a good request, a bad one (in-band error, the stream goes on), an abort.
    messages = [
        {"add": {"request_id": "good", "prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, **GREEDY}}},
        {"add": {"request_id": "bad", "prompt_token_ids": [5, 6, 7], "sampling_params": {"top_p": 2}}},
        {"add": {"request_id": "long", "prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1500}}},
        {"abort": {"request_ids": ["long"]}},
    ]
    out = s.ok(f"{ENGINE}/Stream", stdin="\n".join(json.dumps(m) for m in messages))
    outputs = [o for m in json_objects(out) for o in m.get("outputs", [])]
    finishes = {o["request_id"]: o for o in outputs if "finish_reason" in o}
    assert {rid: o["finish_reason"] for rid, o in finishes.items()} == {
        "good": "FINISH_REASON_LENGTH",
        "bad": "FINISH_REASON_ERROR",
        "long": "FINISH_REASON_ABORT",
    }, s.transcript()
    assert finishes["bad"]["error"] == {
        "code": "ERROR_CODE_INVALID_ARGUMENT",
        "field": "sampling_params.top_p",
        "message": "sampling_params.top_p: must be in (0, 1], got 2.0",
    }, s.transcript()
    assert sum(len(o.get("new_token_ids", [])) for o in outputs if o["request_id"] == "good") == 4, s.transcript()

    [load] = s.call(f"{ENGINE}/GetLoad")
    assert load["load"].get("num_running", 0) == 0 and load["load"].get("num_used_blocks", 0) == 0, s.transcript()
