// miStudio's shared page code (plain JS, no build step): the REST API client, inline form errors,
// toasts, confirmations, the theme switch, number and time formatting, and one live-event connection per page
// with a polling fallback. Every page script uses `window.mi`.
(function () {
  "use strict";

  const csrfToken = () => document.querySelector('meta[name="csrf-token"]')?.content || "";

  // --- REST API ---------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, body) {
      const error = (body && body.error) || {};
      super(error.message || `The server answered ${status}.`);
      this.status = status;
      this.code = error.code || "HTTP_" + status;
      this.details = error.details || {};
    }
    // {field: [messages]} from the documented error body (validation errors carry details.fields).
    get fields() {
      return this.details.fields || {};
    }
  }

  // fetch() the API with the session cookie and CSRF token; JSON in, JSON out; ApiError on 4xx/5xx.
  async function api(method, path, body, options = {}) {
    const headers = { Accept: "application/json", "X-CSRFToken": csrfToken() };
    let payload = body;
    if (body !== undefined && !(body instanceof FormData)) {
      headers["Content-Type"] = "application/json";
      payload = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path.startsWith("/") ? path : `/api/${path}`, {
        method, headers, body: payload, credentials: "same-origin", signal: options.signal,
      });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError(0, { error: { code: "NETWORK", message: "The server cannot be reached. Nothing was changed." } });
    }
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  // An HTML fragment the server renders for a page (the same template as the page's first render):
  // its text, or an Error with the server's status. 4xx fragments are notices meant to be shown.
  async function fragment(url, options = {}) {
    let response;
    try {
      response = await fetch(url, { credentials: "same-origin", signal: options.signal, headers: { Accept: "text/html" } });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new Error("The server cannot be reached.");
    }
    const html = await response.text();
    if (response.status >= 500 || !html.trim()) throw new Error(`The server answered ${response.status}.`);
    return { html, ok: response.ok };
  }

  // The elements of a fragment's HTML, ready to insert where a <div>'s innerHTML would not parse
  // them (table rows, list items).
  function elementsOf(html) {
    const template = document.createElement("template");
    template.innerHTML = html.trim();
    return [...template.content.children];
  }

  // --- styles a strict Content-Security-Policy allows ------------------------------------------------
  // Markup never carries style="" (the policy refuses inline styles); numbers a style needs travel as
  // data attributes and are applied here, through the CSSOM, which the policy allows:
  // data-width="42.5" → width: 42.5%;  data-alpha="0.8" → --a: 0.8 (a heat colour's strength).
  function applyDataStyles(root) {
    const nodes = root.querySelectorAll ? [...root.querySelectorAll("[data-width], [data-alpha]")] : [];
    if (root.dataset && (root.dataset.width !== undefined || root.dataset.alpha !== undefined)) nodes.push(root);
    for (const node of nodes) {
      if (node.dataset.width !== undefined) node.style.width = `${Number(node.dataset.width) || 0}%`;
      if (node.dataset.alpha !== undefined) node.style.setProperty("--a", String(Number(node.dataset.alpha) || 0));
    }
  }
  applyDataStyles(document);
  new MutationObserver((records) => {
    for (const record of records) {
      if (record.type === "attributes") applyDataStyles(record.target);
      else record.addedNodes.forEach((node) => node.nodeType === 1 && applyDataStyles(node));
    }
  }).observe(document.documentElement, { childList: true, subtree: true, attributes: true, attributeFilter: ["data-width", "data-alpha"] });

  // --- forms --------------------------------------------------------------------------------------

  function clearErrors(form) {
    form.querySelectorAll(".field-error, .form-error").forEach((node) => node.remove());
    form.querySelectorAll(".invalid").forEach((node) => node.classList.remove("invalid"));
  }

  function flatten(messages) {
    if (Array.isArray(messages)) return messages.map(flatten).join(" ");
    if (messages && typeof messages === "object") return Object.entries(messages).map(([key, value]) => `${key}: ${flatten(value)}`).join(" ");
    return String(messages);
  }

  // Show an ApiError on a form: each field's message under its input, the rest on top. Nothing the
  // user typed is cleared.
  function showErrors(form, error) {
    clearErrors(form);
    const leftOver = [];
    for (const [name, messages] of Object.entries(error.fields || {})) {
      const input = form.querySelector(`[name="${CSS.escape(name)}"]`);
      if (!input) { leftOver.push(`${name}: ${flatten(messages)}`); continue; }
      input.classList.add("invalid");
      const note = document.createElement("div");
      note.className = "field-error";
      note.dataset.errorFor = name;
      note.textContent = flatten(messages);
      (input.closest(".field") || input.parentElement).appendChild(note);
    }
    const summary = document.createElement("div");
    summary.className = "form-error";
    summary.setAttribute("role", "alert");
    summary.textContent = [error.message, ...leftOver].join(" ");
    form.prepend(summary);
  }

  // A form a model's worker answers (patching, the logit lens): the button is off while it runs,
  // ``request()``'s result goes to ``draw``, an error shows on the form with its code (the summary
  // gets ``errorId``), and a model that is not loaded gets a link to its page.
  function workerForm(form, { submit, state, errorId, request, draw }) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      clearErrors(form);
      submit.disabled = true;
      state.textContent = "Running on the model's worker…";
      try {
        draw(await request());
        state.textContent = "Done";
      } catch (error) {
        showErrors(form, error);
        const summary = form.querySelector(".form-error");
        summary.id = errorId;
        summary.dataset.code = error.code;
        const code = document.createElement("code");
        code.textContent = error.code;
        summary.prepend(code, " ");
        if (error.code === "MODEL_NOT_LOADED") {
          const link = document.createElement("a");
          link.href = `/models/${encodeURIComponent(form.dataset.modelId)}/`;
          link.textContent = "Load it on the model's page";
          summary.append(" ", link, ", then try again.");
        }
        state.textContent = "";
      } finally {
        submit.disabled = false;
      }
    });
  }

  // --- toasts and confirmation ---------------------------------------------------------------------

  function toast(message, kind = "info", seconds = 6) {
    const box = document.getElementById("toasts");
    if (!box) return;
    const node = document.createElement("div");
    node.className = `toast ${kind}`;
    node.setAttribute("role", kind === "error" ? "alert" : "status");
    node.textContent = message;
    box.appendChild(node);
    setTimeout(() => node.remove(), seconds * 1000);
  }

  // A modal yes/no built on <dialog>: resolves true when confirmed. Escape or Cancel resolves false.
  function confirmAction(message, { confirmLabel = "Confirm", danger = true } = {}) {
    return new Promise((resolve) => {
      const dialog = document.createElement("dialog");
      dialog.className = "confirm";
      dialog.innerHTML = `<h2>Are you sure?</h2><p></p><div class="dialog-actions">
        <button type="button" value="cancel">Cancel</button>
        <button type="button" value="ok" class="${danger ? "danger solid" : "primary"}"></button></div>`;
      dialog.querySelector("p").textContent = message;
      dialog.querySelector('[value="ok"]').textContent = confirmLabel;
      document.body.appendChild(dialog);
      const finish = (answer) => { dialog.close(); dialog.remove(); resolve(answer); };
      dialog.querySelector('[value="cancel"]').onclick = () => finish(false);
      dialog.querySelector('[value="ok"]').onclick = () => finish(true);
      dialog.addEventListener("cancel", (event) => { event.preventDefault(); finish(false); });
      dialog.showModal();
      dialog.querySelector('[value="cancel"]').focus();
    });
  }

  // --- formatting ---------------------------------------------------------------------------------

  function bytes(value) {
    if (value === null || value === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let size = Number(value), unit = 0;
    while (size >= 1024 && unit < units.length - 1) { size /= 1024; unit += 1; }
    return `${size.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "—";
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 60) return `${seconds}s`;
    const minutes = Math.floor(seconds / 60);
    if (minutes < 60) return `${minutes}m ${seconds % 60}s`;
    return `${Math.floor(minutes / 60)}h ${minutes % 60}m`;
  }

  const pad = (n) => String(n).padStart(2, "0");

  // A date as the reader's own "YYYY-MM-DD HH:MM" (the server renders its times in UTC).
  function localTime(date) {
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ${pad(date.getHours())}:${pad(date.getMinutes())}`;
  }

  // A time of today as just its hour, any other as just its date: narrow enough for a table column.
  function shortTime(date) {
    return date.toDateString() === new Date().toDateString() ? localTime(date).slice(11) : localTime(date).slice(0, 10);
  }

  // Every <time datetime> under root in the reader's time zone, the full date in its tooltip; with
  // shortInTables, those in table cells as shortTime.
  function localizeTimes(root = document, { shortInTables = false } = {}) {
    root.querySelectorAll("time[datetime]").forEach((node) => {
      const date = new Date(node.getAttribute("datetime"));
      if (isNaN(date)) return;
      node.textContent = shortInTables && node.closest("td") ? shortTime(date) : localTime(date);
      node.title = date.toString();
    });
  }

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  // A progress bar element (.progress > span) set to a percentage.
  function setProgress(bar, percent) {
    if (!bar) return;
    const value = Math.max(0, Math.min(100, Number(percent) || 0));
    bar.querySelector("span").style.width = `${value}%`;
    bar.setAttribute("aria-valuenow", String(Math.round(value)));
    bar.classList.toggle("done", value >= 100);
  }

  // --- theme --------------------------------------------------------------------------------------

  function applyTheme(theme) {
    if (theme === "light" || theme === "dark") document.documentElement.dataset.theme = theme;
    else delete document.documentElement.dataset.theme;
  }
  function currentTheme() {
    return document.documentElement.dataset.theme
      || (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light");
  }
  function toggleTheme() {
    const next = currentTheme() === "dark" ? "light" : "dark";
    localStorage.setItem("mistudio-theme", next);
    applyTheme(next);
  }

  // --- live events ----------------------------------------------------------------------------------
  //
  // One WebSocket to /ws/events/ per page. live.subscribe(group, handler) gets the group's snapshot
  // and then each event ({type: "snapshot"|"event", group, event, data}). While the socket is down
  // every poller registered with live.poll(fn) runs every 5 s (the pages refetch over REST) and the
  // indicator in the top bar says "Polling"; the socket reconnects with exponential backoff.
  // Each group's messages carry `seq` (1, 2, 3, … per group; a snapshot carries the current one):
  // an event that skips a number means some were missed, so the pollers refetch over REST once;
  // an event not newer than what the page has (already in its snapshot) is dropped.

  const live = {
    handlers: new Map(),
    lastSeq: new Map(),
    pollers: [],
    socket: null,
    state: "connecting",
    retryDelay: 1000,
    pollTimer: null,
    indicator: null,

    subscribe(group, handler) {
      if (!this.handlers.has(group)) this.handlers.set(group, []);
      this.handlers.get(group).push(handler);
      if (this.socket && this.socket.readyState === WebSocket.OPEN) {
        this.socket.send(JSON.stringify({ action: "subscribe", groups: [group] }));
      }
      this.start();
    },

    poll(fn) {
      this.pollers.push(fn);
      this.start();
    },

    setState(state) {
      this.state = state;
      document.documentElement.dataset.live = state;
      if (this.indicator) {
        this.indicator.dataset.state = state;
        this.indicator.textContent = { live: "Live", polling: "Polling", connecting: "Connecting…" }[state];
        this.indicator.title = state === "polling"
          ? "The live connection dropped: refreshing every 5 s until it is back."
          : "Updates arrive live over a WebSocket.";
      }
    },

    startPolling() {
      if (this.pollTimer || !this.pollers.length) return;
      this.pollTimer = setInterval(() => this.runPollers(), 5000);
      this.runPollers();
    },

    runPollers() {
      for (const fn of this.pollers) Promise.resolve().then(fn).catch(() => {});
    },

    stopPolling() {
      clearInterval(this.pollTimer);
      this.pollTimer = null;
    },

    started: false,
    start() {
      if (this.started) return;
      this.started = true;
      this.indicator = document.getElementById("live-indicator");
      if (this.indicator) this.indicator.hidden = false;
      this.setState("connecting");
      this.connect();
    },

    connect() {
      const scheme = location.protocol === "https:" ? "wss" : "ws";
      let socket;
      try {
        socket = new WebSocket(`${scheme}://${location.host}/ws/events/`);
      } catch (_) {
        this.onDown();
        return;
      }
      this.socket = socket;
      socket.onopen = () => {
        this.retryDelay = 1000;
        this.setState("live");
        this.stopPolling();
        const groups = [...this.handlers.keys()];
        if (groups.length) socket.send(JSON.stringify({ action: "subscribe", groups }));
        this.runPollers(); // one catch-up refresh: events may have been missed while down
      };
      socket.onmessage = (message) => {
        let payload;
        try { payload = JSON.parse(message.data); } catch (_) { return; }
        if (payload.type === "error") { console.warn("live:", payload.code, payload.message); return; }
        // "skip": an event of this group the user may not see (another user's private row); it only
        // moves the group's seq on, so that it does not read as a missed event.
        if (!this.inSequence(payload) || payload.type === "skip") return;
        for (const handler of this.handlers.get(payload.group) || []) {
          try { handler(payload); } catch (error) { console.error(error); }
        }
      };
      socket.onclose = () => { if (this.socket === socket) this.onDown(); };
    },

    // Whether to hand the message to the page; refetches over REST when events were missed.
    inSequence(payload) {
      if (typeof payload.seq !== "number") return true;
      const last = this.lastSeq.get(payload.group);
      if (payload.type !== "snapshot" && last !== undefined && payload.seq <= last) return false;
      this.lastSeq.set(payload.group, payload.seq);
      if (payload.type !== "snapshot" && last !== undefined && payload.seq > last + 1) this.runPollers();
      return true;
    },

    onDown() {
      this.socket = null;
      this.setState("polling");
      this.startPolling();
      setTimeout(() => this.connect(), this.retryDelay);
      this.retryDelay = Math.min(this.retryDelay * 2, 30000);
    },
  };

  // A token as the probe pages show it: spaces as middle dots and newlines as ⏎, so that a
  // whitespace token is visible.
  const visibleToken = (token) => token.replace(/ /g, "·").replace(/\n/g, "⏎");
  // A model's status as the pages name it (the same as the model_status template filter).
  const modelStatus = (status) => (status === "pending" ? "not loaded" : status);

  window.mi = {
    api, fragment, elementsOf, ApiError, showErrors, clearErrors, workerForm, toast, confirm: confirmAction,
    bytes, duration, localTime, shortTime, localizeTimes, escapeHtml, setProgress, live, toggleTheme,
    visibleToken, modelStatus,
  };

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("theme-toggle")?.addEventListener("click", toggleTheme);
    // Messages rendered by the server (Django messages) appear as toasts too.
    document.querySelectorAll("[data-toast]").forEach((node) => toast(node.dataset.toast, node.dataset.kind || "info"));
  });
  // A button with data-confirm asks first (cancelling a job loses its work): the form is sent with
  // that button only once the dialog says yes.
  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-confirm]");
    if (!button || button.dataset.confirmed) return;
    event.preventDefault();
    if (await confirmAction(button.dataset.confirm, { confirmLabel: button.dataset.confirmLabel || "Yes" })) {
      button.dataset.confirmed = "1";
      button.click();
      delete button.dataset.confirmed;
    }
  });
})();
