"""``nmt serve``: parse the configuration, run the server until SIGTERM, drain, exit.

The process around ``service.api.server.App``: signals (SIGTERM and SIGINT
drain, SIGHUP rescans the model repository), start-up failures as one line and
an exit code.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from service.api.auth import TlsFiles, TokenFile
from service.api.server import build, log
from service.config import ConfigError, ServeConfig, parse
from service.errors import ModelRepositoryError, ProviderUnavailableError
from service.process import freeze_heap, global_pools_allowed, sched_batch
from service.scheduling.remote import ProcessScheduler


async def serve(config: ServeConfig) -> int:
    """Run until SIGTERM or SIGINT, then drain and return 0."""
    with global_pools_allowed():  # this process is the server: its engines may share ONNX Runtime's pools
        app = build(config)
    # before its engine processes start (they inherit it); auto: on where there is one
    children = any(isinstance(m.scheduler, ProcessScheduler) for m in app.models.all)
    log.info("scheduling: %s", sched_batch(children if config.sched_batch is None else config.sched_batch))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app.rescan)
    try:
        await app.start()
    except Exception:
        log.exception("start-up failed (warm-up translation)")
        await app.stop(0)
        return 1
    freeze_heap()  # the models are loaded and warm
    await stop.wait()
    log.info("draining: NOT_SERVING, up to %.1f s for in-flight calls", config.grace_period)
    await app.stop(config.grace_period)
    log.info("stopped")
    return 0


def check_security_files(config: ServeConfig) -> None:
    """ConfigError naming a missing, unreadable or mismatched TLS file or token file."""
    if config.security.tls:
        TlsFiles(config.security)
    if config.security.auth_token_file:
        TokenFile(config.security.auth_token_file)


def main(argv: list[str]) -> int:
    """``nmt serve [flags]``."""
    try:
        config = parse(argv)
    except ConfigError as e:
        print(f"nmt serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),  # StrEnum: "info" -> "INFO"
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_security_files(config)  # before the models load: a bad file fails in a second
        return asyncio.run(serve(config))
    except (ConfigError, ModelRepositoryError, ProviderUnavailableError) as e:
        print(f"nmt serve: {e}", file=sys.stderr)
        return 1
