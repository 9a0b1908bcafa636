"""Slow, silent and too many connections, bounded in the HTTP protocol (uvicorn's h11 protocol,
subclassed), before any request reaches the app.

- A connection must send a request's headers within `header_timeout_s` of opening, or of its
  last response (a kept-alive connection): else it is closed. uvicorn alone holds a silent
  socket forever; 1,100 of them used up the file limit and the server became unreachable.
- At most `max_connections` are open: one more is answered 503 (OpenAI's error shape) at once
  and closed, so the server stays reachable and says why. The process's soft file limit is
  raised to its hard limit, and the bound kept below it.
- A request body must arrive within the app's `body_timeout_s` (hybridjax.server.app, 408).
- A connection closed while its request body is still arriving (that 408, or a 413) closes as
  nginx's `lingering_close` does: our FIN after the response, then what the client still sends is
  read and dropped for `LINGER_S`. A socket closed with unread bytes answers with a reset, and
  the client's read then fails instead of returning the response it was sent.
- A client that half-closes its side after sending (shutdown(SHUT_WR)) still gets its answer.
  uvicorn closes on EOF, but a client that left entirely sends the same FIN. To tell them apart
  the server writes an interim `100 Continue` (every HTTP/1.1 client must accept 1xx responses
  before the final one): a socket closed for good answers it with a reset, and the connection
  is then dropped (and its request cancelled) as before; a half-closed one stays open for the
  answer. (Linux: the TCP state is read with TCP_INFO; elsewhere EOF closes, as in uvicorn.)
"""

from __future__ import annotations

import json
import logging
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hybridjax.server")

# Descriptors kept free for everything but client connections (model files, logs, pipes).
RESERVED_FILES = 64
LINGER_S = 1.0  # a lingering close drains the client this long after our FIN (it reads our answer first)
PROBE_DELAYS_S = (0.05, 0.3, 1.0, 3.0)  # after EOF: when to look for the reset a closed socket answers with
TCP_CLOSE = 7  # tcpi_state after a reset (linux/tcp_states.h)


def _busy_response(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"too many open connections (at most {limit}); try again later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class LingeringTransport:
    """The socket transport as uvicorn's protocol sees it, with one change: `close()` while the
    client is still sending its request body lingers (`linger`)."""

    def __init__(self, transport, protocol: "GuardedH11Protocol"):
        self._transport, self._protocol = transport, protocol
        self.lingering = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self._protocol.conn.their_state is h11.SEND_BODY and not self.is_closing():
            self.linger()
        else:
            self._transport.close()

    def linger(self) -> None:
        """Send our FIN after what is written, drop what the client still sends (the protocol's
        data_received), and close after LINGER_S, or at the client's FIN if sooner."""
        self.lingering = True
        self._transport.write_eof()
        self._transport.resume_reading()
        self._protocol.loop.call_later(LINGER_S, self._transport.close)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection bound (configure a subclass
    with `guarded_protocol`)."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000

    def connection_made(self, transport) -> None:
        self._header_timer = None
        self._waiting_in = None
        super().connection_made(LingeringTransport(transport, self))
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d open (at most %d)", len(self.connections) - 1, self.max_connections)
            self.transport.write(_busy_response(self.max_connections))
            self.transport.linger()  # the 503, our FIN, and the client reads it before the socket closes
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._waiting_in:
            self._header_timer.cancel()  # a request arrived
            self._header_timer = None

    def eof_received(self) -> bool | None:
        """The client sent FIN. With a request whose body has all arrived and whose answer has
        not started, probe (a 100 Continue) whether it only half-closed; keep the connection
        open for the answer meanwhile. An answer already streaming finds out by writing."""
        cycle = self.cycle
        if (self.transport.lingering or cycle is None or cycle.response_complete or cycle.more_body
                or not hasattr(socket, "TCP_INFO")):
            return None  # nothing under way: close, as uvicorn does
        cycle.keep_alive = False  # close once answered: the client sends nothing more
        if self.conn.our_state is h11.SEND_RESPONSE:
            self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                          reason=b"Continue")))
            for delay in PROBE_DELAYS_S:
                self.loop.call_later(delay, self._drop_if_reset)
        return True

    def _drop_if_reset(self) -> None:
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
        except OSError:
            state = TCP_CLOSE
        if state == TCP_CLOSE:  # the peer reset: it had left, not half-closed
            self.transport.abort()  # connection_lost: the app sees a disconnect and cancels

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request is already under way
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._waiting_in = self.cycle  # a new request replaces `cycle`
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_in and not self.transport.is_closing():
            log.info("closed a connection that sent no request headers within %g s", self.header_timeout_s)
            self.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def uvicorn_options(sc) -> dict:
    """uvicorn.run / uvicorn.Config keyword arguments for a ServerConfig's host, port and bounds."""
    files = raise_file_limit()
    limit = sc.max_connections
    if files != resource.RLIM_INFINITY and limit > files - RESERVED_FILES:
        limit = max(1, files - RESERVED_FILES)
        log.warning("max connections lowered to %d: the open-file limit is %d", limit, files)
    return dict(host=sc.host, port=sc.port, http=guarded_protocol(sc.header_timeout_s, limit),
                timeout_keep_alive=sc.keep_alive_s)


def bind(host: str, port: int):
    """A socket bound to (host, port), for `serve`: bound before the model loads, so that a port
    in use is an error at once (OSError), not after minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse the port at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
