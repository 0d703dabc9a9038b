// The completion tab: streams POST /v1/completions for a raw prompt (no chat template). With a
// JSON schema the request carries response_format json_schema, and the alternatives shown are
// those of the masked distribution: only tokens the schema allows, renormalised.
import { modelFor, setApiKey, streamPost } from "./api.js";
import { FieldErrors } from "./fields.js";
import { TokenRun, hideAlternatives, watchTokens } from "./tokens.js";

const TOP_N = 5; // alternatives requested per token (the server allows up to 20)
const NUMBERS = { temperature: "temperature", top_p: "top_p", top_k: "top_k", max_tokens: "max_tokens" };

const $ = (id) => document.getElementById(id);

export function initCompletion() {
  const form = $("controls");
  const runButton = $("run");
  const stopButton = $("stop");
  const statusEl = $("status");
  const tokensEl = $("output-tokens");
  const setStatus = (message) => {
    statusEl.textContent = message;
  };
  const errors = new FieldErrors({
    fields: ["prompt", ...Object.values(NUMBERS), "json_schema", "api_key"],
    general: "err-general",
    params: { response_format: "json_schema" },
    setStatus,
  });
  let controller = null; // AbortController of the running request
  let run = new TokenRun(tokensEl);

  /** The request body from the form; null (with field errors shown) if a field is unreadable. */
  function buildBody() {
    const body = { prompt: $("prompt").value, stream: true, logprobs: TOP_N };
    if (!errors.readNumbers(body, NUMBERS)) return null;
    const schemaText = $("json_schema").value.trim();
    if (schemaText === "") return body;
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (err) {
      errors.set("json_schema", `Not valid JSON: ${err.message}`);
      return null;
    }
    if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
      errors.set("json_schema", 'A JSON schema is an object, such as {"type": "object"}.');
      return null;
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    return body;
  }

  /** For a constrained run: whether the completion parses as JSON. */
  function jsonVerdict() {
    try {
      JSON.parse(run.text);
      return " · valid JSON";
    } catch (_) {
      return " · not complete JSON";
    }
  }

  function setRunning(running) {
    runButton.disabled = running;
    stopButton.disabled = !running;
    form.setAttribute("aria-busy", running ? "true" : "false");
  }

  /** Append one streamed choice: its text, and one shaded span per token with logprobs. */
  function addChoice(choice) {
    const lp = choice.logprobs;
    const entries = [];
    for (let i = 0; lp && lp.tokens && i < lp.tokens.length; i++) {
      const logprob = lp.token_logprobs[i];
      entries.push({
        offset: lp.text_offset[i],
        token: lp.tokens[i],
        p: logprob == null ? null : Math.exp(logprob),
        top: Object.entries(lp.top_logprobs[i] || {}).map(([t, l]) => [t, Math.exp(l)]),
      });
    }
    run.append(choice.text || "", entries);
  }

  async function start(event) {
    event.preventDefault();
    if (controller) return;
    errors.clear();
    const body = buildBody();
    if (!body) return;
    setApiKey($("api_key").value.trim());
    hideAlternatives(true);
    tokensEl.replaceChildren();
    $("output-prompt").textContent = body.prompt;
    run = new TokenRun(tokensEl, { masked: Boolean(body.response_format) });
    controller = new AbortController();
    const { signal } = controller;
    const started = performance.now();
    setRunning(true);
    setStatus("starting…");
    let finish = null;
    try {
      body.model = await modelFor(signal);
      await streamPost("/v1/completions", body, signal, (chunk) => {
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        addChoice(choice);
        if (choice.finish_reason) finish = choice.finish_reason;
        setStatus(`generating… ${run.tokens.length} tokens`);
      });
      const n = run.tokens.length;
      const secs = (performance.now() - started) / 1000;
      const rate = n && secs > 0 ? ` · ${(n / secs).toFixed(1)} tok/s` : "";
      const verdict = run.masked ? jsonVerdict() : "";
      setStatus(`done (${finish || "no finish reason"}) · ${n} tokens · ${secs.toFixed(1)} s${rate}${verdict}`);
    } catch (err) {
      if (signal.aborted) {
        setStatus(`stopped after ${run.tokens.length} tokens`);
      } else {
        errors.show(err);
      }
    } finally {
      controller = null;
      setRunning(false);
    }
  }

  form.addEventListener("submit", start);
  stopButton.addEventListener("click", () => controller && controller.abort());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
  });
  watchTokens(tokensEl);
}
