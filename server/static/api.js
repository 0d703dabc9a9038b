// The server's HTTP API as the playground uses it: the API key, OpenAI-shaped errors, the served
// model's id, and server-sent events read over fetch (EventSource cannot POST or send a key).
// The API key lives in `apiKey` only: it is never written to localStorage, sessionStorage or a
// cookie.

let apiKey = ""; // set from the key field before each request; memory only
let modelId = null; // the first id of GET /v1/models, looked up again when the key changes
let onModel = () => {};

/** An OpenAI-shaped error: {message, type, param, code} plus the HTTP status (null mid-stream). */
export class ApiError extends Error {
  constructor(error, status) {
    super(error.message || "request failed");
    this.param = error.param || null;
    this.code = error.code || null;
    this.status = status;
  }
}

export function setApiKey(key) {
  if (key !== apiKey) modelId = null;
  apiKey = key;
}

/** `listener(id)` runs each time the model id is learned (the header shows it). */
export function setModelListener(listener) {
  onModel = listener;
}

function authHeaders() {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

async function errorFrom(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    // not JSON (a proxy's page, say): the status line is all there is
  }
  if (body && body.error) return new ApiError(body.error, resp.status);
  return new ApiError({ message: `HTTP ${resp.status} ${resp.statusText}`.trim() }, resp.status);
}

/** The served model's id: remembered, or asked of GET /v1/models with the current key. */
export async function modelFor(signal) {
  if (modelId) return modelId;
  const resp = await fetch("/v1/models", { headers: authHeaders(), signal });
  if (!resp.ok) throw await errorFrom(resp);
  const body = await resp.json();
  if (!body.data || !body.data.length) throw new ApiError({ message: "the server lists no model" });
  modelId = body.data[0].id;
  onModel(modelId);
  return modelId;
}

/**
 * POST `body` to `path` and call `onChunk(chunk)` for each JSON chunk of its event stream until
 * [DONE]. An HTTP error or an error event mid-stream throws an ApiError; an aborted `signal`
 * throws an AbortError.
 */
export async function streamPost(path, body, signal, onChunk) {
  const resp = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await errorFrom(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  const boundary = /\r?\n\r?\n/;
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (signal.aborted) throw new DOMException("stopped", "AbortError");
    if (done) throw new ApiError({ message: "the stream ended before [DONE]" }, null);
    buffer += value;
    let match;
    while ((match = boundary.exec(buffer)) !== null) {
      const raw = buffer.slice(0, match.index);
      buffer = buffer.slice(match.index + match[0].length);
      const data = raw
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a comment or keep-alive
      if (data === "[DONE]") {
        reader.cancel().catch(() => {});
        return;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error, null);
      onChunk(chunk);
    }
  }
}
