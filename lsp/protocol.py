"""A pygls protocol that answers malformed messages instead of dropping them.

pygls logs a message it cannot parse or structure and sends nothing, so a client
waiting on that request id would wait forever.  Here a body that is not JSON gets a
``ParseError`` response (id null, as JSON-RPC 2.0 says), and a request whose params do
not fit its method gets ``InvalidParams`` for its id.  Either way the server goes on.
A request after ``shutdown`` gets ``InvalidRequest``, as the LSP specification asks
(pygls drops it).  Before ``initialize``, a request gets ``ServerNotInitialized`` (-32002) and
a notification other than ``exit`` is dropped, as the specification asks (pygls would run it:
a completion asked for before the workspace exists was answered with nothing).
With ``keep_serving`` (the TCP listener) ``exit`` ends the connection, not the process.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

from lsprotocol import types
from pygls.exceptions import (JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcParseError,
                              JsonRpcServerNotInitialized)
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

log = logging.getLogger(__name__)


def _deserialize_noise(record: logging.LogRecord) -> bool:
    """pygls logs a message it cannot structure at ERROR with a traceback before raising, and
    ``RobustProtocol`` then answers it with one warning that says why: the traceback is kept for
    ``-vv`` (pygls at DEBUG) only."""
    if str(record.msg).startswith("Unable to deserialize message"):
        return logging.getLogger("pygls").isEnabledFor(logging.DEBUG)
    return True


logging.getLogger("pygls.protocol.json_rpc").addFilter(_deserialize_noise)


def _why(exc: BaseException) -> str:
    """The first validation error inside ``exc`` (cattrs nests them in exception groups), short."""
    e = exc.__cause__ or exc
    while getattr(e, "exceptions", None):  # an exception group (a backport's on Python 3.10)
        e = e.exceptions[0]
    return str(e)[:200] or type(e).__name__


class _Rejected:
    """Stands in for a message that was answered with an error already."""

    jsonrpc = None


class RobustProtocol(LanguageServerProtocol):
    keep_serving = False  # set by the TCP listener: the daemon outlives its clients
    exit_code: int | None = None  # what the client's exit asked for (0 after shutdown, else 1)
    initialize_seen = False  # the connection's client has sent ``initialize``

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args):
        self.exit_code = 0 if self._shutdown else 1  # pygls's own sys.exit may end only a thread
        if not self.keep_serving:
            yield from super().lsp_exit(*args)
            return
        if (user_handler := self.fm.features.get(types.EXIT)) is not None:
            yield user_handler, args, None
        log.info("client sent exit: connection closed, still listening")
        if self.writer is not None:
            res = self.writer.close()
            if inspect.isawaitable(res):
                asyncio.ensure_future(res)

    def reset_connection(self) -> None:
        """A new client on the TCP listener starts from an uninitialized protocol."""
        self._shutdown = False
        self.initialize_seen = False
        self._workspace = None
        self._request_futures.clear()
        self._result_types.clear()

    def structure_message(self, data):
        try:
            return super().structure_message(data)
        except Exception as exc:
            msg_id = data.get("id") if isinstance(data, dict) else None
            if msg_id is not None and "method" in data:
                err = exc if isinstance(exc, JsonRpcInvalidParams) else JsonRpcInvalidParams()
                log.warning("invalid params for %s (id %s): answered InvalidParams: %s",
                            data.get("method"), msg_id, _why(exc))
                self._send_response(msg_id, None, err.to_response_error())
                return _Rejected()
            raise

    def handle_message(self, message):
        if isinstance(message, _Rejected):
            return
        method, msg_id = getattr(message, "method", None), getattr(message, "id", None)
        if method == types.INITIALIZE:
            self.initialize_seen = True
        elif method is not None and method != types.EXIT and not self.initialize_seen:
            if msg_id is None:
                log.warning("%s before initialize: dropped", method)
                return
            log.warning("%s before initialize (id %s): answered ServerNotInitialized", method, msg_id)
            self._send_response(msg_id, None, JsonRpcServerNotInitialized().to_response_error())
            return
        if self._shutdown and method not in (None, types.EXIT) and msg_id is not None:
            log.warning("%s after shutdown (id %s): answered InvalidRequest", method, msg_id)
            error = JsonRpcInvalidRequest("the server is shutting down").to_response_error()
            self._send_response(msg_id, None, error)
            return
        return super().handle_message(message)

    def send_parse_error(self, detail: str) -> None:
        log.warning("unparsable message: %s", detail)
        error = JsonRpcParseError(f"Parse error: {detail}").to_response_error()
        # JSON-RPC: a parse error is answered with id null.
        self._send_data({"jsonrpc": "2.0", "id": None,
                         "error": self._converter.unstructure(error)})
