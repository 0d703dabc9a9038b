// A form's errors, each shown next to the field it is about: the server names the request field
// it rejects (`param` of an OpenAI-shaped error), and the page maps that name to its input.
import { ApiError } from "./api.js";

const $ = (id) => document.getElementById(id);

export class FieldErrors {
  /**
   * fields: ids of the inputs that have an `err-<id>` element; general: the id of the element for
   * errors about no field of the form; params: request field -> input id where the two differ;
   * setStatus: the form's status line.
   */
  constructor({ fields, general, params = {}, setStatus }) {
    this.fields = fields;
    this.general = general;
    this.params = params;
    this.setStatus = setStatus;
    for (const field of fields) {
      $(field).addEventListener("input", () => this.hide(field));
    }
  }

  set(field, message) {
    const el = field === this.general ? $(field) : $(`err-${field}`);
    el.textContent = message;
    el.hidden = false;
    if (field !== this.general) $(field).setAttribute("aria-invalid", "true");
  }

  hide(field) {
    $(`err-${field}`).hidden = true;
    $(field).removeAttribute("aria-invalid");
  }

  clear() {
    for (const field of this.fields) this.hide(field);
    $(this.general).hidden = true;
    $(this.general).textContent = "";
  }

  /** Show a failed request: at the field it names, the API key's for a 401, else in general. */
  show(err) {
    if (!(err instanceof ApiError)) {
      this.set(this.general, `Could not reach the server: ${err.message}`);
      this.setStatus("request failed");
      return;
    }
    if (err.status === 401 || err.code === "invalid_api_key") {
      this.set("api_key", `API key rejected: ${err.message}`);
      this.setStatus("not authorized");
      return;
    }
    const param = this.params[err.param] || err.param;
    if (this.fields.includes(param)) {
      this.set(param, err.message);
      this.setStatus(`check ${labelOf(param)}`);
      return;
    }
    const where = err.param ? ` (${err.param})` : "";
    const prefix = err.status ? `${err.status}: ` : "";
    this.set(this.general, `${prefix}${err.message}${where}`);
    this.setStatus("request failed");
  }

  /**
   * Copy the number inputs `numbers` (request field -> input id) into `body`, leaving out empty
   * ones; false, with an error at each unreadable input, if any is not a number.
   */
  readNumbers(body, numbers) {
    let ok = true;
    for (const [name, id] of Object.entries(numbers)) {
      const input = $(id);
      if (input.validity.badInput) {
        this.set(id, "Enter a number.");
        ok = false;
        continue;
      }
      const raw = input.value.trim();
      if (raw !== "") body[name] = Number(raw);
    }
    return ok;
  }
}

function labelOf(field) {
  const label = document.querySelector(`label[for="${field}"]`);
  return label ? label.firstChild.textContent.trim().toLowerCase() : field;
}
