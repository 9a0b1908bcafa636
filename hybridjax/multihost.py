"""Serving across processes: process 0 runs the engine, the other processes replay its steps.

In multi-controller SPMD (jax.distributed) every process must launch the same programs, in
the same order, with the same host inputs; a program on a mesh that spans processes runs
only once every process has launched it. The engine launches its device programs in one
place, its `calls` (the jitted steps of hybridjax.engine_steps). On process 0 a `StepLeader`
stands in for that module: each call is described (the step's name and its host arguments:
rows, tokens, token counts, page tables, lengths, sampling parameters, seeds, all numpy) and
sent to every follower, then run. A follower (`follow`) reads the descriptions in order and
makes the same calls on its own copies of the device values: the engine state (every step
takes it and returns the new one, donated), the params, and the row states `read_row` and
`prefill_chunk` return (process 0's snapshot store keeps them; each follower keeps its shards
under a number, which process 0 releases when its own copy is dropped). Warm-up is a sequence of such calls, so it is
replayed like any other; a single-process engine calls the module directly and pays nothing.

The channel: one TCP connection from each follower to process 0, on a port process 0 picks
and publishes once with `multihost_utils.broadcast_one_to_all` (beside a random token each
follower must present), carrying length-prefixed pickles read by a restricted unpickler
(numpy arrays and builtins only). Not a collective per step (`broadcast_one_to_all` for every
message): a follower would wait inside a collective while the server idles, where gloo times
out; every message size would be a program to compile; each step would pay a device round
trip. A stream keeps the order for free, and its end is the followers' signal to stop.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import io
import logging
import pickle
import secrets
import socket
import struct
import threading
import time
import weakref

import jax
import numpy as np

from hybridjax import engine_steps as steps
from hybridjax.cache import GDNState
from hybridjax.config import Config
from hybridjax.params import Params
from hybridjax.sampling import SamplingParams

log = logging.getLogger(__name__)

# The steps a multi-process engine may run. read_pages / write_pages (snapshot persistence)
# are left out: they move sharded pages to and from process 0's host alone.
REPLAYED = ("init_state", "prefill_chunk", "decode", "sample_first", "setup_row", "set_bits", "copy_page", "read_row")
# Outputs that come back as inputs later (a snapshot's row state): kept by number. A prefill call
# returns each row's state after it (`engine_steps._prefill`), which a snapshot may take.
KEPT = {"read_row": lambda out: out, "prefill_chunk": lambda out: out[1]}
_STRUCTS = {"GDNState": GDNState, "SamplingParams": SamplingParams}
_STOP = "stop"
_HEADER = struct.Struct("<Q")


class ChannelError(RuntimeError):
    """The step channel between process 0 and a follower failed or was refused."""


# --- the wire ------------------------------------------------------------------------------


def _send(sock: socket.socket, obj) -> None:
    body = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket):
    """The next message, or None when the peer closed the connection."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0])
    if body is None:
        return None
    return _Unpickler(io.BytesIO(body)).load()


class _Unpickler(pickle.Unpickler):
    """Numpy arrays, dtypes and scalars; everything else is builtins (tuples, lists, dicts,
    str, numbers, None), which need no class lookup."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy.core.numeric", "_frombuffer")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or module.startswith("numpy.dtypes"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"forbidden class {module}.{name} on the step channel")


def _encode(x, handle_of: dict):
    """(wire form, value to run here) of a step argument. On the wire: the engine state, params,
    config and mesh by role (each process has its own), device arrays a step made by number,
    host values as numpy; small device arrays made on this host (e.g. sampling parameters) go
    as numpy, and run here as numpy too, so that every process passes the same kind of value."""
    if isinstance(x, steps.EngineState):
        return ("S",), x
    if isinstance(x, Params):
        return ("P",), x
    if isinstance(x, Config):
        return ("C",), x
    if isinstance(x, jax.sharding.Mesh):
        return ("M",), x
    if isinstance(x, jax.Array):
        number = handle_of.get(id(x))
        if number is not None:
            return ("H", number), x
        if not x.is_fully_addressable:
            raise ChannelError("a device value no replayed step made cannot be passed to a step across processes")
        x = np.asarray(x)
        return ("V", x), x
    if isinstance(x, (tuple, list)):
        pairs = [_encode(v, handle_of) for v in x]
        kind = type(x)
        return ("T" if kind is tuple else "L", [w for w, _ in pairs]), kind(v for _, v in pairs)
    if isinstance(x, dict):
        pairs = {k: _encode(v, handle_of) for k, v in x.items()}
        return ("K", {k: w for k, (w, _) in pairs.items()}), {k: v for k, (_, v) in pairs.items()}
    name = type(x).__name__
    if _STRUCTS.get(name) is type(x):
        pairs = {f.name: _encode(getattr(x, f.name), handle_of) for f in dataclasses.fields(x)}
        return ("D", name, {k: w for k, (w, _) in pairs.items()}), type(x)(**{k: v for k, (_, v) in pairs.items()})
    if x is None or isinstance(x, (bool, int, float, str, np.ndarray, np.generic, np.dtype)):
        return ("V", np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x), x
    raise ChannelError(f"cannot send a {type(x).__name__} to the followers")


def _decode(x, own: dict, handles: dict):
    tag = x[0]
    if tag in own:
        return own[tag]
    if tag == "H":
        return handles[x[1]]
    if tag in ("T", "L"):
        items = [_decode(v, own, handles) for v in x[1]]
        return tuple(items) if tag == "T" else items
    if tag == "K":
        return {k: _decode(v, own, handles) for k, v in x[1].items()}
    if tag == "D":
        return _STRUCTS[x[1]](**{k: _decode(v, own, handles) for k, v in x[2].items()})
    if tag == "V":
        return x[1]
    raise ChannelError(f"unknown value tag {tag!r} on the step channel")


def _new_state(out):
    """The engine state a step returned (alone, or last of a tuple), else None."""
    if isinstance(out, steps.EngineState):
        return out
    if isinstance(out, tuple) and out and isinstance(out[-1], steps.EngineState):
        return out[-1]
    return None


def fingerprint(cfg: Config, params: Params) -> str:
    """What every process must agree on before replaying: the config, the mesh, the param shapes."""
    mesh = params.mesh
    shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(params)]
    text = repr((repr(cfg), dict(mesh.shape) if mesh is not None else None, shapes))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# --- process 0 -------------------------------------------------------------------------------


class StepLeader:
    """Process 0's stand-in for `hybridjax.engine_steps` (pass it as `Engine(calls=...)`): each
    step in REPLAYED is sent to every follower, then run here. Calls are serialised, so the
    followers see them in the order they run here."""

    def __init__(self, conns: list[socket.socket]):
        self._conns = conns
        self._lock = threading.Lock()
        self._handle_of: dict[int, int] = {}  # id(device array) -> its number on the followers
        self._released: collections.deque = collections.deque()  # numbers to release (finalizers append)
        self._next = 0
        self.calls = 0
        self.closed = False
        for name in REPLAYED:
            setattr(self, name, functools.partial(self._call, name))

    def __getattr__(self, name):
        if name in ("read_pages", "write_pages"):
            raise ChannelError("saving or loading snapshots is not supported across processes")
        raise AttributeError(name)

    def _call(self, name, *args, **kwargs):
        with self._lock:
            if self.closed:
                raise ChannelError("the step channel is closed")
            released = []
            while self._released:
                released.append(self._released.popleft())
            (wire_args, args), (wire_kwargs, kwargs) = _encode(args, self._handle_of), _encode(kwargs, self._handle_of)
            self._broadcast((released, name, wire_args, wire_kwargs))
            out = getattr(steps, name)(*args, **kwargs)
            self.calls += 1
            if name in KEPT:
                for leaf in jax.tree_util.tree_leaves(KEPT[name](out)):
                    self._keep(leaf)
            return out

    def _keep(self, leaf) -> None:
        key, number = id(leaf), self._next
        self._next += 1
        self._handle_of[key] = number
        done = weakref.finalize(leaf, self._drop, key, number)
        done.atexit = False

    def _drop(self, key: int, number: int) -> None:
        # Runs when the array is collected (any thread): no lock, only atomic dict / deque ops.
        self._handle_of.pop(key, None)
        self._released.append(number)

    def _broadcast(self, msg) -> None:
        body = pickle.dumps(msg, protocol=5)
        frame = _HEADER.pack(len(body)) + body
        for i, conn in enumerate(self._conns):
            try:
                conn.sendall(frame)
            except OSError as e:
                raise ChannelError(f"lost follower {i + 1}: {e}") from None

    def close(self) -> None:
        """Tell the followers to stop (after the engine has stopped) and close the channel."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            released = []
            while self._released:
                released.append(self._released.popleft())
            for conn in self._conns:
                try:
                    _send(conn, (_STOP, released))
                    conn.shutdown(socket.SHUT_WR)
                    conn.settimeout(30)
                    _recv(conn)  # the follower closes its end once it has drained its steps
                except OSError:
                    pass
                finally:
                    conn.close()


def _publish(port: int = 0, token: bytes = b"") -> tuple[int, bytes]:
    """Process 0's (port, token), broadcast to every process (one collective, at start-up)."""
    from jax.experimental import multihost_utils

    words = np.zeros((5,), np.int32)
    if jax.process_index() == 0:
        words[0] = port
        words[1:] = np.frombuffer(token, np.int32) & 0x7FFFFFFF
    words = np.asarray(multihost_utils.broadcast_one_to_all(words))
    return int(words[0]), words[1:].astype(np.int32).tobytes()


def lead(host: str, cfg: Config, params: Params, timeout: float = 300.0) -> StepLeader:
    """On process 0: open the channel on `host` and wait for every other process to connect."""
    followers = jax.process_count() - 1
    server = socket.create_server((host, 0))
    try:
        port, token = _publish(server.getsockname()[1], secrets.token_bytes(16))
        mine = fingerprint(cfg, params)
        deadline = time.monotonic() + timeout
        conns: dict[int, socket.socket] = {}
        while len(conns) < followers:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                raise ChannelError(f"{followers - len(conns)} of {followers} followers did not connect "
                                   f"within {timeout:.0f} s") from None
            conn.settimeout(30)
            try:
                hello = _recv(conn)
            except (OSError, pickle.UnpicklingError, ValueError, EOFError):
                hello = None
            if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == token):
                conn.close()  # not one of ours
                continue
            _, index, theirs = hello
            if theirs != mine:
                _send(conn, f"process {index} loaded a different model or mesh than process 0")
                conn.close()
                raise ChannelError(f"process {index} loaded a different model or mesh than process 0")
            _send(conn, "ok")
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns[index] = conn
        log.info("step channel: %d followers connected", followers)
        return StepLeader([conns[i] for i in sorted(conns)])
    finally:
        server.close()


# --- the other processes ---------------------------------------------------------------------


def connect(host: str, cfg: Config, params: Params, timeout: float = 300.0) -> socket.socket:
    """On a follower: connect to process 0's channel (its port comes from the broadcast)."""
    port, token = _publish()
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise ChannelError(f"cannot reach process 0's step channel at {host}:{port}") from None
            time.sleep(0.2)
    _send(sock, (token, jax.process_index(), fingerprint(cfg, params)))
    answer = _recv(sock)
    if answer != "ok":
        raise ChannelError(answer or "process 0 closed the step channel")
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Follower:
    """A follower's replay state: its engine state, and the row states process 0 still names."""

    def __init__(self, cfg: Config, params: Params):
        self._own = {"P": params, "C": cfg, "M": params.mesh}
        self.state: steps.EngineState | None = None
        self.handles: dict[int, jax.Array] = {}
        self.calls = 0
        self._numbered = 0

    def replay(self, msg) -> None:
        """Make one call process 0 described (a step that fails here failed there too: same
        program, same inputs; process 0 then starts over with `init_state`, replayed like the rest)."""
        released, name, args, kwargs = msg
        for n in released:
            self.handles.pop(n, None)
        if name not in REPLAYED:
            raise ChannelError(f"process 0 asked for an unknown step {name!r}")
        self._own["S"] = self.state
        try:
            out = getattr(steps, name)(*_decode(args, self._own, self.handles), **_decode(kwargs, self._own, self.handles))
        except Exception:
            log.exception("replayed step %s failed", name)
            return
        self.calls += 1
        new = _new_state(out)
        self.state = self.state if new is None else new
        if name in KEPT:
            for leaf in jax.tree_util.tree_leaves(KEPT[name](out)):
                self.handles[self._numbered] = leaf
                self._numbered += 1

    def run(self, sock: socket.socket) -> int:
        """Replay until process 0 says stop (0) or the channel breaks (1); closes `sock`."""
        try:
            while True:
                msg = _recv(sock)
                if msg is None:
                    log.error("process 0 closed the step channel without a stop")
                    return 1
                if msg[0] == _STOP:
                    for n in msg[1]:
                        self.handles.pop(n, None)
                    break
                self.replay(msg)
            if self.state is not None:
                jax.block_until_ready(self.state)  # the last steps complete before this process leaves
            log.info("follower: replayed %d steps; process 0 stopped", self.calls)
            return 0
        finally:
            sock.close()


def follow(cfg: Config, params: Params, sock: socket.socket) -> int:
    """Replay process 0's steps on this process until it says stop (0) or the channel breaks (1)."""
    return Follower(cfg, params).run(sock)
