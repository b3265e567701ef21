"""The Lua scripts of ``cache.versioned``, registered with ``celery_explicit.redis_scripts``.

Each script changes an entity's keys together on one Redis (a read-compare-write that
two readers, or a reader and a bump, must not interleave). The header of each states its
contract: ``KEYS``, ``ARGV`` and what it returns. They run the way every Lua script of
the package runs (``redis_scripts.call``: a function of the loaded library, or a script
where the server has no functions), on the django-redis client the cache resolves at
the call.
"""

from __future__ import annotations

from typing import Any

from celery_explicit.redis_scripts import Script, call

__all__ = ["BUMP", "FILL", "FILL_WITH_CLAIM", "READ_OR_CLAIM", "run_script"]


def run_script(client: Any, script: Script, keys: list[str], args: list[Any]) -> Any:
    """``script`` on ``client``: one round trip; reloaded where the server lost it."""
    return call(client, script, keys, args)


# --- the scripts -------------------------------------------------------------------------

# Versions are compared as decimal strings (shorter is older, then byte order): exact for
# any size, where Lua's tonumber() rounds above 2^53. Python writes them canonically.
_OLDER = """
local function older(a, b)
    return #a < #b or (#a == #b and a < b)
end
"""

# VersionedCache: store a pair read from the source after a miss.
# KEYS[1] - the pair: the cache's encoding of (version, value)
# KEYS[2] - the version key (<identity>:ver)
# ARGV[1] - the version the source returned (decimal)
# ARGV[2] - the pair, encoded by the cache's serializer
# ARGV[3] - the pair's ttl in milliseconds
# return {1 if stored else 0, the version held before (false if none)}: stored, and the
#   version key set to ARGV[1], only if that version was not newer
FILL = Script(
    "cache_fill",
    _OLDER
    + """
local current = redis.call('get', KEYS[2])
if current and older(ARGV[1], current) then
    return {0, current}
end
redis.call('set', KEYS[2], ARGV[1])
redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, current}
""",
)

# VersionedCache: after a commit, move the entity forward to the committed version.
# KEYS[1] - the pair
# KEYS[2] - the version key
# ARGV[1] - the committed version
# return the version held before (false if none); if that was older, or none, the
#   version key now holds ARGV[1] and the pair, of an older version, is deleted
BUMP = Script(
    "cache_bump",
    _OLDER
    + """
local current = redis.call('get', KEYS[2])
if current and not older(current, ARGV[1]) then
    return current
end
redis.call('set', KEYS[2], ARGV[1])
redis.call('del', KEYS[1])
return current
""",
)

# CacheAside: after a plain GET missed, read again or take the fill claim.
# KEYS[1] - the value
# KEYS[2] - the fill claim (``<identity>:lease``)
# ARGV[1] - a new claim token
# ARGV[2] - the claim's ttl in milliseconds
# return {value, 0} if it is cached by now, {false, 1} when this reader got the claim,
#   {false, 0} when another reader holds it (read the source, do not fill)
READ_OR_CLAIM = Script(
    "cache_read_or_claim",
    """
local value = redis.call('get', KEYS[1])
if value then
    return {value, 0}
end
if redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return {false, 1}
end
return {false, 0}
""",
)

# CacheAside: store the value read from the source, if the claim was not invalidated.
# KEYS[1] - the value
# KEYS[2] - the fill claim (``<identity>:lease``)
# ARGV[1] - the claim token this reader got
# ARGV[2] - the value, encoded by the cache's serializer
# ARGV[3] - the value's ttl in milliseconds
# return 1 if stored (the claim was still this reader's), otherwise 0
FILL_WITH_CLAIM = Script(
    "cache_fill_with_claim",
    """
if redis.call('get', KEYS[2]) ~= ARGV[1] then
    return 0
end
redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('del', KEYS[2])
return 1
""",
)
