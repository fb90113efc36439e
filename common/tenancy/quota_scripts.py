"""The edge's quota scripts: what Redis runs, atomically, for rate limits and leases.

Rate limits (``common.tenancy.quota``) are GCRA steps; ``max_concurrent``
(``common.tenancy.concurrency``) is a sorted set of leases. A request that is
subject to both takes them in **one** script, ``ADMIT``, so one round trip admits it
at the edge: the lease is counted first (a request refused for being one too many
takes nothing from its rates), then the rates are stepped (a request over a rate
takes no lease), all or nothing. The steps are Lua functions shared by the scripts,
so a limit is the same arithmetic whichever script runs it.

Time is Redis's TIME, so every replica reads one clock (no skew between hosts):
µs for the rate limits, ms for lease expiries.
"""

from __future__ import annotations

from common.tenancy.script_batch import Script

REDIS_NOW_US = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""

# GCRA over ``keys[1..count]``, one per limit, all or nothing: a request refused by
# one limit takes nothing from the other. TATs are stored as integer µs strings with
# a PX expiry at the TAT: an idle tenant's keys vanish. Per limit, ``argv`` holds
# interval, tolerance (burst × interval), cost, the caller's *floor* (how far ahead
# of now its own copy of the TAT is) and whether to *force* it. The floor raises a
# missing TAT (a Redis that restarted empty gives no fresh burst) and, forced, a
# stored one that missed what the caller admitted in process while Redis was down.
# Returns the reply, per limit the wait (0: conforms) and the TAT − now that
# results, and whether any limit was over.
GCRA_FUNCTION = """
local function gcra(keys, argv, count, now)
  local tats, reply, over = {}, {}, false
  for i = 1, count do
    local interval = tonumber(argv[5 * i - 4])
    local tolerance = tonumber(argv[5 * i - 3])
    local cost = tonumber(argv[5 * i - 2])
    local stored = tonumber(redis.call('GET', keys[i]))
    local tat = math.max(stored or now, now)
    if stored == nil or argv[5 * i] == '1' then
      tat = math.max(tat, now + tonumber(argv[5 * i - 1]))
    end
    tats[i] = tat + cost * interval
    local wait = tats[i] - tolerance - now
    if wait > 0 then
      reply[2 * i - 1] = math.ceil(wait)
      over = true
    else
      reply[2 * i - 1] = 0
    end
    reply[2 * i] = math.floor(tat - now)
  end
  if not over then
    for i = 1, count do
      local ttl = math.max(1, math.ceil((tats[i] - now) / 1000))
      redis.call('SET', keys[i], string.format('%.0f', tats[i]), 'PX', ttl)
      reply[2 * i] = math.floor(tats[i] - now)
    end
  end
  return reply, over
end
"""

# A request's rate limits alone: KEYS one per limit, ARGV five per limit (above).
GCRA = Script(REDIS_NOW_US + GCRA_FUNCTION + "return (gcra(KEYS, ARGV, #KEYS, now))\n")

# Settling a request's tokens on its real count: move the TAT by the difference
# (ARGV[1], µs, negative for a refund), without any conformance check (the request
# was already served). The caller's floor and force (ARGV[2], ARGV[3]) work as in
# GCRA, so a settlement is never how a restarted Redis hands out a fresh burst. A
# refund stops at now: a full bucket, never more than its burst. Replies with
# TAT − now that results (0: full, the key removed).
SETTLE = Script(
    REDIS_NOW_US
    + """
local stored = tonumber(redis.call('GET', KEYS[1]))
local tat = math.max(stored or now, now)
if stored == nil or ARGV[3] == '1' then
  tat = math.max(tat, now + tonumber(ARGV[2]))
end
tat = tat + tonumber(ARGV[1])
if tat <= now then
  redis.call('DEL', KEYS[1])
  return {0}
end
local ttl = math.max(1, math.ceil((tat - now) / 1000))
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', ttl)
return {math.floor(tat - now)}
"""
)

# A tenant's leases: a sorted set of lease ids scored by expiry (ms). From
# ``argv[first]`` on: the new lease, the cap, the TTL (ms), then leases this replica
# released whose removal may not have landed yet (so its own release is seen at
# once). ``leases_held`` drops expired and released leases and counts the rest;
# ``lease_add`` adds the new one.
LEASE_FUNCTIONS = """
local function leases_held(key, argv, first, now_ms)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  for i = first + 3, #argv do redis.call('ZREM', key, argv[i]) end
  return redis.call('ZCARD', key)
end
local function lease_add(key, argv, first, now_ms)
  redis.call('ZADD', key, now_ms + tonumber(argv[first + 2]), argv[first])
  redis.call('PEXPIRE', key, argv[first + 2])
end
"""

# A lease and the request's rate limits in one step. KEYS: the rate limits' (none or
# more, as GCRA), then the tenant's leases. ARGV: five per rate limit (as GCRA), then
# the lease's (as LEASE_FUNCTIONS). Reply: {outcome, leases held, then GCRA's reply};
# outcome 1: admitted (the lease added, the rates stepped); 0: refused at the cap
# (nothing else looked at or taken); 2: refused by a rate limit (no lease added, no
# rate stepped).
OVER_CAP = 0
ADMIT = Script(
    REDIS_NOW_US
    + GCRA_FUNCTION
    + LEASE_FUNCTIONS
    + """
local rates = #KEYS - 1
local first = 5 * rates + 1
local key = KEYS[rates + 1]
local now_ms = math.floor(now / 1000)
local held = leases_held(key, ARGV, first, now_ms)
if held >= tonumber(ARGV[first + 1]) then return {0, held} end
local reply, over = gcra(KEYS, ARGV, rates, now)
if over then
  table.insert(reply, 1, held)
  table.insert(reply, 1, 2)
  return reply
end
lease_add(key, ARGV, first, now_ms)
table.insert(reply, 1, held + 1)
table.insert(reply, 1, 1)
return reply
"""
)

# KEYS[1]: the tenant's leases. ARGV: the TTL (ms), how many released leases follow,
# those, then the live ones, added back (after a Redis restart) or renewed.
# Reply: {held}.
SYNC = Script(
    REDIS_NOW_US
    + """
local now_ms = math.floor(now / 1000)
local key, ttl, gone = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, 2 + gone do redis.call('ZREM', key, ARGV[i]) end
for i = 3 + gone, #ARGV do redis.call('ZADD', key, now_ms + ttl, ARGV[i]) end
if #ARGV > 2 + gone then redis.call('PEXPIRE', key, ttl) end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
return {redis.call('ZCARD', key)}
"""
)

# Every script the edge's quotas run, loaded when it starts (``QuotaRedis.warm``).
EDGE_SCRIPTS = (GCRA, SETTLE, ADMIT, SYNC)
