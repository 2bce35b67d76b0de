// The activation-patching page: posts the form to POST /api/models/{id}/patching (the model's worker
// answers within the request) and draws the answer as a heatmap: one row per hook point, one column
// per position (headed by the clean prompt's tokens) and a last column with every position patched.
// The colour is the normalized effect, (metric - corrupted) / (clean - corrupted), on a diverging
// scale clamped to [-1, 1]; when the two runs tie (normalized is null) it is the metric's change
// scaled by its largest |change|. Each cell is focusable; hover or focus reads its value out.
(function () {
  "use strict";

  const form = document.getElementById("patching-form");
  if (!form) return;
  const $ = (id) => document.getElementById(id);
  const submit = $("patch-submit"), state = $("patch-state"), table = $("patch-heatmap");
  const number = (value) => (value === null || value === undefined ? "—" : Number(value).toFixed(3));

  // --- the tokenizer preview: POST /api/models/{id}/tokenize as the fields change -----------------
  // Prompts as patching reads them (with the special tokens a prompt gets), answers without them;
  // each shows its tokens, and whether the prompts are of equal length and the answers one token.

  const modelId = form.dataset.modelId;
  let previewTimer = null, previewTicket = 0;

  function strip(target, tokens, note, ok) {
    target.replaceChildren();
    if (!tokens) return;
    const line = document.createElement("div");
    line.className = `token-note ${ok ? "ok" : "warn-text"}`;
    line.textContent = note;
    const pieces = document.createElement("div");
    pieces.className = "token-strip mono";
    for (const token of tokens) {
      const piece = document.createElement("span");
      piece.className = "tok";
      piece.textContent = token.text;
      piece.title = `token ${token.id}`;
      pieces.append(piece);
    }
    target.append(line, pieces);
  }

  async function preview() {
    const ticket = ++previewTicket;
    const prompts = [form.elements.clean.value, form.elements.corrupted.value];
    const answers = [form.elements.answer.value, form.elements.wrong_answer.value];
    try {
      const [promptTokens, answerTokens] = await Promise.all([
        prompts.some(Boolean) ? mi.api("POST", `models/${encodeURIComponent(modelId)}/tokenize`, { texts: prompts, special_tokens: true }) : null,
        answers.some(Boolean) ? mi.api("POST", `models/${encodeURIComponent(modelId)}/tokenize`, { texts: answers, special_tokens: false }) : null,
      ]);
      if (ticket !== previewTicket) return; // the fields changed meanwhile
      const [clean, corrupted] = promptTokens ? promptTokens.tokens : [[], []];
      const same = clean.length === corrupted.length;
      const lengths = (count, other) => `${count} token${count === 1 ? "" : "s"}` + (prompts.every(Boolean) ? (same ? " · same length" : ` · the other has ${other}: patching needs the same number`) : "");
      strip($("patch-clean-tokens"), prompts[0] ? clean : null, lengths(clean.length, corrupted.length), same);
      strip($("patch-corrupted-tokens"), prompts[1] ? corrupted : null, lengths(corrupted.length, clean.length), same);
      const [answer, wrong] = answerTokens ? answerTokens.tokens : [[], []];
      const one = (tokens) => (tokens.length === 1 ? "one token" : `${tokens.length} tokens: the metric reads one`);
      strip($("patch-answer-tokens"), answers[0] ? answer : null, one(answer), answer.length === 1);
      strip($("patch-wrong-tokens"), answers[1] ? wrong : null, one(wrong), wrong.length === 1);
    } catch (error) {
      if (ticket === previewTicket) $("patch-clean-tokens").textContent = `No tokenizer preview: ${error.message}`;
    }
  }

  for (const name of ["clean", "corrupted", "answer", "wrong_answer"]) {
    form.elements[name].addEventListener("input", () => {
      clearTimeout(previewTimer);
      previewTimer = setTimeout(preview, 250);
    });
  }

  form.querySelectorAll("[data-hooks]").forEach((button) => {
    button.addEventListener("click", () => { $("patch-hooks").value = button.dataset.hooks; });
  });

  function body() {
    const data = {
      clean: form.elements.clean.value,
      corrupted: form.elements.corrupted.value,
      answer: form.elements.answer.value,
      wrong_answer: form.elements.wrong_answer.value,
    };
    const hooks = form.elements.hooks.value.split(",").map((name) => name.trim()).filter(Boolean);
    if (hooks.length) data.hooks = hooks;
    return data;
  }

  // The value each cell is coloured by, in [-1, 1], and what the legend's ends mean.
  function scaled(result) {
    const tie = result.normalized.every((row) => row.every((value) => value === null));
    if (!tie) {
      const clamp = (value) => Math.max(-1, Math.min(1, value));
      const all = result.all_positions.map((metric) => (metric - result.corrupted_metric) / (result.clean_metric - result.corrupted_metric));
      return { cells: result.normalized.map((row) => row.map(clamp)), all: all.map(clamp), normalized: true };
    }
    const changes = result.grid.map((row) => row.map((metric) => metric - result.corrupted_metric));
    const allChanges = result.all_positions.map((metric) => metric - result.corrupted_metric);
    const largest = Math.max(1e-9, ...changes.flat().map(Math.abs), ...allChanges.map(Math.abs));
    return { cells: changes.map((row) => row.map((value) => value / largest)), all: allChanges.map((value) => value / largest), normalized: false, largest };
  }

  function cell(value, shown, label) {
    const td = document.createElement("td");
    td.className = `heat-cell ${value >= 0 ? "pos" : "neg"}`;
    td.style.setProperty("--alpha", Math.min(0.9, Math.abs(value)).toFixed(3));
    td.tabIndex = 0;
    td.textContent = shown;
    td.dataset.label = label;
    td.setAttribute("aria-label", label);
    return td;
  }

  function draw(result) {
    const scale = scaled(result);
    const head = document.createElement("thead"), headRow = document.createElement("tr");
    const corner = document.createElement("th");
    corner.scope = "col";
    corner.textContent = "Hook point";
    headRow.appendChild(corner);
    result.tokens.forEach((token, position) => {
      const th = document.createElement("th");
      th.scope = "col";
      th.className = "token-head";
      th.title = `position ${position}, corrupted: ${JSON.stringify(result.corrupted_tokens[position])}`;
      const text = document.createElement("span");
      text.className = "mono token-text";
      text.textContent = mi.visibleToken(token);
      const index = document.createElement("small");
      index.textContent = String(position);
      th.append(text, index);
      headRow.appendChild(th);
    });
    const allHead = document.createElement("th");
    allHead.scope = "col";
    allHead.textContent = "All";
    allHead.title = "Every position of the hook point patched at once";
    headRow.appendChild(allHead);
    head.appendChild(headRow);

    const rows = document.createElement("tbody");
    result.hooks.forEach((hook, row) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.scope = "row";
      th.className = "mono";
      th.textContent = hook;
      tr.appendChild(th);
      result.tokens.forEach((token, position) => {
        const normalized = result.normalized[row][position];
        const shown = scale.normalized ? number(normalized) : number(result.grid[row][position] - result.corrupted_metric);
        const label = `${hook}, position ${position} ${JSON.stringify(token)}: normalized ${number(normalized)}, metric ${number(result.grid[row][position])}`;
        tr.appendChild(cell(scale.cells[row][position], shown, label));
      });
      const allMetric = result.all_positions[row];
      const allNormalized = (allMetric - result.corrupted_metric) / (result.clean_metric - result.corrupted_metric);
      const label = `${hook}, every position: ${scale.normalized ? `normalized ${number(allNormalized)}, ` : ""}metric ${number(allMetric)}`;
      const allCell = cell(scale.all[row], number(scale.normalized ? allNormalized : allMetric - result.corrupted_metric), label);
      allCell.classList.add("all-cell");
      tr.appendChild(allCell);
      rows.appendChild(tr);
    });
    table.replaceChildren(head, rows);

    $("clean-metric").textContent = number(result.clean_metric);
    $("corrupted-metric").textContent = number(result.corrupted_metric);
    if (scale.normalized) {
      $("legend-low").textContent = "−1";
      $("legend-high").textContent = "1";
      $("legend-text").textContent = "Colour: the normalized effect, (metric − corrupted) / (clean − corrupted). 1 (red): the clean answer fully restored; 0: no effect; negative (blue): further toward the wrong answer. Values beyond ±1 are shown in full but coloured as ±1.";
      $("patch-scale-note").textContent = `${result.hooks.length} hook point${result.hooks.length === 1 ? "" : "s"} × ${result.tokens.length} positions`;
    } else {
      const largest = number(scale.largest);
      $("legend-low").textContent = `−${largest}`;
      $("legend-high").textContent = largest;
      $("legend-text").textContent = "The clean and corrupted runs give the same metric, so nothing can be normalized: each cell shows the metric's change from the corrupted run (red: toward the answer, blue: toward the wrong answer).";
      $("patch-scale-note").textContent = "clean and corrupted tie";
    }
    $("cell-readout").textContent = "Hover or focus a cell to read its value.";
    $("patch-warning").textContent = result.warning || "";
    $("patch-warning").hidden = !result.warning;
    $("patching-result").hidden = false;
  }

  function readout(event) {
    const target = event.target.closest(".heat-cell");
    if (target) $("cell-readout").textContent = target.dataset.label;
  }
  table.addEventListener("mouseover", readout);
  table.addEventListener("focusin", readout);
  // Arrow keys move between cells, as in a spreadsheet.
  table.addEventListener("keydown", (event) => {
    const current = event.target.closest(".heat-cell");
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (!current || !moves[event.key]) return;
    const [down, across] = moves[event.key];
    const row = current.parentElement, rows = [...table.tBodies[0].rows];
    const target = rows[rows.indexOf(row) + down]?.cells[current.cellIndex + across];
    if (target && target.classList.contains("heat-cell")) {
      event.preventDefault();
      target.focus();
    }
  });

  mi.workerForm(form, {
    submit, state, errorId: "patch-error", draw,
    request: () => mi.api("POST", `models/${encodeURIComponent(form.dataset.modelId)}/patching`, body()),
  });
})();
