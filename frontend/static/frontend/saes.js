// Sparse autoencoders: the training form's choices (hooks of the chosen cache, fields of the chosen
// architecture), live rows on the list, and the SAE page following its training. What changes is
// rendered by the server (the same templates as the first load) and fetched as fragments:
// `?fragment=training` (status, progress, curves), `?fragment=results` (held-out metrics, facts),
// `?fragment=analyses` (its feature analyses: phase, percent, tokens/s, ETA), `?fragment=row&sae=<id>`.
// Events over `sae.<id>` (`sae:*`, and `analysis:*` of its analyses) only say *when* to fetch, at
// most once a second.
(function () {
  "use strict";

  const GAP_MS = 1000;

  // run(parts) for the parts asked for since the last run, at most once per GAP_MS; parts asked for
  // while a run is in flight wait for the next one.
  function throttled(run) {
    const wanted = new Set();
    let timer = null;
    let last = 0;
    function schedule(parts) {
      parts.forEach((part) => wanted.add(part));
      if (timer || !wanted.size) return;
      timer = setTimeout(async () => {
        const now = [...wanted];
        wanted.clear();
        last = Date.now();
        try { await run(now); } catch (_) { /* the next event or poll tries again */ }
        timer = null;
        schedule([]);
      }, Math.max(0, last + GAP_MS - Date.now()));
    }
    return schedule;
  }

  // --- the training form ------------------------------------------------------------------------

  function setUpTrainForm() {
    const form = document.getElementById("train-form");
    if (!form) return;
    const cache = document.getElementById("train-cache");
    const hook = document.getElementById("train-hook");
    const architecture = document.getElementById("train-architecture");
    const tokens = document.getElementById("train-tokens");

    // Only the chosen cache's hooks are in the list (a hidden optgroup still shows in some browsers'
    // dropdowns: the others are taken out, kept aside); the same hook stays chosen if the new cache
    // has it too.
    const groups = [...hook.querySelectorAll("optgroup")];
    function showHooks() {
      const selected = hook.selectedOptions[0];
      const group = groups.find((each) => each.dataset.cache === cache.value) || null;
      groups.forEach((each) => { if (each !== group) each.remove(); });
      if (group && group.parentElement !== hook) hook.appendChild(group);
      if (group && (!selected || selected.parentElement !== group)) {
        const same = [...group.querySelectorAll("option")].find((option) => option.value === selected?.value);
        (same || group.querySelector("option")).selected = true;
      }
      const option = cache.selectedOptions[0];
      if (option) tokens.placeholder = option.dataset.tokens;
      describeHook();
    }

    // The default expansion for the chosen hook of the chosen cache, as the service will pick it.
    const expansion = document.getElementById("train-expansion");
    function describeHook() {
      const chosen = hook.selectedOptions[0];
      if (chosen && chosen.dataset.expansion) expansion.placeholder = chosen.dataset.expansion;
    }
    hook.addEventListener("change", describeHook);

    // Fields that apply to some architectures only are hidden (and not sent) for the others.
    function showArchitectureFields() {
      form.querySelectorAll("[data-architectures]").forEach((field) => {
        const applies = field.dataset.architectures.split(" ").includes(architecture.value);
        field.hidden = !applies;
        field.querySelectorAll("input, select").forEach((input) => { input.disabled = !applies; });
      });
    }

    cache.addEventListener("change", showHooks);
    architecture.addEventListener("change", showArchitectureFields);
    showHooks();
    showArchitectureFields();
    form.addEventListener("submit", () => {
      document.getElementById("train-submit").disabled = true; // one training per click
    });
  }

  // --- the list: rows of SAEs in training follow their events -----------------------------------

  function setUpList() {
    const table = document.getElementById("sae-table");
    if (!table) return;
    const rowOf = (id) => table.querySelector(`tr[data-sae-id="${CSS.escape(id)}"]`);
    const refresh = throttled(async (ids) => {
      for (const id of ids) {
        const query = new URLSearchParams({ fragment: "row", sae: id });
        const { html, ok } = await mi.fragment(`${window.location.pathname}?${query}`);
        const row = rowOf(id);
        const [fresh] = mi.elementsOf(html);
        if (ok && row && fresh) {
          row.replaceWith(fresh);
          mi.localizeTimes(fresh, { shortInTables: true });
        }
      }
    });
    const active = [...table.querySelectorAll("tr[data-active]")].map((row) => row.dataset.saeId);
    for (const id of active) {
      mi.live.subscribe(`sae.${id}`, (message) => {
        if (message.type === "snapshot" && message.data?.status === rowOf(id)?.dataset.status
          && message.data?.status !== "running") return;
        refresh([id]);
      });
    }
    if (active.length) {
      mi.live.poll(() => refresh([...table.querySelectorAll("tr[data-active]")].map((row) => row.dataset.saeId)));
    }
    mi.localizeTimes(table, { shortInTables: true });
  }

  // --- one SAE ----------------------------------------------------------------------------------

  function setUpDetail() {
    const page = document.getElementById("sae-page");
    if (!page) return;
    const id = page.dataset.saeId;
    const live = document.getElementById("sae-live");
    const results = document.getElementById("sae-results");
    const analyses = document.getElementById("sae-analyses");
    const state = () => document.getElementById("sae-training").dataset;
    const analysing = () => Boolean(analyses?.querySelector("[data-active]"));

    // Buttons and panels that depend on the status: data-when="active" | "idle" | "completed".
    function applyState() {
      const { status, evaluationStatus } = state();
      const active = status === "queued" || status === "running";
      page.querySelectorAll("[data-when]").forEach((node) => {
        const when = node.dataset.when;
        node.hidden = !((when === "active" && active) || (when === "idle" && !active)
          || (when === "completed" && status === "completed"));
      });
      const evaluate = document.getElementById("evaluate-sae");
      if (evaluate) evaluate.disabled = Boolean(evaluationStatus);
    }

    const refresh = throttled(async (parts) => {
      const base = window.location.pathname;
      if (parts.includes("training")) {
        const { html, ok } = await mi.fragment(`${base}?fragment=training`);
        if (ok) live.innerHTML = html;
      }
      if (parts.includes("results")) {
        const { html, ok } = await mi.fragment(`${base}?fragment=results`);
        if (ok) results.innerHTML = html;
      }
      if (parts.includes("analyses") && analyses) {
        const { html, ok } = await mi.fragment(`${base}?fragment=analyses`);
        if (ok) analyses.innerHTML = html;
      }
      applyState();
      mi.localizeTimes(page);
    });

    mi.live.subscribe(`sae.${id}`, (message) => {
      const data = message.data || {};
      if (message.type === "snapshot") {
        // The page may have been rendered before the newest step: catch up if so.
        const shown = state();
        if (data.status !== shown.status || String(data.step) !== shown.step
          || (data.evaluation_status || "") !== shown.evaluationStatus) refresh(["training", "results"]);
        return;
      }
      if (message.event === "sae:deleted") return;
      if (message.event?.startsWith("analysis:")) {
        refresh(["analyses"]);
        return;
      }
      refresh(message.event === "sae:progress" ? ["training"] : ["training", "results"]);
    });
    mi.live.poll(() => {
      const { status, evaluationStatus } = state();
      if (status === "queued" || status === "running" || evaluationStatus) refresh(["training", "results"]);
      if (analysing()) refresh(["analyses"]);
    });
    document.getElementById("analysis-form")?.addEventListener("submit", () => {
      document.getElementById("run-analysis").disabled = true; // one analysis per click
    });
    applyState();
    mi.localizeTimes(page);
  }

  // Forms with data-confirm ask first (delete).
  function setUpConfirm() {
    document.querySelectorAll("form[data-confirm]").forEach((form) => {
      form.addEventListener("submit", async (event) => {
        if (form.dataset.confirmed) return;
        event.preventDefault();
        const sure = await mi.confirm(form.dataset.confirm, { confirmLabel: form.dataset.confirmLabel || "Confirm" });
        if (!sure) return;
        form.dataset.confirmed = "1";
        form.requestSubmit(event.submitter);
      });
    });
  }

  function start() {
    setUpTrainForm();
    setUpList();
    setUpDetail();
    setUpConfirm();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
