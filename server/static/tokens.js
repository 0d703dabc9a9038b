// Generated text as one span per token, shaded by the token's probability, and the popup with the
// model's top alternatives for a token (hover, tap or focus it; arrow keys move between tokens).
// The completion tab has one TokenRun; the chat has one per assistant answer.

const owners = new WeakMap(); // token span -> {run, index}
let popup = null; // the page's one popup element
let pinned = null; // the token span whose popup was opened by click or tap

/** The tokens of one generated text, laid over that text as it streams in. */
export class TokenRun {
  /** `masked`: the alternatives are those a JSON schema allowed (the popup says so). */
  constructor(container, { masked = false } = {}) {
    this.el = container;
    this.masked = masked;
    this.tokens = []; // [{offset, token, p, top: [[token, p], ...], span}]
    this.text = "";
    this.open = 0; // the first token whose text may still grow
  }

  /**
   * Append streamed text and the tokens that came with it: [{offset, token, p, top}], `offset`
   * where the token's text begins in this run's text, `p` its probability (null: none), `top`
   * its alternatives. Text and tokens may arrive in different chunks (the server holds back
   * text that could begin a stop string), so a token's text is its slice up to the next token.
   */
  append(text, entries) {
    this.text += text;
    if (!entries.length && !this.tokens.length) {
      if (text) this.el.append(document.createTextNode(text)); // no logprobs: plain text
      return;
    }
    for (const entry of entries) {
      const span = document.createElement("span");
      span.className = "tok";
      span.tabIndex = this.tokens.length === 0 ? 0 : -1; // roving tabindex: arrows move on
      span.style.setProperty("--p", entry.p == null ? "0.5" : String(entry.p));
      owners.set(span, { run: this, index: this.tokens.length });
      this.tokens.push({ ...entry, span });
      this.el.append(span);
    }
    let open = -1;
    for (let i = this.open; i < this.tokens.length; i++) {
      const end = i + 1 < this.tokens.length ? this.tokens[i + 1].offset : this.text.length;
      const piece = this.text.slice(this.tokens[i].offset, end);
      this.tokens[i].span.textContent = piece;
      this.tokens[i].span.classList.toggle("nl", piece.includes("\n")); // shows a ↵ to hover
      if (open < 0 && end >= this.text.length) open = i;
    }
    this.open = Math.max(0, open < 0 ? this.tokens.length - 1 : open);
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

function fillPopup(tok, masked) {
  const head = document.createElement("h3");
  const chosen = document.createElement("span");
  chosen.className = "chosen";
  chosen.textContent = visible(tok.token);
  head.append("Chose ", chosen, tok.p == null ? "" : ` · ${fmtPct(tok.p)}`);
  const alts = [...tok.top].sort((a, b) => b[1] - a[1]);
  popup.replaceChildren(head);
  if (masked) {
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
  const owner = owners.get(span);
  if (!owner) return;
  const { run, index } = owner;
  document.querySelectorAll(".tok.active").forEach((el) => el.classList.remove("active"));
  span.classList.add("active");
  fillPopup(run.tokens[index], run.masked);
  popup.hidden = false;
  span.setAttribute("aria-describedby", popup.id);
  const r = span.getBoundingClientRect();
  const w = popup.offsetWidth;
  const h = popup.offsetHeight;
  const left = Math.max(8, Math.min(r.left, document.documentElement.clientWidth - w - 8));
  const below = r.bottom + 6;
  const top = below + h > window.innerHeight && r.top - h - 6 > 0 ? r.top - h - 6 : below;
  popup.style.left = `${left + window.scrollX}px`;
  popup.style.top = `${top + window.scrollY}px`;
}

/** Close the popup; unless `force`, one pinned by a click or tap stays. */
export function hideAlternatives(force) {
  if (!popup || (pinned && !force)) return;
  pinned = null;
  popup.hidden = true;
  document.querySelectorAll(".tok.active").forEach((el) => el.classList.remove("active"));
  document.querySelectorAll(".tok[aria-describedby]").forEach((el) => {
    el.removeAttribute("aria-describedby");
  });
}

const tokenOf = (el) => (el instanceof Element ? el.closest(".tok") : null);

/** Use `element` as the page's popup; closes on Escape and on a click anywhere else. */
export function initAlternatives(element) {
  popup = element;
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") hideAlternatives(true);
  });
  document.addEventListener("click", (e) => {
    if (pinned && !tokenOf(e.target) && !popup.contains(e.target)) hideAlternatives(true);
  });
}

/** Show alternatives for the tokens anywhere inside `root`. */
export function watchTokens(root) {
  root.addEventListener("mouseover", (e) => {
    const span = tokenOf(e.target);
    if (span && !pinned) showPopup(span);
  });
  root.addEventListener("mouseout", (e) => {
    if (tokenOf(e.target) && !tokenOf(e.relatedTarget)) hideAlternatives(false);
  });
  root.addEventListener("click", (e) => {
    const span = tokenOf(e.target);
    if (!span) return;
    if (pinned === span) {
      hideAlternatives(true);
      return;
    }
    pinned = span;
    showPopup(span);
  });
  root.addEventListener("focusin", (e) => {
    const span = tokenOf(e.target);
    if (span) showPopup(span);
  });
  root.addEventListener("focusout", (e) => {
    if (!tokenOf(e.relatedTarget)) hideAlternatives(true);
  });
  root.addEventListener("keydown", (e) => {
    const span = tokenOf(e.target);
    const owner = span && owners.get(span);
    if (!owner) return;
    const { run, index } = owner;
    const last = run.tokens.length - 1;
    const next = { ArrowRight: index + 1, ArrowLeft: index - 1, Home: 0, End: last }[e.key];
    if (next !== undefined && run.tokens[next]) {
      e.preventDefault();
      span.tabIndex = -1;
      run.tokens[next].span.tabIndex = 0;
      pinned = null;
      run.tokens[next].span.focus();
    } else if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      span.click();
    }
  });
}
