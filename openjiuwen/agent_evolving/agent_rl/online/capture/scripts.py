"""The capture hooks' Redis transitions as Lua scripts: each one decision and its writes in ONE round trip
(CONTRACT §5.1, §5.3).

The hooks carry every captured completion, so their transitions are the service's hottest Redis traffic. As
WATCH → MGET → MULTI/EXEC each cost three round trips (four with the Task read before it); a script reads, decides
and writes inside Redis, atomically, in one EVALSHA. The scripts write exactly what the Python transactions they
replace wrote: the bytes to store (capture metadata, staged sample, event `data`) are encoded in Python and passed
in, so Lua only compares and copies them. A script answers a status code (and what the caller needs to decide or
to raise the domain error it used to raise); `TaskRegistry` maps it. Each keeps the invariants of CONTRACT §5.4 named
on it.

Task identity: the hook path validates against a Task's immutable fields (`TaskRegistry.task_facts`, possibly from
this process's memory). Every script that acts on such facts is given the Task's `created_at` and answers TASK_CHANGED,
writing nothing, when the record is another Task now (an id reused after its record expired); existence and the
live `status` are always read here, never taken from memory.

redis-py's `AsyncScript` sends EVALSHA and loads the script on NOSCRIPT (a restarted or flushed Redis), then retries.
Every key a script touches is in its KEYS. The timeline's XADD (`*` id, a non-deterministic command) is each
script's last write, so the script also replicates verbatim where effects replication is not the default
(Redis before 7).
"""

from __future__ import annotations

from redis.asyncio import Redis

from ...common.wire.task_states import TaskStatus
from .. import events
from ..tasks.task_records import CaptureStatus

# Reply codes (first element of every reply). The scripts take them, and the status values they compare, by
# substitution, so that a value is spelled once (here, or in the status enums).
NOT_FOUND = 0  # no Task record
TASK_CHANGED = 1  # the record is another Task than the caller's facts: [1, record]
DONE = 2  # the transition was written
CAPTURE_EXISTS = 3  # reserve: the capture already exists: [3, metadata] (the caller decides: idempotent or conflict)
INACTIVE = 4  # reserve: the Task is not active
TURN_CLOSED = 5  # reserve (delayed): the turn is closed or has a publish state
TURN_CLOSING = 6  # reserve (delayed): the current turn has a successor waiting
TURN_WAITING = 7  # reserve (delayed): another turn already waits: [7, transition, current]
PUBLISH_CURRENT = 8  # reserve (delayed): the current turn must be published first: [8, current]
STATE = 9  # commit: not written; the capture as stored and whether the Task is active: [9, metadata|nil, 0|1]
NO_CAPTURE = 10  # discard: unknown capture or inactive Task (a no-op)
COMMITTED = 11  # discard: the capture is committed
OTHER_TURN = 12  # discard: the capture belongs to another turn

# Shared prologue. KEYS[1] is always the Task record. `task_status(identity)` answers the live status, or returns
# NOT_FOUND / TASK_CHANGED from the script; identity "" skips the identity check.
_PROLOGUE = """
local function task_status(identity)
  local raw = redis.call('GET', KEYS[1])
  if not raw then return nil, {%(NOT_FOUND)d} end
  local record = cjson.decode(raw)
  if identity ~= '' and record['created_at'] ~= identity then return nil, {%(TASK_CHANGED)d, raw} end
  return record['status'], nil
end
local function event(stream, event_type, at, data)
  redis.call('XADD', stream, 'MAXLEN', '~', %(MAXLEN)d, '*', 'type', event_type, 'at', at, 'data', data)
end
""" % {"NOT_FOUND": NOT_FOUND, "TASK_CHANGED": TASK_CHANGED, "MAXLEN": events.MAXLEN}

# Reserve an open capture (CONTRACT §4.2 before; §4.3 steps 1-2 in delayed mode).
# Invariant 2: the metadata, the `captures` set and the open set change together (with the `capture_reserved`
# event). Invariant 7: a closed turn (closed set or any publish state) never accepts a capture; `turn:current` is
# only set here when unset, and otherwise moves only through `advance_turn` after its predecessor is published.
# KEYS: task, capture, captures, open, events, [turn:current, turn:transition, turns:closed, turn:{u}:publish]
# ARGV: identity, capture_id, turn ('' = none), metadata, event at, event data, delayed ('1' / '0')
RESERVE = _PROLOGUE + """
local status, answer = task_status(ARGV[1])
if answer then return answer end
local existing = redis.call('GET', KEYS[2])
if existing then return {%(CAPTURE_EXISTS)d, existing} end
if status ~= '%(ACTIVE)s' then return {%(INACTIVE)d} end
local turn = ARGV[3]
local set_current = false
if ARGV[7] == '1' then
  if redis.call('SISMEMBER', KEYS[8], turn) == 1 or redis.call('EXISTS', KEYS[9]) == 1 then
    return {%(TURN_CLOSED)d}
  end
  local current = redis.call('GET', KEYS[6])
  local transition = redis.call('GET', KEYS[7])
  if not current then
    set_current = true
  elseif current == turn then
    if transition then return {%(TURN_CLOSING)d} end
  else
    if transition and transition ~= turn then return {%(TURN_WAITING)d, transition, current} end
    if not transition then redis.call('SET', KEYS[7], turn) end
    return {%(PUBLISH_CURRENT)d, current}
  end
end
if set_current then redis.call('SET', KEYS[6], turn) end
redis.call('SET', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[2])
event(KEYS[5], 'capture_reserved', ARGV[5], ARGV[6])
return {%(DONE)d}
""" % {"CAPTURE_EXISTS": CAPTURE_EXISTS, "INACTIVE": INACTIVE, "ACTIVE": TaskStatus.ACTIVE.value, "TURN_CLOSED": TURN_CLOSED,
       "TURN_CLOSING": TURN_CLOSING, "TURN_WAITING": TURN_WAITING, "PUBLISH_CURRENT": PUBLISH_CURRENT, "DONE": DONE}

# open → committed (CONTRACT §4.2 after). The caller decided from `expected`, the capture metadata as it read or
# wrote it (its `created_at` is in the staged sample's `completion_latency_ms`, encoded in Python): the writes
# happen only while the capture is still exactly `expected` and the Task active, which is what WATCH guarded
# before. Otherwise nothing is written and the capture as stored comes back for the caller to decide again.
# Invariants 2 and 3: the capture leaves the open set, joins the committed (and turn) set and gains its staged
# sample at once, with the `capture_committed` event.
# KEYS: task, capture, staged, open, committed, events, [turn:{u}:captures]
# ARGV: identity, expected ('' = only read), committed metadata, staged sample, capture_id, event at, event data
COMMIT = _PROLOGUE + """
local status, answer = task_status(ARGV[1])
if answer then return answer end
local raw = redis.call('GET', KEYS[2])
local active = 0
if status == '%(ACTIVE)s' then active = 1 end
if ARGV[2] == '' or raw ~= ARGV[2] or active == 0 then return {%(STATE)d, raw, active} end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4])
redis.call('SREM', KEYS[4], ARGV[5])
redis.call('SADD', KEYS[5], ARGV[5])
if KEYS[7] then redis.call('SADD', KEYS[7], ARGV[5]) end
event(KEYS[6], 'capture_committed', ARGV[6], ARGV[7])
return {%(DONE)d}
""" % {"STATE": STATE, "DONE": DONE, "ACTIVE": TaskStatus.ACTIVE.value}

# Drop an open capture (CONTRACT §4.2 discard): unknown capture or inactive Task is a no-op; a committed capture or
# another turn's is a conflict. Invariant 2 as in RESERVE: metadata and both memberships go together, with the
# `capture_discarded` event.
# KEYS: task, capture, captures, open, events
# ARGV: turn ('' = none), capture_id, event at, event data
DISCARD = _PROLOGUE + """
local status, answer = task_status('')
if answer then return answer end
local raw = redis.call('GET', KEYS[2])
if not raw or status ~= '%(ACTIVE)s' then return {%(NO_CAPTURE)d} end
local meta = cjson.decode(raw)
if meta['status'] == '%(COMMITTED_STATUS)s' then return {%(COMMITTED)d} end
local turn = meta['agent_turn_id']
if turn == cjson.null or turn == nil then turn = '' end
if turn ~= ARGV[1] then return {%(OTHER_TURN)d} end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
redis.call('SREM', KEYS[4], ARGV[2])
event(KEYS[5], 'capture_discarded', ARGV[3], ARGV[4])
return {%(DONE)d}
""" % {"NO_CAPTURE": NO_CAPTURE, "COMMITTED": COMMITTED, "OTHER_TURN": OTHER_TURN, "DONE": DONE,
       "ACTIVE": TaskStatus.ACTIVE.value, "COMMITTED_STATUS": CaptureStatus.COMMITTED.value}


class CaptureScripts:
    """The three scripts registered on one client (EVALSHA, loaded on NOSCRIPT)."""

    def __init__(self, redis: Redis) -> None:
        self.reserve = redis.register_script(RESERVE)
        self.commit = redis.register_script(COMMIT)
        self.discard = redis.register_script(DISCARD)
