"""Cost per token of splitting reasoning and tool calls from the text, on the frontend.

    python -m benchmarks.tool_parsers [--repeats 20]

For each format, a typical answer (a short thought, a sentence, two calls with nested
arguments) is tokenized with the demo model's tokenizer and pushed through ChoiceProcessor
one token per engine output, with and without the split; the difference per token is what
the parsers add (target: under 20 us). The parsers alone, fed the same token-sized deltas,
are timed too. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from engine_svc.demo_model import ensure_demo_model
from frontend_svc.text.message_parser import MessageFormat, MessageParser
from frontend_svc.text.output_processor import ChoiceProcessor, TextParams
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools import FORMATS
from frontend_svc.types import EngineOutput
from tandem_common.types import FinishReason

_ARGS = '{"city": "Paris", "when": {"days": [1, 2, 3], "note": "a \\"quoted\\" </tool_call> }"}}'
_WEATHER = f'{{"name": "get_weather", "arguments": {_ARGS}}}'
_TIME = '{"name": "get_time", "arguments": {}}'
_CALLS = {
    "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {_ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {_ARGS}}}; {{"name": "get_time", "parameters": {{}}}}',
    "mistral": f"[TOOL_CALLS][{_WEATHER}, {_TIME}]",
    "pythonic": '[get_weather(city="Paris", when={"days": [1, 2, 3]}), get_time()]',
    "json": f"[{_WEATHER}, {_TIME}]",
}
_THOUGHT = "The user wants the weather in Paris and the time; I will call both tools.</think>"


def _outputs(ids: list[int]) -> list[EngineOutput]:
    return [EngineOutput("r", [t]) for t in ids[:-1]] + [EngineOutput("r", ids[-1:], finish_reason=FinishReason.STOP)]


def _pipeline_s(tok: Tokenizer, ids: list[int], fmt: MessageFormat, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        proc = ChoiceProcessor(0, tok, [1], TextParams(message=fmt))
        outs = _outputs(ids)
        start = time.perf_counter()
        for o in outs:
            proc.process(o)
        best = min(best, time.perf_counter() - start)
    return best


def _parser_s(deltas: list[str], fmt: MessageFormat, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        parser = MessageParser(fmt)
        start = time.perf_counter()
        for d in deltas:
            parser.feed(d)
        parser.finish()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20, help="runs per case; the fastest is kept")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_dir(ensure_demo_model())
    report = {}
    for name, calls in _CALLS.items():
        # Tagged formats may have text before the calls; the others are calls from the start.
        text = _THOUGHT + ("Let me look that up for you.\n" if name in ("hermes", "mistral") else "") + calls
        ids = tok.encode(text, add_special_tokens=False)
        deltas = [tok.decode([t]) for t in ids]  # about one token's text each
        fmt = MessageFormat(tools=FORMATS[name], reasoning=True, starts_in_thought=True)
        plain = _pipeline_s(tok, ids, MessageFormat(), args.repeats)
        split = _pipeline_s(tok, ids, fmt, args.repeats)
        alone = _parser_s(deltas, fmt, args.repeats)
        report[name] = {
            "num_tokens": len(ids),
            "pipeline_us_per_token": round(plain / len(ids) * 1e6, 2),
            "pipeline_with_split_us_per_token": round(split / len(ids) * 1e6, 2),
            "split_added_us_per_token": round((split - plain) / len(ids) * 1e6, 2),
            "parsers_alone_us_per_token": round(alone / len(ids) * 1e6, 2),
        }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
