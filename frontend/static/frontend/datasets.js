// Datasets pages: upload (drag and drop or pick a file, with upload progress), register a server path,
// list and delete on /datasets/; paged sample preview and delete on /datasets/<id>/. Every change goes
// through the REST API (/api/datasets…); the server-rendered rows and samples are the starting state.
(function () {
  "use strict";

  const FLASH_KEY = "mistudio-flash";
  const pad = (n) => String(n).padStart(2, "0");

  // Server times are rendered in UTC; show them in the reader's own time zone.
  function localizeTimes(root = document) {
    root.querySelectorAll("time[datetime]").forEach((node) => {
      const date = new Date(node.getAttribute("datetime"));
      if (isNaN(date)) return;
      node.textContent = `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ${pad(date.getHours())}:${pad(date.getMinutes())}`;
      node.title = date.toString();
    });
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
    const canWrite = table.dataset.canWrite === "true";

    function refreshCount() {
      const rows = tbody.querySelectorAll("tr").length;
      count.textContent = `${rows} dataset${rows === 1 ? "" : "s"}`;
      wrap.hidden = rows === 0;
      empty.hidden = rows !== 0;
    }

    // The same cells as the server-rendered rows in datasets.html.
    function rowFor(dataset) {
      const e = mi.escapeHtml;
      const row = document.createElement("tr");
      row.dataset.datasetId = dataset.id;
      row.dataset.name = dataset.name;
      const href = table.dataset.detailUrl.replace("DATASET_ID", encodeURIComponent(dataset.id));
      const original = dataset.original_name && dataset.original_name !== dataset.name
        ? `<div class="muted small truncate" title="${e(dataset.original_name)}">${e(dataset.original_name)}</div>` : "";
      row.innerHTML = `
        <td class="name-cell"><a href="${e(href)}">${e(dataset.name)}</a>${original}</td>
        <td><code class="id">${e(dataset.id)}</code></td>
        <td><span class="chip">${e(dataset.format || "—")}</span> <span class="muted small">${e(dataset.source)}</span></td>
        <td class="num" data-testid="sample-count">${e(dataset.sample_count)}</td>
        <td class="num">${e(mi.bytes(dataset.size_bytes))}</td>
        <td><code class="hash" title="sha256 ${e(dataset.content_hash)}">${e(dataset.content_hash.slice(0, 12))}</code></td>
        <td><time datetime="${e(dataset.created_at)}"></time></td>
        ${canWrite ? `<td class="actions"><button type="button" class="danger small-button" data-action="delete" aria-label="Delete ${e(dataset.name)}">Delete</button></td>` : ""}`;
      localizeTimes(row);
      return row;
    }

    function added(dataset) {
      tbody.querySelector(`tr[data-dataset-id="${CSS.escape(dataset.id)}"]`)?.remove();
      const row = rowFor(dataset);
      row.classList.add("fresh");
      tbody.prepend(row);
      refreshCount();
      mi.toast(`Added “${dataset.name}”: ${dataset.sample_count} sample${dataset.sample_count === 1 ? "" : "s"}.`, "ok");
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

  function sampleItem(index, text) {
    const item = document.createElement("li");
    item.className = "sample";
    item.dataset.index = String(index);
    const length = [...text].length; // characters as the server counts them (code points)
    item.innerHTML = `<div class="sample-head"><span class="sample-index">#${index}</span>
      <span class="muted small">${length} character${length === 1 ? "" : "s"}</span></div>
      <div class="sample-text"></div>`;
    item.querySelector(".sample-text").textContent = text;
    return item;
  }

  function initDetail(list) {
    const more = document.getElementById("load-more");
    const shown = document.getElementById("samples-shown");
    const total = Number(list.dataset.total);
    const pageSize = Number(list.dataset.pageSize) || 20;
    const id = list.dataset.datasetId;

    more?.addEventListener("click", async () => {
      const offset = list.children.length;
      more.disabled = true;
      more.textContent = "Loading…";
      try {
        const page = await mi.api("GET", `datasets/${encodeURIComponent(id)}/samples?offset=${offset}&limit=${pageSize}`);
        page.samples.forEach((text, i) => list.appendChild(sampleItem(page.offset + i, text)));
        const count = list.children.length;
        shown.textContent = `Showing 1–${count} of ${page.total}`;
        if (count >= page.total || !page.samples.length) more.parentElement.remove();
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
    localizeTimes();
    const table = document.getElementById("dataset-table");
    if (table) initList(table);
    const samples = document.getElementById("samples");
    if (samples) initDetail(samples);
  });
})();
