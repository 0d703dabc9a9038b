// gptserve playground: a chat with the served model or one of its LoRA adapters (chat.js) and, on a second tab, the raw
// completion view (completion.js); both show each generated token's probability and the
// model's top alternatives (tokens.js). Plain browser JavaScript modules, no dependencies, no
// build step.
import { chooseModel, forgetModels, modelFor, setApiKey, setModelsListener } from "./api.js";
import { initChat } from "./chat.js";
import { initCompletion } from "./completion.js";
import { initAlternatives } from "./tokens.js";

const $ = (id) => document.getElementById(id);
const TABS = ["chat", "completion"];

/** Show one tab's panel; the address's #hash names it, so a reload or a link opens it again. */
function selectTab(name, focus) {
  for (const tab of TABS) {
    const selected = tab === name;
    const button = $(`tab-${tab}`);
    button.setAttribute("aria-selected", String(selected));
    button.tabIndex = selected ? 0 : -1;
    $(`panel-${tab}`).hidden = !selected;
    if (selected && focus) button.focus();
  }
  if (location.hash.slice(1) !== name) {
    history.replaceState(null, "", name === TABS[0] ? location.pathname : `#${name}`);
  }
}

function initTabs() {
  for (const tab of TABS) $(`tab-${tab}`).addEventListener("click", () => selectTab(tab, false));
  // the tab pattern: arrow keys move between tabs, Tab moves into the panel
  $("tabs").addEventListener("keydown", (e) => {
    const current = TABS.findIndex((tab) => $(`tab-${tab}`).getAttribute("aria-selected") === "true");
    const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
    let next = step === undefined ? undefined : (current + step + TABS.length) % TABS.length;
    if (e.key === "Home") next = 0;
    if (e.key === "End") next = TABS.length - 1;
    if (next === undefined) return;
    e.preventDefault();
    selectTab(TABS[next], true);
  });
  const fromAddress = () => {
    const wanted = location.hash.slice(1);
    selectTab(TABS.includes(wanted) ? wanted : TABS[0], false);
  };
  window.addEventListener("hashchange", fromAddress);
  fromAddress();
  // the key form has no action: Enter in the key field only sets the key
  $("key-form").addEventListener("submit", (e) => e.preventDefault());
}

/** The header's model select: the base model and each LoRA adapter, the chosen one selected. */
function showModels(models, chosen) {
  const select = $("model-select");
  select.replaceChildren(
    ...models.map((m) => {
      const label = m.parent ? `${m.id} (LoRA adapter of ${m.parent})` : m.id;
      return new Option(label, m.id, false, m.id === chosen);
    }),
  );
  select.value = chosen;
}

function showNoModels(text) {
  $("model-select").replaceChildren(new Option(text, "", true, true));
}

setModelsListener(showModels);
$("model-select").addEventListener("change", (e) => {
  if (e.target.value) chooseModel(e.target.value);
});
// the list again each time the select is opened: adapters may have come or gone
$("model-select").addEventListener("focus", () => {
  forgetModels();
  modelFor(undefined).catch(() => {});
});
initAlternatives($("popup"));
initTabs();
initChat();
initCompletion();
// Show the model name when the server needs no key; failures here are silent.
setApiKey("");
modelFor(undefined).catch(() => showNoModels("(enter the API key and send)"));
