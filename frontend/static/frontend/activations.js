// Activation caches: the list's filters, and the browser's neuron picker, sample heatmap, log-scale
// switch, snippet copy and delete. The neuron and sample panels are rendered by the server (the same
// templates as the first load) and fetched as fragments: `?fragment=neuron` / `?fragment=sample`.
(function () {
  "use strict";

  // --- list -------------------------------------------------------------------------------------

  function setUpList() {
    const filters = document.getElementById("cache-filters");
    if (!filters) return;
    filters.querySelector('button[type="submit"]').hidden = true; // a change applies the filter
    filters.querySelectorAll("select").forEach((select) => {
      select.addEventListener("change", () => filters.requestSubmit());
    });
    filters.addEventListener("submit", (event) => {
      // Leave empty choices out of the URL.
      event.preventDefault();
      const query = new URLSearchParams();
      for (const [name, value] of new FormData(filters)) if (value) query.set(name, value);
      window.location.search = query.toString();
    });
  }

  // --- browser ----------------------------------------------------------------------------------

  function setUpBrowser() {
    const neuronForm = document.getElementById("neuron-form");
    if (!neuronForm) return;
    const neuronInput = document.getElementById("neuron-input");
    const sampleForm = document.getElementById("sample-form");
    const sampleInput = document.getElementById("sample-input");
    const neuronPanel = document.getElementById("neuron-panel");
    const samplePanel = document.getElementById("sample-panel");
    const readout = document.getElementById("token-readout");
    const hook = neuronForm.elements.hook.value;
    const lastSample = Number(sampleInput.max);
    const lastNeuron = Number(neuronInput.max);
    const state = { neuron: Number(neuronInput.value), sample: Number(sampleInput.value) };
    const inFlight = {};

    function fragmentUrl(fragment) {
      const query = new URLSearchParams({ hook, neuron: state.neuron, sample: state.sample, fragment });
      return `${window.location.pathname}?${query}`;
    }

    // The address bar always names what is shown, so the view can be shared or reloaded.
    function remember() {
      const query = new URLSearchParams({ hook, neuron: state.neuron, sample: state.sample });
      history.replaceState(null, "", `${window.location.pathname}?${query}`);
    }

    // Fetch one panel; a newer request for the same panel aborts the older one. Errors (the server's
    // message, or a network failure) show inside the panel; the inputs keep what was typed.
    async function load(panel, fragment) {
      inFlight[fragment]?.abort();
      const controller = new AbortController();
      inFlight[fragment] = controller;
      panel.setAttribute("aria-busy", "true");
      try {
        const { html, ok } = await mi.fragment(fragmentUrl(fragment), { signal: controller.signal });
        panel.innerHTML = html;
        return ok;
      } catch (error) {
        if (error.name === "AbortError") return false;
        panel.innerHTML = `<p class="notice error" role="alert">${mi.escapeHtml(error.message || "The server cannot be reached.")}</p>`;
        return false;
      } finally {
        if (inFlight[fragment] === controller) {
          delete inFlight[fragment];
          panel.removeAttribute("aria-busy");
        }
      }
    }

    function markPicks() {
      document.querySelectorAll("#quick-picks .pick").forEach((button) => {
        button.setAttribute("aria-pressed", String(Number(button.dataset.neuron) === state.neuron));
      });
    }

    function updateSampleButtons() {
      document.getElementById("sample-prev").disabled = state.sample <= 0;
      document.getElementById("sample-next").disabled = state.sample >= lastSample;
    }

    function showNeuron(neuron) {
      if (!Number.isInteger(neuron) || neuron < 0 || neuron > lastNeuron) {
        fieldError(neuronForm, neuronInput, `Choose a neuron from 0 to ${lastNeuron}.`);
        return;
      }
      mi.clearErrors(neuronForm);
      state.neuron = neuron;
      neuronInput.value = neuron;
      document.getElementById("sample-neuron").value = neuron;
      markPicks();
      remember();
      load(neuronPanel, "neuron");
      load(samplePanel, "sample");
    }

    function showSample(sample) {
      if (!Number.isInteger(sample) || sample < 0 || sample > lastSample) {
        fieldError(sampleForm, sampleInput, `Choose a sample from 0 to ${lastSample}.`);
        return;
      }
      mi.clearErrors(sampleForm);
      state.sample = sample;
      sampleInput.value = sample;
      updateSampleButtons();
      remember();
      load(samplePanel, "sample");
    }

    // The same marks as mi.showErrors, for a check made here before asking the server.
    function fieldError(form, input, message) {
      mi.clearErrors(form);
      input.classList.add("invalid");
      const note = document.createElement("div");
      note.className = "field-error";
      note.dataset.errorFor = input.name;
      note.setAttribute("role", "alert");
      note.textContent = message;
      input.closest(".field").appendChild(note);
    }

    const parse = (text) => (String(text).trim() === "" ? NaN : Number(text));

    neuronForm.addEventListener("submit", (event) => {
      event.preventDefault();
      showNeuron(parse(neuronInput.value));
    });
    document.getElementById("quick-picks")?.addEventListener("submit", (event) => {
      event.preventDefault();
      const button = event.submitter;
      if (button?.dataset.neuron) showNeuron(Number(button.dataset.neuron));
    });
    sampleForm.addEventListener("submit", (event) => {
      event.preventDefault();
      showSample(parse(sampleInput.value));
    });
    sampleInput.addEventListener("change", () => showSample(parse(sampleInput.value)));
    document.getElementById("sample-prev").addEventListener("click", () => showSample(state.sample - 1));
    document.getElementById("sample-next").addEventListener("click", () => showSample(state.sample + 1));

    // ← / → step through samples, unless the user is typing somewhere.
    document.addEventListener("keydown", (event) => {
      if (event.altKey || event.ctrlKey || event.metaKey || event.shiftKey) return;
      if (event.target.closest("input, select, textarea, [contenteditable], dialog")) return;
      if (event.key === "ArrowLeft" && state.sample > 0) { event.preventDefault(); showSample(state.sample - 1); }
      if (event.key === "ArrowRight" && state.sample < lastSample) { event.preventDefault(); showSample(state.sample + 1); }
    });

    // A top token's "sample n" jumps to that sample's heatmap.
    neuronPanel.addEventListener("click", (event) => {
      const button = event.target.closest(".show-sample");
      if (!button) return;
      showSample(Number(button.dataset.sample));
      document.getElementById("sample-section").scrollIntoView({ behavior: "smooth", block: "start" });
    });

    // Hovering a token reads its exact value out beside the sample controls.
    document.addEventListener("mouseover", (event) => {
      const token = event.target.closest(".tokens .tok");
      if (!token || !readout) return;
      readout.textContent = token.title;
    });

    const logScale = document.getElementById("log-scale");
    logScale?.addEventListener("change", () => {
      document.getElementById("histogram").dataset.scale = logScale.checked ? "log" : "linear";
    });

    document.getElementById("copy-snippet")?.addEventListener("click", async () => {
      const text = document.getElementById("snippet").textContent;
      try {
        await navigator.clipboard.writeText(text);
        mi.toast("Snippet copied.", "ok", 3);
      } catch (_) {
        // No clipboard access (plain http on another host): select it for Ctrl+C instead.
        const range = document.createRange();
        range.selectNodeContents(document.getElementById("snippet"));
        window.getSelection().removeAllRanges();
        window.getSelection().addRange(range);
        mi.toast("Selected: press Ctrl+C to copy.", "info", 4);
      }
    });
  }

  function setUpDelete() {
    const button = document.getElementById("delete-cache");
    if (!button) return;
    button.addEventListener("click", async () => {
      const id = button.dataset.cacheId;
      const sure = await mi.confirm(`Delete ${id} and its files? An identical extraction would compute it again.`, {
        confirmLabel: "Delete cache",
      });
      if (!sure) return;
      button.disabled = true;
      try {
        await mi.api("DELETE", `activation-caches/${encodeURIComponent(id)}`);
        window.location.assign(button.dataset.next);
      } catch (error) {
        mi.toast(error.message, "error");
        button.disabled = false;
      }
    });
  }

  // A cache being written: follow its extraction live (REST polling while the socket is down) and
  // reload when it ends, so the charts appear without the user asking.
  function setUpWriting() {
    const box = document.getElementById("writing");
    if (!box) return;
    const id = box.dataset.extractionId;
    let reloading = false;
    function update(job) {
      if (!job || reloading) return;
      mi.setProgress(box.querySelector(".progress"), job.progress);
      document.getElementById("writing-percent").textContent = `${Math.round(job.progress || 0)} %`;
      const rate = job.tokens_per_second ? ` · ${Math.round(job.tokens_per_second)} tokens/s` : "";
      const eta = job.eta_seconds ? ` · ${mi.duration(job.eta_seconds)} left` : "";
      const detail = document.getElementById("writing-detail");
      detail.textContent = `${id} · ${job.status} · ${job.samples_processed} / ${job.total_samples} samples${rate}${eta}`;
      if (["completed", "failed", "cancelled"].includes(job.status)) {
        reloading = true;
        window.location.reload();
      }
    }
    mi.live.subscribe(`extraction.${id}`, (message) => update(message.data));
    mi.live.poll(async () => update(await mi.api("GET", `extractions/${encodeURIComponent(id)}`)));
  }

  function start() {
    setUpWriting();
    setUpList();
    setUpBrowser();
    setUpDelete();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
