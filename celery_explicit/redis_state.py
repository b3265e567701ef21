"""Where the contracts keep their state in Redis: one key prefix, one client per process.

Dedup marks, delivery counts, ordering, downstream limits and execution leases live in
the Redis named by ``EXPLICIT_REDIS_URL`` (by default the broker, when it is Redis).
Locks take their client from the caller and message leases the broker's; every key we
write starts with ``EXPLICIT_KEY_PREFIX`` (default ``explicit:``), so an operator finds
everything under it. Lua goes through ``celery_explicit.redis_scripts``.

A prefork pool child runs one job at a time, and each job makes its few calls (the
execution lease's acquire and release) one after another. There the client keeps one
connection of its own (``OneConnection``) instead of taking one from redis-py's pool and
giving it back on every call, which costs about 15-20 µs of CPU a call (the pool's
locking and its connection metrics; docs/performance.md).
Everywhere else (the worker's main process extending leases, a threads or
gevent pool, a web process) jobs and threads call concurrently, and the pooled client
stays: one shared connection would make them wait for each other's round trips.
Pipelines take their connection from the pool either way.

**Behind Sentinel.** ``EXPLICIT_REDIS_URL`` (or the broker's URL) in Celery's Sentinel
form, ``sentinel://host:26379;sentinel://host2:26379/0``, with the master's name in the
URL (``?master_name=mymaster``) or, for the broker's URL, in Celery's
``broker_transport_options["master_name"]``: the client asks the Sentinels for the
primary (redis-py's ``SentinelConnectionPool``) and asks again when a connection to it
fails, so after a failover the next command reaches the promoted replica. A password
in the URL is the primary's; ``sentinel_kwargs`` in the transport options go to the
Sentinels, as kombu passes them.

**On a Redis Cluster.** ``redis+cluster://host:7000,host2:7001``: redis-py's cluster
client. Our keys carry hash tags (the job's task id, the lock's or entity's name), so
a script's keys share a slot; the function library is loaded on every primary.
"""

from __future__ import annotations

import os
import select
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel, SentinelConnectionPool

from celery_explicit.conf import settings

_clients: dict[tuple[str, int], Any] = {}
_clients_lock = threading.Lock()
#: The pid of a prefork pool child (``worker_process_init``): there, one connection each.
_one_job_at_a_time_in: int | None = None


def prefix() -> str:
    """``EXPLICIT_KEY_PREFIX``: the head of every key we write."""
    return settings.key_prefix


class OneConnection(redis.Redis):
    """A client keeping one connection, which it checks before each command.

    redis-py's pool looks at a connection's socket before handing it out: readable
    while no command is in flight means the server closed it (a restart, an idle
    timeout, a proxy) or a reply was left unread, and the pool connects again. A plain
    ``single_connection_client`` does not, and its ``from_url`` default retries nothing,
    so the first command after a restart would fail (the job's execution lease would be
    skipped). The same look is taken here, one ``poll`` with no wait; a command is
    never retried, because a script like the lease's acquire is not safe to run twice.
    """

    def execute_command(self, *args: Any, **options: Any) -> Any:
        with self.single_connection_lock:  # reentrant: the command takes it again
            sock = self.connection._sock if self.connection is not None else None
            if sock is not None:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                if poller.poll(0):
                    self.connection.disconnect()
                    sock = None
            if sock is None and self.connection is not None:
                # Connected here, not by the command: redis-py's send connects without
                # calling connect(), which a Sentinel-managed connection overrides to
                # ask the Sentinels where the primary is now.
                self.connection.connect()  # type: ignore[no-untyped-call]
            return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def client() -> Any:
    """The Redis client for ``EXPLICIT_REDIS_URL``, one per URL and process."""
    url, pid = settings.redis_url, os.getpid()
    # Keyed by pid: a client made before a fork is not the child's (a kept connection's
    # socket would be shared with the parent).
    found = _clients.get((url, pid))
    if found is not None:
        return found
    with _clients_lock:
        if (url, pid) not in _clients:
            _clients[(url, pid)] = new_client(
                url,
                keep_one=_one_job_at_a_time_in == pid,
                options=settings.celery_app().conf.broker_transport_options or {},
            )
        return _clients[(url, pid)]


def new_client(url: str, *, keep_one: bool, options: Mapping[str, Any] | None = None) -> Any:
    """A client for ``url``: ``OneConnection`` when ``keep_one``, else redis-py's pooled
    one. Timeouts: the worker's main loop extends leases with this client, and a Redis
    that stops answering must not stall it. ``options``: Celery's transport options
    for a ``sentinel://`` URL (``master_name``, ``sentinel_kwargs``)."""
    timeouts = {"socket_timeout": 5, "socket_connect_timeout": 5}
    if url.startswith(CLUSTER_SCHEMES):
        return cluster_client(url, **timeouts)
    if url.startswith("sentinel://"):
        target = SentinelTarget.parse(url, options or {})
        pool = target.pool(**timeouts)
        if keep_one:
            return OneConnection(connection_pool=pool, single_connection_client=True)
        return redis.Redis(connection_pool=pool)
    if keep_one:
        return OneConnection.from_url(url, single_connection_client=True, **timeouts)
    return redis.Redis.from_url(url, **timeouts)


#: A Redis Cluster: ``redis+cluster://[user:password@]host:port[,host:port...]`` (and
#: ``rediss+cluster://`` for TLS); redis-py has no URL form of its own for one.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def cluster_client(url: str, **connection: Any) -> Any:
    """redis-py's cluster client for a ``redis+cluster://`` URL: it learns the slots
    from the nodes given and follows them as they move. Every key of one job, lock or
    entity shares a hash tag, so each of our scripts touches one slot."""
    parsed = urllib.parse.urlsplit(url)
    hosts = parsed.netloc.rpartition("@")[2]
    nodes = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "6379")
        nodes.append(ClusterNode(name, int(port or 6379)))  # type: ignore[no-untyped-call]
    if not nodes:
        raise ValueError(f"{url!r} names no cluster node: redis+cluster://host:port[,...]")
    if parsed.path.strip("/") not in ("", "0"):
        raise ValueError(f"{url!r}: a Redis Cluster has database 0 only")
    return RedisCluster(
        startup_nodes=nodes,
        username=urllib.parse.unquote(parsed.username) if parsed.username else None,
        password=urllib.parse.unquote(parsed.password) if parsed.password else None,
        ssl=parsed.scheme.startswith("rediss"),
        **connection,
    )


@dataclass(frozen=True)
class SentinelTarget:
    """A primary named ``master_name`` that ``sentinels`` watch, as Celery's URL says."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    password: str | None = None
    username: str | None = None
    sentinel_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str, options: Mapping[str, Any]) -> SentinelTarget:
        """``sentinel://[user:password@]host:port[/db][?master_name=name]``, several
        joined by ``;``; the name from ``options`` when the URL has none. Raises
        ``ValueError`` naming what is missing."""
        sentinels: list[tuple[str, int]] = []
        db, password, username = 0, None, None
        names: set[str] = set()
        for part in filter(None, (p.strip() for p in url.split(";"))):
            parsed = urllib.parse.urlsplit(part)
            if parsed.scheme != "sentinel" or not parsed.hostname:
                raise ValueError(f"{part!r} is not a sentinel://host:port URL")
            sentinels.append((parsed.hostname, parsed.port or 26379))
            if parsed.path.strip("/"):
                db = int(parsed.path.strip("/"))
            password = parsed.password or password
            username = parsed.username or username
            names.update(urllib.parse.parse_qs(parsed.query).get("master_name", []))
        if not names and options.get("master_name"):
            names.add(str(options["master_name"]))
        if len(names) != 1:
            raise ValueError(
                "a sentinel:// URL needs one master name: add ?master_name=<name> to the "
                "URL (or broker_transport_options['master_name'] for the broker's), got "
                f"{sorted(names) or 'none'}"
            )
        return cls(
            sentinels=tuple(sentinels),
            master_name=names.pop(),
            db=db,
            password=urllib.parse.unquote(password) if password else None,
            username=urllib.parse.unquote(username) if username else None,
            sentinel_kwargs=dict(options.get("sentinel_kwargs") or {}),
        )

    def pool(self, **connection: Any) -> SentinelConnectionPool:
        # redis-py types these constructors in some releases and not in others (8.2
        # typed Sentinel's): called through Any, one line checks under every release
        # the matrix runs, where a "type: ignore" is unused in half of them.
        sentinel_class: Any = Sentinel
        pool_class: Any = SentinelConnectionPool
        sentinel = sentinel_class(
            list(self.sentinels), sentinel_kwargs={**connection, **self.sentinel_kwargs}
        )
        pool: SentinelConnectionPool = pool_class(
            self.master_name,
            sentinel,
            is_master=True,
            db=self.db,
            password=self.password,
            username=self.username,
            **connection,
        )
        return pool


def one_job_at_a_time(**_: Any) -> None:
    """``worker_process_init``: this process is a prefork pool child, which runs one job
    at a time; its clients keep one connection each (see the module's docstring)."""
    global _one_job_at_a_time_in
    pid = os.getpid()
    with _clients_lock:
        _one_job_at_a_time_in = pid
        _clients.clear()  # made before the signal (here or in the parent): pooled


def text(value: Any) -> str:
    """A Redis reply (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def untag(name: str) -> str:
    """A name as it was given, from a key part written as a hash tag (``{name}``)."""
    return name[1:-1] if name.startswith("{") and name.endswith("}") else name


def live_strings(
    client: Any, head: str, *, also: str | None = None
) -> Iterator[tuple[str, str, int, str | None]]:
    """(name after ``head``, value, milliseconds left, the string at ``also`` + the
    same name or None) of each string key under ``head`` that still has a TTL: SCAN,
    not KEYS; keys released between SCAN and the read are skipped. The reads of one key
    are one MULTI, so ``also`` is read as it was beside that value (a lock's fence
    counter, which shares its hash tag). What ``manage.py explicit_locks`` and
    ``explicit_leases`` list."""
    for raw_key in client.scan_iter(match=f"{head}*", count=500, _type="STRING"):
        key = text(raw_key)
        name = key[len(head) :]
        pipe = client.pipeline(transaction=True)
        pipe.get(key)
        pipe.pttl(key)
        if also is not None:
            pipe.get(f"{also}{name}")
        value, ttl_ms, *companion = pipe.execute()
        if value is None or int(ttl_ms) < 0:
            continue
        beside = text(companion[0]) if companion and companion[0] is not None else None
        yield untag(name), text(value), int(ttl_ms), beside
