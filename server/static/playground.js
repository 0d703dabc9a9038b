// gptserve playground: streams POST /v1/completions (SSE over fetch) and shows, for every
// generated token, its probability (shading) and the model's top alternatives (popup). With a
// JSON schema the request carries response_format json_schema, and the alternatives are those of
// the masked distribution: only tokens the schema allows, renormalised.
// Plain browser JavaScript, no dependencies. The API key lives in `apiKey` only: it is never
// written to localStorage, sessionStorage or a cookie.
"use strict";

(() => {
  const TOP_N = 5; // alternatives requested per token (the server allows up to 20)
  const FIELDS = ["prompt", "temperature", "top_p", "top_k", "max_tokens", "json_schema", "api_key"];
  const PARAM_FIELDS = { response_format: "json_schema" }; // request fields shown at another form field
  const NUMBER_FIELDS = ["temperature", "top_p", "top_k", "max_tokens"];

  const $ = (id) => document.getElementById(id);
  const form = $("controls");
  const runButton = $("run");
  const stopButton = $("stop");
  const statusEl = $("status");
  const promptEcho = $("output-prompt");
  const tokensEl = $("output-tokens");
  const popup = $("popup");

  let apiKey = "";        // read from the key field at each run; memory only
  let modelId = null;     // the first id of GET /v1/models
  let controller = null;  // AbortController of the running request
  let tokens = [];        // [{offset, p, top, token, span}] of the current completion
  let text = "";          // the completion's text so far
  let pinned = null;      // the token span whose popup was opened by click/tap
  let constrained = false; // the current completion follows a JSON schema

  /** An OpenAI-shaped error: {message, type, param, code} plus the HTTP status. */
  class ApiError extends Error {
    constructor(error, status) {
      super(error.message || "request failed");
      this.param = error.param || null;
      this.code = error.code || null;
      this.status = status;
    }
  }

  function authHeaders() {
    return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  }

  async function errorFrom(resp) {
    let body = null;
    try {
      body = await resp.json();
    } catch (_) {
      // not JSON: fall through to a generic message
    }
    if (body && body.error) return new ApiError(body.error, resp.status);
    return new ApiError({ message: `HTTP ${resp.status} ${resp.statusText}`.trim() }, resp.status);
  }

  async function fetchModel(signal) {
    const resp = await fetch("/v1/models", { headers: authHeaders(), signal });
    if (!resp.ok) throw await errorFrom(resp);
    const body = await resp.json();
    if (!body.data || !body.data.length) throw new ApiError({ message: "the server lists no model" });
    modelId = body.data[0].id;
    $("model-name").textContent = modelId;
    return modelId;
  }

  // ---- errors next to their fields ----------------------------------------------------------

  function setError(field, message) {
    const el = $(`err-${field}`) || $("err-general");
    el.textContent = message;
    el.hidden = false;
    const input = $(field);
    if (input && el.id !== "err-general") input.setAttribute("aria-invalid", "true");
  }

  function clearErrors() {
    for (const field of FIELDS.concat("general")) {
      const el = $(`err-${field}`);
      el.hidden = true;
      el.textContent = "";
      const input = $(field);
      if (input) input.removeAttribute("aria-invalid");
    }
  }

  function showError(err) {
    if (err instanceof ApiError) {
      if (err.status === 401 || err.code === "invalid_api_key") {
        setError("api_key", `API key rejected: ${err.message}`);
        setStatus("not authorized");
        return;
      }
      const param = PARAM_FIELDS[err.param] || err.param;
      const field = FIELDS.includes(param) ? param : "general";
      const where = field === "general" && err.param ? ` (${err.param})` : "";
      const prefix = err.status ? `${err.status}: ` : "";
      setError(field, field === "general" ? `${prefix}${err.message}${where}` : err.message);
      setStatus(field === "general" ? "request failed" : `check ${labelOf(field)}`);
      return;
    }
    setError("general", `Could not reach the server: ${err.message}`);
    setStatus("request failed");
  }

  function labelOf(field) {
    const label = document.querySelector(`label[for="${field}"]`);
    return label ? label.firstChild.textContent.trim().toLowerCase() : field;
  }

  // ---- request -------------------------------------------------------------------------------

  /** The request body from the form; null (with field errors shown) if a number is unreadable. */
  function buildBody() {
    const body = {
      prompt: $("prompt").value,
      stream: true,
      logprobs: TOP_N,
    };
    let ok = true;
    for (const name of NUMBER_FIELDS) {
      const input = $(name);
      if (input.validity.badInput) {
        setError(name, "Enter a number.");
        ok = false;
        continue;
      }
      const raw = input.value.trim();
      if (raw !== "") body[name] = Number(raw);
    }
    const schemaText = $("json_schema").value.trim();
    if (schemaText !== "") {
      let schema;
      try {
        schema = JSON.parse(schemaText);
      } catch (err) {
        setError("json_schema", `Not valid JSON: ${err.message}`);
        return null;
      }
      if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
        setError("json_schema", "A JSON schema is an object, such as {\"type\": \"object\"}.");
        return null;
      }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    }
    return ok ? body : null;
  }

  /** For a constrained run: whether the completion parses as JSON. */
  function jsonVerdict() {
    try {
      JSON.parse(text);
      return " · valid JSON";
    } catch (_) {
      return " · not complete JSON";
    }
  }

  function setStatus(message) {
    statusEl.textContent = message;
  }

  function setRunning(running) {
    runButton.disabled = running;
    stopButton.disabled = !running;
    form.setAttribute("aria-busy", running ? "true" : "false");
  }

  async function run(event) {
    event.preventDefault();
    if (controller) return;
    clearErrors();
    const body = buildBody();
    if (!body) return;
    apiKey = $("api_key").value.trim();
    resetOutput(body.prompt);
    constrained = Boolean(body.response_format);
    controller = new AbortController();
    const { signal } = controller;
    const started = performance.now();
    setRunning(true);
    setStatus("starting…");
    let finish = null;
    try {
      body.model = modelId || (await fetchModel(signal));
      const resp = await fetch("/v1/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
        body: JSON.stringify(body),
        signal,
      });
      if (!resp.ok) throw await errorFrom(resp);
      finish = await readStream(resp, signal);
      const secs = (performance.now() - started) / 1000;
      const rate = tokens.length && secs > 0 ? ` · ${(tokens.length / secs).toFixed(1)} tok/s` : "";
      const verdict = constrained ? jsonVerdict() : "";
      setStatus(`done (${finish || "no finish reason"}) · ${tokens.length} tokens · ${secs.toFixed(1)} s${rate}${verdict}`);
    } catch (err) {
      if (signal.aborted) {
        setStatus(`stopped after ${tokens.length} tokens`);
      } else {
        showError(err);
      }
    } finally {
      controller = null;
      setRunning(false);
    }
  }

  function stop() {
    if (controller) controller.abort();
  }

  /** Read server-sent events until [DONE]; returns the finish reason. */
  async function readStream(resp, signal) {
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    const boundary = /\r?\n\r?\n/;
    let buffer = "";
    let finish = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (signal.aborted) throw new DOMException("stopped", "AbortError");
      if (done) throw new ApiError({ message: "the stream ended before [DONE]" });
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
          return finish;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error, null);
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        addChunk(choice);
        if (choice.finish_reason) finish = choice.finish_reason;
        setStatus(`generating… ${tokens.length} tokens`);
      }
    }
  }

  // ---- tokens --------------------------------------------------------------------------------

  function resetOutput(prompt) {
    hidePopup(true);
    tokens = [];
    text = "";
    tokensEl.replaceChildren();
    promptEcho.textContent = prompt;
  }

  /** Append one streamed choice: its text, and one shaded span per token with logprobs. */
  function addChunk(choice) {
    const lp = choice.logprobs;
    const firstDirty = Math.max(0, tokens.length - 1);
    text += choice.text || "";
    if (!lp || !lp.tokens) {
      if (choice.text) tokensEl.append(document.createTextNode(choice.text));
      return;
    }
    for (let i = 0; i < lp.tokens.length; i++) {
      const logprob = lp.token_logprobs[i];
      const span = document.createElement("span");
      span.className = "tok";
      span.tabIndex = tokens.length === 0 ? 0 : -1; // roving tabindex: arrow keys move between tokens
      span.dataset.index = String(tokens.length);
      const p = logprob == null ? null : Math.exp(logprob);
      span.style.setProperty("--p", p == null ? "0.5" : String(p));
      tokens.push({ offset: lp.text_offset[i], p, top: lp.top_logprobs[i] || {}, token: lp.tokens[i], span });
      tokensEl.append(span);
    }
    // A token's text runs from its offset to the next token's; the last one may still grow.
    for (let i = firstDirty; i < tokens.length; i++) {
      const end = i + 1 < tokens.length ? tokens[i + 1].offset : text.length;
      const piece = text.slice(tokens[i].offset, end);
      tokens[i].span.textContent = piece;
      tokens[i].span.classList.toggle("nl", piece.includes("\n")); // shows a ↵ to hover
    }
  }

  function visible(token) {
    return token.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
  }

  function fmtPct(p) {
    const v = p * 100;
    if (v >= 1) return `${v.toFixed(1)}%`;
    if (v >= 0.01) return `${v.toFixed(2)}%`;
    return v > 0 ? "<0.01%" : "0%";
  }

  function altRow(token, p, chosen) {
    const li = document.createElement("li");
    li.className = chosen ? "alt is-chosen" : "alt";
    const name = document.createElement("span");
    name.className = "alt-token";
    name.textContent = visible(token);
    name.title = token;
    const track = document.createElement("span");
    track.className = "bar-track";
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.display = "block";
    bar.style.width = `${Math.min(100, p * 100).toFixed(2)}%`;
    track.append(bar);
    const pct = document.createElement("span");
    pct.className = "alt-pct";
    pct.textContent = fmtPct(p);
    li.append(name, track, pct);
    li.setAttribute("aria-label", `${JSON.stringify(token)}: ${fmtPct(p)}${chosen ? " (chosen)" : ""}`);
    return li;
  }

  function fillPopup(tok) {
    const head = document.createElement("h3");
    const chosen = document.createElement("span");
    chosen.className = "chosen";
    chosen.textContent = visible(tok.token);
    head.append("Chose ", chosen, tok.p == null ? "" : ` · ${fmtPct(tok.p)}`);
    const alts = Object.entries(tok.top)
      .map(([t, lp]) => [t, Math.exp(lp)])
      .sort((a, b) => b[1] - a[1]);
    popup.replaceChildren(head);
    if (constrained) {
      const note = document.createElement("p");
      note.className = "masked";
      note.textContent = "Masked by the JSON schema: only allowed tokens, renormalised.";
      popup.append(note);
    }
    if (!alts.length) {
      const none = document.createElement("p");
      none.className = "none";
      none.textContent = "no alternatives were returned";
      popup.append(none);
      return;
    }
    const list = document.createElement("ol");
    list.setAttribute("aria-label", "Top alternatives");
    for (const [t, p] of alts) list.append(altRow(t, p, t === tok.token));
    if (tok.p != null && !alts.some(([t]) => t === tok.token)) list.append(altRow(tok.token, tok.p, true));
    popup.append(list);
  }

  function showPopup(span) {
    const tok = tokens[Number(span.dataset.index)];
    if (!tok) return;
    for (const t of tokens) t.span.classList.remove("active");
    span.classList.add("active");
    fillPopup(tok);
    popup.hidden = false;
    span.setAttribute("aria-describedby", "popup");
    const r = span.getBoundingClientRect();
    const w = popup.offsetWidth;
    const h = popup.offsetHeight;
    const left = Math.max(8, Math.min(r.left, document.documentElement.clientWidth - w - 8));
    const below = r.bottom + 6;
    const top = below + h > window.innerHeight && r.top - h - 6 > 0 ? r.top - h - 6 : below;
    popup.style.left = `${left + window.scrollX}px`;
    popup.style.top = `${top + window.scrollY}px`;
  }

  function hidePopup(force) {
    if (pinned && !force) return;
    pinned = null;
    popup.hidden = true;
    for (const t of tokens) {
      t.span.classList.remove("active");
      t.span.removeAttribute("aria-describedby");
    }
  }

  const tokenOf = (el) => (el instanceof Element ? el.closest(".tok") : null);

  tokensEl.addEventListener("mouseover", (e) => {
    const span = tokenOf(e.target);
    if (span && !pinned) showPopup(span);
  });
  tokensEl.addEventListener("mouseout", (e) => {
    if (tokenOf(e.target) && !tokenOf(e.relatedTarget)) hidePopup(false);
  });
  tokensEl.addEventListener("click", (e) => {
    const span = tokenOf(e.target);
    if (!span) return;
    if (pinned === span) {
      hidePopup(true);
      return;
    }
    pinned = span;
    showPopup(span);
  });
  tokensEl.addEventListener("focusin", (e) => {
    const span = tokenOf(e.target);
    if (span) showPopup(span);
  });
  tokensEl.addEventListener("focusout", (e) => {
    if (!tokenOf(e.relatedTarget)) hidePopup(true);
  });
  tokensEl.addEventListener("keydown", (e) => {
    const span = tokenOf(e.target);
    if (!span) return;
    const i = Number(span.dataset.index);
    const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tokens.length - 1 }[e.key];
    if (next !== undefined && tokens[next]) {
      e.preventDefault();
      span.tabIndex = -1;
      tokens[next].span.tabIndex = 0;
      pinned = null;
      tokens[next].span.focus();
    } else if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      span.click();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") hidePopup(true);
  });
  document.addEventListener("click", (e) => {
    if (pinned && !tokenOf(e.target) && !popup.contains(e.target)) hidePopup(true);
  });

  // ---- wiring --------------------------------------------------------------------------------

  form.addEventListener("submit", run);
  stopButton.addEventListener("click", stop);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
  });
  for (const field of FIELDS) {
    $(field).addEventListener("input", () => {
      const el = $(`err-${field}`);
      el.hidden = true;
      $(field).removeAttribute("aria-invalid");
    });
  }
  $("api_key").addEventListener("change", () => {
    modelId = null; // look the model up again with the new key
  });
  // Show the model name when the server needs no key; failures here are silent.
  fetchModel(undefined).catch(() => {
    $("model-name").textContent = "(enter the API key and run)";
  });
})();
