"""``tandem-frontend``: start the frontend service."""

from __future__ import annotations

import asyncio
import sys

from frontend_svc.config import FrontendConfig, build_parser
from tandem_common.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    config = FrontendConfig.from_args(parser.parse_args(argv))
    problems = config.check()
    if problems:
        parser.error("; ".join(problems))
    setup_logging(config.log_level, config.log_format)
    if config.workers > 1:
        from frontend_svc.service.workers import run_workers

        return run_workers(config)
    from frontend_svc.service.server import FrontendServer

    asyncio.run(FrontendServer(config).serve_until_signal())
    return 0


if __name__ == "__main__":
    sys.exit(main())
