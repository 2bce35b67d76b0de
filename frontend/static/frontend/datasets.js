// Datasets pages: upload (drag and drop or pick a file, with upload progress), register a server path,
// list and delete on /datasets/; paged sample preview and delete on /datasets/<id>/. Every change goes
// through the REST API (/api/datasets…); the server-rendered rows and samples are the starting state.
(function () {
  "use strict";

  const FLASH_KEY = "mistudio-flash";
  // A fragment's rows or items, their times in the reader's time zone.
  function nodesOf(html) {
    const nodes = mi.elementsOf(html);
    nodes.forEach((node) => mi.localizeTimes(node));
    return nodes;
  }

  // A message to show on the next page (after a redirect), e.g. "Deleted …" on the list.
  function flashNext(message) {
    try { sessionStorage.setItem(FLASH_KEY, message); } catch (_) { /* private mode: no flash */ }
  }
  function showFlash() {
    let message = null;
    try { message = sessionStorage.getItem(FLASH_KEY); sessionStorage.removeItem(FLASH_KEY); } catch (_) { /* none */ }
    if (message) mi.toast(message, "ok");
  }

  // POST a FormData to /api/datasets with XMLHttpRequest, which (unlike fetch) reports upload
  // progress. Errors are mi.ApiError, exactly as mi.api throws them.
  function uploadWithProgress(formData, onProgress) {
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      xhr.open("POST", "/api/datasets");
      xhr.setRequestHeader("Accept", "application/json");
      xhr.setRequestHeader("X-CSRFToken", document.querySelector('meta[name="csrf-token"]')?.content || "");
      xhr.upload.addEventListener("progress", (event) => {
        if (event.lengthComputable) onProgress(100 * event.loaded / event.total, false);
      });
      xhr.upload.addEventListener("load", () => onProgress(100, true));
      xhr.addEventListener("load", () => {
        let data = null;
        try { data = xhr.responseText ? JSON.parse(xhr.responseText) : null; } catch (_) { data = null; }
        if (xhr.status >= 200 && xhr.status < 300) resolve(data);
        else reject(new mi.ApiError(xhr.status, data));
      });
      const unreachable = () => reject(new mi.ApiError(0, {
        error: { code: "NETWORK", message: "The server cannot be reached. Nothing was uploaded." },
      }));
      xhr.addEventListener("error", unreachable);
      xhr.addEventListener("abort", unreachable);
      xhr.send(formData);
    });
  }

  // The API's refusal on an upload form. A missing JSONL field / CSV column is also said under the
  // field input, with the ones the file has, since that is what the user changes next.
  function showUploadError(form, error) {
    const available = error.details?.available_fields;
    if (error.code === "FIELD_NOT_FOUND" && Array.isArray(available) && form.elements.field) {
      const more = (error.details.available_fields_count ?? available.length) - available.length;
      const listed = available.join(", ") + (more > 0 ? ` and ${more} more` : "");
      mi.showErrors(form, { message: error.message, fields: { field: [`The file has: ${listed}`] } });
      form.elements.field.focus();
      return;
    }
    mi.showErrors(form, error);
  }

  // --- list page ------------------------------------------------------------------------------------

  function initList(table) {
    const tbody = table.querySelector("tbody");
    const wrap = document.getElementById("dataset-table-wrap");
    const empty = document.getElementById("dataset-empty");
    const count = document.getElementById("dataset-count");

    function refreshCount() {
      const rows = tbody.querySelectorAll("tr").length;
      count.textContent = `${rows} dataset${rows === 1 ? "" : "s"}`;
      wrap.hidden = rows === 0;
      empty.hidden = rows !== 0;
    }

    // The new dataset's row as the server renders it (partials/dataset_row.html, as in the page).
    async function added(dataset) {
      const message = `Added “${dataset.name}”: ${dataset.sample_count} sample${dataset.sample_count === 1 ? "" : "s"}.`;
      let row = null;
      try {
        const query = new URLSearchParams({ fragment: "row", dataset: dataset.id });
        const { html, ok } = await mi.fragment(`${location.pathname}?${query}`);
        if (ok) [row] = nodesOf(html);
      } catch (error) {
        mi.toast(`${message} Reload the page to see it: ${error.message}`, "error");
        return;
      }
      if (row) {
        tbody.querySelector(`tr[data-dataset-id="${CSS.escape(dataset.id)}"]`)?.remove();
        row.classList.add("fresh");
        tbody.prepend(row);
        refreshCount();
      }
      mi.toast(message, "ok");
    }

    tbody.addEventListener("click", async (event) => {
      const button = event.target.closest('[data-action="delete"]');
      if (!button) return;
      const row = button.closest("tr");
      const name = row.dataset.name;
      const confirmed = await mi.confirm(
        `Delete the dataset “${name}”? Its stored samples are removed. Activation caches made from it stay.`,
        { confirmLabel: "Delete dataset" },
      );
      if (!confirmed) { button.focus(); return; }
      button.disabled = true;
      try {
        await mi.api("DELETE", `datasets/${encodeURIComponent(row.dataset.datasetId)}`);
        row.remove();
        refreshCount();
        mi.toast(`Deleted “${name}”.`, "ok");
      } catch (error) {
        button.disabled = false;
        mi.toast(`Could not delete “${name}”: ${error.message}`, "error", 12);
      }
    });

    const form = document.getElementById("upload-form");
    if (form) initUpload(form, added);
    const localForm = document.getElementById("local-form");
    if (localForm) initLocal(localForm, added);
    showFlash();
  }

  function initUpload(form, added) {
    const input = form.querySelector("#dataset-file");
    const zone = form.querySelector("#dropzone");
    const title = zone.querySelector(".drop-title");
    const nameInput = form.querySelector("#dataset-name");
    const clearButton = form.querySelector("#upload-clear");
    const submit = form.querySelector("#upload-button");
    const progressBox = form.querySelector("#upload-progress");
    const bar = progressBox.querySelector(".progress");
    const stage = progressBox.querySelector("#upload-stage");
    const percent = progressBox.querySelector("#upload-percent");
    const maxBytes = Number(form.dataset.maxBytes) || Infinity;
    let file = null;
    let busy = false;

    function choose(picked) {
      mi.clearErrors(form);
      file = picked || null;
      zone.classList.toggle("has-file", !!file);
      clearButton.hidden = !file;
      if (file) {
        title.innerHTML = `<strong>${mi.escapeHtml(file.name)}</strong> <span class="muted">${mi.escapeHtml(mi.bytes(file.size))}</span>`;
        nameInput.placeholder = file.name;
        if (file.size > maxBytes) {
          mi.showErrors(form, {
            message: "This file is too large to upload.",
            fields: { file: [`It is ${mi.bytes(file.size)}; uploads are limited to ${mi.bytes(maxBytes)}. Register it from a server path instead.`] },
          });
        }
      } else {
        title.textContent = title.dataset.emptyText;
        nameInput.placeholder = "Defaults to the file name";
      }
    }

    zone.addEventListener("click", () => { if (!busy) input.click(); });
    input.addEventListener("change", () => choose(input.files[0]));
    clearButton.addEventListener("click", () => { input.value = ""; choose(null); zone.focus(); });

    const hasFiles = (event) => [...(event.dataTransfer?.types || [])].includes("Files");
    // A file dropped next to the zone must not make the browser navigate away to it.
    for (const type of ["dragover", "drop"]) {
      window.addEventListener(type, (event) => { if (hasFiles(event)) event.preventDefault(); });
    }
    let depth = 0; // dragenter/leave fire for each child element; count to know when the drag left
    zone.addEventListener("dragenter", (event) => { event.preventDefault(); depth += 1; zone.classList.add("over"); });
    zone.addEventListener("dragover", (event) => {
      event.preventDefault();
      if (event.dataTransfer) event.dataTransfer.dropEffect = "copy";
    });
    zone.addEventListener("dragleave", () => { depth = Math.max(depth - 1, 0); if (!depth) zone.classList.remove("over"); });
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      depth = 0;
      zone.classList.remove("over");
      if (busy) return;
      const files = event.dataTransfer?.files || [];
      if (!files.length) return;
      if (files.length > 1) mi.toast("One file at a time: the first one was taken.", "info");
      input.value = ""; // the picked file (if any) is replaced by the dropped one
      choose(files[0]);
    });

    function setBusy(value) {
      busy = value;
      form.setAttribute("aria-busy", String(value));
      submit.disabled = value;
      zone.disabled = value;
      clearButton.disabled = value;
      submit.textContent = value ? "Uploading…" : "Upload";
      progressBox.hidden = !value;
    }

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (busy) return;
      mi.clearErrors(form);
      if (!file) {
        mi.showErrors(form, { message: "Choose or drop a file first.", fields: { file: ["No file chosen."] } });
        zone.focus();
        return;
      }
      const body = new FormData();
      body.append("file", file, file.name);
      for (const name of ["name", "format", "field"]) {
        const value = form.elements[name].value.trim();
        if (value) body.append(name, value);
      }
      setBusy(true);
      mi.setProgress(bar, 0);
      stage.textContent = "Uploading…";
      percent.textContent = "0 %";
      try {
        const dataset = await uploadWithProgress(body, (value, sent) => {
          mi.setProgress(bar, value);
          percent.textContent = `${Math.round(value)} %`;
          if (sent) stage.textContent = "Reading samples…";
        });
        form.reset();
        input.value = "";
        choose(null);
        added(dataset);
      } catch (error) {
        showUploadError(form, error);
      } finally {
        setBusy(false);
      }
    });
  }

  function initLocal(form, added) {
    const submit = form.querySelector("#local-button");
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      mi.clearErrors(form);
      const body = {};
      for (const name of ["local_path", "name", "format", "field"]) {
        const value = form.elements[name].value.trim();
        if (value) body[name] = value;
      }
      if (!body.local_path) {
        mi.showErrors(form, { message: "Give the path of a file or folder.", fields: { local_path: ["Required."] } });
        return;
      }
      submit.disabled = true;
      submit.textContent = "Reading…";
      try {
        const dataset = await mi.api("POST", "datasets", body);
        form.reset();
        added(dataset);
      } catch (error) {
        showUploadError(form, error);
      } finally {
        submit.disabled = false;
        submit.textContent = "Register";
      }
    });
  }

  // --- detail page ----------------------------------------------------------------------------------

  function initDetail(list) {
    const more = document.getElementById("load-more");
    const shown = document.getElementById("samples-shown");
    const total = Number(list.dataset.total);

    more?.addEventListener("click", async () => {
      const offset = list.children.length;
      more.disabled = true;
      more.textContent = "Loading…";
      try {
        // The next samples as the server renders the first ones (partials/dataset_samples.html).
        const { html, ok } = await mi.fragment(`${location.pathname}?fragment=samples&offset=${offset}`);
        if (ok) list.append(...nodesOf(html));
        const count = list.children.length;
        shown.textContent = `Showing 1–${count} of ${total}`;
        if (count >= total || !ok) more.parentElement.remove();
        else list.children[offset]?.scrollIntoView({ block: "nearest", behavior: "smooth" });
      } catch (error) {
        mi.toast(`Could not load more samples: ${error.message}`, "error");
      } finally {
        if (more.isConnected) { more.disabled = false; more.textContent = "Load more samples"; }
      }
    });
    if (!total) shown.textContent = "";

    const remove = document.getElementById("delete-dataset");
    remove?.addEventListener("click", async () => {
      const name = remove.dataset.name;
      const confirmed = await mi.confirm(
        `Delete the dataset “${name}”? Its stored samples are removed. Activation caches made from it stay.`,
        { confirmLabel: "Delete dataset" },
      );
      if (!confirmed) { remove.focus(); return; }
      remove.disabled = true;
      try {
        await mi.api("DELETE", `datasets/${encodeURIComponent(remove.dataset.datasetId)}`);
        flashNext(`Deleted “${name}”.`);
        location.assign(remove.dataset.listUrl);
      } catch (error) {
        remove.disabled = false;
        mi.toast(`Could not delete “${name}”: ${error.message}`, "error", 12);
      }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    mi.localizeTimes();
    const table = document.getElementById("dataset-table");
    if (table) initList(table);
    const samples = document.getElementById("samples");
    if (samples) initDetail(samples);
  });
})();
