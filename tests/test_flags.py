"""Impossible flag values stop a service at start, naming the flag and what it accepts
(issue 18, items 12 and 16); the help says each default once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine_svc.config import build_parser as engine_parser
from frontend_svc.config import build_parser as frontend_parser

ROOT = Path(__file__).resolve().parent.parent

ENGINE_REFUSED = [
    ("--max-num-seqs", "0", "an integer >= 1"),
    ("--max-num-batched-tokens", "0", "an integer >= 1"),
    ("--max-waiting", "0", "an integer >= 1"),
    ("--max-model-len", "1", "an integer >= 2"),
    ("--block-size", "0", "an integer in [1, 1024]"),
    ("--block-size", "4096", "an integer in [1, 1024]"),
    ("--num-kv-blocks", "0", "an integer >= 1"),
    ("--kv-cache-bytes", "-1", "an integer >= 1"),
    ("--num-threads", "0", "an integer >= 1"),
    ("--port", "65536", "an integer in [0, 65535]"),
    ("--metrics-port", "-1", "an integer in [0, 65535]"),
    ("--metrics-client-rate", "-1", "a number >= 0"),
    ("--metrics-max-rate", "0", "a number > 0"),
    ("--max-message-bytes", "100", "an integer in [2048, 2147483647]"),
    ("--stream-backlog-bytes", "1000", "an integer >= 65536"),
    ("--shutdown-timeout", "-5", "a number >= 0"),
    ("--shutdown-timeout", "nan", "a number >= 0"),
    ("--seed", "-1", "an integer in [0, 18446744073709551615]"),
    ("--max-num-seqs", "four", "an integer >= 1"),
]
FRONTEND_REFUSED = [
    ("--port", "99999", "an integer in [0, 65535]"),
    ("--metrics-port", "70000", "an integer in [0, 65535]"),
    ("--metrics-client-rate", "nan", "a number >= 0"),
    ("--metrics-max-rate", "inf", "a number > 0"),
    ("--max-message-bytes", "0", "an integer in [2048"),
    ("--shutdown-timeout", "inf", "a number >= 0"),
    ("--engine-progress-timeout-s", "-1", "a number >= 0"),
    ("--engine-progress-factor", "-1", "a number >= 0"),
    ("--engine-progress-floor-s", "0", "a number > 0"),
    ("--max-calls-per-client", "-1", "an integer >= 0"),
    ("--chat-template-timeout-s", "0", "a number in (0, 3600]"),
    ("--chat-template-timeout-s", "nan", "a number in (0, 3600]"),
    ("--chat-template-max-bytes", "100", "an integer in [4096, 1073741824]"),
    ("--chat-template-workers", "0", "an integer in [1, 64]"),
    ("--http-header-timeout-s", "0", "a number > 0"),
    ("--http-idle-timeout-s", "nan", "a number > 0"),
    ("--http-max-connections", "-1", "an integer >= 0"),
    ("--http-max-header-bytes", "100", "an integer in [1024, 16777216]"),
    ("--http-max-header-fields", "0", "an integer >= 1"),
    ("--max-pending-output-bytes", "1000", "an integer >= 65536"),
    ("--responses-store-max-bytes", "-1", "an integer >= 0"),
    ("--responses-store-max-age-s", "0", "a number > 0"),
    ("--responses-store-max-age-s", "inf", "a number > 0"),
    ("--allowed-origins", "https://app.example", 'a JSON array of origins ("*" or scheme://host[:port])'),
    ("--allowed-origins", '["https://app.example/path"]', "a JSON array of origins"),
    ("--allowed-methods", '["PO ST"]', "a JSON array of HTTP methods"),
    ("--allowed-headers", "[1]", "a JSON array of header names"),
]


@pytest.mark.parametrize("flag, value, allowed", ENGINE_REFUSED)
def test_engine_refuses_impossible_values(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as exit_:
        engine_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be {allowed}" in err, err


@pytest.mark.parametrize("flag, value, allowed", FRONTEND_REFUSED)
def test_frontend_refuses_impossible_values(capsys, flag, value, allowed):
    with pytest.raises(SystemExit):
        frontend_parser().parse_args(["--engine", "a:1", flag, value])
    assert f"argument {flag}: must be {allowed}" in capsys.readouterr().err


def test_the_engine_process_exits_at_once_instead_of_hanging_every_request():
    # Each of these used to start and then hang every request.
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-waiting"):
        result = subprocess.run(
            [sys.executable, "-m", "engine_svc", flag, "0"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert result.returncode == 2 and f"argument {flag}: must be an integer >= 1, got 0" in result.stderr


@pytest.mark.parametrize("parser", [engine_parser, frontend_parser])
def test_help_states_each_default_once(parser):
    p = parser()
    assert "(default: None)" not in p.format_help()
    formatter = p._get_formatter()
    for action in p._actions:
        if action.help:
            assert formatter._expand_help(action).lower().count("default") <= 1, action.dest


def test_every_engine_flag_has_help():
    missing = [a.dest for a in engine_parser()._actions if a.dest != "help" and not a.help]
    assert not missing, missing


def test_lora_admin_over_http_needs_an_api_key():
    from frontend_svc.config import FrontendConfig

    problems = FrontendConfig(engines=["a:1"], http_lora_admin=True).check()
    assert any(p.startswith("--http-lora-admin needs --api-key") for p in problems), problems
    assert FrontendConfig(engines=["a:1"], http_lora_admin=True, api_keys=["k"]).check() == []
