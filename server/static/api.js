// The server's HTTP API as the playground uses it: the API key, OpenAI-shaped errors, the served
// models (the base and its LoRA adapters) and the one requests name, and server-sent events read
// over fetch (EventSource cannot POST or send a key).
// The API key lives in `apiKey` only: it is never written to localStorage, sessionStorage or a
// cookie.

let apiKey = ""; // set from the key field before each request; memory only
let models = null; // GET /v1/models's list, looked up again when the key changes
let chosen = null; // the id requests name: the model select's (the first listed until then)
let onModels = () => {};

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
  if (key !== apiKey) models = null;
  apiKey = key;
}

/** `listener(models, chosen)` runs each time the list of models is learned (the header's model
 * select shows it): GET /v1/models's entries (a LoRA adapter has its base as `parent`). */
export function setModelsListener(listener) {
  onModels = listener;
}

/** Requests name `id` from now on (one of the listed models). */
export function chooseModel(id) {
  chosen = id;
}

/** Ask GET /v1/models again (adapters may have been loaded or unloaded since). */
export function forgetModels() {
  models = null;
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

/** The model requests name: the chosen one, among those GET /v1/models lists with the current
 * key (asked once per key); the first listed (the base) while none is chosen or it is gone. */
export async function modelFor(signal) {
  if (models && models.some((m) => m.id === chosen)) return chosen;
  const resp = await fetch("/v1/models", { headers: authHeaders(), signal });
  if (!resp.ok) throw await errorFrom(resp);
  const body = await resp.json();
  if (!body.data || !body.data.length) throw new ApiError({ message: "the server lists no model" });
  models = body.data;
  if (!models.some((m) => m.id === chosen)) chosen = models[0].id;
  onModels(models, chosen);
  return chosen;
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
