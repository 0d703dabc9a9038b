// The chat tab: the conversation goes to POST /v1/chat/completions as `messages` (the server
// applies the model's chat template) and the answer streams into an assistant bubble, one
// shaded token at a time, each with its alternatives (`logprobs: true, top_logprobs`).
import { modelFor, setApiKey, streamPost } from "./api.js";
import { FieldErrors } from "./fields.js";
import { TokenRun, hideAlternatives, watchTokens } from "./tokens.js";

const TOP_N = 5; // alternatives requested per token (the server allows up to 20)
const NUMBERS = { temperature: "chat_temperature", max_tokens: "chat_max_tokens" };
const ROLE_NAMES = { user: "You", assistant: "Assistant", system: "System", tool: "Tool" };

const $ = (id) => document.getElementById(id);

/**
 * One message as a bubble: who speaks, then what was said. Every message on the page is drawn
 * here; a streaming answer's body is then filled by its TokenRun.
 */
export function renderMessage(message) {
  const bubble = document.createElement("article");
  bubble.className = `msg msg-${message.role}`;
  const who = document.createElement("h3");
  who.className = "msg-role";
  who.textContent = ROLE_NAMES[message.role] || message.role;
  // a reasoning model's thinking, folded above its answer (`reasoning_content`)
  const reasoning = document.createElement("details");
  reasoning.className = "msg-reasoning";
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const thought = document.createElement("div");
  thought.className = "msg-reasoning-body";
  reasoning.append(summary, thought);
  thought.textContent = message.reasoning_content || "";
  reasoning.hidden = !message.reasoning_content;
  const body = document.createElement("div");
  body.className = "msg-body";
  if (message.content) body.textContent = message.content;
  const calls = document.createElement("ul");
  calls.className = "msg-calls";
  const note = document.createElement("p");
  note.className = "msg-note";
  note.hidden = true;
  bubble.append(who, reasoning, body, calls, note);
  showToolCalls(bubble, message.tool_calls || []);
  return bubble;
}

/** The message's tool calls under its text, one `name(arguments)` line each. */
export function showToolCalls(bubble, calls) {
  const list = bubble.querySelector(".msg-calls");
  list.replaceChildren(
    ...calls.map((call) => {
      const item = document.createElement("li");
      item.textContent = `${call.function.name}(${call.function.arguments})`;
      return item;
    }),
  );
  list.hidden = !calls.length;
}

/** Streamed `delta.tool_calls` added to the calls so far (a call's first piece names it). */
function addToolCalls(calls, deltas) {
  for (const piece of deltas || []) {
    const fn = piece.function || {};
    calls[piece.index] ||= {
      id: piece.id, type: "function", function: { name: "", arguments: "" },
    };
    const call = calls[piece.index].function;
    if (fn.name) call.name = fn.name;
    if (fn.arguments) call.arguments += fn.arguments;
  }
}

export function initChat() {
  const form = $("chat-form");
  const input = $("message");
  const list = $("messages");
  const sendButton = $("send");
  const stopButton = $("chat-stop");
  const statusEl = $("chat-status");
  const setStatus = (message) => {
    statusEl.textContent = message;
  };
  const errors = new FieldErrors({
    fields: ["message", "system", "tools", ...Object.values(NUMBERS), "api_key"],
    general: "err-chat",
    params: {
      messages: "message",
      max_completion_tokens: "chat_max_tokens",
      tool_choice: "tools",
      ...NUMBERS,
    },
    setStatus,
  });
  let history = []; // the finished turns, as the server saw them: [{role, content}]
  let controller = null; // AbortController of the running answer
  let conversation = 0; // bumped by "new chat": a late answer of an old one is dropped

  function buildBody(text) {
    const body = { messages: [], stream: true, logprobs: true, top_logprobs: TOP_N };
    if (!errors.readNumbers(body, NUMBERS)) return null;
    const system = $("system").value.trim();
    if (system) body.messages.push({ role: "system", content: system });
    const tools = $("tools").value.trim();
    if (tools) {
      try {
        body.tools = JSON.parse(tools);
      } catch {
        errors.set("tools", "Tools must be JSON: an array of tool objects.");
        return null;
      }
    }
    body.messages.push(...history, { role: "user", content: text });
    return body;
  }

  function setRunning(running) {
    sendButton.disabled = running;
    stopButton.disabled = !running;
    form.setAttribute("aria-busy", running ? "true" : "false");
  }

  /** Keep the newest text in view while the reader is at the bottom already and is not
   * looking at a token's alternatives (scrolling closes them). */
  function follow(update) {
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 24;
    update();
    if (atBottom && $("popup").hidden) list.scrollTop = list.scrollHeight;
  }

  async function send(event) {
    event.preventDefault();
    if (controller) return;
    errors.clear();
    const text = input.value.trim();
    if (!text) {
      errors.set("message", "Type a message first.");
      return;
    }
    const body = buildBody(text);
    if (!body) return;
    setApiKey($("api_key").value.trim());
    const question = { role: "user", content: text };
    const asked = renderMessage(question);
    const answer = renderMessage({ role: "assistant", content: "" });
    answer.setAttribute("aria-busy", "true"); // read out once complete, not token by token
    follow(() => list.append(asked, answer));
    input.value = "";
    const run = new TokenRun(answer.querySelector(".msg-body"));
    const bytes = new TextDecoder(); // token bytes -> text, so each token knows its offset
    let offset = 0;
    const mine = conversation;
    controller = new AbortController();
    const { signal } = controller;
    const started = performance.now();
    setRunning(true);
    setStatus("starting…");
    let finish = null;
    let outcome = null;
    const calls = [];
    let thinking = "";
    try {
      body.model = await modelFor(signal);
      await streamPost("/v1/chat/completions", body, signal, (chunk) => {
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          // thinking goes to the folded section; its tokens are not the answer's to shade
          const section = answer.querySelector(".msg-reasoning");
          follow(() => {
            section.hidden = false;
            section.querySelector(".msg-reasoning-body").append(delta.reasoning_content);
          });
          thinking += delta.reasoning_content;
        }
        const entries = [];
        const answered = !delta.reasoning_content; // a chunk of the answer alone: its tokens
        for (const item of (answered && choice.logprobs && choice.logprobs.content) || []) {
          const piece = item.bytes ? bytes.decode(new Uint8Array(item.bytes), { stream: true }) : item.token;
          const top = (item.top_logprobs || []).map((alt) => [alt.token, Math.exp(alt.logprob)]);
          entries.push({ offset, token: item.token, p: Math.exp(item.logprob), top });
          offset += piece.length;
        }
        follow(() => run.append((choice.delta && choice.delta.content) || "", entries));
        if (choice.delta && choice.delta.tool_calls) {
          addToolCalls(calls, choice.delta.tool_calls);
          follow(() => showToolCalls(answer, calls));
        }
        if (choice.finish_reason) finish = choice.finish_reason;
        setStatus(`generating… ${run.tokens.length} tokens`);
      });
      const n = run.tokens.length;
      const secs = (performance.now() - started) / 1000;
      const rate = n && secs > 0 ? ` · ${(n / secs).toFixed(1)} tok/s` : "";
      setStatus(`done (${finish || "no finish reason"}) · ${n} tokens · ${secs.toFixed(1)} s${rate}`);
      if (finish === "length") outcome = "cut at max tokens";
    } catch (err) {
      if (signal.aborted) {
        setStatus(mine === conversation ? `stopped after ${run.tokens.length} tokens` : "");
        outcome = "stopped";
      } else {
        errors.show(err);
        outcome = "interrupted by an error";
      }
    } finally {
      controller = null;
      setRunning(false);
      answer.removeAttribute("aria-busy");
    }
    if (mine !== conversation) return;
    if (!run.text && !calls.length && !thinking) {
      // Nothing was answered: take the turn back, so the message can be sent again as it was.
      asked.remove();
      answer.remove();
      if (!input.value) input.value = text;
      return;
    }
    const reply = { role: "assistant", content: run.text || null };
    if (thinking) reply.reasoning_content = thinking;
    if (calls.length) reply.tool_calls = calls;
    history.push(question, reply);
    if (outcome) {
      const note = answer.querySelector(".msg-note");
      note.textContent = outcome;
      note.hidden = false;
    }
  }

  function newChat() {
    conversation += 1;
    if (controller) controller.abort();
    history = [];
    hideAlternatives(true);
    list.replaceChildren();
    errors.clear();
    setStatus("");
    input.focus();
  }

  form.addEventListener("submit", send);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  stopButton.addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("chat-settings").addEventListener("submit", (e) => e.preventDefault());
  $("shade").addEventListener("change", (e) => list.classList.toggle("plain", !e.target.checked));
  list.addEventListener("scroll", () => hideAlternatives(true), { passive: true });
  watchTokens(list);
}
