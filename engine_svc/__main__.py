"""``tandem-engine``: start the engine service."""

from __future__ import annotations

import asyncio
import sys

from engine_svc.config import EngineConfig, build_parser
from tandem_common.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        config = EngineConfig.from_args(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
    setup_logging(config.log_level, config.log_format)
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    from engine_svc.service.server import EngineServer

    asyncio.run(EngineServer(config).serve_until_signal())
    return 0


if __name__ == "__main__":
    sys.exit(main())
