-- The fleet-store contract in Redis, for the bench's comparison baseline only
-- (see redis_lua.rs). Two scripts live in this file, split by the marker lines
-- below; each is loaded on its own and called with EVALSHA.
--
-- Keys (built by redis_lua.rs; every key of one tenant shares a {hash tag}):
--   bucket: "ankusa:{<tenant>}:b:<kind>"  value: TAT, unix µs, as an integer
--   claim:  "ankusa:{<tenant>}:c:<len(source_id)>:<source_id><key>"
--           value: "p:<hook_id>" (pending) or "c:<hook_id>" (committed)
--
-- Time is the server's (TIME), so every client sees one clock. Lua numbers are
-- doubles: unix µs (~2^51) and capacities (<= one year of µs) stay exact, but
-- tostring() would print them in exponent form, hence string.format('%.0f').

-- @@hit
-- KEYS[1..n]  the buckets to charge, in charge order
-- KEYS[n+1]   the claim key, when ARGV[2] == "1"
-- ARGV[1]     n, the number of charges
-- ARGV[2]     "1" when the hit carries a claim, "0" otherwise
-- ARGV[3]     hook_id
-- ARGV[4]     pending_ttl_ms
-- ARGV[5..]   increment_us, capacity_us for each charge
-- Returns {0} ok, {1, hook_id} duplicate, {2, ms} pending, {3, ms} rate limited.

-- Redis < 7 refuses a write after a non-deterministic command (TIME) unless
-- effects are replicated instead of the script; 7 always does that.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local n = tonumber(ARGV[1])
local has_claim = ARGV[2] == '1'
local hook_id = ARGV[3]
local pending_ttl_ms = tonumber(ARGV[4])
local claim_key = KEYS[n + 1]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- Whole ms, rounded up and never 0: a sender that waits the hint is not told
-- to wait again for the same reason (gcra::retry_ms).
local function retry_ms(us)
  local ms = math.ceil(us / 1000)
  if ms < 1 then ms = 1 end
  return ms
end

-- A replay by the hook that already holds the key pending: its first attempt
-- paid, so it is Ok again and spends nothing.
local held = nil
if has_claim then
  held = redis.call('GET', claim_key)
  if held and held == 'p:' .. hook_id then
    return {0}
  end
end

-- Every charge is evaluated before any is written: all or nothing.
local new_tats = {}
local wait_us = nil
for i = 1, n do
  local inc = tonumber(ARGV[3 + 2 * i])
  local cap = tonumber(ARGV[4 + 2 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
  if tat < now then tat = now end
  local new_tat = tat + inc
  local limit = now + cap
  if new_tat <= limit then
    new_tats[i] = new_tat
  else
    local w = new_tat - limit
    if wait_us == nil or w > wait_us then wait_us = w end
  end
end
if wait_us ~= nil then
  return {3, retry_ms(wait_us)}
end

-- A taken key spends no charge. Only a committed claim is a duplicate; a
-- pending one (another hook in flight) is told to retry when it would expire.
if has_claim then
  if held then
    if string.sub(held, 1, 2) == 'c:' then
      return {1, string.sub(held, 3)}
    end
    local pttl = redis.call('PTTL', claim_key)
    if pttl < 1 then pttl = 1 end
    return {2, pttl}
  end
  redis.call('SET', claim_key, 'p:' .. hook_id, 'PX', pending_ttl_ms)
end

-- A bucket is full again once its TAT has passed, so it need not outlive it.
for i = 1, n do
  local ttl_ms = retry_ms(new_tats[i] - now)
  redis.call('SET', KEYS[i], string.format('%.0f', new_tats[i]), 'PX', ttl_ms)
end
return {0}

-- @@settle
-- KEYS[1]  the claim key
-- ARGV[1]  "commit" or "release"
-- ARGV[2]  hook_id
-- ARGV[3]  ttl_ms (commit only)
-- Returns {0} ok, {1} not found, {2, hook_id} not owner, {3} already committed.

local held = redis.call('GET', KEYS[1])
if not held then
  return {1}
end
local phase = string.sub(held, 1, 2)
local owner = string.sub(held, 3)
if owner ~= ARGV[2] then
  return {2, owner}
end
if ARGV[1] == 'commit' then
  -- A repeated commit keeps the first commit's expiry.
  if phase == 'p:' then
    redis.call('SET', KEYS[1], 'c:' .. owner, 'PX', tonumber(ARGV[3]))
  end
  return {0}
end
if phase == 'c:' then
  return {3}
end
redis.call('DEL', KEYS[1])
return {0}
