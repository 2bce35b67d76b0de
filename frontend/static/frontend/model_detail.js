// Model detail page (/models/<id>/): the header's status and actions live over `model.<id>` (shared code
// in models.js), the extraction form (hook picker, quick picks, inline API errors), and the job panel
// with live progress over `extraction.<id>`, tokens/s, ETA, cancel, and the link to the new cache.
// While the socket is down every part refreshes over REST (mi.live.poll).
(function () {
  "use strict";

  const ACTIVE = new Set(["queued", "running"]);
  const $ = (id) => document.getElementById(id);
  const number = (value) => Number(value).toLocaleString("en-US");

  // --- the tables of extraction jobs and caches -----------------------------------------------------

  // A new row of the jobs or caches table as the server renders the page's rows
  // (?fragment=job-row&job=… / cache-row&cache=…); null when it is not this model's.
  async function serverRow(kind, id) {
    const query = new URLSearchParams({ fragment: `${kind}-row`, [kind]: id });
    const { html, ok } = await mi.fragment(`${location.pathname}?${query}`);
    if (!ok) return null;
    const [row] = mi.elementsOf(html);
    mi.localizeTimes(row, { shortInTables: true });
    return row;
  }

  const jobsTable = {
    body: () => document.querySelector("#job-table tbody"),
    pending: new Map(), // extraction id → its row, while the server renders it

    // A job's state into its row; a job not listed yet gets its row first.
    upsert(state) {
      const body = this.body();
      if (!body || !state.extraction_id) return;
      const id = state.extraction_id;
      const row = body.querySelector(`tr[data-job-id="${CSS.escape(id)}"]`);
      if (row) { this.show(row, state); return; }
      if (!this.pending.has(id)) this.pending.set(id, this.add(id));
      this.pending.get(id).then((added) => added && this.show(added, state));
    },

    async add(id) {
      let row = null;
      try {
        row = await serverRow("job", id);
      } catch (error) {
        console.warn("jobs:", error.message);
      }
      this.pending.delete(id);
      const body = this.body();
      const listed = body.querySelector(`tr[data-job-id="${CSS.escape(id)}"]`);
      if (listed || !row) return listed;
      body.prepend(row);
      $("jobs-wrap").hidden = false;
      $("jobs-empty").hidden = true;
      return row;
    },

    show(row, state) {
      const field = (name) => row.querySelector(`[data-job-field="${name}"]`);
      if (state.total_samples !== undefined) field("samples").textContent = `${state.samples_processed} / ${state.total_samples}`;
      if (state.tokens_per_second) field("rate").textContent = number(Math.round(state.tokens_per_second));
      if (state.status) {
        const badge = field("status");
        badge.className = `badge status-${state.status}`;
        badge.textContent = state.cached ? "cached" : state.status;
      }
      if (state.status === "completed" && state.cache_id) {
        field("cache").innerHTML = `<a href="/activations/${encodeURIComponent(state.cache_id)}/"><code>${mi.escapeHtml(state.cache_id)}</code></a>`;
      }
    },
  };

  const cachesTable = {
    async add(cacheId) {
      const body = document.querySelector("#cache-table tbody");
      const listed = () => body.querySelector(`tr[data-cache-id="${CSS.escape(cacheId)}"]`);
      if (!body || listed()) return;
      let row;
      try {
        row = await serverRow("cache", cacheId);
      } catch (error) {
        console.warn("caches:", error.message);
        return;
      }
      if (!row || listed()) return;
      body.prepend(row);
      $("caches-wrap").hidden = false;
      $("caches-empty").hidden = true;
      const count = body.querySelectorAll("tr").length;
      $("cache-count").textContent = `${count} cache${count === 1 ? "" : "s"}`;
    },
  };

  // --- the job panel: one extraction followed live ------------------------------------------------

  function createJobPanel() {
    const panel = $("job-panel");
    const subscribed = new Set();
    let job = null; // the followed extraction's latest state, plus what the page measured itself
    let ticker = null;

    function follow(state, { estimateSeconds = null } = {}) {
      job = { ...state, estimateSeconds, seenRunningAt: null };
      render(state);
      // Bring the panel into view only when it is off screen (a long form pushes it below the fold).
      const box = panel.getBoundingClientRect();
      if (box.top > innerHeight || box.bottom < 0) panel.scrollIntoView({ block: "nearest", behavior: "smooth" });
      const id = state.extraction_id;
      if (ACTIVE.has(state.status) && !subscribed.has(id)) {
        subscribed.add(id);
        mi.live.subscribe(`extraction.${id}`, (message) => {
          if (message.type === "snapshot" || message.event) update(message.data);
        });
      }
    }

    // Any state of any extraction of this model: the jobs table takes it; the panel if it is the followed one.
    function update(state) {
      jobsTable.upsert(state);
      if (job && state.extraction_id === job.extraction_id) render(state);
    }

    function elapsedSeconds() {
      if (job.extraction_time_seconds !== null && job.extraction_time_seconds !== undefined && !ACTIVE.has(job.status)) {
        return job.extraction_time_seconds;
      }
      if (job.started_at) return (Date.now() - Date.parse(job.started_at)) / 1000;
      return job.seenRunningAt ? (Date.now() - job.seenRunningAt) / 1000 : null;
    }

    function tick() {
      const seconds = job.cached ? 0 : elapsedSeconds();
      // Tiny jobs finish in well under a second: tenths say more than "0s" there.
      $("job-elapsed").textContent = seconds !== null && seconds < 10 ? `${seconds.toFixed(1)} s` : mi.duration(seconds);
      if (!ACTIVE.has(job.status)) { clearInterval(ticker); ticker = null; }
    }

    function render(state) {
      const wasCompleted = job.status === "completed" && job.rendered;
      Object.assign(job, state, { rendered: true });
      if (job.status === "running" && !job.seenRunningAt) job.seenRunningAt = Date.now();
      panel.hidden = false;
      $("job-id").textContent = job.extraction_id;
      const badge = $("job-status");
      badge.className = `badge status-${job.status}`;
      badge.textContent = job.status;
      const percent = job.status === "completed" ? 100 : Number(job.progress) || 0;
      mi.setProgress($("job-progress"), percent);
      $("job-percent").textContent = `${Math.round(percent)} %`;
      $("job-samples").textContent = job.status === "queued"
        ? "Queued — waiting for the worker"
        : `${number(job.samples_processed || 0)} / ${number(job.total_samples || 0)} samples`;
      $("job-rate").textContent = job.tokens_per_second ? number(Math.round(job.tokens_per_second)) : "—";
      let eta = "—";
      if (job.status === "running" && job.eta_seconds !== null && job.eta_seconds !== undefined) eta = mi.duration(job.eta_seconds);
      else if (job.status === "queued" && job.estimateSeconds) eta = `≈ ${mi.duration(job.estimateSeconds)}`;
      else if (job.status === "completed") eta = "done";
      $("job-eta").textContent = eta;
      if (job.hooks) $("job-hooks").textContent = String(job.hooks.length);
      const cancel = $("job-cancel");
      if (cancel) cancel.hidden = !ACTIVE.has(job.status);

      const result = $("job-result"), notice = $("job-notice"), open = $("job-open");
      result.hidden = ACTIVE.has(job.status);
      open.hidden = !(job.status === "completed" && job.cache_id);
      if (job.cache_id) open.href = `/activations/${encodeURIComponent(job.cache_id)}/`;
      if (job.status === "completed") {
        notice.className = "notice ok";
        notice.textContent = job.cached
          ? "Using cached activations: an identical extraction was done before, so nothing was recomputed."
          : `Extraction complete: ${number(job.total_samples || job.samples_processed || 0)} samples`
            + (job.file_size_bytes ? `, ${mi.bytes(job.file_size_bytes)} on disk.` : ".");
        if (!wasCompleted && job.cache_id) cachesTable.add(job.cache_id);
      } else if (job.status === "failed") {
        notice.className = "notice error";
        notice.textContent = `${job.error_code || "FAILED"}: ${job.error_message || "The extraction failed."}`;
      } else if (job.status === "cancelled") {
        notice.className = "notice warn";
        notice.textContent = "Cancelled. The partial cache was removed.";
      }
      if (ACTIVE.has(job.status) && !ticker) ticker = setInterval(tick, 1000);
      tick();
    }

    $("job-cancel")?.addEventListener("click", async (event) => {
      const button = event.currentTarget;
      if (!job || !(await mi.confirm("Cancel this extraction? A running one stops after its current batch.", { confirmLabel: "Cancel extraction" }))) return;
      button.disabled = true;
      try {
        update(await mi.api("POST", `extractions/${job.extraction_id}/cancel`));
        mi.toast("Cancelling the extraction…");
      } catch (error) {
        mi.toast(error.message, "error");
      } finally {
        button.disabled = false;
      }
    });

    // REST refresh of the followed job while the socket is down.
    async function poll() {
      if (job && ACTIVE.has(job.status)) update(await mi.api("GET", `extractions/${job.extraction_id}`));
    }

    return { follow, update, poll };
  }

  // --- the extraction form --------------------------------------------------------------------------

  function initExtractForm(form, jobPanel) {
    const summary = $("hook-summary");
    const boxes = () => [...form.querySelectorAll('input[name="hooks"]')];

    function pickBoxes(suffix) {
      return boxes().filter((box) => box.value.startsWith("blocks.") && box.value.endsWith(`.${suffix}`));
    }

    function hooksChanged() {
      const checked = boxes().filter((box) => box.checked);
      summary.textContent = checked.length
        ? `${checked.length} hook point${checked.length === 1 ? "" : "s"} selected`
        : "No hook points selected.";
      form.querySelectorAll("[data-pick]").forEach((button) => {
        const picked = button.dataset.pick ? pickBoxes(button.dataset.pick) : [];
        button.setAttribute("aria-pressed", String(picked.length > 0 && picked.every((box) => box.checked)));
      });
      sizeChanged();
    }

    // A quick pick checks that hook at every layer; pressed again it unchecks them. "Clear" unchecks all.
    form.querySelectorAll("[data-pick]").forEach((button) => {
      button.addEventListener("click", () => {
        if (!button.dataset.pick) {
          boxes().forEach((box) => { box.checked = false; });
        } else {
          const picked = pickBoxes(button.dataset.pick);
          const all = picked.every((box) => box.checked);
          picked.forEach((box) => { box.checked = !all; });
        }
        hooksChanged();
      });
    });
    form.addEventListener("change", (event) => { if (event.target.name === "hooks") hooksChanged(); });

    // The cache's size at most: every sample at max length, each token's rows in the stored dtype
    // plus its int64 token columns (data-token-bytes: activations.store.cache_bytes_per_token's).
    const sizeNote = $("extract-size");
    function sizeChanged() {
      const values = new FormData(form);
      const hidden = Number(sizeNote.dataset.hiddenSize) || 0;
      const layers = String(values.get("layer_indices") || "").split(/[\s,]+/).filter((layer) => /^\d+$/.test(layer));
      const modules = String(values.get("module_hooks") || "").split(/[\s,]+/).filter(Boolean);
      const width = boxes().filter((box) => box.checked).reduce((sum, box) => sum + Number(box.dataset.width || 0), 0)
        + layers.length * hidden;
      if (!width) { sizeNote.textContent = "Choose hook points to see the cache's size."; return; }
      const option = datasetSelect.selectedOptions[0];
      const samples = Number(values.get("sample_count")) || Number(option?.dataset.samples) || 0;
      const tokens = samples * (Number(values.get("max_length")) || 0);
      const perToken = width * Number(form.elements.dtype.selectedOptions[0].dataset.bytes)
        + Number(sizeNote.dataset.tokenBytes);
      sizeNote.textContent = `At most ${mi.bytes(tokens * perToken)} (${tokens.toLocaleString()} tokens × ${perToken.toLocaleString()} bytes)`
        + (modules.length ? ", plus the raw modules." : ".");
    }
    form.addEventListener("input", sizeChanged);
    form.addEventListener("change", sizeChanged);

    const datasetSelect = form.elements.dataset_id;
    function datasetChanged() {
      const option = datasetSelect.selectedOptions[0];
      if (!option) return;
      form.elements.sample_count.placeholder = `all ${option.dataset.samples}`;
      form.elements.sample_count.max = option.dataset.samples;
    }
    datasetSelect.addEventListener("change", datasetChanged);
    sizeChanged();

    function asNumber(raw) {
      const value = Number(raw);
      return raw !== "" && Number.isInteger(value) ? value : raw;
    }

    // The request body, as the API names it. Returns {error} for what only the browser can tell.
    function collect() {
      const values = new FormData(form);
      const body = { dataset_id: values.get("dataset_id"), dtype: values.get("dtype") };
      const hooks = values.getAll("hooks");
      const modules = String(values.get("module_hooks") || "").split(/[\s,]+/).filter(Boolean);
      body.hooks = [...hooks, ...modules]; // none picked: the API says a hook point is needed
      const layers = String(values.get("layer_indices") || "").split(/[\s,]+/).filter(Boolean);
      if (layers.some((layer) => !/^\d+$/.test(layer))) {
        return { error: { message: "The request is not valid.", fields: { layer_indices: ["Whole layer numbers, separated by commas: 0, 6, 11."] } } };
      }
      if (layers.length) body.layer_indices = layers.map(Number);
      for (const name of ["sample_count", "batch_size", "max_length"]) {
        const raw = String(values.get(name) || "").trim();
        if (raw !== "") body[name] = asNumber(raw);
      }
      return { body };
    }

    function showError(error) {
      if (error.code === "INVALID_HOOK" && !Object.keys(error.fields).length) {
        const invalid = error.details.invalid || [];
        const fromModules = invalid.some((name) => String(name).startsWith("module:"));
        const field = fromModules ? "module_hooks" : boxes().length ? "hooks" : "module_hooks";
        mi.showErrors(form, { message: "Choose the hook points again.", fields: { [field]: [error.message] } });
      } else if (error.code === "DATASET_NOT_FOUND") {
        mi.showErrors(form, { message: "Choose another dataset.", fields: { dataset_id: [error.message] } });
      } else {
        mi.showErrors(form, error);
      }
      const invalid = form.querySelector(".invalid");
      const details = invalid?.closest("details");
      if (details) details.open = true;
      (invalid || form.querySelector(".form-error"))?.focus?.();
    }

    const submit = $("extract-submit");
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      mi.clearErrors(form);
      const { body, error } = collect();
      if (error) { showError({ ...error, code: "", details: {} }); return; }
      submit.disabled = true;
      submit.textContent = "Starting…";
      try {
        const answer = await mi.api("POST", `models/${form.closest("[data-model-id]").dataset.modelId}/extract-activations`, body);
        jobsTable.upsert(answer);
        jobPanel.follow(answer, { estimateSeconds: answer.estimated_time_seconds });
        if (answer.cached) mi.toast("Using cached activations.", "ok");
      } catch (failure) {
        showError(failure);
      } finally {
        submit.disabled = false;
        submit.textContent = "Extract activations";
      }
    });

    datasetChanged();
    hooksChanged();
  }

  // --- the page -------------------------------------------------------------------------------------

  function init(page) {
    const modelId = page.dataset.modelId;
    const form = $("extract-form");
    const locked = $("extract-locked");
    const jobPanel = createJobPanel();
    let gone = false;

    // The form is there only for a ready model; the notice says why when it is not.
    page.addEventListener("model-state", () => {
      const status = page.dataset.status;
      if (form) form.hidden = status !== "ready" || gone;
      if (locked) {
        locked.hidden = status === "ready" || gone;
        locked.textContent = status === "loading"
          ? "Load the model to extract activations. It is loading now; the form appears when it is ready."
          : "Load the model to extract activations.";
      }
    });

    function markDeleted() {
      if (gone) return;
      gone = true;
      $("model-deleted").hidden = false;
      page.querySelectorAll("button[data-action], #extract-form button").forEach((button) => { button.disabled = true; });
      if (form) form.hidden = true;
    }

    miModels.bindActions(page, {
      onDeleted: () => {
        try { sessionStorage.setItem("mistudio-flash", "The model was deleted."); } catch (_) { /* no flash */ }
        location.assign("/");
      },
    });

    mi.live.subscribe(`model.${modelId}`, (message) => {
      if (message.type === "snapshot") miModels.apply(page, message.data);
      else if (message.event === "model:deleted") markDeleted();
      else if (message.event?.startsWith("model:")) miModels.apply(page, message.data);
      else if (message.event?.startsWith("extraction:")) jobPanel.update(message.data);
    });
    mi.live.poll(async () => {
      try {
        miModels.apply(page, await mi.api("GET", `models/${modelId}`));
      } catch (error) {
        if (error.status === 404) markDeleted();
        else throw error;
      }
      await jobPanel.poll();
    });

    if (form) initExtractForm(form, jobPanel);
    mi.localizeTimes(document, { shortInTables: true });

    // Opened while an extraction of this model runs: follow it.
    const active = $("job-panel").dataset.activeJob;
    if (active) {
      mi.api("GET", `extractions/${active}`).then((state) => jobPanel.follow(state)).catch(() => {});
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    const page = document.getElementById("model-page");
    if (page) init(page);
  });
})();
