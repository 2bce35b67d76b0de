// Models page ("/"): the card grid with instant filters, the "Add model" dialog, Load / Unload / Cancel /
// Delete, and load progress that moves live (the `models` group; REST polling while the socket is down).
// `window.miModels` (apply a model's state to a card or a page, and the card actions) is shared with
// the model detail page, which loads this file too. Every change goes through the REST API.
(function () {
  "use strict";

  const STAGES = {
    resolve: "Resolving files", download: "Downloading", weights: "Loading weights",
    place: "Placing on the device", "warm-up": "Warming up",
  };
  const UNLOAD_REASONS = {
    requested: "Unloaded on request", evicted: "Evicted to make room for another model",
    idle: "Unloaded after being idle", deleted: "Deleted", worker_stopped: "Its worker stopped",
    worker_lost: "Its worker was lost",
  };
  // Registration errors that are about what was typed as the hub id / path: shown under that input.
  const IDENTIFIER_ERRORS = new Set([
    "INVALID_LOCAL_PATH", "INVALID_MODEL_ID", "MODEL_NOT_FOUND_ON_HUB", "INVALID_MODEL",
    "UNSUPPORTED_ARCHITECTURE", "UNSAFE_WEIGHTS", "REMOTE_CODE_NOT_ALLOWED", "GATED_MODEL",
  ]);

  function paramsHuman(count) {
    if (count === null || count === undefined || count === "") return "—";
    for (const [threshold, suffix] of [[1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
      if (count >= threshold) return `${(count / threshold).toFixed(1)}${suffix}`;
    }
    return String(Math.round(count));
  }

  // Events and snapshots carry `model_state` (model_id, message); the REST API the row (id, status_message).
  function normalize(data) {
    return { ...data, id: data.model_id || data.id, message: data.message ?? data.status_message ?? "" };
  }

  const fields = (root, name) => root.querySelectorAll(`[data-field="${name}"]`);
  function setText(root, name, text) {
    fields(root, name).forEach((node) => { node.textContent = text; });
  }

  function stageLine(model) {
    let text = model.message || STAGES[model.stage] || "Queued";
    if (model.stage === "download" && model.download_bytes_total) {
      text += ` · ${mi.bytes(model.download_bytes_done)} of ${mi.bytes(model.download_bytes_total)}`;
    }
    return text;
  }

  // Loaded: what the worker measured. Otherwise the estimate for its quantization, marked as such.
  function showMemory(root, bytesUsed, byDevice) {
    let estimates = {};
    try { estimates = JSON.parse(root.dataset.estimates || "{}"); } catch (_) { estimates = {}; }
    const quantization = root.dataset.quantization;
    const places = Object.entries(byDevice || {});
    fields(root, "memory").forEach((node) => {
      node.replaceChildren();
      if (bytesUsed) {
        node.textContent = mi.bytes(bytesUsed);
        if (places.length > 1) {
          // A split model (--device auto): where its bytes sit, disk included.
          const placement = document.createElement("span");
          placement.className = "muted";
          placement.dataset.field = "placement";
          placement.textContent = ` (${places.map(([device, size]) => `${device} ${mi.bytes(size)}`).join(" · ")})`;
          node.appendChild(placement);
        }
      } else if (estimates[quantization]) {
        const estimate = document.createElement("span");
        estimate.className = "estimate";
        estimate.title = `Estimate for ${quantization}`;
        estimate.textContent = `≈ ${mi.bytes(estimates[quantization])}`;
        node.appendChild(estimate);
      } else {
        node.textContent = "—";
      }
    });
  }

  function updateActions(root) {
    const status = root.dataset.status;
    if (status !== "ready") delete root.dataset.pending;
    root.querySelectorAll("button[data-action]").forEach((button) => {
      const action = button.dataset.action;
      if (action === "load") {
        button.hidden = status === "loading" || status === "ready";
        if (!button.dataset.quantization) button.textContent = status === "failed" ? "Retry load" : "Load";
      }
      if (action === "unload") {
        button.hidden = status !== "ready";
        const unloading = root.dataset.pending === "unload";
        button.disabled = unloading;
        button.textContent = unloading ? "Unloading…" : "Unload";
      }
      if (action === "cancel") button.hidden = status !== "loading";
    });
  }

  // Bring a card, or the detail page, up to date with a model's state. Fields absent from `data` keep
  // their value (events carry the live part of the row, the REST API all of it).
  function apply(root, data) {
    const model = normalize(data);
    if (model.status) {
      root.dataset.status = model.status;
      fields(root, "status").forEach((badge) => {
        badge.className = `badge status-${model.status}`;
        badge.textContent = mi.modelStatus(model.status);
      });
    }
    if (model.name) setText(root, "name", model.name);
    if (model.model_type) { root.dataset.family = model.model_type; setText(root, "model_type", model.model_type); }
    if (model.source) setText(root, "source", model.source === "local" ? "local" : "hub");
    if (model.identifier) fields(root, "identifier").forEach((node) => { node.textContent = model.identifier; node.title = model.identifier; });
    if ("parameter_count" in model) {
      fields(root, "parameters").forEach((node) => {
        node.textContent = paramsHuman(model.parameter_count);
        node.title = model.parameter_count === null ? "" : Number(model.parameter_count).toLocaleString("en-US");
      });
    }
    if ("num_layers" in model) setText(root, "num_layers", model.num_layers ?? "—");
    if (model.memory_estimates) root.dataset.estimates = JSON.stringify(model.memory_estimates);
    if (model.quantization) { root.dataset.quantization = model.quantization; setText(root, "quantization", model.quantization); }
    if ("memory_usage_bytes" in model) showMemory(root, model.memory_usage_bytes, model.memory_by_device);
    if ("host_worker" in model) setText(root, "host_worker", model.host_worker || "—");
    if ("load_time_seconds" in model) {
      setText(root, "load_time", model.load_time_seconds === null ? "—" : `${Number(model.load_time_seconds).toFixed(1)} s`);
    }

    const loading = root.dataset.status === "loading";
    root.querySelectorAll('[data-part="progress"]').forEach((part) => { part.hidden = !loading; });
    if (loading && "progress" in model) {
      root.querySelectorAll('[data-part="progress"] .progress').forEach((bar) => mi.setProgress(bar, model.progress));
      setText(root, "percent", `${Math.round(model.progress || 0)} %`);
      setText(root, "stage", stageLine(model));
    }
    if ("unload_reason" in model) {
      const reason = root.dataset.status === "unloaded" ? UNLOAD_REASONS[model.unload_reason] || "" : "";
      fields(root, "unload_reason").forEach((node) => { node.textContent = reason; node.hidden = !reason; });
    }
    if ("error_code" in model) {
      const shown = Boolean(model.error_code || (root.dataset.status === "failed" && model.error_message));
      root.querySelectorAll('[data-part="error"]').forEach((part) => { part.hidden = !shown; });
      setText(root, "error_code", model.error_code || "FAILED");
      setText(root, "error_message", model.error_message || "");
    }
    updateActions(root);
    root.dispatchEvent(new CustomEvent("model-state", { detail: model }));
  }

  // Load / Unload / Cancel / Delete on every [data-model-id] inside `container` (event delegation, so
  // cards added later work too). `onDeleted(id, root)` runs after a successful delete.
  function bindActions(container, { onDeleted } = {}) {
    container.addEventListener("click", async (event) => {
      const button = event.target.closest("button[data-action]");
      const root = button?.closest("[data-model-id]");
      if (!button || !root || !container.contains(button) || button.disabled) return;
      const id = root.dataset.modelId;
      const name = fields(root, "name")[0]?.textContent.trim() || id;
      const action = button.dataset.action;
      if (action === "delete") {
        const confirmed = await mi.confirm(
          `Delete ${name}? A loaded model is unloaded first, and its activation caches are deleted with it.`,
          { confirmLabel: "Delete model" },
        );
        if (!confirmed) return;
      }
      button.disabled = true;
      button.setAttribute("aria-busy", "true");
      try {
        if (action === "load") {
          const body = button.dataset.quantization ? { quantization: button.dataset.quantization } : {};
          apply(root, await mi.api("POST", `models/${id}/load`, body));
        } else if (action === "unload") {
          await mi.api("POST", `models/${id}/unload`);
          root.dataset.pending = "unload";
          mi.toast(`Unloading ${name}…`);
        } else if (action === "cancel") {
          apply(root, await mi.api("POST", `models/${id}/cancel`));
          mi.toast(`Cancelling the load of ${name}…`);
        } else if (action === "delete") {
          await mi.api("DELETE", `models/${id}`);
          mi.toast(`Deleted ${name}.`, "ok");
          if (onDeleted) onDeleted(id, root);
        }
      } catch (error) {
        mi.toast(error.message, "error");
      } finally {
        button.removeAttribute("aria-busy");
        button.disabled = false;
        updateActions(root);
      }
    });
  }

  window.miModels = { apply, normalize, bindActions, paramsHuman, stageLine };

  // --- the models page --------------------------------------------------------------------------------

  function initList(grid) {
    const template = document.getElementById("model-card-template");
    const search = document.getElementById("model-search");
    const statusFilter = document.getElementById("model-status-filter");
    const familyFilter = document.getElementById("model-family-filter");
    const filterBar = document.getElementById("model-filters");
    const count = document.getElementById("model-count");
    const empty = document.getElementById("models-empty");
    const noMatch = document.getElementById("models-no-match");
    const fetching = new Set();

    const cards = () => [...grid.querySelectorAll(".model-card")];
    const cardFor = (id) => grid.querySelector(`.model-card[data-model-id="${CSS.escape(id)}"]`);

    // Show the cards that match; the count, empty and no-match states follow.
    function refresh() {
      const query = search.value.trim().toLowerCase();
      const status = statusFilter.value, family = familyFilter.value;
      const all = cards();
      let shown = 0;
      for (const card of all) {
        const match = (!status || card.dataset.status === status)
          && (!family || card.dataset.family === family)
          && (!query || (card.dataset.search || "").includes(query));
        card.hidden = !match;
        if (match) shown += 1;
      }
      count.textContent = shown === all.length
        ? `${all.length} model${all.length === 1 ? "" : "s"}`
        : `${shown} of ${all.length} models`;
      empty.hidden = all.length > 0;
      filterBar.hidden = all.length === 0;
      noMatch.hidden = all.length === 0 || shown > 0;
    }

    // The filters live in the URL too, so a filtered view can be shared or reloaded.
    function filtersChanged() {
      const params = new URLSearchParams();
      if (search.value.trim()) params.set("q", search.value.trim());
      if (statusFilter.value) params.set("status", statusFilter.value);
      if (familyFilter.value) params.set("family", familyFilter.value);
      const query = params.toString();
      history.replaceState(null, "", query ? `?${query}` : location.pathname);
      refresh();
    }

    function ensureFamilyOption(family) {
      if (!family || [...familyFilter.options].some((option) => option.value === family)) return;
      const option = new Option(family, family);
      const after = [...familyFilter.options].slice(1).find((existing) => existing.value > family);
      familyFilter.insertBefore(option, after || null);
    }

    function addCard(data) {
      const model = normalize(data);
      let card = cardFor(model.id);
      if (!card) {
        card = template.content.firstElementChild.cloneNode(true);
        card.dataset.modelId = model.id;
        card.querySelector('[data-field="link"]').href = `/models/${encodeURIComponent(model.id)}/`;
        setText(card, "id", model.id);
        card.querySelector(".progress")?.setAttribute("aria-label", `Loading ${model.name}`);
        grid.prepend(card);
      }
      card.dataset.search = [model.name, model.identifier, model.id, model.model_type]
        .filter(Boolean).join(" ").toLowerCase();
      apply(card, model);
      ensureFamilyOption(model.model_type);
      refresh();
      return card;
    }

    // A model this page has not seen (registered elsewhere): its card needs the full row.
    async function fetchAndAdd(id) {
      if (fetching.has(id)) return;
      fetching.add(id);
      try {
        addCard(await mi.api("GET", `models/${id}`));
      } catch (error) {
        if (error.status !== 404) console.warn("models:", error.message);
      } finally {
        fetching.delete(id);
      }
    }

    function removeCard(id) {
      cardFor(id)?.remove();
      refresh();
    }

    function update(data) {
      const model = normalize(data);
      const card = cardFor(model.id);
      if (card) apply(card, model);
      else fetchAndAdd(model.id);
    }

    // The whole list as the server has it now: cards it no longer has were deleted meanwhile.
    function reconcile(models, { complete }) {
      const ids = new Set(models.map((model) => normalize(model).id));
      for (const model of models) (complete ? addCard : update)(model);
      for (const card of cards()) if (!ids.has(card.dataset.modelId)) card.remove();
      refresh();
    }

    mi.live.subscribe("models", (message) => {
      if (message.type === "snapshot") reconcile(message.data.models || [], { complete: false });
      else if (message.event === "model:deleted") removeCard(message.data.model_id);
      else if (message.event?.startsWith("model:")) { update(message.data); refresh(); }
    });
    mi.live.poll(async () => {
      const answer = await mi.api("GET", "models?limit=500");
      reconcile(answer.models, { complete: true });
    });

    bindActions(grid, { onDeleted: removeCard });
    search.addEventListener("input", filtersChanged);
    statusFilter.addEventListener("change", filtersChanged);
    familyFilter.addEventListener("change", filtersChanged);
    document.getElementById("clear-filters")?.addEventListener("click", () => {
      search.value = statusFilter.value = familyFilter.value = "";
      filtersChanged();
      search.focus();
    });
    // "/" jumps to the search box, as in most research tools.
    document.addEventListener("keydown", (event) => {
      if (event.key !== "/" || event.target.closest("input, textarea, select, dialog")) return;
      event.preventDefault();
      search.focus();
    });
    // A message left by the page we came from (the detail page after a delete).
    try {
      const flash = sessionStorage.getItem("mistudio-flash");
      sessionStorage.removeItem("mistudio-flash");
      if (flash) mi.toast(flash, "ok");
    } catch (_) { /* storage unavailable: no flash */ }
    initAddDialog((model) => {
      const card = addCard(model);
      card.classList.add("just-added");
      card.scrollIntoView({ block: "nearest" });
    });
    refresh();
  }

  // --- the "Add model" dialog ---------------------------------------------------------------------

  function showAddError(form, error) {
    if (Object.keys(error.fields).length) {
      mi.showErrors(form, error);
    } else if (IDENTIFIER_ERRORS.has(error.code)) {
      mi.showErrors(form, { message: "The model could not be registered.", fields: { model_identifier: [error.message] } });
    } else if (error.code === "UNSUPPORTED_QUANTIZATION") {
      mi.showErrors(form, { message: "The model could not be registered.", fields: { quantization: [error.message] } });
    } else {
      mi.showErrors(form, error);
      const existing = error.code === "MODEL_ALREADY_REGISTERED" && error.details.model_id;
      if (existing) {
        const link = document.createElement("a");
        link.href = `/models/${encodeURIComponent(existing)}/`;
        link.textContent = "Open it";
        form.querySelector(".form-error")?.append(" ", link);
      }
    }
    (form.querySelector(".invalid") || form.elements.model_identifier).focus();
  }

  function initAddDialog(onAdded) {
    const opener = document.getElementById("add-model-open");
    const dialog = document.getElementById("add-model-dialog");
    if (!opener || !dialog) return;
    const form = document.getElementById("add-model-form");
    const identifier = form.elements.model_identifier;
    const label = document.getElementById("add-identifier-label");
    const help = document.getElementById("add-identifier-help");
    const revisionField = document.getElementById("add-revision-field");
    const submit = document.getElementById("add-model-submit");

    function sourceChanged() {
      const local = form.elements.source.value === "local";
      label.textContent = local ? "Folder path" : "Hub id";
      identifier.placeholder = local ? "/srv/models/my-model" : "openai-community/gpt2";
      help.textContent = local ? help.dataset.local : help.dataset.hub;
      revisionField.hidden = local;
    }

    opener.addEventListener("click", () => {
      dialog.showModal();
      identifier.focus();
    });
    document.getElementById("add-model-cancel").addEventListener("click", () => dialog.close());
    // A click on the backdrop closes it, like Escape (the backdrop's clicks land on the dialog element,
    // outside its box; clicks on its own padding land there too, inside the box, and must not close it).
    dialog.addEventListener("click", (event) => {
      if (event.target !== dialog) return;
      const box = dialog.getBoundingClientRect();
      const inside = event.clientX >= box.left && event.clientX <= box.right
        && event.clientY >= box.top && event.clientY <= box.bottom;
      if (!inside) dialog.close();
    });
    form.addEventListener("change", (event) => { if (event.target.name === "source") sourceChanged(); });

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      mi.clearErrors(form);
      const local = form.elements.source.value === "local";
      const body = {
        source: form.elements.source.value,
        model_identifier: identifier.value.trim(),
        name: form.elements.name.value.trim(),
        quantization: form.elements.quantization.value,
        auto_load: form.elements.auto_load.checked,
      };
      if (!local && form.elements.revision.value.trim()) body.revision = form.elements.revision.value.trim();
      submit.disabled = true;
      submit.textContent = "Inspecting…";
      try {
        const model = await mi.api("POST", "models", body);
        dialog.close();
        form.reset();
        sourceChanged();
        onAdded(model);
        mi.toast(`Registered ${model.name}${body.auto_load ? " — loading" : ""}.`, "ok");
      } catch (error) {
        showAddError(form, error);
      } finally {
        submit.disabled = false;
        submit.textContent = "Add model";
      }
    });
    sourceChanged();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const grid = document.getElementById("model-grid");
    if (grid) initList(grid);
  });
})();
