-- kvgate's response meter: Envoy's Lua filter runs it on the response of every request
-- kvgate admitted with a body (kvgate's metadata names how to read it).
--
-- kvgate's ext_proc sees a request's headers and body but not its response: a streamed
-- answer would otherwise cost one gRPC message per chunk, and Python time that grows with
-- the answer. This script reads the response as it passes, never holding a chunk back, and
-- reports to the kvgate process that admitted the request (over the kvgate_report cluster):
--   * streams only, when the first token passes (the chunk in which the first SSE data
--     line begins: comments such as a proxy's ": ping" keep-alives, blank lines and id: or
--     event: lines carry none): POST /first/<lease> (fire and forget): the engine has
--     finished prefilling;
--   * every response, when its body has ended (a stream: at its [DONE] event, after which
--     openai-python hangs up at once, maybe before the body's end reaches Envoy): POST
--     /done/<lease> with the engine's usage
--     object (and whether it was an answer, a 2xx), also fire and forget. The response's
--     end never waits for kvgate, and the call outlives the request: a client that hangs up
--     as soon as it has the last byte cancels nothing (a call Envoy cancels costs its
--     HTTP/1.1 connection). The report may reach kvgate just after Envoy ends the
--     request's ext_proc stream: kvgate waits for it a moment before it releases the
--     request (server.REPORT_WAIT_S), and charges the reservation when none comes.
-- At the end it also publishes the usage as dynamic metadata (namespace kvgate.usage:
-- prompt_tokens, completion_tokens, total_tokens) for what runs when the stream is done: an
-- Envoy ratelimit action with hits_addend "%DYNAMIC_METADATA(kvgate.usage:total_tokens)%"
-- and apply_on_stream_done charges the real usage to kvgate's Rate Limit Service. Each
-- count is held to what the request can have used (kvgate.bound's "prompt:output", set
-- by kvgate on admission), as kvgate holds the charge it settles itself: an engine's
-- absurd count would otherwise lock the tenant out of the Rate Limit Service's limits.
-- Before the body is read, an answer (2xx) publishes as its total what kvgate charges an
-- answer it cannot meter (the bound's ":prompt:output" that follow: what kvgate
-- reserved): a client that hangs up mid-answer ends this script before its end, and Envoy
-- still runs the stream-done charge, which then spent nothing.
-- With "sse-strip" it also removes the usage-only event kvgate asked the engine for when
-- the client did not ask for it. With "sse-final" (a request for several choices) only the
-- usage-only event's usage counts: a chunk's running usage (continuous_usage_stats) counts
-- its own choice alone, and a stream cut before the usage-only event has no usage.
-- Unfinished events are held back only while stripping, and only up to the end of the
-- event, which is what an SSE client waits for anyway. The body's end also ends its last
-- event for the meter: a usage event with no blank line after it is read (and stripped),
-- provided its data is one whole JSON object (a cut-off one is no usage); any other event
-- still held then goes on, added to the body's last chunk (as kvgate's Python meter passes
-- it on: an SSE client discards half an event itself).
-- The engine's usage is the last complete "usage" object read (of an event's data, of the
-- stream, of a JSON body), as a JSON parser keeps the last of repeated keys and a later
-- count replaces an earlier one. It is reported as found: one that is no valid usage (no
-- JSON, a count that is no whole number in range) is none to kvgate, which charges the
-- answer as if none had come, never an earlier object's count (extproc/meter.py alike).
-- An event counts (the done report's "events") when any of its lines is a data line,
-- whatever id:, event: or comment lines an engine puts before it, unless its data is
-- [DONE] (the end: a token that quotes it counts). An event's usage is read from its data
-- (its data lines' values joined by LF, as an SSE client joins them: a usage object may
-- span lines; comment, id: and event: lines hold none). A UTF-8 byte order mark at the
-- stream's very start is no part of its first line (an SSE client drops it): it passes
-- on, unread.

local TAIL = 8192 -- bytes of an unfinished SSE event, or of the JSON read so far, kept
local HOLD = 4096 -- an unfinished event longer than this is no usage event: never held
local TIMEOUT_MS = 1000 -- a report kvgate has not answered by then is given up
-- A usage object is a few hundred bytes (vLLM's, token details included): only the last
-- USAGE_TRIES "usage" keys of a piece of text are read, each at most USAGE_MAX bytes, so an
-- engine that writes the key thousands of times costs a scan, not a scan per key
local USAGE_MAX, USAGE_TRIES = 4096, 4

-- The JSON object that starts at `from` (a "{"), strings honoured, within `max` bytes
-- (USAGE_MAX unless told); nil when unfinished there.
local function object_at(text, from, max)
  local depth, in_string, escaped = 0, false, false
  for i = from, math.min(#text, from + (max or USAGE_MAX)) do
    local c = string.byte(text, i)
    if in_string then
      if escaped then escaped = false
      elseif c == 92 then escaped = true
      elseif c == 34 then in_string = false end
    elseif c == 34 then in_string = true
    elseif c == 123 then depth = depth + 1
    elseif c == 125 then
      depth = depth - 1
      if depth == 0 then return string.sub(text, from, i) end
    end
  end
  return nil
end

-- The last complete "usage": {...} object in `text` (of its last USAGE_TRIES): its braces
-- balanced (one cut off by the text's end is passed over), valid or not (kvgate tells).
local function last_usage(text)
  local starts, at = {}, 1
  while true do
    local s, e = string.find(text, '"usage"%s*:%s*{', at)
    if s == nil then break end
    starts[#starts + 1] = e
    if #starts > USAGE_TRIES then table.remove(starts, 1) end
    at = e + 1
  end
  for k = #starts, 1, -1 do
    local found = object_at(text, starts[k])
    if found ~= nil then return found end
  end
  return nil
end

local function report(handle, meta, what, body)
  local headers = {
    [":method"] = "POST",
    [":path"] = "/" .. what .. "/" .. meta.lease,
    [":authority"] = "kvgate",
    ["x-envoy-original-dst-host"] = meta.report,
    ["x-kvgate-report-key"] = meta.key,
    ["content-type"] = "application/json",
  }
  handle:httpCall("kvgate_report", headers, body, TIMEOUT_MS, true) -- asynchronous
end

-- The length of the line end at `i` (SSE's line ends: LF, CRLF, and CR alone), or nil when
-- it cannot be told yet: a CR that ends `text` may be the first half of a CRLF.
local function line_end(text, i)
  local c = string.byte(text, i)
  if c == 10 then return 1 end
  if i == #text then return nil end
  return string.byte(text, i + 1) == 10 and 2 or 1
end

-- Where the next event in `text` ends: its blank line, a line end right after another (LF,
-- CRLF or CR line ends, mixed as SSE allows), and the separator's length. The scan starts
-- at `from`: the event's start, or where an earlier scan of its text left off (never the
-- LF of a CRLF; see resume_at).
local function event_end(text, from)
  local i = string.find(text, "[\r\n]", from)
  while i ~= nil do
    local first = line_end(text, i)
    if first == nil then return nil end
    local c = string.byte(text, i + first)
    if c == 10 or c == 13 then
      local second = line_end(text, i + first)
      if second == nil then return nil end
      return i, first + second
    end
    i = string.find(text, "[\r\n]", i + first)
  end
  return nil
end

-- Where the scan for an event's end goes on once more bytes follow `text`, in which none
-- was found from `pos`: a blank line the next bytes complete begins at one of its last
-- three bytes at the earliest (its first line end a CRLF, its second a CR that may be half
-- of one), so a long event of short lines is scanned once, not once a chunk. A CRLF is
-- never split there (its LF would read as a line end of its own).
local function resume_at(text, pos)
  local at = math.max(pos, #text - 2)
  if at > pos and string.byte(text, at) == 10 and string.byte(text, at - 1) == 13 then
    at = at - 1
  end
  return at
end

-- The lines an event may open with: its data, and the id, event name, retry or comment
-- lines an engine may put before it.
local FIELDS = {"data:", "id:", "event:", "retry:", ":"}
local DATA = "data:"
local DONE = "[DONE]" -- the data of the event that ends an OpenAI stream
local BOM = "\239\187\191" -- UTF-8's byte order mark: SSE drops one at a stream's start

-- The stream's first bytes: a byte order mark there is no part of its first line.
-- state.bom: the mark's bytes seen so far (nil once the stream's start is past). Returns
-- the chunk's bytes past the mark, and the mark's bytes in it (passed on, never read).
local function skip_bom(state, bytes)
  local seen = state.bom
  local n = math.min(#bytes, #BOM - seen)
  if string.sub(bytes, 1, n) ~= string.sub(BOM, seen + 1, seen + n) then
    state.bom = nil
    -- no mark after all: the bytes taken for one begin the first line (already passed on)
    state.carry, state.scan = string.sub(BOM, 1, seen), 1
    if state.strip then state.sent = seen end
    state.fresh = seen == 0
    return bytes, ""
  end
  state.bom = seen + n < #BOM and seen + n or nil
  return string.sub(bytes, n + 1), string.sub(bytes, 1, n)
end

-- Whether an event has a data line (SSE: a line that begins "data:"), a token's sign,
-- whatever id:, event: or comment lines come first: one find, none for the usual event
-- that begins with its data. `whole`: `event` begins at its start (no carry cut mid-line).
local function has_data(event, whole)
  if whole and string.sub(event, 1, 5) == DATA then return true end
  return string.find(event, "[\r\n]data:") ~= nil
end

-- Whether a stream's chunk (not empty) begins a data line, the first token's sign:
-- comments (keep-alive pings), blank lines, and id, event or retry lines carry none.
-- `fresh`: the chunk starts a line. A data line cut by the chunk's end counts from its
-- first byte ("d"): the chunk in which it begins reports it. Run until the first token only.
local function opens_data(bytes, fresh)
  if fresh then
    local start = string.sub(bytes, 1, 5)
    if start == string.sub(DATA, 1, #start) then return true end
  end
  if string.find(bytes, "[\r\n]data:") ~= nil then return true end
  -- the chunk's last line, when it is short enough to be the start of "data:"
  for i = math.max(1, #bytes - 4), #bytes - 1 do
    local c = string.byte(bytes, i)
    if c == 10 or c == 13 then
      local rest = string.sub(bytes, i + 1)
      if rest == string.sub(DATA, 1, #rest) then return true end
    end
  end
  return false
end

-- An event's data: its data lines' values (each less one leading space) joined by LF, as
-- an SSE client joins them; what its usage and [DONE] are read from (a comment, id: or
-- event: line is none of it). The usual event, one data line, costs a find and a sub: no
-- pass over lines. `lost`: nil when `event` is whole, else whether the start its carry
-- lost had a data line: its first line, cut, is then taken as data (a long event is a long
-- data line), else as none.
local function event_data(event, lost)
  if lost == nil and string.sub(event, 1, 5) == DATA
      and string.find(event, "[\r\n]") == nil then
    return string.sub(event, string.byte(event, 6) == 32 and 7 or 6)
  end
  local values, from = {}, 1
  if lost ~= nil then
    local cut = string.find(event, "[\r\n]") or #event + 1
    if lost then values[1] = string.sub(event, 1, cut - 1) end
    from = cut
  end
  for line in string.gmatch(string.sub(event, from), "[^\r\n]+") do
    if string.sub(line, 1, 5) == DATA then
      values[#values + 1] = string.sub(line, string.byte(line, 6) == 32 and 7 or 6)
    end
  end
  return table.concat(values, "\n")
end

-- Whether an event is the end of an OpenAI stream: its data is [DONE] (an event that only
-- mentions it, a token quoting it, is not). `data`: the event's, when already read.
local function is_done(event, lost, data)
  if not string.find(event, DONE, 1, true) then return false end
  return (data or event_data(event, lost)) == DONE
end

-- The data of an event when it is one whole JSON object, else nil: only such an event is
-- read when the body's end, not a blank line, ends it (an object cut off never closes its
-- first brace).
local function whole_object(event)
  local data = event_data(event, nil)
  local from = string.match(data, "^%s*(){")
  if from == nil then return nil end
  local object = object_at(data, from, #data)
  if object == nil or string.find(data, "^%s*$", from + #object) == nil then return nil end
  return object
end

-- Whether an unfinished event may still turn out to be the usage-only event (SSE field
-- lines, its data not begun with [DONE], with no choices in it yet): only such an event is
-- held back, so a stream whose last event never gets its blank line loses nothing but that
-- event. (One that merely mentions [DONE] may be the usage event: held. Each test, once
-- failed, fails for every longer partial: what is held does not depend on the splits.)
local function may_be_usage(partial)
  local lines = string.match(partial, "^[\r\n]*(.*)$")
  local field = false
  for _, name in ipairs(FIELDS) do
    local n = math.min(#lines, #name)
    if string.sub(lines, 1, n) == string.sub(name, 1, n) then field = true break end
  end
  if not field then return false end
  if string.find(partial, DONE, 1, true)
      and string.sub(event_data(partial, nil), 1, #DONE) == DONE then
    return false
  end
  return string.find(partial, '"choices"%s*:%s*%[%s*[^%]%s]') == nil
end

-- One whole event: note its usage and count it when it is a data event with tokens;
-- true when it is the usage-only event (to strip). `lost`: nil when `event` is whole,
-- else whether the start its carry lost had a data line.
local function note_event(state, event, lost)
  local usage_only, data = false, nil
  if string.find(event, '"usage"', 1, true) then -- else its data has none either
    data = event_data(event, lost)
    if string.find(data, '"usage"', 1, true) then
      usage_only = string.find(data, '"choices"%s*:%s*%[%s*%]') ~= nil
      -- "sse-final" (n > 1): a chunk's running usage counts its own choice only
      if usage_only or not state.final then
        state.usage = last_usage(data) or state.usage
      end
    end
  end
  if not usage_only and (lost or has_data(event, lost == nil)) then
    if is_done(event, lost, data) then
      state.ended = true -- the stream's end: a client may hang up now (openai-python does)
    else
      state.events = state.events + 1
    end
  end
  return usage_only
end

-- One streamed chunk: note usage, count data events, and with `strip` drop the usage-only
-- event. Stripping holds back an unfinished event that may be the usage event at a chunk's
-- end until its end arrives (no SSE client can act on half an event, so nothing is delayed
-- for it) unless it grows past HOLD bytes: then it cannot be the small usage event and
-- goes on at once. `lead`: a byte order mark's bytes before `bytes`, passed on unread.
local function read_events(state, chunk, bytes, lead)
  local text = state.carry .. bytes
  local sent = state.sent -- leading bytes of `text` the client already has
  local out, pos = {lead}, 1
  while true do
    -- the carry was looked at up to state.scan: the first event's end is not before it
    local s, gap = event_end(text, math.max(pos, state.scan))
    if s == nil then break end
    local event = string.sub(text, pos, s - 1)
    -- an event longer than TAIL lost its start while carried: state.lost tells its data
    -- (false is an answer too: no `pos == 1 and state.lost or nil`)
    local lost = nil
    if pos == 1 then lost = state.lost end
    local usage_only = note_event(state, event, lost)
    if state.strip and not (usage_only and sent < pos) then
      out[#out + 1] = string.sub(text, math.max(pos, sent + 1), s + gap - 1)
    end
    pos = s + gap
  end
  local partial = string.sub(text, pos)
  local scan = resume_at(text, pos) - pos + 1 -- in `partial`; less what a cut takes
  if pos > 1 then state.lost = nil end
  -- its carry loses its start: note whether a data line was in it (once looked at, only
  -- this chunk's bytes and the line end before them: no rescan of the carry per chunk)
  if #partial > TAIL and not state.lost then
    local from = state.lost == nil and 1 or math.max(1, #partial - #bytes - 5)
    state.lost = has_data(string.sub(partial, from), state.lost == nil)
  end
  if not state.strip then
    state.carry = #partial > TAIL and string.sub(partial, -TAIL) or partial
    state.scan = math.max(1, scan - (#partial - #state.carry))
    return
  end
  local partial_sent = math.max(0, sent - (pos - 1))
  if #partial > HOLD or not may_be_usage(partial) then
    out[#out + 1] = string.sub(partial, partial_sent + 1)
    partial_sent = #partial
    if #partial > TAIL then
      scan = math.max(1, scan - (#partial - TAIL))
      partial, partial_sent = string.sub(partial, -TAIL), TAIL
    end
  end
  state.carry, state.sent, state.scan = partial, partial_sent, scan
  chunk:setBytes(table.concat(out))
end

-- Bytes still held back at the body's end (an unfinished event that might have been the
-- usage event: one whose blank line never came, or whose last CR might have begun a CRLF)
-- go on at the end of its last chunk: the script runs within the turn in which Envoy hands
-- that chunk to it, so the chunk has not been sent yet. After a body ended by trailers
-- (engines send none) the chunk kept may be out of the script's reach: the error is caught
-- and the bytes are lost, as before.
local function pass_on(chunk, bytes)
  pcall(function()
    local size = chunk:length()
    chunk:setBytes((size > 0 and chunk:getBytes(0, size) or "") .. bytes)
  end)
end

-- A 429 from Envoy's ratelimit filter (after kvgate admitted the request) never reached
-- an engine: it used nothing.
local NOTHING = '{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}'

local COUNTS = {"prompt_tokens", "completion_tokens", "total_tokens"}

-- The usage's counts, each held to kvgate's bound when it set one (total: the two held
-- counts' sum, or held to the two bounds' sum).
local function bounded(counts, bound)
  local prompt_max, output_max = string.match(bound or "", "^(%d+):(%d+)")
  if prompt_max == nil then return counts end
  prompt_max, output_max = tonumber(prompt_max), tonumber(output_max)
  local prompt, output = tonumber(counts.prompt_tokens), tonumber(counts.completion_tokens)
  local total = tonumber(counts.total_tokens)
  if prompt ~= nil then prompt = math.min(prompt, prompt_max) end
  if output ~= nil then output = math.min(output, output_max) end
  if prompt ~= nil and output ~= nil then
    total = prompt + output
  elseif total ~= nil then
    total = math.min(total, prompt_max + output_max)
  end
  local held = {}
  for name, n in pairs({prompt_tokens = prompt, completion_tokens = output,
                        total_tokens = total}) do
    held[name] = string.format("%d", n)
  end
  return held
end

local function publish(handle, usage)
  if usage == nil then return end
  local info = handle:streamInfo():dynamicMetadata()
  local counts = {}
  for _, name in ipairs(COUNTS) do
    counts[name] = string.match(usage, '"' .. name .. '"%s*:%s*(%d+)')
  end
  local bound = info:get("kvgate.bound")
  counts = bounded(counts, bound and bound.usage)
  for _, name in ipairs(COUNTS) do
    if counts[name] ~= nil then info:set("kvgate.usage", name, counts[name]) end
  end
end

-- What kvgate charges an answer it cannot meter, published as the total until the real
-- usage replaces it (publish): a client that leaves mid-answer is charged it too, as
-- kvgate charges it (its prompt before a stream's first token, then its reservation).
local function provisional(handle, tokens)
  handle:streamInfo():dynamicMetadata():set("kvgate.usage", "total_tokens",
                                            string.format("%d", tokens))
end

-- kvgate's reservation, from kvgate.bound's usage ("prompt_max:output_max:prompt:output"):
-- the prompt and the output cap, or nil without one.
local function reserved(handle)
  local bound = handle:streamInfo():dynamicMetadata():get("kvgate.bound")
  local prompt, output = string.match(bound and bound.usage or "", "^%d+:%d+:(%d+):(%d+)$")
  if prompt == nil then return nil end
  return tonumber(prompt), tonumber(output)
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get("kvgate")
  if meta == nil or meta.meter == nil or meta.meter == "" then return end
  -- a streamed request answered with JSON (an engine's error) is read as JSON; a media
  -- type is case-insensitive
  local sse = string.find(string.lower(handle:headers():get("content-type") or ""),
                          "text/event-stream", 1, true) ~= nil
  -- a compressed answer (a proxy's: kvgate asks engines for none) cannot be read or
  -- stripped: it passes untouched, charged its reservation
  local encoding = handle:headers():get("content-encoding") or "identity"
  local readable = encoding == "identity"
  local stream = meta.meter ~= "json" and sse
  local status = handle:headers():get(":status") or ""
  local limited = status == "429" and handle:headers():get("x-envoy-ratelimited") ~= nil
  -- an engine's answer (2xx): one with no usage kvgate could read is charged its reservation
  local answered = string.sub(status, 1, 1) == "2"
  -- fresh: the next chunk starts a line (while the first token is to come); scan: where in
  -- the carry the search for its event's end goes on
  local state = {carry = "", sent = 0, scan = 1, usage = nil, events = 0, bom = 0,
                 fresh = true, ended = false, final = meta.meter == "sse-final",
                 strip = readable and stream and meta.meter == "sse-strip"}
  if state.strip then -- the stripped body is shorter than any length the engine declared
    handle:headers():remove("content-length")
  end
  local prompt, output = reserved(handle)
  if not answered then prompt = nil end
  if prompt ~= nil then provisional(handle, stream and prompt or prompt + output) end
  local first = stream -- the first token is still to come
  local reported = false
  -- the done report, once: at the stream's [DONE] event, else at the body's end
  local function finish()
    if reported then return end
    reported = true
    if limited then state.usage = NOTHING end
    -- an answer that ended without a usage the meter could read: its reservation, as kvgate
    if prompt ~= nil and state.usage == nil then provisional(handle, prompt + output) end
    -- the usage last: an engine's object kvgate cannot parse costs only itself (reports.py)
    report(handle, meta, "done",
           '{"events":' .. state.events .. ',"answered":' .. tostring(answered) ..
           ',"usage":' .. (state.usage or "null") .. '}')
    publish(handle, state.usage)
  end
  local last = nil -- the body's last chunk (held bytes go on in it)
  for chunk in handle:bodyChunks() do
    last = chunk
    local size = chunk:length()
    local bytes = size > 0 and readable and chunk:getBytes(0, size) or nil
    local text, lead = bytes, "" -- a stream's bytes to read, past a byte order mark
    if stream and bytes ~= nil and state.bom ~= nil then
      text, lead = skip_bom(state, bytes)
    end
    -- an unreadable (compressed) stream's first chunk stands for its first token
    if first and size > 0
        and (bytes == nil or (text ~= "" and opens_data(text, state.fresh))) then
      first = false
      report(handle, meta, "first", "")
      if prompt ~= nil then provisional(handle, prompt + output) end
    elseif first and bytes ~= nil and text ~= "" then
      local last = string.byte(text, -1)
      state.fresh = last == 10 or last == 13
    end
    if bytes ~= nil then
      if stream then
        read_events(state, chunk, text, lead)
        -- a client that has [DONE] may hang up before the body's end reaches Envoy (the
        -- engine's last write): the rest of this script would then never run
        if state.ended then finish() end
      else
        -- vLLM writes fields after the usage (prompt_logprobs, prompt_text, token ids) that
        -- a client can make far longer than TAIL: read every chunk, not the body's end
        local text = state.carry .. bytes
        state.usage = last_usage(text) or state.usage
        state.carry = #text > TAIL and string.sub(text, -TAIL) or text
      end
    end
  end
  -- the body's end ends its last event: read it when whole (its start kept, its data one
  -- whole JSON object), as if its blank line had come; what stripping still holds of it
  -- goes on, unless it is the usage-only event, held whole
  local held = state.strip and string.sub(state.carry, state.sent + 1) or ""
  if stream and readable and state.carry ~= "" and state.lost == nil
      and whole_object(state.carry) ~= nil then
    if note_event(state, state.carry, nil) and state.sent == 0 then held = "" end
  end
  if held ~= "" and last ~= nil then pass_on(last, held) end
  finish()
end
