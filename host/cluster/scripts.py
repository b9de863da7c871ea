"""The cluster index's changes that must be atomic, as Lua scripts run inside Redis.

Each script takes the key prefix as ARGV[1] and builds the keys store.Keys spells (the
helper functions below). Times come from Redis (`TIME`), so that nodes, the scheduler and
the gateway never compare clocks of different machines.

    heartbeat  a node's capacity, usage and liveness, and its sandboxes: `full` replaces the
               node's sandbox set with the list sent, `delta` applies changes since the
               node's last accepted heartbeat, and is refused ({0}) unless the index holds
               that node's full list (its sync token): after a FLUSHALL, or once the node
               was declared dead, the node sends everything again at once. Accepted: {1,
               disowned ids...}: paused sandboxes the node reported that are bound to
               another node (taken over while this one was dead); the node forgets them
    sweep      declares nodes whose liveness key expired dead (their running sandboxes
               become `lost`, everything of theirs expires after the retention time) and
               forgets nodes whose hash is gone; returns {node id, sandboxes lost} pairs
    reserve    holds a place on a node for a sandbox being created (refused if the node is
               not ready, or would pass its sandbox limit with the places already held)
    bind       binds a sandbox to a node (moving it off another), releases its placement
    unbind     removes a binding, if it still names that node
    set_state  the state of a binding, if it still names that node
"""

from __future__ import annotations

_KEYS = """
local P = ARGV[1]
local function node_key(id) return P .. 'node:' .. id end
local function alive_key(id) return P .. 'node:' .. id .. ':alive' end
local function set_key(id) return P .. 'node:' .. id .. ':sandboxes' end
local function placing_key(id) return P .. 'node:' .. id .. ':placing' end
local function sandbox_key(id) return P .. 'sandbox:' .. id end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# ARGV: prefix, node id, alive ms, mode (full|delta), sync token, fields (JSON object),
# upserts (JSON object sandbox id -> state), removals (JSON array of sandbox ids)
HEARTBEAT = _KEYS + """
local id, mode, token = ARGV[2], ARGV[4], ARGV[5]
local node, members = node_key(id), set_key(id)
if mode == 'delta' and redis.call('HGET', node, 'syncToken') ~= token then
  return {0}
end
local now = now_ms()
local args = {}
for k, v in pairs(cjson.decode(ARGV[6])) do
  args[#args + 1] = k
  args[#args + 1] = tostring(v)
end
redis.call('HSET', node, 'lastHeartbeatMs', now, unpack(args))
redis.call('HDEL', node, 'deadAtMs')
redis.call('PERSIST', node)
redis.call('SADD', P .. 'nodes', id)
redis.call('SET', alive_key(id), now, 'PX', ARGV[3])
local upserts = cjson.decode(ARGV[7])
if mode == 'full' then
  for _, sid in ipairs(redis.call('SMEMBERS', members)) do
    if upserts[sid] == nil then
      if redis.call('HGET', sandbox_key(sid), 'node') == id then
        redis.call('DEL', sandbox_key(sid))
      end
      redis.call('SREM', members, sid)
    end
  end
  redis.call('HSET', node, 'syncToken', token)
end
local disowned = {1}
for sid, state in pairs(upserts) do
  local b = sandbox_key(sid)
  local old = redis.call('HGET', b, 'node')
  if old and old ~= id and state == 'paused' then
    -- bound to another node, which took it over: a paused copy never takes it back
    disowned[#disowned + 1] = sid
    redis.call('SREM', members, sid)
  else
    if old and old ~= id then redis.call('SREM', set_key(old), sid) end
    redis.call('HSET', b, 'node', id, 'state', state)
    redis.call('HDEL', b, 'lostAtMs')
    redis.call('PERSIST', b)
    redis.call('SADD', members, sid)
  end
end
for _, sid in ipairs(cjson.decode(ARGV[8])) do
  if redis.call('HGET', sandbox_key(sid), 'node') == id then
    redis.call('DEL', sandbox_key(sid))
  end
  redis.call('SREM', members, sid)
end
redis.call('PERSIST', members)
return disowned
"""

# ARGV: prefix, retention ms (dead nodes and lost sandboxes)
SWEEP = _KEYS + """
local keep = tonumber(ARGV[2])
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', P .. 'nodes')) do
  local node = node_key(id)
  local state = redis.call('HGET', node, 'state')
  if not state then
    redis.call('SREM', P .. 'nodes', id)
  elseif state ~= 'dead' and redis.call('EXISTS', alive_key(id)) == 0 then
    local now = now_ms()
    redis.call('HSET', node, 'state', 'dead', 'deadAtMs', now)
    redis.call('HDEL', node, 'syncToken')
    local lost = 0
    for _, sid in ipairs(redis.call('SMEMBERS', set_key(id))) do
      local b = sandbox_key(sid)
      if redis.call('HGET', b, 'node') == id then
        if redis.call('HGET', b, 'state') == 'running' then
          redis.call('HSET', b, 'state', 'lost', 'lostAtMs', now)
          lost = lost + 1
        end
        redis.call('PEXPIRE', b, keep)
      end
    end
    redis.call('PEXPIRE', set_key(id), keep)
    redis.call('PEXPIRE', node, keep)
    redis.call('DEL', placing_key(id))
    redis.call('DEL', P .. 'node:' .. id .. ':memory', P .. 'node:' .. id .. ':layers')  -- --p2p
    out[#out + 1] = id
    out[#out + 1] = lost
  end
end
return out
"""

# ARGV: prefix, node id, placement id, ttl ms
RESERVE = _KEYS + """
local id = ARGV[2]
local node, placing = node_key(id), placing_key(id)
if redis.call('EXISTS', alive_key(id)) == 0 or redis.call('HGET', node, 'state') ~= 'ready' then
  return 0
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', placing, '-inf', now)
local max = tonumber(redis.call('HGET', node, 'maxSandboxes') or '0') or 0
if max > 0 then
  local used = tonumber(redis.call('HGET', node, 'usedSandboxes') or '0') or 0
  if used + redis.call('ZCARD', placing) >= max then return 0 end
end
redis.call('ZADD', placing, now + tonumber(ARGV[4]), ARGV[3])
redis.call('PEXPIRE', placing, tonumber(ARGV[4]))
return 1
"""

# ARGV: prefix, sandbox id, node id, state, placement id ('' for none), used delta
BIND = _KEYS + """
local sid, id = ARGV[2], ARGV[3]
local b = sandbox_key(sid)
local old = redis.call('HGET', b, 'node')
if old and old ~= id then redis.call('SREM', set_key(old), sid) end
redis.call('HSET', b, 'node', id, 'state', ARGV[4])
redis.call('HDEL', b, 'lostAtMs')
redis.call('PERSIST', b)
redis.call('SADD', set_key(id), sid)
if ARGV[5] ~= '' then redis.call('ZREM', placing_key(id), ARGV[5]) end
local delta = tonumber(ARGV[6])
if delta ~= 0 and redis.call('EXISTS', node_key(id)) == 1 then
  redis.call('HINCRBY', node_key(id), 'usedSandboxes', delta)
end
return 1
"""

# ARGV: prefix, sandbox id, node id
UNBIND = _KEYS + """
local sid, id = ARGV[2], ARGV[3]
if redis.call('HGET', sandbox_key(sid), 'node') == id then
  redis.call('DEL', sandbox_key(sid))
end
redis.call('SREM', set_key(id), sid)
return 1
"""

# ARGV: prefix, sandbox id, node id, state
SET_STATE = _KEYS + """
if redis.call('HGET', sandbox_key(ARGV[2]), 'node') == ARGV[3] then
  redis.call('HSET', sandbox_key(ARGV[2]), 'state', ARGV[4])
  return 1
end
return 0
"""

SCRIPTS: dict[str, str] = {
    "heartbeat": HEARTBEAT, "sweep": SWEEP, "reserve": RESERVE, "bind": BIND,
    "unbind": UNBIND, "set_state": SET_STATE,
}
