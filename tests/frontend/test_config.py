"""The frontend's command line: every flag, its default, and the checks on combinations."""

from __future__ import annotations

import pytest

from frontend_svc.config import FrontendConfig, build_parser

FLAGS = [
    "--engine",
    "--dns-refresh-s",
    "--routing",
    "--routing-load-threshold",
    "--host",
    "--port",
    "--tokenizer",
    "--metrics-port",
    "--log-level",
    "--log-format",
    "--otlp-endpoint",
    "--tls-cert",
    "--tls-key",
    "--engine-tls-ca",
    "--engine-tls-cert",
    "--engine-tls-key",
    "--api-key",
    "--api-key-file",
    "--max-message-bytes",
    "--max-stop-strings",
    "--max-n",
    "--shutdown-timeout",
    "--max-stop-string-chars",
    "--max-concurrent-calls",
    "--stalled-client-timeout-s",
    "--engine-stall-timeout-s",
    "--engine-progress-timeout-s",
    "--max-calls-per-client",
    "--metrics-host",
]


def parse(*argv: str) -> FrontendConfig:
    return FrontendConfig.from_args(build_parser().parse_args(list(argv)))


def test_help_lists_every_flag():
    parser = build_parser()
    assert parser.prog == "tandem-frontend"
    text = parser.format_help()
    for flag in FLAGS:
        assert flag in text, flag
    assert "(default: None)" not in text  # a flag without a default says nothing about one


def test_defaults():
    c = parse("--engine", "127.0.0.1:50051")
    assert c.engines == ["127.0.0.1:50051"]
    assert (c.host, c.port, c.metrics_port, c.dns_refresh_s) == ("127.0.0.1", 50050, 0, 10.0)
    assert (c.max_stop_strings, c.max_n, c.tokenizer, c.api_keys) == (16, 16, None, [])
    assert c.log_format == "text" and not c.engine_tls
    assert (c.max_stop_string_chars, c.max_concurrent_calls, c.stalled_client_timeout_s) == (1024, 1024, 30.0)
    assert (c.engine_stall_timeout_s, c.metrics_host) == (10.0, None)
    assert c.check() == []


def test_repeatable_flags_and_dns_targets(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team keys\nk2\n\n  k3  \n")
    c = parse(
        "--engine",
        "a:1",
        "--engine",
        "dns:///engines.ns.svc:50051",
        "--api-key",
        "k1",
        "--api-key-file",
        str(keyfile),
        "--dns-refresh-s",
        "2.5",
    )
    assert c.engines == ["a:1", "dns:///engines.ns.svc:50051"]
    assert c.all_api_keys() == ["k1", "k2", "k3"]
    assert c.dns_refresh_s == 2.5


def test_check_reports_unusable_combinations():
    assert any("--engine" in p for p in parse().check())
    problems = parse("--engine", "a:1", "--tls-cert", "c.pem", "--engine-tls-key", "k.pem", "--max-n", "0").check()
    assert len(problems) == 3
    assert parse("--engine", "a:1", "--engine-tls-ca", "ca.pem").engine_tls


def test_limits_and_timeouts_are_checked(capsys):
    # On the command line argparse refuses them, naming the flag and its range ...
    for flag, value in [
        ("--max-stop-string-chars", "0"),
        ("--max-concurrent-calls", "-1"),
        ("--max-calls-per-client", "-1"),
        ("--stalled-client-timeout-s", "-1"),
        ("--engine-stall-timeout-s", "0"),
        ("--engine-progress-timeout-s", "-1"),
        ("--routing-load-threshold", "-1"),
    ]:
        with pytest.raises(SystemExit):
            parse("--engine", "a:1", flag, value)
        assert f"argument {flag}: must be" in capsys.readouterr().err
    # ... and a configuration built in code gets the same verdict from check().
    bad = FrontendConfig(
        engines=["a:1"],
        max_stop_string_chars=0,
        max_concurrent_calls=-1,
        max_calls_per_client=-1,
        stalled_client_timeout_s=-1,
        engine_stall_timeout_s=0,
        engine_progress_timeout_s=-1,
        routing_load_threshold=-1,
    )
    assert len(bad.check()) == 7, bad.check()
    assert (
        parse("--engine", "a:1").calls_per_client,
        parse("--engine", "a:1", "--max-concurrent-calls", "0").calls_per_client,
    ) == (512, 0)
    assert parse("--engine", "a:1", "--max-concurrent-calls", "0", "--stalled-client-timeout-s", "0").check() == []


def test_routing_defaults_to_prefix_only_when_there_can_be_several_engines():
    assert parse("--engine", "a:1").routing_policy == "least-load"
    assert parse("--engine", "a:1", "--engine", "b:1").routing_policy == "prefix"
    assert parse("--engine", "dns:///engines.ns.svc:50051").routing_policy == "prefix"
    assert parse("--engine", "a:1", "--routing", "prefix").routing_policy == "prefix"
    assert parse("--engine", "a:1", "--engine", "b:1", "--routing", "least-load").routing_policy == "least-load"
    assert parse("--engine", "a:1").routing_load_threshold == 2048
