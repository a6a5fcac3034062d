-- Kept streams (guards.stores._kept): a resumable stream's events, one list per stream, and
-- names pointing at streams. One key per call (on Redis Cluster: that key's slot). Sent with
-- EVAL (its text is small); ARGV[1] names the operation. Every key written gets its TTL.
local op = ARGV[1]
local key = KEYS[1]
if op == 'append' then
  -- ARGV[2]: the list's length expected now; ARGV[3]: TTL in ms; ARGV[4..]: the items.
  if redis.call('LLEN', key) ~= tonumber(ARGV[2]) then
    return {0}
  end
  for i = 4, #ARGV, 1000 do
    redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
  redis.call('PEXPIRE', key, ARGV[3])
  return {1}
elseif op == 'read' then
  -- ARGV[2]: the first index; ARGV[3]: how many. {} when there is no list, else
  -- {length, items...}.
  local length = redis.call('LLEN', key)
  if length == 0 then
    return {}
  end
  local first = tonumber(ARGV[2])
  local items = redis.call('LRANGE', key, first, first + tonumber(ARGV[3]) - 1)
  table.insert(items, 1, length)
  return items
elseif op == 'set' then
  redis.call('SET', key, ARGV[2], 'PX', ARGV[3])
  return {}
elseif op == 'get' then
  local value = redis.call('GET', key)
  if value then
    return {value}
  end
  return {}
end
return redis.error_reply('unknown kept operation')
