"""``--model FILE.gguf`` end to end: the real SmolLM2-135M-Instruct GGUF served by an engine
process and a frontend, answering a chat through the public API and the real grpcurl.

One pair serves the module; prompts are short and answers greedy and few tokens long.
"""

from __future__ import annotations

import json

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as pb
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.grpcurl import grpcurl
from tests.services import running_pair, start_engine

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gguf_pair(smollm2_gguf):
    with running_pair(smollm2_gguf, "--num-kv-blocks", "256", "--max-model-len", "2048", "--dtype", "float32") as p:
        yield p


def test_a_chat_is_answered_through_the_public_api(gguf_pair):
    _, frontend = gguf_pair
    with grpc.insecure_channel(frontend.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert info.model_name == "SmolLM2-135M-Instruct.Q4_1" and info.has_chat_template
        assert list(info.eos_token_ids) == [2]
        request = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)]),
            sampling_params=pb.SamplingParams(max_tokens=16, temperature=0.0),
        )
        responses = list(stub.Generate(request, timeout=120))
    text = "".join(r.text for r in responses)
    assert "Paris" in text, text
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP  # ended by <|im_end|>, not the limit


def test_grpcurl_gets_the_same_answer(gguf_pair):
    _, frontend = gguf_pair
    body = {"messages": {"messages": [{"role": "user", "content": QUESTION}]}, "samplingParams": {"maxTokens": 16}}
    body["samplingParams"]["temperature"] = 0
    out = grpcurl("-plaintext", "-d", json.dumps(body), frontend.address, "tandem.generate.v1.GenerateService/Generate")
    text = "".join(json.loads(chunk).get("text", "") for chunk in out.replace("}\n{", "}\0{").split("\0"))
    assert "Paris" in text, out


def test_a_gguf_the_engine_cannot_read_is_refused_with_a_clear_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    engine = start_engine(bad)
    try:
        assert engine.proc.wait(120) == 1
    finally:
        engine.terminate()
    log = engine.log()
    assert "broken.gguf is not a readable GGUF file" in log, log
    assert "Traceback" not in log, log
