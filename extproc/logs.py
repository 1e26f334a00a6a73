"""Log lines, as text or one JSON object per line, and request ids.

A line about a request carries its ``request_id`` (Envoy's ``x-request-id``; kvgate makes one
when the request has none and sends it upstream) and may carry ``tenant``: pass them as
``extra={...}``. A line never carries an API key or a request body: kvgate logs neither,
and the formatters blank any ``Bearer`` credential that an exception's text might bring.
"""

from __future__ import annotations

import datetime
import logging
import os
import re

import orjson
from aiohttp.http_exceptions import HttpProcessingError

FORMATS = ("plain", "json")
CONTEXT = ("request_id", "tenant")  # the ``extra`` fields a line may carry
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def redact(text: str) -> str:
    return _BEARER.sub(r"\1[redacted]", text)


def new_request_id() -> str:
    return os.urandom(16).hex()


def usable_request_id(value: str) -> bool:
    """A client's or Envoy's id goes into log lines only if it is short and plain."""
    return _ID.fullmatch(value) is not None


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT if hasattr(record, k))
        return redact(f"{line} [{context}]" if context else line)


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "pid", "msg", request_id?, tenant?, "exc"?}``."""

    def format(self, record: logging.LogRecord) -> str:
        document = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": redact(record.getMessage()),
        }
        for key in CONTEXT:
            if hasattr(record, key):
                document[key] = getattr(record, key)
        if record.exc_info:
            document["exc"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(document).decode()


class _ClientErrorsQuiet(logging.Filter):
    """A library that logs someone else's fault at ERROR with a traceback: aiohttp, a
    request it cannot parse (an over-long request line or header, a bad chunk); gRPC, a
    reply it could not write because Envoy had given up on the stream (its message timeout
    — one per request while kvgate is overloaded, when log lines cost most). A hostile
    client or a timeout storm could fill the log with them. Such a record (its exception
    one of ``kinds``) becomes one DEBUG line, dropped unless kvgate logs DEBUG; an error in
    kvgate's own handlers is logged as before."""

    def __init__(self, kinds: tuple[type[BaseException], ...]):
        super().__init__()
        self.kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, self.kinds):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        code = getattr(error, "code", None)
        record.msg = f"{record.getMessage()}: {type(error).__name__}" + (
            f" {code}" if code is not None else "")
        record.args, record.exc_info, record.exc_text = (), None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _quieted(name: str, kinds: tuple[type[BaseException], ...]) -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _ClientErrorsQuiet) for f in logger.filters):
        logger.addFilter(_ClientErrorsQuiet(kinds))
    return logger


def http_server_log(name: str) -> logging.Logger:
    """The logger to give an aiohttp server kvgate runs (``AppRunner(logger=...)``)."""
    return _quieted(name, (HttpProcessingError,))


def quiet_grpc_write_failures() -> None:
    """gRPC's aio server logs a reply it could not write to a cancelled RPC at ERROR."""
    from grpc._cython.cygrpc import ExecuteBatchError

    _quieted("grpc._cython.cygrpc", (ExecuteBatchError,))


def setup_logging(level: str, fmt: str = "plain") -> None:
    """The root logger's one handler (stderr), replaced if set before (a worker process
    re-applies the config file's format)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
