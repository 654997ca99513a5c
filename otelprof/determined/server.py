"""The bridge's OTLP gRPC receiver (metrics and traces services of opentelemetry-proto).

Before anything is parsed a request must show a bearer token (`ingest_auth.py`), fit the
size limit and be admitted (bytes in flight, requests per credential, so one producer's
flood waits for its own share); only resources of trials in the token's scope go on. Each
refusal is counted (`BridgeServer.stats()`) and answered with the OTLP status a client acts
on (UNAVAILABLE is retried, RESOURCE_EXHAUSTED not); unauthenticated, oversized and
out-of-scope senders are logged (`RefusalLog`) naming the token's line, never the token.
Requests are parsed here, not by grpcio, so a malformed one gets INVALID_ARGUMENT naming
the problem rather than an opaque INTERNAL. A request whose caller went away is dropped at
mapping's next check (`CHECK_EVERY`), counted (`refused_abandoned`) and its share given
back; nothing of it reaches a window, as it is mapped whole before aggregation. Memory per
request: docs/ARCHITECTURE.md, "Who owns what".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from otelprof.determined.ingest_auth import (
    IngestLimits,
    IngestTokens,
    NotKnownYet,
    Scope,
    ScopeChecker,
    TlsFiles,
)
from otelprof.determined.mapping import (
    CHECK_EVERY,
    Cancelled,
    Extracted,
    RouteError,
    Stop,
    attributes_dict,
    resolve_route,
    resource_items,
)
from otelprof.determined.pipeline import Pipeline

log = logging.getLogger("otelprof.determined")


@dataclass
class IngestStats:
    """Requests and points refused before they reached the pipeline, by reason (each is
    `refused_<name>` in `BridgeServer.stats()`)."""

    unauthenticated: int = 0  # no or a wrong bearer token (UNAUTHENTICATED)
    too_large: int = 0  # over max_request_bytes (RESOURCE_EXHAUSTED)
    throttled: int = 0  # the credential's share or the bytes in flight were used (UNAVAILABLE)
    unverified_trial: int = 0  # the master could not say a trial's experiment (UNAVAILABLE)
    out_of_scope_requests: int = 0  # nothing in the request was in the token's scope
    out_of_scope_points: int = 0  # points and spans for trials outside the token's scope
    abandoned: int = 0  # the caller went away (deadline, closed connection): work dropped


class _Call:
    """One request: its gRPC context and, once authenticated, its credential and scope.
    `gone()`: its caller stopped waiting (gRPC ends the call when its deadline passes or
    its connection closes, and calls back at once)."""

    credential: bytes
    scope: Scope

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self._ended = threading.Event()
        if not context.add_callback(self._ended.set):
            self._ended.set()  # it ended before the handler ran

    def gone(self) -> bool:
        if self._ended.is_set() or not self.context.is_active():
            return True
        remaining = self.context.time_remaining()
        return remaining is not None and remaining <= 0


@dataclass(frozen=True)
class _Signal:
    """One OTLP service: its messages (`module`, e.g. metrics_service_pb2), the request
    field holding the resources, the pipeline's ingest, and partial success's counter."""

    module: Any
    service: str  # e.g. MetricsService
    resources: str  # e.g. resource_metrics
    ingest: Callable[[Any, Stop], Extracted]
    rejected_field: str
    what: str  # what partial success counts, e.g. "data points"

    @functools.cached_property
    def request(self) -> Any:
        """The Export request's message class, looked up once (not per request)."""
        return getattr(self.module, f"Export{self.service}Request")


def sender_of(context: grpc.ServicerContext) -> str:
    """The sender's address without its port (`ipv4:10.0.0.5:51234` -> `10.0.0.5`)."""
    peer = context.peer() or "unknown"
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in address:
        address = address.rsplit(":", 1)[0]
    return (address or peer).strip("[]")[:64]


class RefusalLog:
    """One warning per (reason, sender, trial) per `interval_s`, with how many requests of
    that kind were refused since the last one: an operator sees who targeted what, and a
    flood of refusals cannot flood the log. Keys beyond `max_keys` push the oldest out."""

    def __init__(self, interval_s: float = 60.0, max_keys: int = 1024) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: OrderedDict[tuple[str, str, str], list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def refused(self, reason: str, sender: str, trials: str, message: str) -> None:
        key = (reason, sender, trials)
        now = time.monotonic()
        with self._lock:
            entry = self._last.get(key)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return
            since = 0 if entry is None else int(entry[1])
            self._last[key] = [now, 0]
            self._last.move_to_end(key)
            while len(self._last) > self.max_keys:
                self._last.popitem(last=False)
        more = f" ({since} more like it in the last {self.interval_s:g} s)" if since else ""
        log.warning("refused OTLP from %s: %s%s", sender, message, more)


class _Admission:
    """Bytes in flight and requests per credential: taken before parsing, given back after."""

    def __init__(self, limits: IngestLimits) -> None:
        self.limits = limits
        self.inflight_bytes = 0
        self._per_credential: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def enter(self, credential: bytes, size: int) -> str | None:
        """None when admitted, else why not."""
        with self._lock:
            if self._per_credential.get(credential, 0) >= self.limits.max_per_credential:
                return (f"this credential already has {self.limits.max_per_credential} "
                        "requests in the bridge; retry later")  # fmt: skip
            if self.inflight_bytes and self.inflight_bytes + size > self.limits.max_inflight_bytes:
                return "the bridge is busy with other requests; retry later"
            self.inflight_bytes += size
            self._per_credential[credential] = self._per_credential.get(credential, 0) + 1
            return None

    def leave(self, credential: bytes, size: int) -> None:
        with self._lock:
            self.inflight_bytes -= size
            left = self._per_credential[credential] - 1
            if left:
                self._per_credential[credential] = left
            else:
                del self._per_credential[credential]


class _HeapTrim:
    """Hands the heap memory big requests freed back to the system once none is in flight
    (glibc would keep it for reuse). Shortly after the request, on a timer thread: by then
    the handler and gRPC have let go of its bytes too, and a burst trims once. A no-op
    without glibc."""

    BIG = 1 << 20  # requests smaller than this leave no heap worth trimming
    DELAY_S = 0.2

    def __init__(self, admission: _Admission) -> None:
        self._admission = admission
        self._trim: Callable[[int], int] | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._trim = ctypes.CDLL(None).malloc_trim
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def after(self, size: int) -> None:
        if self._trim is None or size < self.BIG:
            return
        timer = threading.Timer(self.DELAY_S, self._run)
        timer.daemon = True
        with self._lock:  # the last big request's end counts: a burst trims once, after it
            if self._timer is not None:
                self._timer.cancel()
            self._timer = timer
        timer.start()

    def _run(self) -> None:
        with self._lock:
            self._timer = None
        if self._admission.inflight_bytes:
            return  # the last of those requests to end asks again
        assert self._trim is not None
        self._trim(0)


class _Receiver:
    """What both OTLP services do before mapping: authenticate, bound, admit, scope."""

    def __init__(
        self, pipeline: Pipeline, tokens: IngestTokens, scopes: ScopeChecker, limits: IngestLimits
    ) -> None:
        self.pipeline = pipeline
        self.tokens = tokens
        self.scopes = scopes
        self.limits = limits
        self.stats = IngestStats()
        self.admission = _Admission(limits)
        self.refusals = RefusalLog()
        self.heap = _HeapTrim(self.admission)
        self._stats_lock = threading.Lock()

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:  # worker threads refuse at once: no count may be lost
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def export(self, raw: bytes, context: grpc.ServicerContext, signal: _Signal) -> Extracted:
        call = _Call(context)
        if call.gone():  # it waited for a worker past its deadline
            self._abandon(context)
        found = self.tokens.scope_of(context.invocation_metadata())
        if found is None:
            self._count("unauthenticated")
            self.refusals.refused("unauthenticated", sender_of(context), "",
                                  "no valid bearer token")  # fmt: skip
            _abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "no valid bearer token: send `authorization: Bearer <token>` "
                "(OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>)",
            )
        call.credential, call.scope = found
        if len(raw) > self.limits.max_request_bytes:
            self._count("too_large")
            self.refusals.refused(
                "too_large", sender_of(context), "",
                f"a request of {len(raw)} bytes (limit {self.limits.max_request_bytes}) with "
                f"{self.tokens.describe(call.credential)}",
            )  # fmt: skip
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request of {len(raw)} bytes is over the bridge's limit of "
                f"{self.limits.max_request_bytes}; send smaller batches",
            )
        refusal = self.admission.enter(call.credential, len(raw))
        if refusal is not None:
            self._count("throttled")
            _abort(context, grpc.StatusCode.UNAVAILABLE, refusal)
        try:
            done = self._admitted(raw, call, signal)
        finally:
            self.admission.leave(call.credential, len(raw))
        if done is None:
            self._abandon(context)
        return done

    def _admitted(self, raw: bytes, call: _Call, signal: _Signal) -> Extracted | None:
        """Parse, scope and ingest an admitted request; None when its caller went away (its
        message is freed on return: no traceback holds it)."""
        try:
            message = _parse(signal.request, raw, call.context)
            message, forbidden = self._keep_in_scope(message, call, signal.resources)
            try:
                extracted = signal.ingest(message, call.gone)
            except Cancelled:
                raise
            except Exception as exc:  # a mapping bug must not take the receiver down
                log.exception("could not map an OTLP request")
                _abort(
                    call.context, grpc.StatusCode.INVALID_ARGUMENT, f"could not map request: {exc}"
                )
        except Cancelled:
            return None
        if forbidden:
            extracted.reject(forbidden[0], forbidden[1], "out_of_scope")
        return extracted

    def _abandon(self, context: grpc.ServicerContext) -> NoReturn:
        self._count("abandoned")
        _abort(context, grpc.StatusCode.CANCELLED, "the caller went away; the request was dropped")

    def _keep_in_scope(
        self, message: Any, call: _Call, field_name: str
    ) -> tuple[Any, tuple[int, str] | None]:
        """The request without the resources of trials the token may not write, and
        (points left out, why) when there were some."""
        resources, scope, context = getattr(message, field_name), call.scope, call.context
        if scope.everything:
            return message, None
        kept, refused, trials = [], 0, set()
        for i, resource in enumerate(resources):
            if i % CHECK_EVERY == 0 and call.gone():  # a master lookup per new trial may wait
                raise Cancelled
            attrs = attributes_dict(resource.resource.attributes)
            try:
                trial, _run, _agent = resolve_route(attrs, self.pipeline.route)
            except RouteError:
                kept.append(resource)  # the mapping refuses it with the reason
                continue
            try:
                allowed = self.scopes.allows(scope, trial)
            except NotKnownYet as exc:
                self._count("unverified_trial")
                _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
            if allowed:
                kept.append(resource)
            else:
                refused += resource_items(resource)
                trials.add(trial)
        if not trials:
            return message, None
        self._count("out_of_scope_points", refused)
        named = ", ".join(map(str, sorted(trials)[:20])) + (" ..." if len(trials) > 20 else "")
        why = f"this token may write into {scope.describe()}, not into trial(s) {named}"
        self.refusals.refused(
            "out_of_scope", sender_of(context), named,
            f"{refused} points/spans for trial(s) {named} with "
            f"{self.tokens.describe(call.credential)}, whose scope is {scope.describe()}",
        )  # fmt: skip
        if not kept:
            self._count("out_of_scope_requests")
            _abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
        allowed_only = type(message)()
        getattr(allowed_only, field_name).extend(kept)
        return allowed_only, (refused, why)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


def _parse(cls: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError) as exc:
        _abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"malformed OTLP {cls.DESCRIPTOR.name} ({len(raw)} bytes): {exc}",
        )


def _service(receiver: _Receiver, signal: _Signal) -> grpc.GenericRpcHandler:
    """`signal`'s Export → pipeline; data that maps to nothing is INVALID_ARGUMENT, some
    of it: partial success."""
    response_cls = getattr(signal.module, f"Export{signal.service}Response")

    def export(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            extracted = receiver.export(raw, context, signal)
        finally:  # refused or taken: what it cost the heap goes back
            receiver.heap.after(len(raw))
        response = response_cls()
        if extracted.rejected:
            errors = "; ".join(extracted.errors)[:2000]
            if not extracted.gauges and not extracted.timings:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"refused {extracted.rejected} {signal.what}: {errors}",
                )
            setattr(response.partial_success, signal.rejected_field, extracted.rejected)
            response.partial_success.error_message = errors
        return response

    return grpc.method_handlers_generic_handler(
        signal.module.DESCRIPTOR.services_by_name[signal.service].full_name,
        {
            "Export": grpc.unary_unary_rpc_method_handler(
                export,
                request_deserializer=None,  # raw bytes: parsed in _parse
                response_serializer=response_cls.SerializeToString,
            )
        },
    )


def is_loopback(listen: str) -> bool:
    """Does `host:port` listen on this machine's loopback only?"""
    host = listen.rsplit(":", 1)[0].strip("[]") if ":" in listen else listen
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: reachable from elsewhere


class BridgeServer:
    """A grpc.Server with both OTLP services bound to one listen address.

    Every request needs a bearer token of `tokens`; beyond loopback the bridge also needs
    TLS (`tls`), so tokens never cross a network in the clear.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        listen: str = "127.0.0.1:4327",
        workers: int = 8,
        *,
        tokens: IngestTokens,
        tls: TlsFiles | None = None,
        limits: IngestLimits | None = None,
    ) -> None:
        if tls is None and not is_loopback(listen):
            raise OSError(
                f"refusing to listen on {listen} without TLS: tokens would cross the network "
                "in the clear; pass --tls-cert and --tls-key (and --tls-client-ca for mutual "
                "TLS), or listen on 127.0.0.1"
            )
        self.pipeline = pipeline
        limits = limits or IngestLimits(max_per_credential=max(1, workers // 2))
        self.receiver = _Receiver(
            pipeline, tokens, ScopeChecker(pipeline.client.trial_experiment), limits
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otelprof-otlp"),
            options=[
                # gRPC refuses larger messages before they are buffered whole; the receiver
                # counts and refuses those over the configured limit itself.
                ("grpc.max_receive_message_length", limits.max_request_bytes * 2),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=workers * 4,
        )
        signals = (
            _Signal(
                metrics_service_pb2,
                "MetricsService",
                "resource_metrics",
                pipeline.ingest_metrics,
                "rejected_data_points",
                "data points",
            ),
            _Signal(
                trace_service_pb2,
                "TraceService",
                "resource_spans",
                pipeline.ingest_traces,
                "rejected_spans",
                "spans",
            ),
        )
        self._server.add_generic_rpc_handlers(tuple(_service(self.receiver, s) for s in signals))
        try:
            if tls is None:
                self.port = self._server.add_insecure_port(listen)
            else:
                self.port = self._server.add_secure_port(listen, tls.credentials())
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {listen}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {listen} (address in use or invalid)")

    def stats(self) -> dict[str, Any]:
        """The pipeline's counters plus what was refused at the door."""
        return {
            **self.pipeline.stats(),
            **{f"refused_{name}": n for name, n in asdict(self.receiver.stats).items()},
            "inflight_bytes": self.receiver.admission.inflight_bytes,
        }

    def start(self) -> None:
        self.pipeline.start()
        self._server.start()
        log.info("Determined bridge receiving OTLP gRPC on port %d", self.port)

    def stop(self, grace_s: float = 2.0, drain_timeout_s: float = 5.0) -> None:
        """Stop accepting, finish in-flight calls, close the last window, drain delivery."""
        self._server.stop(grace_s).wait(grace_s + 1)
        self.pipeline.shutdown(drain_timeout_s)
